"""The loss a resharded resume costs at a sparse wire format: the training job straight, against the same
job saved halfway and resumed with --reshard (the CO2 state, the error-feedback residuals included, re-cut
for the new grid; the inner optimizer state fresh; the partial round dropped), for each seed.

Runs scripts/train_lm.py under torchrun on this host (gloo, one thread per rank), tiny model, top-k int2.
Prints a table and writes <out>/<name>.json: every run's final validation loss, the exact commands, the
host's load before each run.

    python -m scripts.bench_reshard --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
MODEL = [
    "--n_layer",
    "2",
    "--n_embd",
    "64",
    "--n_head",
    "2",
    "--block_size",
    "32",
    "--batch_size",
    "8",
    "--data_bytes",
    "400000",
    "--eval_batches",
    "8",
    "--no_progress",
]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--ranks", type=int, default=2, help="the saving run's ranks (R, one shard each)")
    p.add_argument("--resume_ranks", type=int, default=None, help="the resumed run's ranks; default --ranks")
    p.add_argument("--steps", type=int, default=64, help="--max_steps of every run")
    p.add_argument("--save_at", type=int, default=32, help="the step saved and resumed from (a round end)")
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--topk", type=float, default=0.05)
    p.add_argument("--comm_dtype", default="int2")
    p.add_argument("--work", default=None, help="scratch directory for checkpoints and logs (default: a new one)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "reshard"))
    p.add_argument("--name", default="topk_int2")
    return p.parse_args(argv)


def run(flags: list[str], ranks: int, cwd: Path, out: Path) -> dict:
    """One launch of the training job -> {"command", "load", "val_loss" (final), "records"}."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        str(ROOT / "scripts" / "train_lm.py"),
        *flags,
        "--out_json",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    shown = shlex.join(["torchrun", "--standalone", "--nproc_per_node", str(ranks), "scripts/train_lm.py", *flags])
    return {"command": shown, "load": load, "val_loss": records[-1]["val_loss"]}


def measure(a: argparse.Namespace, seed: int) -> dict:
    """The straight run (saving at --save_at) and the resharded resume from that save, for one seed."""
    work = Path(a.work or tempfile.mkdtemp(prefix="c2z-reshard-")) / f"seed{seed}"
    work.mkdir(parents=True)  # a save directory belongs to one run: never one of an earlier invocation
    common = [
        *MODEL,
        "--seed",
        str(seed),
        "--tau",
        str(a.tau),
        "--max_steps",
        str(a.steps),
        "--topk",
        str(a.topk),
        "--comm_dtype",
        a.comm_dtype,
        "--eval_every",
        str(a.steps),
    ]
    saving = [*common, "--save_dir", "ckpt", "--save_every", str(a.save_at)]
    straight = run(saving, a.ranks, work, work / "straight.jsonl")
    resumed = [*common, "--resume", f"ckpt/step{a.save_at:08d}", "--reshard"]
    resharded = run(resumed, a.resume_ranks or a.ranks, work, work / "resharded.jsonl")
    return {
        "seed": seed,
        "straight": straight,
        "resharded": resharded,
        "difference": resharded["val_loss"] - straight["val_loss"],
    }


def main(argv: Sequence[str] = ()) -> None:
    a = parse(argv or sys.argv[1:])
    runs = [measure(a, seed) for seed in a.seeds]
    straight = [r["straight"]["val_loss"] for r in runs]
    resharded = [r["resharded"]["val_loss"] for r in runs]
    summary = {
        "straight_mean": statistics.mean(straight),
        "resharded_mean": statistics.mean(resharded),
        "difference_mean": statistics.mean(r["difference"] for r in runs),
        "difference_relative": statistics.mean(resharded) / statistics.mean(straight) - 1,
    }
    settings = {k: v for k, v in vars(a).items() if k not in ("work", "out", "name")}
    doc = {
        "what": __doc__.split("\n\n")[0],
        "settings": settings,
        "model": MODEL,
        "summary": summary,
        "runs": runs,
        "command": shlex.join(["python", "-m", "scripts.bench_reshard", *(argv or sys.argv[1:])]),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"| seed | straight | resharded at step {a.save_at} | difference |")
    print("|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['seed']} | {r['straight']['val_loss']:.4f} | {r['resharded']['val_loss']:.4f} | "
            f"{r['difference']:+.4f} |"
        )
    print(
        f"| mean | {summary['straight_mean']:.4f} | {summary['resharded_mean']:.4f} | "
        f"{summary['difference_mean']:+.4f} ({100 * summary['difference_relative']:+.2f}%) |"
    )


if __name__ == "__main__":
    main()
