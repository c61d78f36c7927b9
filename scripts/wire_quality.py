"""The wire formats' quality study, summarised (`python -m scripts.bench_wire --quality DIR`).

A bench_quality.py study of the compressed defaults (DIR/cells) against the fp32 defaults, seed for
seed: final validation loss, its gap to fp32 (mean [min, max] over the seeds both ran) and the bytes per
round as a ratio of fp32's, from the bytes rank 0 sent over each run. fp32's cells the study lacks come
from --baseline (the quality study, same flags, its best setting per τ). With --throughput (a
bench_throughput.py JSON of the study's model on one link, the formats' co2 runs labelled as
`throughput_label` says), also the wall-clock each format's mean curve needs to DDP's mean final loss
(the baseline's DDP cells) and to within 2, 5 and 10% of it at its measured tokens/s there.
Writes DIR/wire_quality.json and .md.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional, Sequence

from scripts import bench_quality as bq
from scripts.bench_compression import seconds_to_reach

FP32 = "diloco_local_sync"


def throughput_label(method: str) -> str:
    """bench_throughput.py's run label of a wire method's format: co2, co2-int4, co2-top1.5%-int2-decay, ..."""
    if method in ("ddp", "none"):
        return method
    if method == FP32:
        return "co2"
    dtype, topk = bq.WIRE[method]
    name = dtype if topk == 1.0 else f"top{100 * topk:g}%-{dtype}"
    return f"co2-{name}" + ("-decay" if method in bq.DECAY else "")


def quality_rows(cells: Sequence[dict], baseline: Sequence[dict] = ()) -> list[dict]:
    """Per (method, τ, outer lr, momentum): the seeds, losses, gaps to fp32 at the same τ and seed, bytes ratio,
    and the mean validation curve. fp32's cells are the study's own, else `baseline`'s (run before the bytes
    were recorded: their bytes per round are then any of the study's fp32 cells', the model's whatever τ)."""
    fp32 = {(c["tau"], c["seed"]): c for c in [*baseline, *cells] if c["method"] == FP32}
    measured = [c["bytes_per_round"] for c in cells if c["method"] == FP32 and "bytes_per_round" in c]
    fp32 = {key: {**c, "bytes_per_round": c.get("bytes_per_round", measured[0] if measured else None)}
            for key, c in fp32.items()}  # fmt: skip
    taus = {c["tau"] for c in cells}
    groups: dict = {}
    for c in [*(c for c in cells if c["method"] != FP32), *(c for c in fp32.values() if c["tau"] in taus)]:
        groups.setdefault(bq.row_setting(c), []).append(c)
    rows = []
    for (method, tau, lr, momentum), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pairs = [(c, fp32[(tau, c["seed"])]) for c in runs if (tau, c["seed"]) in fp32]
        rows.append({"method": method, "tau": tau, "outer_lr": lr, "momentum": momentum,
                     "seeds": sorted(c["seed"] for c in runs), "val_loss": [c["final_val_loss"] for c in runs],
                     "gap_to_fp32": [c["final_val_loss"] / f["final_val_loss"] - 1 for c, f in pairs],
                     "bytes_ratio_to_fp32": [f["bytes_per_round"] / c["bytes_per_round"] for c, f in pairs],
                     "curve": bq.mean_curve(runs)})  # fmt: skip
    return rows


def quality_markdown(rows: Sequence[dict]) -> str:
    lines = ["| method | τ | outer lr, β | seeds | final val loss (mean) | gap to fp32 (per seed) | × fewer bytes |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        gap = (f"{statistics.mean(r['gap_to_fp32']):+.1%} [{min(r['gap_to_fp32']):+.1%}, {max(r['gap_to_fp32']):+.1%}]"
               if r["gap_to_fp32"] else "–")  # fmt: skip
        ratio = f"{statistics.mean(r['bytes_ratio_to_fp32']):.1f}" if r["bytes_ratio_to_fp32"] else "–"
        lines.append(f"| {r['method']} | {r['tau']} | {r['outer_lr']:g}, {r['momentum']:g} | {len(r['seeds'])} | "
                     f"{statistics.mean(r['val_loss']):.4f} | {gap} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def wall_clock(rows: Sequence[dict], ddp: Sequence[dict], throughput: dict, nodes: int) -> list[dict]:
    """Per row (DDP's first): its tokens/s on the link, and the seconds its mean curve needs to DDP's mean
    final loss × (1 + m) for each of bench_quality's TARGET_MARGINS (None: not within the budget)."""
    final = statistics.mean(c["final_val_loss"] for c in ddp)
    none = bq.link_tokens_per_s(throughput, nodes, "none", labels=("none",))
    out = []
    for r in [{"method": "ddp", "tau": None, "outer_lr": None, "momentum": None, "curve": bq.mean_curve(ddp)}, *rows]:
        speed = bq.link_tokens_per_s(throughput, nodes, r["method"], r["tau"], labels=(throughput_label(r["method"]),))
        per_s = speed["tokens_per_s"] if speed else None
        reach = [seconds_to_reach(r["curve"], final * (1 + m)) for m in bq.TARGET_MARGINS]
        out.append({"method": r["method"], "tau": r["tau"], "outer_lr": r["outer_lr"], "momentum": r["momentum"],
                    "throughput": speed,
                    "over_none": per_s / none["tokens_per_s"] if per_s and none else None,
                    "seconds": [t / per_s if t is not None and per_s else None for t in reach],
                    "budget_seconds": r["curve"][0][-1] / per_s if per_s else None})  # fmt: skip
    return out


def _minutes(seconds: Optional[float]) -> str:
    return "–" if seconds is None else f"{seconds / 60:,.1f}"


def wall_clock_markdown(rows: Sequence[dict], rate: str) -> str:
    head = " | ".join(["to DDP's final loss", *(f"within {m:.0%}" for m in bq.TARGET_MARGINS[1:])])
    lines = [f"Minutes at {rate} (–: not within the budget or not measured):", "",
             f"| method | τ | outer lr, β | tokens/s (× compute-only) | {head} | the whole budget |",
             "|---|---|---|---|" + "---|" * (len(bq.TARGET_MARGINS) + 1)]  # fmt: skip
    for r in rows:
        speed, over = r["throughput"], r["over_none"]
        rate_text = "–" if speed is None else f"{speed['tokens_per_s']:,.0f} ({over:.3f}, run at τ {speed['tau']})"
        cells = " | ".join(_minutes(s) for s in r["seconds"])
        outer = "–" if r["outer_lr"] is None else f"{r['outer_lr']:g}, {r['momentum']:g}"
        lines.append(f"| {r['method']} | {r['tau'] or '–'} | {outer} | {rate_text} | {cells} | "
                     f"{_minutes(r['budget_seconds'])} |")  # fmt: skip
    return "\n".join(lines)


def _cells(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((directory / "cells").glob("*.json"))]


def _best_fp32(study: Path) -> list[dict]:
    """The fp32 defaults' cells of a quality study at its best setting per τ (its quality.json's table)."""
    best = {(r["tau"], r["outer_lr"], r["momentum"]) for r in json.loads((study / "quality.json").read_text())["table"]
            if r["method"] == FP32}  # fmt: skip
    return [c for c in _cells(study) if c["method"] == FP32 and (c["tau"], c["outer_lr"], c["momentum"]) in best]


def summarise(directory: Path, baseline: Optional[Path] = None, throughput: Optional[dict] = None) -> int:
    """DIR/wire_quality.{json,md}; prints the tables."""
    cells = _cells(directory)
    rows = quality_rows(cells, _best_fp32(baseline) if baseline else ())
    result: dict = {"rows": rows}
    text = quality_markdown(rows)
    if throughput is not None:
        if baseline is None:
            raise SystemExit("bench_wire --quality --throughput: DDP's cells come from --baseline; name the study")
        ddp = [c for c in _cells(baseline) if c["method"] == "ddp"]
        cell = throughput["cells"][0]
        result["wall_clock"] = wall_clock(rows, ddp, throughput, cell["nodes"])
        result["throughput_command"] = throughput["command"]
        text += "\n\n" + wall_clock_markdown(result["wall_clock"], cell["rate"])
    command = f"python -m scripts.bench_wire --quality {directory}" + (f" --baseline {baseline}" if baseline else "")
    (directory / "wire_quality.json").write_text(json.dumps({"command": command, **result}, indent=1))
    (directory / "wire_quality.md").write_text(f"`{command}`\n\n{text}\n")
    print(text)
    return 0
