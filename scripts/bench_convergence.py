"""Convergence of CO2 against DDP and the blocking baselines on one token budget, plus CO2's ablations.

Every run trains scripts/train_lm.py on the same model, per-rank batch and number of inner steps
(so the same number of tokens) inside one emulated cluster (default P = 4 nodes at 1 Gbit/s,
scripts/emulated_cluster.py), validating every few rounds on the same held-out batches. It records
validation loss against tokens and against wall-clock (training time, validation excluded) and
writes:

  <out_dir>/convergence.json             every curve, the exact commands, host load, self-check
  <out_dir>/convergence.md               final validation loss per run, gap to ddp, time, tokens/s
  <out_dir>/convergence_tokens.png       validation loss vs tokens (methods)
  <out_dir>/convergence_wallclock.png    validation loss vs wall-clock seconds (methods)
  <out_dir>/ablations.png                CO2 gap penalty (none/constant/adaptive) and clip (none/value/norm)

Runs (--runs picks a subset): the methods none, ddp, co2, localsgd, slowmo, diloco; and CO2 with
gap_penalty none / constant (λ = --gap_value) against the default adaptive, and clip value
(φ = --clip_value) / norm (φ = --clip_norm) against none. Every run is repeated for each --seeds.
τ: --tau, or what scripts/tune_tau.py picks in the cluster (0, the default).

    python -m scripts.bench_convergence --seeds 1337 1338
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import bench_throughput as bt
from scripts import emulated_cluster as ec

ROOT = Path(__file__).resolve().parent.parent


def run_specs(a) -> dict[str, list[str]]:
    """label -> train_lm.py flags that differ from the common ones."""
    co2 = ["--method", "co2_published", *a.co2_flags.split()]  # its results (benchmarks/) are CO2 as published
    return {
        "none": ["--method", "none"],
        "ddp": ["--method", "ddp"],
        "co2": co2,
        "localsgd": ["--method", "localsgd"],
        "slowmo": ["--method", "slowmo"],
        "diloco": ["--method", "diloco"],
        "co2 gap=none": [*co2, "--gap_penalty", "none"],
        "co2 gap=constant": [*co2, "--gap_penalty", "constant", "--gap_value", str(a.gap_value)],
        "co2 clip=value": [*co2, "--clip", "value", "--clip_threshold", str(a.clip_value)],
        "co2 clip=norm": [*co2, "--clip", "norm", "--clip_threshold", str(a.clip_norm)],
        # the same at a second tau (e.g. the throughput tuner's pick on an oversubscribed host)
        "co2 tau2": [*co2, "--tau", str(a.tau2)],
        "localsgd tau2": ["--method", "localsgd", "--tau", str(a.tau2)],
    }


METHOD_RUNS = ("none", "ddp", "co2", "localsgd", "slowmo", "diloco", "co2 tau2", "localsgd tau2")
ABLATIONS = {
    "gap penalty": ("co2 gap=none", "co2 gap=constant", "co2"),
    "clip": ("co2", "co2 clip=value", "co2 clip=norm"),
}


def get_args(argv: Optional[Sequence[str]] = None):
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=288, help="inner steps per rank, every run (a multiple of both taus)")
    p.add_argument("--tau", type=int, default=0, help="0: what tune_tau.py picks in the cluster")
    p.add_argument("--margin", type=float, default=1.5)
    p.add_argument("--tau2", type=int, default=36, help="the second tau of the 'co2 tau2', 'localsgd tau2' runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument("--runs", nargs="+", default=None, help="labels to run (default: all)")
    p.add_argument("--eval_points", type=int, default=10, help="validations per run (besides start and end)")
    p.add_argument("--co2_flags", default="--outer_momentum 0 --gap_penalty adaptive --gap_strength 2",
                   help="train_lm.py flags of every co2 run (the base the ablations vary)")  # fmt: skip
    p.add_argument("--gap_value", type=float, default=2.0,
                   help="λ of the constant gap penalty (2: the adaptive one's steady state at strength 2)")  # fmt: skip
    p.add_argument("--clip_value", type=float, default=0.002,
                   help="φ of the element-wise clip (~max |m| per element after the first rounds here)")  # fmt: skip
    p.add_argument("--clip_norm", type=float, default=1.0,
                   help="φ of the global-norm clip (|m| is ~1.3 early, ~0.2 at the end here)")  # fmt: skip
    p.add_argument("--model", default="--n_layer 4 --n_embd 320 --n_head 4 --block_size 64 --batch_size 1",
                   help="train_lm.py model/batch flags, one string")  # fmt: skip
    p.add_argument("--extra", default="--lr 3e-3 --min_lr 3e-4 --warmup_steps 30 --eval_batches 16",
                   help="more train_lm.py flags shared by every run")  # fmt: skip
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "convergence"))
    p.add_argument("--max_load", type=float, default=2.5)
    p.add_argument("--wait_load_s", type=float, default=1800)
    return p.parse_args(argv)


def curve(records: list[dict]) -> dict:
    points = [(r["tokens"], r["elapsed_s"], r["val_loss"]) for r in records
              if r.get("val_loss") is not None and not r.get("summary")]  # fmt: skip
    summary = records[-1]
    points.append((summary["tokens"], summary["elapsed_s"], summary["val_loss"]))
    return {"tokens": [p[0] for p in points], "elapsed_s": [p[1] for p in points], "val_loss": [p[2] for p in points],
            "final_val_loss": summary["val_loss"], "train_s": summary["elapsed_s"],
            "tokens_per_s": summary["tokens_per_s"], "steps": summary["steps"]}  # fmt: skip


def require_matplotlib() -> None:
    """The plots come last, after many minutes of runs: fail at the start if they could not be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"bench_convergence.py draws its plots with matplotlib ({error}): pip install -e '.[bench]'"
        ) from error


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    require_matplotlib()
    ec.require_privileges()
    specs = run_specs(a)
    labels = a.runs or list(specs)
    unknown = [x for x in labels if x not in specs]
    if unknown:
        raise SystemExit(f"unknown --runs {unknown}; known: {list(specs)}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_root = Path("/tmp") / f"c2z-conv-{int(time.time())}"
    model, extra = a.model.split(), a.extra.split()
    result = {
        "command": shlex.join(["python", "scripts/bench_convergence.py", *(sys.argv[1:] if argv is None else argv)]),
        "nodes": a.nodes, "rate": a.rate, "model": a.model, "extra": a.extra, "co2_flags": a.co2_flags,
        "seeds": a.seeds,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": [],
    }  # fmt: skip
    began = time.time()
    result["host_before"] = ec.wait_for_quiet_host(a.max_load, a.wait_load_s)
    with ec.EmulatedCluster(a.nodes, a.rate) as cluster:
        result["self_check"] = cluster.self_check()
        print(f"self-check: {json.dumps(result['self_check'])}", file=sys.stderr, flush=True)
        if a.tau > 0:
            tau = a.tau
        else:
            result["tuner"] = bt.run_tuner(cluster, model, a.margin, log_root / "tune")
            tau = result["tuner"]["recommendation"]["tau"]
        unit = math.lcm(tau, a.tau2) if any(x.endswith("tau2") for x in labels) else tau
        steps = -(-a.steps // unit) * unit  # a whole number of rounds for every run: the same tokens
        lines = steps // tau  # one log line per round / per tau steps
        eval_every = max(1, lines // a.eval_points)
        result.update(tau=tau, steps=steps, eval_every_steps=eval_every * tau)
        print(f"tau={tau} steps={steps} eval every {eval_every * tau} steps", file=sys.stderr, flush=True)
        for seed in a.seeds:
            for label in labels:
                log_dir = log_root / f"{label.replace(' ', '_').replace('=', '-')}_s{seed}"
                out_json = log_dir / "train.jsonl"
                run_tau = a.tau2 if label.endswith("tau2") else tau
                run_eval = max(1, steps // run_tau // a.eval_points)
                args = ["--tau", str(run_tau), "--log_every", str(run_tau), "--max_steps", str(steps),
                        "--eval_every", str(run_eval), "--seed", str(seed), "--no_progress", *model, *extra,
                        *specs[label], "--out_json", str(out_json)]  # fmt: skip
                host = {"load_avg": ec.load_average(), "cpu_busy": round(ec.host_cpu_busy(1.0), 3)}
                cluster.torchrun(bt.TRAIN, args, log_dir=log_dir, timeout_s=1200)
                records = [json.loads(line) for line in out_json.read_text().splitlines()]
                run = {"label": label, "seed": seed, "host_before": host,
                       "command": shlex.join(["scripts/train_lm.py", *args[:-2]]), **curve(records)}  # fmt: skip
                result["runs"].append(run)
                print(f"{label:18s} seed {seed}: final val {run['final_val_loss']:.4f} in {run['train_s']:.1f}s "
                      f"({run['tokens_per_s']:.0f} tok/s) host before {host}", file=sys.stderr, flush=True)  # fmt: skip
                (out_dir / "convergence.json").write_text(json.dumps(result, indent=1))
    result["total_s"] = round(time.time() - began, 1)
    result["table"] = table(result)
    (out_dir / "convergence.json").write_text(json.dumps(result, indent=1))
    (out_dir / "convergence.md").write_text(markdown(result))
    plots(result, out_dir)
    print(markdown(result))
    print(f"logs: {log_root}", file=sys.stderr)
    return 0


def table(result: dict) -> dict:
    """label -> mean final val loss over seeds, its spread, gap to ddp, mean train seconds, tokens/s."""
    by: dict[str, list[dict]] = {}
    for r in result["runs"]:
        by.setdefault(r["label"], []).append(r)
    out = {}
    for label, runs in by.items():
        losses = [r["final_val_loss"] for r in runs]
        out[label] = {"final_val_loss": statistics.mean(losses), "spread": max(losses) - min(losses),
                      "seeds": len(runs), "train_s": statistics.mean(r["train_s"] for r in runs),
                      "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs)}  # fmt: skip
    if "ddp" in out:
        for row in out.values():
            row["vs_ddp"] = row["final_val_loss"] / out["ddp"]["final_val_loss"] - 1
    return out


def markdown(result: dict) -> str:
    t = result["table"]
    chk = result["self_check"]
    lines = [
        "# Convergence on the emulated cluster",
        "",
        f"P = {result['nodes']} nodes at {result['rate']} (self-check: all-reduce reached "
        f"{chk.get('bus_bits_per_s', 0) / 1e9:.2f} Gbit/s, status {chk.get('status')}); model/batch "
        f"`{result['model']}`; `{result['extra']}`; τ = {result['tau']}; {result['steps']} inner steps per rank "
        f"for every run (same tokens); seeds {result['seeds']}. Every co2 run: `{result['co2_flags']}`; the "
        "ablations change one thing from it. Final validation loss is the mean over seeds "
        "(spread = max − min); `vs ddp` is the relative gap. Wall-clock excludes validation.",
        "",
        "| run | final val loss | spread | vs ddp | train s | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in t.items():
        vs = f"{100 * row['vs_ddp']:+.2f}%" if "vs_ddp" in row else ""
        lines.append(f"| {label} | {row['final_val_loss']:.4f} | {row['spread']:.4f} | {vs} | "
                     f"{row['train_s']:.1f} | {row['tokens_per_s']:,.0f} |")  # fmt: skip
    lines += ["", "Ablations (CO2, everything else at the defaults):", ""]
    for name, labels in ABLATIONS.items():
        have = [x for x in labels if x in t]
        if len(have) > 1:
            best = min(have, key=lambda x: t[x]["final_val_loss"])
            lines.append(f"- {name}: " + ", ".join(f"{x} {t[x]['final_val_loss']:.4f}" for x in have)
                         + f" → lowest: **{best}**")  # fmt: skip
    lines += ["", "Command:", "", f"    {result['command']}", "",
              "Plots: `convergence_tokens.png`, `convergence_wallclock.png`, `ablations.png`.", ""]  # fmt: skip
    return "\n".join(lines)


def plots(result: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = result["seeds"][0]
    runs = {r["label"]: r for r in result["runs"] if r["seed"] == seed}
    subtitle = f"P={result['nodes']} @ {result['rate']}, tau={result['tau']}, seed {seed}"
    for x, fname, xlabel in (("tokens", "convergence_tokens.png", "tokens (global)"),
                             ("elapsed_s", "convergence_wallclock.png", "wall-clock training seconds")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label in METHOD_RUNS:
            if label in runs:
                r = runs[label]
                ax.plot(r[x], r["val_loss"], marker=".", label=label, lw=2 if label in ("co2", "ddp") else 1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"Validation loss vs {xlabel.split(' (')[0]} — {subtitle}", fontsize=9)
        _zoom(ax, [runs[k] for k in METHOD_RUNS if k in runs])
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(ABLATIONS), figsize=(11, 4.2))
    for ax, (name, labels) in zip(axes, ABLATIONS.items()):
        have = [x for x in labels if x in runs]
        for label in have:
            ax.plot(runs[label]["tokens"], runs[label]["val_loss"], marker=".", label=label)
        ax.set_title(f"CO2 {name} — {subtitle}", fontsize=9)
        ax.set_xlabel("tokens (global)")
        ax.set_ylabel("validation loss")
        _zoom(ax, [runs[x] for x in have])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ablations.png", dpi=110)
    plt.close(fig)


def _zoom(ax, runs: list[dict]) -> None:
    """Show the second half of training in detail: y from the best loss to the worst mid-run loss."""
    if not runs:
        return
    lo = min(min(r["val_loss"]) for r in runs)
    mid = max(r["val_loss"][len(r["val_loss"]) // 3] for r in runs)
    ax.set_ylim(lo - 0.05 * (mid - lo) - 0.01, mid + 0.05 * (mid - lo) + 0.01)


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
