"""MkDocs hook: the benchmark tables, generated from the JSON results under benchmarks/ at build time.

A page includes a table with a marker line `<!-- benchmark: NAME -->` (NAME in `TABLES`). The README
carries a copy of `readme_results` (it is the package's long description, so nothing renders it);
tests/project/test_docs.py checks that the copy equals what this module generates. The images under
benchmarks/ are added to the site at their repository paths, so a page links them as
`benchmarks/compression/headline.png`.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
CELLS = ("P4_100mbit", "P8_100mbit", "P4_1gbit", "P8_1gbit")  # the current throughput runs, in table order
WIRE_FORMATS = ("fp32", "bf16", "int8")
THROUGHPUT_ROWS = (  # (label in the table, run label in the JSON)
    ("`none` (compute only)", "none"),
    ("`ddp`", "ddp"),
    ("`co2`, fp32", "co2"),
    ("`co2`, bf16", "co2-bf16"),
    ("`co2`, int8", "co2-int8"),
    ("`localsgd` (blocking, fp32)", "localsgd"),
    ("`co2`, bf16 at its own τ", "co2-bf16 @tuned"),
    ("`co2`, int8 at its own τ", "co2-int8 @tuned"),
)
MARKER = re.compile(r"^<!-- benchmark: ([a-z0-9_]+) -->$", re.MULTILINE)


def _load(relative: str) -> dict[str, Any]:
    return json.loads((BENCH / relative).read_text())


def _cell_title(cell: dict[str, Any]) -> str:
    rate = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s"}.get(cell["rate"], cell["rate"])
    return f"P = {cell['nodes']}, {rate}"


def _ratio(row: dict[str, Any] | None, tuned: bool) -> str:
    """Median ratio to `none` [range], and the share of time blocked on the exchange where it shows."""
    if row is None:
        return "–"
    low, high = row["ratio_range"]
    text = f"{row['ratio_to_none']:.3f} [{low:.2f}–{high:.2f}]"
    blocked = round(100 * row.get("wait_fraction", 0.0))
    if tuned:
        return f"{text} ({blocked}% blocked, τ {row['tau']})"
    return f"{text} ({blocked}% blocked)" if blocked >= 1 else text


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def throughput() -> str:
    """Steady-state tokens/s over `none`'s, median of the repetitions [range], one column per cell."""
    cells = [_load(f"throughput/throughput_{name}.json")["cells"][0] for name in CELLS]
    taus = [f"{c['tau']} ({' / '.join(str(c['tuned_tau'][d]) for d in WIRE_FORMATS)})" for c in cells]
    comm = [f"{c['tuners']['fp32']['recommendation']['comm_over_step']:.1f}" for c in cells]
    rows = [["τ (fp32 / bf16 / int8 tuner)", *taus], ["comm/step (fp32)", *comm]]
    for title, label in THROUGHPUT_ROWS:
        rows.append([title, *(_ratio(c["summary"].get(label), label.endswith("@tuned")) for c in cells)])
    cases = [_load(f"{HETEROGENEOUS_ROW_STUDY}/{case}.json") for case in HETEROGENEOUS_CASES]
    rows.append([HETEROGENEOUS_ROW, *(_heterogeneous(c, cases) for c in cells)])
    return _table(["run", *(_cell_title(c) for c in cells)], rows)


README_ROWS = ("ddp", "co2", "co2-int8", "localsgd")  # run labels of throughput's rows, the README's few


def readme_results() -> str:
    """The README's one results table: `throughput`'s medians for a few runs, without ranges (the page has them)."""
    cells = [_load(f"throughput/throughput_{name}.json")["cells"][0] for name in CELLS]
    titles = dict((label, title) for title, label in THROUGHPUT_ROWS)
    rows = [["τ", *(str(c["tau"]) for c in cells)]]
    for label in README_ROWS:
        rows.append([titles[label], *(f"{c['summary'][label]['ratio_to_none']:.2f}" for c in cells)])
    return _table(["tokens/s ÷ compute only", *(_cell_title(c) for c in cells)], rows)


def _wire_format(run_label: str) -> str:
    """A bench_throughput run label's wire format as benchmarks/wire/wire.json names it: co2-top1.5%-int2-decay ->
    top1.5%-int2 (the decay changes no byte), co2 -> fp32."""
    return "fp32" if run_label == "co2" else run_label.removeprefix("co2-").removesuffix("-decay")


def wire() -> str:
    """Each format's bytes per round per rank against fp32's, measured from the wire (benchmarks/wire/wire.json,
    scripts/bench_wire.py): the one ratio a format has on every page."""
    rows = _load("wire/wire.json")["wire"]
    replicas = sorted({r["replicas"] for r in rows})
    ratio = {(r["wire"], r["replicas"]): r["ratio_to_fp32"] for r in rows}
    formats = list(dict.fromkeys(r["wire"] for r in rows))
    body = [[f"`{f}`", *(f"{ratio[(f, n)]:.1f}" for n in replicas)] for f in formats]
    return _table(["format", *(f"× fewer bytes than fp32, R = {n}" for n in replicas)], body)


def wire_10mbit() -> str:
    """The wire formats' throughput at 10 Mbit/s, nodes capped at 0.4 core (throughput_P4_10mbit_wire_capped)."""
    cell = _load("throughput/throughput_P4_10mbit_wire_capped.json")["cells"][0]
    labels = [label for label in cell["summary"] if label != "none" and not label.endswith("@tuned")]
    rows = [
        [f"`{_wire_format(label)}`" + (", decay 0.95" if label.endswith("-decay") else ""),
         _ratio(cell["summary"][label], False), _ratio(cell["summary"].get(f"{label} @tuned"), True)]
        for label in labels
    ]  # fmt: skip
    return _table(["format", f"× compute-only at τ = {cell['tau']}", "at the tuner's τ"], rows)


def wire_tuner() -> str:
    """What `co2-tune-tau` measured per wire format at 10 Mbit/s, nodes capped at 0.4 core: the bytes a rank sends
    per round, the exchange's and a step's seconds, its first guess of τ (`--verify_rounds 0`,
    throughput_P4_10mbit_wire_capped) and the τ its verification picked (throughput_P4_10mbit_wire_verified)."""
    guessed = _load("throughput/throughput_P4_10mbit_wire_capped.json")["cells"][0]["tuners"]
    verified = _load("throughput/throughput_P4_10mbit_wire_verified.json")["cells"][0]["tuned_tau"]
    rows = [_tuner_row(name, tuner, verified.get(name, "–")) for name, tuner in guessed.items()]
    head = ["format", "MB per round per rank", "exchange, s", "step, s", "τ, first guess", "τ, verified"]
    return _table(head, rows)


def _tuner_row(name: str, tuner: dict[str, Any], verified_tau: int | str) -> list[str]:
    comm, step = tuner["comm"], tuner["compute"]["t_step"]
    label = f"`{_wire_format(name)}`" + (", decay 0.95" if name.endswith("-decay") else "")
    megabytes, tau = f"{comm['bytes_sent'] / 1e6:.2f}", str(tuner["recommendation"]["tau"])
    return [label, megabytes, f"{comm['t_comm']:.1f}", f"{step:.2f}", tau, str(verified_tau)]


def _gap(gaps: list[float]) -> str:
    return f"{statistics.mean(gaps):+.1%} [{min(gaps):+.1%}, {max(gaps):+.1%}]" if gaps else "–"


def wire_quality() -> str:
    """The wire formats' loss at the quality study's full budget (benchmarks/quality_wire_full/), each format's
    bytes from `wire` (R = 4), and the minutes to DDP's loss at 10 Mbit/s (scripts/wire_quality.py)."""
    sys.path.insert(0, str(ROOT))
    from scripts import wire_quality as wq

    study = _load("quality_wire_full/wire_quality.json")
    ratio = {r["wire"]: r["ratio_to_fp32"] for r in _load("wire/wire.json")["wire"] if r["replicas"] == 4}
    rows = []
    for r in study["rows"]:
        wire_name = _wire_format(wq.throughput_label(r["method"]))
        rows.append([
            r["method"], str(r["tau"]), f"{r['outer_lr']:g}, {r['momentum']:g}", str(len(r["seeds"])),
            f"{statistics.mean(r['val_loss']):.4f}", _gap(r["gap_to_fp32"]), f"{ratio[wire_name]:.1f}",
        ])  # fmt: skip
    head = ["method", "τ", "outer lr, β", "seeds", "final val loss (mean)", "gap to fp32 (per seed)", "× fewer bytes"]
    return _table(head, rows) + "\n\n" + wq.wall_clock_markdown(study["wall_clock"], "10 Mbit/s")


HETEROGENEOUS_CASES = ("half", "quarter")
HETEROGENEOUS_ROW_STUDY = "heterogeneous/int4_30_rounds"  # the README row's study (benchmarks/<it>/; a page table too)
HETEROGENEOUS_ROW_METHOD = "auto"
HETEROGENEOUS_ROW = (
    '`co2`, `replica_tau: "auto"`, int4, τ = 32, 30 rounds, speeds 1, 1, 1, ½ · 1, 1, ½, ¼ (÷ the replicas\' '
    "own speeds, whole run; a uniform cluster's)"
)


def _heterogeneous(cell: dict[str, Any], cases: list[dict[str, Any]]) -> str:
    """The job's tokens/s over its replicas' own speeds, `HETEROGENEOUS_ROW_METHOD` (a uniform cluster's median
    in brackets), in the cell that scripts/bench_hetero.py's `cases` measured (P = 4 at their rate); – in the
    others."""
    if (cell["nodes"], cell["rate"]) != (len(cases[0]["speeds"]), cases[0]["rate"]):
        return "–"
    parts = []
    for case in cases:
        ratios = case["methods"][HETEROGENEOUS_ROW_METHOD]["tokens_per_s_over_own_speeds"]
        uniform = statistics.median(case["methods"]["uniform"]["tokens_per_s_over_own_speeds"])
        parts.append(f"{statistics.median(ratios):.3f} [{min(ratios):.2f}–{max(ratios):.2f}] ({uniform:.3f})")
    return " · ".join(parts)


def compression() -> str:
    """Convergence of ddp and co2 per wire format at their tuned τ (benchmarks/compression/)."""
    table = _load("compression/compression.json")["table"]
    names = {"ddp": "`ddp`", "co2": "`co2`, fp32", "co2-int8": "`co2`, int8", "co2-bf16": "`co2`, bf16"}
    rows = []
    for label, r in table.items():
        ddp = label == "ddp"
        rows.append([
            names.get(label, f"`{label}`"),
            "–" if ddp else str(r["tau"]),
            f"{r['final_val_loss']:.3f} [{r['spread']:.3f}]",
            "" if ddp else f"{100 * r['vs_ddp']:+.1f}%",
            f"{r['train_s']:,.0f}",
            "" if ddp else f"{r['ddp_s_to_same_loss']:,.0f} ({r['ddp_s_to_same_loss'] / r['train_s']:.2f}×)",
        ])  # fmt: skip
    head = ["run", "τ", "final val loss, mean [spread]", "vs ddp", "seconds on the link", "ddp's seconds to that loss"]
    return _table(head, rows)


def convergence() -> str:
    """Final validation loss at τ = 4, P = 4, 1 Gbit/s, per seed and mean (benchmarks/convergence/)."""
    seeds = [_load("convergence/convergence.json"), _load("convergence/seed1338/convergence.json")]
    ddp = statistics.mean(s["table"]["ddp"]["final_val_loss"] for s in seeds)
    rows = []
    for label in seeds[0]["table"]:
        losses = [s["table"][label]["final_val_loss"] for s in seeds if label in s["table"]]
        mean = statistics.mean(losses)
        per_seed = [f"{x:.3f}" for x in losses] + ["–"] * (len(seeds) - len(losses))
        rows.append(
            [f"`{label}`", *per_seed, f"{mean:.3f}", f"{100 * (mean / ddp - 1):+.1f}%" if len(losses) > 1 else ""]
        )
    head = ["run", *(f"seed {s['seeds'][0]}" for s in seeds), "mean", "mean vs ddp (both seeds)"]
    return _table(head, rows)


def elastic() -> str:
    """Step efficiency and recoveries under failures (benchmarks/elastic/, scripts/bench_elastic.py): the
    repetitions combined (elastic_runs.json) where there are, else the one run, once measured. The
    README carries a copy (tests/project/test_docs.py)."""
    runs, one = BENCH / "elastic" / "elastic_runs.json", BENCH / "elastic" / "elastic.json"
    if not runs.exists() and not one.exists():
        return "*Not measured yet: benchmarks/elastic/elastic.json is written by `python -m scripts.bench_elastic`.*"
    sys.path.insert(0, str(ROOT))
    from scripts import bench_elastic

    if runs.exists():
        return bench_elastic.combined_report(json.loads(runs.read_text()))
    return bench_elastic.report(json.loads(one.read_text()))


QUALITY = BENCH / "quality" / "quality.json"


def quality() -> str:
    """The quality study (benchmarks/quality/, scripts/bench_quality.py): its summary as far as its cells
    go; the summary names the cells still to run."""
    if not QUALITY.exists():
        return "*Not summarized yet: `python -m scripts.bench_quality --summary` writes quality.json.*"
    sys.path.insert(0, str(ROOT))
    from scripts import bench_quality

    body = bench_quality.markdown(json.loads(QUALITY.read_text()))
    return body.split("\n", 2)[2]  # without its title: the page has its own heading


PRESETS_TAU = 32
PRESET_ROWS = (  # (setting, the quality study's method, applied, stand-in, outer step): configuration.md's ablation
    (
        "CO2 as published (`co2`, `co2_zero.core.config.PUBLISHED`)",
        "co2",
        "a round late",
        "`shared`",
        "heavy ball, adaptive Λ",
    ),
    ("`co2_eager`", "co2_eager", "a round late", "`eager`", "heavy ball, adaptive Λ"),
    ("`co2_local`", "co2_local", "a round late", "`local`", "heavy ball, adaptive Λ"),
    ("`diloco_eager`", "diloco_eager", "a round late", "`eager`", "Nesterov"),
    ("`diloco_local`", "diloco_local", "a round late", "`local`", "Nesterov"),
    ("`diloco_local_sync` (the defaults, d = 8)", "diloco_local_sync", "8 steps in", "`local`", "Nesterov"),
    ("blocking DiLoCo (`diloco`)", "diloco", "at once (blocks)", "–", "Nesterov"),
)


def presets() -> str:
    """The defaults' ablation, one change at a time (benchmarks/quality/quality.json at τ = PRESETS_TAU): each
    setting's final validation loss at its best outer lr and momentum, mean over the seeds, against blocking
    DiLoCo's."""
    best = {r["method"]: r for r in _load("quality/quality.json")["table"] if r["tau"] == PRESETS_TAU}
    blocking = best["diloco"]["final_val_loss"]["mean"]
    rows = [_preset_row(row, best[row[1]], blocking) for row in PRESET_ROWS]
    return _table(["setting", "applied", "stand-in", "outer step", "loss", "vs blocking DiLoCo"], rows)


def _preset_row(row: tuple[str, ...], result: dict[str, Any], blocking: float) -> list[str]:
    setting, method, applied, stand_in, step = row
    loss = result["final_val_loss"]["mean"]
    outer = f"{step}, β = {result['momentum']:g}, lr {result['outer_lr']:g}"
    return [
        setting,
        applied,
        stand_in,
        outer,
        f"{loss:.4f}",
        "–" if method == "diloco" else f"{loss / blocking - 1:+.1%}",
    ]


def _heterogeneous_tables(study: str) -> str:
    """Replicas of different speeds (benchmarks/<study>/, scripts/bench_hetero.py): a table per case."""
    sys.path.insert(0, str(ROOT))
    from scripts import bench_hetero_report

    cases = [BENCH / study / f"{case}.json" for case in HETEROGENEOUS_CASES]
    return "\n".join(bench_hetero_report.markdown(json.loads(p.read_text())) for p in cases if p.exists())


TABLES: dict[str, Callable[[], str]] = {
    "throughput": throughput,
    "compression": compression,
    "convergence": convergence,
    "elastic": elastic,
    "quality": quality,
    "presets": presets,
    "wire": wire,
    "wire_10mbit": wire_10mbit,
    "wire_tuner": wire_tuner,
    "wire_quality": wire_quality,
    "heterogeneous": lambda: _heterogeneous_tables("heterogeneous"),
    "heterogeneous_int4_30_rounds": lambda: _heterogeneous_tables(HETEROGENEOUS_ROW_STUDY),
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: TABLES[m.group(1)](), markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for image in sorted(BENCH.rglob("*.png")):
        uri = image.relative_to(ROOT).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(image)))
    return files


if __name__ == "__main__":  # the README's copy
    print(readme_results())
