"""What a user pays who changes only the wire format: train_lm.py with everything else at its defaults
(AdamW, the co2 method, `auto` outer settings), one short run per format and seed, side by side with fp32.

Each run: `torchrun --standalone --nproc_per_node NODES scripts/train_lm.py --tau TAU --max_steps ROUNDS·TAU`
plus the format's flags (and, for a `--with` variant, the flags it adds). Prints the table and writes

  <out_dir>/format_defaults.json   every run (final validation loss, payload ratio, overlap), the command
  <out_dir>/format_defaults.md     format × final loss over fp32's, per seed and its range

    python -m scripts.bench_format_defaults                      # the defaults of every format, 3 seeds
    python -m scripts.bench_format_defaults --formats int2 top1.5%-int2 --with 'momentum=--outer_momentum 0.9'
    python -m scripts.bench_format_defaults --formats top1.5%-int2 --with_env 'flat=CO2_SPARSE_CHUNKS=flat'

`--with_env` runs a variant under environment variables instead of flags: the sparse exchange's study switches
`CO2_SPARSE_CHUNKS` (tensor, flat) and `CO2_SPARSE_GUARD` (on, off), docs/design-communication.md §5.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from scripts import bench_compression as bcomp

ROOT = Path(__file__).resolve().parent.parent
FORMATS = {  # the flags a user adds to choose the format, nothing else
    "fp32": [],
    "int8": ["--comm_dtype", "int8"],
    "int4": ["--comm_dtype", "int4"],
    "int2": ["--comm_dtype", "int2"],
    "top3%-int2": ["--comm_dtype", "int2", "--topk", "0.03"],
    "top1.5%-int2": ["--comm_dtype", "int2", "--topk", "0.015"],
    "top0.9%-int2": ["--comm_dtype", "int2", "--topk", "0.009"],
}


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument(
        "--with",
        dest="variants",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run each non-fp32 format with these flags added (a setting the user asked for)",
    )
    p.add_argument(
        "--with_env",
        dest="env_variants",
        action="append",
        default=[],
        metavar="NAME=VAR=VALUE[ VAR=VALUE]",
        help="also run each non-fp32 format with these environment variables set (a study switch)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "format_defaults"))
    p.add_argument("--report", action="store_true", help="only rewrite the table from <out_dir>/format_defaults.json")
    return p.parse_args(argv)


def run_one(a: argparse.Namespace, flags: list[str], seed: int, log_root: Path, env: dict[str, str]) -> dict:
    """One training run with `env` added to the environment; its summary record (final loss, bytes, payload
    ratio, overlap)."""
    out_json = log_root / f"{abs(hash((tuple(flags), tuple(env.items()), seed)))}.jsonl"
    args = ["--tau", str(a.tau), "--max_steps", str(a.rounds * a.tau), "--seed", str(seed), "--no_progress", *flags]
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        bcomp.run_unshaped(a.nodes, [*args, "--out_json", str(out_json)], log_root / out_json.stem)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    end = next(r for r in map(json.loads, out_json.read_text().splitlines()) if r.get("summary"))
    overlap = end.get("senders_per_sent") or []
    setting = [f"{name}={value}" for name, value in env.items()]
    command = [*setting, "torchrun", "--standalone", "--nproc_per_node", str(a.nodes), "scripts/train_lm.py", *args]
    return {
        "seed": seed,
        "final_val_loss": end["val_loss"],
        "payload_ratio": end.get("payload_ratio"),
        "senders_per_sent": statistics.mean(overlap) if overlap else None,
        "command": shlex.join(command),
    }


def cases(a: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, flags, environment): fp32, every format alone, then each `--with` and `--with_env` variant of
    every format but fp32."""
    formats = [f for f in a.formats if f != "fp32"]
    out = [("fp32", [], {})] + [(f, FORMATS[f], {}) for f in formats]
    for variant in a.variants:
        name, _, flags = variant.partition("=")
        out += [(f"{f} {name}", FORMATS[f] + shlex.split(flags), {}) for f in formats]
    for variant in a.env_variants:
        name, _, settings = variant.partition("=")
        env = dict(setting.split("=", 1) for setting in shlex.split(settings))
        out += [(f"{f} {name}", FORMATS[f], env) for f in formats]
    return out


def table(runs: dict[str, list[dict]]) -> list[dict]:
    """Per case: final loss over fp32's seed for seed, their mean and range."""
    fp32 = {r["seed"]: r["final_val_loss"] for r in runs["fp32"]}
    rows = []
    for label, got in runs.items():
        ratios = [r["final_val_loss"] / fp32[r["seed"]] for r in got]
        rows.append(
            {
                "case": label,
                "vs_fp32": statistics.mean(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "payload_ratio": got[0]["payload_ratio"],
                "senders_per_sent": got[0]["senders_per_sent"],
                "seeds": len(got),
            }
        )
    return rows


def _overlap(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}"


def markdown(rows: list[dict], a: argparse.Namespace, command: str) -> str:
    head = (
        f"# A user who changes only the format\n\n{a.rounds} rounds at τ = {a.tau}, {a.nodes} ranks, AdamW, "
        f"every other setting at its default. Final validation loss over fp32's, seed for seed: mean "
        f"[min, max] over {len(a.seeds)} seeds. Payload: fp32 bytes over one replica's payload.\n\n"
        "| format | loss vs fp32 | payload ratio | senders per sent coordinate |\n|---|---|---|---|\n"
    )
    lines = [
        f"| {r['case']} | {r['vs_fp32']:.3f} [{r['min']:.3f}, {r['max']:.3f}] | "
        f"{r['payload_ratio'] or 1:.1f}× | {_overlap(r['senders_per_sent'])} |"
        for r in rows
    ]
    return head + "\n".join(lines) + f"\n\nCommand:\n\n    {command}\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    if a.report:
        done = json.loads((Path(a.out_dir) / "format_defaults.json").read_text())
        (Path(a.out_dir) / "format_defaults.md").write_text(markdown(done["rows"], a, done["command"]))
        return 0
    log_root = Path(tempfile.mkdtemp(prefix="c2z-formats-"))
    runs: dict[str, list[dict]] = {}
    for label, flags, env in cases(a):
        runs[label] = [run_one(a, flags, seed, log_root, env) for seed in a.seeds]
        print(label, [round(r["final_val_loss"], 4) for r in runs[label]], flush=True)
    rows = table(runs)
    command = shlex.join(["python", "-m", "scripts.bench_format_defaults", *(sys.argv[1:] if argv is None else argv)])
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "format_defaults.json").write_text(json.dumps({"command": command, "rows": rows, "runs": runs}, indent=1))
    (out / "format_defaults.md").write_text(markdown(rows, a, command))
    print(markdown(rows, a, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
