"""Convergence of CO2 with a compressed exchange, and the headline plot: validation loss against
wall-clock for DDP, CO2 fp32 and CO2 int8 on a slow link.

It reads a scripts/bench_throughput.py result (--throughput) and takes from its cell of the same P
and link: the model, batch and CO2 flags, the τ the tuner picked for each comm_dtype, and DDP's
steady-state tokens/s. Then, for every seed, on one token budget (--tokens):

  co2 in each --comm_dtypes at its own tuned τ, inside the emulated cluster at --rate
      (scripts/emulated_cluster.py): its wall-clock is its own (training time, validation excluded);
  ddp unshaped (plain torchrun, loopback): its loss does not depend on the link, and on the slow link
      it would take hours. Its wall-clock axis is tokens / (ddp's tokens/s in the throughput run).

Writes <out_dir>/compression.json (every curve, command, host load, the throughput cell it used),
compression.md (final validation loss per run: mean over seeds, spread, gap to ddp, wall-clock) and
headline.png (validation loss vs wall-clock, mean over seeds, every seed faint).

    python -m scripts.bench_compression --throughput benchmarks/throughput/throughput_compress.json \\
        --nodes 4 --rate 100mbit --seeds 1337 1338 1339
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import bench_convergence as bc
from scripts import bench_throughput as bt
from scripts import emulated_cluster as ec

ROOT = Path(__file__).resolve().parent.parent


def get_args(argv: Optional[Sequence[str]] = None):
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--throughput", default=str(ROOT / "benchmarks" / "throughput" / "throughput_compress.json"),
                   help="a bench_throughput.py result holding the cell --nodes:--rate")  # fmt: skip
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--comm_dtypes", nargs="+", default=["fp32", "int8"], choices=["fp32", "bf16", "int8", "fp8"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    p.add_argument("--tokens", type=int, default=737_280, help="token budget of every run (10x the 73,728 of before)")
    p.add_argument("--eval_points", type=int, default=10, help="validations per run (besides start and end)")
    p.add_argument("--extra", default="--lr 3e-3 --min_lr 3e-4 --warmup_steps 30 --eval_batches 16",
                   help="train_lm.py flags of every run besides the model, one string")  # fmt: skip
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "compression"))
    p.add_argument("--max_busy", type=float, default=0.15, help="before every run: wait for CPU busy below this")
    p.add_argument("--wait_busy_s", type=float, default=120)
    p.add_argument("--report", action="store_true", help="only rebuild the table and plot from <out_dir>'s JSON")
    return p.parse_args(argv)


def find_cell(throughput: dict, nodes: int, rate: str) -> dict:
    for cell in throughput["cells"]:
        if cell["nodes"] == nodes and cell["rate"] == rate:
            return cell
    have = [f"{c['nodes']}:{c['rate']}" for c in throughput["cells"]]
    raise SystemExit(f"--throughput has no cell {nodes}:{rate} (it has {have}); run bench_throughput.py for it")


def schedule(label: str, tau: int, steps: int, eval_points: int) -> list[str]:
    """--tau/--log_every/--eval_every of a run: co2 logs once per round, ddp every ~steps/eval_points
    steps; both validate about eval_points times."""
    if label == "ddp":
        every = max(1, steps // eval_points)
        return ["--tau", "1", "--log_every", str(every), "--eval_every", "1"]
    return ["--tau", str(tau), "--log_every", str(tau), "--eval_every", str(max(1, steps // tau // eval_points))]


def run_unshaped(nodes: int, args: list[str], log_dir: Path) -> None:
    """train_lm.py on `nodes` local ranks over loopback (no namespaces, no shaping)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nodes), bt.TRAIN,
           *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_dir / "node0.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    bc.require_matplotlib()
    if a.report:
        return report(json.loads((Path(a.out_dir) / "compression.json").read_text()), Path(a.out_dir))
    ec.require_privileges()
    throughput = json.loads(Path(a.throughput).read_text())
    cell = find_cell(throughput, a.nodes, a.rate)
    missing = [d for d in a.comm_dtypes if d not in cell.get("tuned_tau", {})]
    if missing:
        raise SystemExit(f"the throughput cell {a.nodes}:{a.rate} has no tuned τ for {missing}; it has "
                         f"{cell.get('tuned_tau')}: run bench_throughput.py with co2-<dtype> in --methods")  # fmt: skip
    model, co2_flags = throughput["model"].split(), throughput["co2_flags"].split()
    flags = dict(zip(model[::2], model[1::2]))
    tokens_per_step = a.nodes * int(flags["--batch_size"]) * int(flags["--block_size"])
    steps = -(-a.tokens // tokens_per_step)
    ddp_tps = cell["summary"]["ddp"]["tokens_per_s"]
    labels = {"ddp": 1, **{("co2" if d == "fp32" else f"co2-{d}"): cell["tuned_tau"][d] for d in a.comm_dtypes}}
    out_dir, log_root = Path(a.out_dir), Path("/tmp") / f"c2z-compress-{int(time.time())}"
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join(["python", "scripts/bench_compression.py", *(sys.argv[1:] if argv is None else argv)]),
        "throughput_file": a.throughput, "throughput_command": throughput["command"], "nodes": a.nodes,
        "rate": a.rate, "model": throughput["model"], "co2_flags": throughput["co2_flags"], "extra": a.extra,
        "seeds": a.seeds, "tokens": a.tokens, "taus": labels, "ddp_shaped_tokens_per_s": ddp_tps,
        "self_check": cell["self_check"], "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": [],
    }  # fmt: skip
    began = time.time()
    with ec.EmulatedCluster(a.nodes, a.rate) as cluster:
        result["self_check_now"] = cluster.self_check(strict=False)
        for seed in a.seeds:
            for label, tau in labels.items():
                log_dir = log_root / f"{label}_s{seed}"
                out_json = log_dir / "train.jsonl"
                args = [*schedule(label, tau, steps, a.eval_points), "--max_steps", str(steps), "--seed", str(seed),
                        "--no_progress", *bt.run_flags(label, model, co2_flags), *a.extra.split(),
                        "--out_json", str(out_json)]  # fmt: skip
                host = ec.wait_for_idle_cpus(a.max_busy, a.wait_busy_s)
                if label == "ddp":
                    run_unshaped(a.nodes, args, log_dir)
                else:
                    cluster.torchrun(bt.TRAIN, args, log_dir=log_dir, timeout_s=3600)
                run = {"label": label, "tau": tau, "seed": seed, "host_before": host,
                       "shaped": label != "ddp", "command": shlex.join(["scripts/train_lm.py", *args[:-2]]),
                       **bc.curve([json.loads(x) for x in out_json.read_text().splitlines()])}  # fmt: skip
                if label == "ddp":  # its time on the link, from the shaped throughput run
                    run["unshaped_elapsed_s"] = run["elapsed_s"]
                    run["elapsed_s"] = [t / ddp_tps for t in run["tokens"]]
                    run["train_s"] = run["elapsed_s"][-1]
                result["runs"].append(run)
                print(f"{label:9s} seed {seed}: final val {run['final_val_loss']:.4f}, {run['train_s']:.0f} s on the "
                      f"link  (host before: {host})", file=sys.stderr, flush=True)  # fmt: skip
                (out_dir / "compression.json").write_text(json.dumps(result, indent=1))
    result["total_s"] = round(time.time() - began, 1)
    return report(result, out_dir)


def report(result: dict, out_dir: Path) -> int:
    """The table (into the JSON too), compression.md and headline.png."""
    result["table"] = table(result)
    (out_dir / "compression.json").write_text(json.dumps(result, indent=1))
    (out_dir / "compression.md").write_text(markdown(result))
    plot(result, out_dir / "headline.png")
    print(markdown(result))
    return 0


def mean_curve(result: dict, label: str) -> tuple[list[float], list[float]]:
    """(seconds, validation loss) of `label`, each the mean over seeds at the same validation points."""
    runs = [r for r in result["runs"] if r["label"] == label]
    n = min(len(r["val_loss"]) for r in runs)
    return ([statistics.mean(r["elapsed_s"][i] for r in runs) for i in range(n)],
            [statistics.mean(r["val_loss"][i] for r in runs) for i in range(n)])  # fmt: skip


def seconds_to_reach(curve: tuple[list[float], list[float]], loss: float) -> Optional[float]:
    """When a curve first gets down to `loss` (linear between validation points); None if it never does."""
    seconds, losses = curve
    for i, value in enumerate(losses):
        if value <= loss:
            if i == 0:
                return seconds[0]
            t0, t1, v0 = seconds[i - 1], seconds[i], losses[i - 1]
            return t0 + (t1 - t0) * (v0 - loss) / (v0 - value)
    return None


def table(result: dict) -> dict:
    """bench_convergence's table (mean final val loss over seeds, spread, gap to ddp, mean seconds), with
    each run's τ, its speed against ddp's on the link, and when ddp gets down to the same loss."""
    out = bc.table(result)
    ddp = mean_curve(result, "ddp")
    for label, row in out.items():
        row["tau"] = result["taus"][label]
        row["speedup_vs_ddp"] = out["ddp"]["train_s"] / row["train_s"]
        row["ddp_s_to_same_loss"] = seconds_to_reach(ddp, row["final_val_loss"])
    return out


def markdown(result: dict) -> str:
    chk = result["self_check"]
    lines = [
        "# CO2 with a compressed exchange: convergence and wall-clock",
        "",
        f"P = {result['nodes']} nodes at {result['rate']} (throughput run's self-check: "
        f"{chk.get('bus_bits_per_s', 0) / 1e6:.0f} Mbit/s all-reduce bus bandwidth); model/batch "
        f"`{result['model']}`; `{result['extra']}`; co2 `{result['co2_flags']}`; {result['tokens']:,} tokens per run; "
        f"seeds {result['seeds']}. τ: what scripts/tune_tau.py picked for each comm_dtype in that cell. ddp trained "
        "unshaped; its wall-clock is tokens / its tokens/s on the link in the throughput run "
        f"({result['ddp_shaped_tokens_per_s']:,.0f} tokens/s). Final validation loss: mean over seeds (spread = "
        "max − min); wall-clock excludes validation.",
        "",
        "| run | τ | final val loss | spread | vs ddp | wall-clock s | ddp's s to that loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in result["table"].items():
        reach = row["ddp_s_to_same_loss"]
        lines.append(f"| {label} | {row['tau'] if label != 'ddp' else '–'} | {row['final_val_loss']:.4f} | "
                     f"{row['spread']:.4f} | {100 * row['vs_ddp']:+.2f}% | {row['train_s']:,.0f} | "
                     f"{'never' if reach is None else f'{reach:,.0f}'} |")  # fmt: skip
    lines += ["", "Command (after the throughput run it reads):", "", f"    {result['throughput_command']}",
              f"    {result['command']}", "", "Plot: `headline.png`.", ""]  # fmt: skip
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    means = []
    for label in result["taus"]:
        runs = [r for r in result["runs"] if r["label"] == label]
        x, y = mean_curve(result, label)
        tau = f", τ={result['taus'][label]}" if label != "ddp" else ""
        (line,) = ax.plot(x[1:], y[1:], marker=".", lw=2, label=f"{label}{tau} (mean over {len(runs)} seed(s))")
        for r in runs:  # every seed faint; the start (0 s) is off a log axis
            ax.plot(r["elapsed_s"][1:], r["val_loss"][1:], color=line.get_color(), lw=0.6, alpha=0.35)
        means.append({"val_loss": y})
    ax.set_xscale("log")
    ax.set_xlabel(f"training seconds on the link (log scale; ddp: tokens / its tokens/s at {result['rate']})")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Validation loss vs wall-clock — P={result['nodes']} @ {result['rate']}, "
                 f"{result['tokens']:,} tokens", fontsize=9)  # fmt: skip
    bc._zoom(ax, means)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
