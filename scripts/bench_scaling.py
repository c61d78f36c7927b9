"""How the sparse format's gap to the fp32 defaults moves with model size (issue 62's scaling series).

The same rounds at three widths of the study's model, seeds side by side: the fp32 defaults (outer lr 0.5,
Nesterov 0.9) and the 100x format (top-0.9% int2, the sparse defaults: outer lr 1, no outer momentum, decay
0.95). Each size is one `scripts/bench_quality.py` run (its cells under <out_dir>/d<width>/cells); this
script then prints the table and writes

  <out_dir>/scaling.json   per size and seed: parameters, both final validation losses, the gap, the
                           payload ratio (fp32 bytes over one replica's payload) and senders per sent coordinate
  <out_dir>/scaling.md     the same as a table

    python -m scripts.bench_scaling                        # 3 widths x 2 seeds x 2 methods, 100 rounds of tau 8
    python -m scripts.bench_scaling --summary --out_dir benchmarks/scaling
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from co2_zero.train.data import BYTE_VOCAB
from co2_zero.train.model import GPT

DENSE, SPARSE = "diloco_local_sync", "diloco_local_sync_topk0.9_int2_decay"
GRIDS = [f"{DENSE}:0.5:0.9", f"{SPARSE}:1:0"]  # each method at its defaults' outer step

BLOCK, LAYERS = 32, 2


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256], help="n_embd of each size")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338])
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--out_dir", default="benchmarks/scaling")
    p.add_argument("--summary", action="store_true", help="only summarize the cells there are")
    return p.parse_args(argv)


def model_flags(width: int) -> str:
    heads = max(2, width // 64)
    return f"--n_layer {LAYERS} --n_embd {width} --n_head {heads} --block_size {BLOCK} --batch_size 8"


def parameters(width: int) -> int:
    model = GPT(BYTE_VOCAB, BLOCK, LAYERS, max(2, width // 64), width, 0.0)
    return sum(p.numel() for p in model.parameters())


def run_size(args: argparse.Namespace, width: int) -> None:
    command = [sys.executable, "-m", "scripts.bench_quality", "--methods", DENSE, SPARSE, "--taus", str(args.tau)]
    command += ["--seeds", *map(str, args.seeds), "--steps", str(args.rounds * args.tau), "--cells_only"]
    command += [x for grid in GRIDS for x in ("--grid", grid)]
    command += ["--model", model_flags(width), "--out_dir", str(Path(args.out_dir) / f"d{width}")]
    subprocess.run(command, check=True)


def summarize(args: argparse.Namespace) -> list[dict]:
    rows = []
    for width in args.widths:
        cells = {}
        for path in sorted((Path(args.out_dir) / f"d{width}" / "cells").glob("*.json")):
            cell = json.loads(path.read_text())
            cells[(cell["method"], cell["seed"])] = cell
        for seed in args.seeds:
            dense, sparse = cells.get((DENSE, seed)), cells.get((SPARSE, seed))
            if dense is None or sparse is None:
                continue
            rows.append(
                {
                    "width": width,
                    "parameters": parameters(width),
                    "seed": seed,
                    "fp32_defaults": dense["final_val_loss"],
                    "top0.9%_int2": sparse["final_val_loss"],
                    "gap": sparse["final_val_loss"] / dense["final_val_loss"] - 1,
                    "payload_ratio": sparse["payload_ratio"],
                    "senders_per_sent": statistics.mean(sparse["senders_per_sent"]),
                    "commands": [dense["command"], sparse["command"]],
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| width | parameters | seed | fp32 defaults | top-0.9% int2 | gap | payload ratio | senders per sent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['parameters']:,} | {r['seed']} | {r['fp32_defaults']:.4f} | {r['top0.9%_int2']:.4f} "
            f"| {100 * r['gap']:+.1f}% | {r['payload_ratio']:.0f}x | {r['senders_per_sent']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_args(argv)
    if not args.summary:
        for width in args.widths:
            run_size(args, width)
    rows = summarize(args)
    text = table(rows)
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tau": args.tau, "rounds": args.rounds, "seeds": args.seeds, "widths": args.widths}
    (out / "scaling.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (out / "scaling.md").write_text(
        f"{len(rows)} pairs of runs, {args.rounds} rounds of tau {args.tau}, R = 4\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
