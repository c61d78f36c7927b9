"""Throughput of CO2 against DDP, the blocking baselines and compute-only, on an emulated cluster.

For every cell (nodes P x link rate) it builds the cluster (scripts/emulated_cluster.py), runs the
bandwidth self-check, runs scripts/tune_tau.py once per CO2 wire format asked for (co2 = fp32,
co2-bf16, co2-int8: `comm_dtype`) to pick τ for that cell, then runs scripts/train_lm.py once per
method and repetition (in a rotated order each repetition, so slow drift of the host does not favour
one). `torchft-diloco` and `torchft-streaming` are torchft's own DiLoCo and Streaming DiLoCo (2
fragments) on the same model (scripts/torchft_peer.py): a Lighthouse on node 0 and one replica per
node, each replica in its node's namespace with its own hostname; they run --rounds × τ steps (no
--max_seconds) and their JSON lines are merged (tokens summed). Every method runs at the same τ,
fp32's pick (or --tau); a compressed co2 whose own pick is smaller also runs at that τ ("co2-int8
@tuned"): what the fewer bytes buy. The figure of merit is each run's steady-state tokens/s divided
by that of `none` (no communication at all: compute-only) in the same repetition of the same cluster.

Steady state: the first logged round (start-up, and for CO2 a round with nothing in flight) is
dropped; tokens/s is measured from the end of that round to the end of the run, excluding validation.
A run with fewer than --min_intervals intervals after it is flagged (`few_intervals`). For the
CO2-family methods the seconds blocked on the exchange (wait) and the round-end bookkeeping
(round_end - wait) are reported as fractions of that time. Every interval ends after train_lm.py's
log-point all-reduce, i.e. when the slowest rank got there (docs/design.md §9).

Results: <out_dir>/throughput.json (every run, with the load average and CPU-busy fraction of the
host before it, the self-check, the tuner's measurements and the exact command) and
<out_dir>/throughput.md (medians). Numbers measured while other programs load the host are
meaningless: by default it waits for the 1-minute load average to fall below --max_load before a
cell, and for the host's CPUs to be idle (busy < --max_busy over 1 s) before every run. On a host that
cannot be kept quiet, --cpus_per_node caps every node (compute-only included) at a fixed share of a core
and --cpu_weight puts the nodes ahead of the other programs, so that each node runs at the same speed
whatever else runs (`emulated_cluster.CpuCaps`).

    python -m scripts.bench_throughput --cells 4:1gbit 2:1gbit --reps 3        # the 1 Gbit/s table
    python -m scripts.bench_throughput --cells 4:100mbit --methods none ddp co2 co2-bf16 co2-int8 localsgd \
        --reps 3 --rounds 3 --min_intervals 2 --max_seconds 75 --tag P4_100mbit \
        --model "--n_layer 4 --n_embd 320 --n_head 4 --block_size 64 --batch_size 4"   # compressed exchange
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import emulated_cluster as ec
from scripts import torchft_peer

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "scripts" / "train_lm.py")
TUNE = str(ROOT / "scripts" / "tune_tau.py")
PEERS = {"torchft-diloco": "diloco", "torchft-streaming": "streaming"}  # run label -> torchft_peer --peer
# wire name (a co2 run label without its "co2-" prefix; "fp32" for "co2") -> the train_lm.py flags of that format;
# the sparse exchanges with SparseLoCo's decaying residual, their recommended setting (docs/configuration.md)
WIRES = {
    "fp32": ["--comm_dtype", "fp32"], "bf16": ["--comm_dtype", "bf16"], "int8": ["--comm_dtype", "int8"],
    "int4": ["--comm_dtype", "int4"], "int2": ["--comm_dtype", "int2"],
    **{f"top{p}%-int2": ["--comm_dtype", "int2", "--topk", f"{float(p) / 100:g}"] for p in ("3", "1.5", "1", "0.9")},
    "top3%-int2-decay": ["--comm_dtype", "int2", "--topk", "0.03", "--feedback_decay", "0.95"],
    "top1.5%-int2-decay": ["--comm_dtype", "int2", "--topk", "0.015", "--feedback_decay", "0.95"],
    "top0.9%-int2-decay": ["--comm_dtype", "int2", "--topk", "0.009", "--feedback_decay", "0.95"],
}  # fmt: skip
CO2_WIRES = tuple("co2" if w == "fp32" else f"co2-{w}" for w in WIRES)
METHODS = ("none", "ddp", *CO2_WIRES, "localsgd", "slowmo", "diloco", *PEERS)
LIGHTHOUSE_PORT = 29510  # on node 0, for the torchft runs
STORE_PORT = 29400  # each torchft replica's own store (its Manager's), on its node
CO2_FAMILY = (*CO2_WIRES, "localsgd", "slowmo", "diloco")
TUNED = "@tuned"  # suffix of a compressed co2 run at its own tuner's τ


def wire_of(label: str) -> str:
    """The wire format of a co2 run label: 'co2' -> fp32, 'co2-int8 @tuned' -> int8."""
    return label.removesuffix(TUNED).strip().partition("-")[2] or "fp32"


def run_flags(label: str, model: list[str], co2_flags: list[str]) -> list[str]:
    """train_lm.py flags of a run label besides tau and the run length: method, wire format, model. A
    torchft run takes the diloco preset's outer step, as the quality study's torchft cells do."""
    if label in PEERS:
        return ["--method", "diloco", *model]
    if not label.startswith("co2"):
        return ["--method", label, *model]
    # CO2 as published, every wire format: the tables in benchmarks/ were measured with it
    return ["--method", "co2_published", *WIRES[wire_of(label)], *model, *co2_flags]


def get_args(argv: Optional[Sequence[str]] = None):
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="+", default=["4:1gbit", "2:1gbit"],
                   help="NODES:RATE pairs, RATE in 100mbit|1gbit|10gbit|unshaped")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=["none", "ddp", "co2", "localsgd", "slowmo", "diloco"],
                   choices=METHODS)  # fmt: skip
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="CO2 rounds per run (steps = rounds x tau; same for all)")
    p.add_argument("--max_seconds", type=float, default=25.0, help="cap on each run's training time")
    p.add_argument("--min_intervals", type=int, default=5, help="steady-state intervals a run should have")
    p.add_argument("--tau", type=int, default=0, help="fixed tau (0: what tune_tau.py picks in each cell)")
    p.add_argument("--tuned_too", action="store_true",
                   help="with --tau: still tune every co2 wire format, and run each also at its own τ")  # fmt: skip
    p.add_argument("--tuner_flags", default="", help="extra tune_tau.py flags (e.g. --verify_rounds 0), one string")
    p.add_argument("--tuned_wires", nargs="*", default=None,
                   help="with --tuned_too: only these wires run at their own τ too (default: every one)")  # fmt: skip
    p.add_argument("--tuners_from", default=None,
                   help="reuse the tuners of an earlier run of the same cell: DIR/tune_<wire>/tune.json")  # fmt: skip
    p.add_argument("--min_steps", type=int, default=0, help="steps per run at least (whole rounds; for small τ)")
    p.add_argument("--margin", type=float, default=1.5, help="tune_tau.py --margin")
    p.add_argument("--co2_flags", default="--outer_momentum 0 --gap_penalty adaptive --gap_strength 2",
                   help="extra train_lm.py flags of the co2 runs and the tuner (see bench_convergence.py)")  # fmt: skip
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "throughput"))
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--max_load", type=float, default=2.5, help="wait for the 1-min load average below this")
    p.add_argument("--wait_load_s", type=float, default=1800, help="give up waiting after this (and say so)")
    p.add_argument("--max_busy", type=float, default=0.15, help="before every run: wait for CPU busy below this")
    p.add_argument("--wait_busy_s", type=float, default=120, help="... for at most this long (and say so)")
    p.add_argument("--cpus_per_node", type=float, default=0.0,
                   help="cap each node at this many cores in a cgroup (root; 0: the nodes share the host)")  # fmt: skip
    p.add_argument("--cpu_weight", type=float, default=1.0,
                   help="the capped nodes' scheduler weight beside other tasks (1: a plain process's)")  # fmt: skip
    p.add_argument("--strict_check", action=argparse.BooleanOptionalAction, default=True,
                   help="abort a cell whose bandwidth self-check fails")  # fmt: skip
    # the model and batch (train_lm.py flags): tokens/rank/step small enough that DDP is communication-bound
    p.add_argument("--model", default="--n_layer 4 --n_embd 320 --n_head 4 --block_size 64 --batch_size 1",
                   help="train_lm.py model/batch flags, one string")  # fmt: skip
    return p.parse_args(argv)


def steady_state(records: list[dict], min_intervals: int = 5) -> dict:
    """tokens/s, wait and bookkeeping fractions after the first logged interval."""
    rounds = [r for r in records if not r.get("summary") and r.get("step", 0) > 0]
    if len(rounds) == 1:  # a very slow method (ddp on a slow link): the one interval, start-up included
        r = rounds[0]
        return {"tokens_per_s": r["tokens"] / r["elapsed_s"], "seconds": r["elapsed_s"], "steps": r["step"],
                "intervals": 1, "includes_startup": True, "few_intervals": True}  # fmt: skip
    if len(rounds) < 2:
        raise ValueError(f"need at least 1 logged interval, got {len(rounds)}")
    first, last = rounds[0], rounds[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    out = {"tokens_per_s": (last["tokens"] - first["tokens"]) / seconds, "seconds": seconds,
           "steps": last["step"] - first["step"], "intervals": len(rounds) - 1}  # fmt: skip
    if out["intervals"] < min_intervals:
        out["few_intervals"] = True
    later = rounds[1:]
    if all(r.get("wait_s") is not None for r in later):
        wait = sum(r["wait_s"] for r in later)
        out["wait_fraction"] = wait / seconds
        if all(r.get("round_end_s") is not None for r in later):
            out["bookkeeping_fraction"] = (sum(r["round_end_s"] for r in later) - wait) / seconds
            out["round_s"] = seconds / len(later)
    return out


def run_tuner(cluster: ec.EmulatedCluster, model: list[str], margin: float, log_dir: Path) -> dict:
    """scripts/tune_tau.py in the cluster; `model`: train_lm.py flags (model, batch, CO2 knobs)."""
    out = log_dir / "tune.json"
    args = [*model, "--margin", str(margin), "--tune_json", str(out)]
    cluster.torchrun(TUNE, args, log_dir=log_dir, timeout_s=900)
    result = json.loads(out.read_text())
    result["command"] = shlex.join(["scripts/tune_tau.py", *args[:-2]])
    result["log"] = (log_dir / "node0.log").read_text(errors="replace")[-3000:]
    return result


def train_args(label: str, tau: int, steps: int, flags: list[str], max_seconds: float, out_json: Path) -> list[str]:
    """train_lm.py flags of one run. CO2-family methods log once per round; `none` every tau steps (the
    same per-round sync as CO2's log line); ddp every min(4, tau) steps, so that even a slow link
    gives it a few log intervals within --max_seconds (it only stops at a log line)."""
    log_every = min(4, tau) if label == "ddp" else tau
    length = [] if label in PEERS else ["--max_seconds", str(max_seconds)]  # torchft's replicas stop at --max_steps
    return [
        "--tau", str(tau), "--log_every", str(log_every), "--max_steps", str(steps), *length,
        "--eval_every", "0", "--eval_batches", "2", "--data_bytes", "1000000",
        "--warmup_steps", "5", "--no_progress", *flags, "--out_json", str(out_json),
    ]  # fmt: skip


def tune_cell(cluster: ec.EmulatedCluster, a, co2_flags: list[str], log_dir: Path) -> dict:
    """wire -> the tuner's result, for every co2 wire format among --methods (none with --tau, unless
    --tuned_too)."""
    if a.tau > 0 and not a.tuned_too:
        return {}
    wires = dict.fromkeys(wire_of(m) for m in a.methods if m.startswith("co2")) or {"fp32": None}
    tuners = {}
    for wire in wires:
        flags = [*a.model.split(), *co2_flags, *WIRES[wire], *a.tuner_flags.split()]
        earlier = Path(a.tuners_from or "/nonexistent") / f"tune_{wire}" / "tune.json"
        if earlier.exists():
            tuners[wire] = {**json.loads(earlier.read_text()), "reused_from": str(earlier)}
            tuners[wire]["command"] = shlex.join(["scripts/tune_tau.py", *flags, "--margin", str(a.margin)])
        else:
            tuners[wire] = run_tuner(cluster, flags, a.margin, log_dir / f"tune_{wire}")
        print(f"   tuner {wire}: {tuners[wire]['recommendation']}", file=sys.stderr, flush=True)
    return tuners


def plan(methods: Sequence[str], tau: int, tuned: dict[str, int], every_wire: bool = False) -> dict[str, int]:
    """run label -> τ: every method at the common τ, and each compressed co2 at its own tuned τ too where
    that is smaller; with `every_wire` (a fixed common τ) every co2 wire, fp32 included, wherever it differs."""
    runs = dict.fromkeys(methods, tau)
    for m in methods:
        own = tuned.get(wire_of(m), tau) if m.startswith("co2") else tau
        if (own < tau and m.startswith("co2-")) or (every_wire and own != tau):
            runs[m + " " + TUNED] = own
    return runs


def run_one(cluster: ec.EmulatedCluster, label: str, tau: int, rep: int, a, log_dir: Path) -> dict:
    """One train_lm.py run in the cluster, on a quiet host; its steady state."""
    out_json = log_dir / "train.jsonl"
    flags = run_flags(label, a.model.split(), a.co2_flags.split())
    rounds = max(a.rounds, -(-a.min_steps // max(tau, 1)))
    steps = rounds * max(tau, 1)
    args = train_args(label.removesuffix(TUNED).strip(), tau, steps, flags, a.max_seconds, out_json)
    host = ec.wait_for_idle_cpus(a.max_busy, a.wait_busy_s)
    began = time.time()
    if label in PEERS:
        records = run_peer(cluster, PEERS[label], args[:-2], log_dir, timeout_s=600)
        script = ["scripts/torchft_peer.py", "--peer", PEERS[label]]
    else:
        cluster.torchrun(TRAIN, args, log_dir=log_dir, timeout_s=600)
        records = [json.loads(line) for line in out_json.read_text().splitlines()]
        script = ["scripts/train_lm.py"]
    run = {"label": label, "tau": tau, "rep": rep, "host_before": host, "wall_s": round(time.time() - began, 1),
           "command": shlex.join([*script, *args[:-2]]),
           "final_val_loss": records[-1].get("val_loss")}  # fmt: skip
    try:
        run.update(steady_state(records, a.min_intervals))
    except ValueError as error:  # too few log lines: recorded, left out of the medians
        run["error"] = str(error)
    return run


def run_peer(cluster: ec.EmulatedCluster, peer: str, flags: list[str], log_dir: Path, timeout_s: float) -> list[dict]:
    """torchft's `peer` job on the cluster: a Lighthouse on node 0 waiting for every node, one replica
    (scripts/torchft_peer.py with `flags`) per node with its own hostname and store; the replicas' JSON
    lines merged. Raises HarnessError with the logs' tails if a replica fails or misses timeout_s."""
    log_dir.mkdir(parents=True, exist_ok=True)
    bind = f"[::]:{LIGHTHOUSE_PORT}"
    lighthouse = cluster.popen(0, torchft_peer.lighthouse_argv(cluster.nodes, bind), log=log_dir / "lighthouse.log",
                               capped=False)  # fmt: skip
    parts = [log_dir / f"replica{i}.jsonl" for i in range(cluster.nodes)]
    try:
        url = f"http://{cluster.ip(0)}:{LIGHTHOUSE_PORT}"
        procs = [cluster.popen(i, torchft_peer.replica_argv(["--peer", peer, *flags], url, i, part),
                               env={"MASTER_ADDR": cluster.ip(i), "MASTER_PORT": str(STORE_PORT)}, cwd=str(ROOT),
                               log=part.with_suffix(".log"), own_hostname=True)
                 for i, part in enumerate(parts)]  # fmt: skip
        codes = cluster.wait_all(procs, timeout_s)
    finally:
        cluster.kill(lighthouse)
    if any(codes):
        tails = "\n".join(f"--- replica {i} (exit {c}):\n" + ec.log_tail(part.with_suffix(".log"))
                          for i, (c, part) in enumerate(zip(codes, parts)) if c)  # fmt: skip
        raise ec.HarnessError(f"torchft {peer}: replicas failed, exit codes {codes}; logs in {log_dir}\n{tails}")
    return torchft_peer.merge_records([[json.loads(x) for x in p.read_text().splitlines()] for p in parts])


def run_cell(nodes: int, rate: str, a, log_root: Path, save: Callable[[dict], None] = lambda cell: None) -> dict:
    """One cell: the cluster, its self-check, the tuners, every run of every repetition; `save(cell)` after
    each repetition (the cell so far, with `reps_done`), so that a cell cut short keeps its whole repetitions."""
    cell = {"nodes": nodes, "rate": rate, "host_before": ec.wait_for_quiet_host(a.max_load, a.wait_load_s)}
    print(f"== cell P={nodes} {rate}: {cell['host_before']}", file=sys.stderr, flush=True)
    caps = {"cpus_per_node": a.cpus_per_node, "cpu_weights": [a.cpu_weight] * nodes} if a.cpus_per_node else {}
    with ec.EmulatedCluster(nodes, rate, **caps) as cluster:
        check = cluster.self_check(strict=False)
        cell["self_check"] = check
        print(f"   self-check: {json.dumps(check)}", file=sys.stderr, flush=True)
        if check.get("status") == "fail" and a.strict_check:
            raise ec.ShapingError(f"cell P={nodes} {rate}: self-check failed: {check.get('error')}")
        cell["tuners"] = tune_cell(cluster, a, a.co2_flags.split(), log_root / f"P{nodes}_{rate}")
        tuned = {dtype: t["recommendation"]["tau"] for dtype, t in cell["tuners"].items()}
        cell["tau"] = a.tau if a.tau > 0 else tuned.get("fp32", max(tuned.values()))
        cell["tuned_tau"] = tuned
        own = {w: t for w, t in tuned.items() if a.tuned_wires is None or w in a.tuned_wires}
        runs_tau = plan(a.methods, cell["tau"], own, every_wire=a.tau > 0 and a.tuned_too)
        labels = list(runs_tau)
        runs = []
        for rep in range(a.reps):
            k = rep % len(labels)
            for label in labels[k:] + labels[:k]:
                log_dir = log_root / f"P{nodes}_{rate}_{label.replace(' ', '')}_r{rep}"
                run = run_one(cluster, label, runs_tau[label], rep, a, log_dir)
                runs.append(run)
                print(f"   {label:16s} rep {rep}: " + (run.get("error") or f"{run['tokens_per_s']:8.0f} tok/s"
                      + (f" wait {100 * run['wait_fraction']:.1f}%" if "wait_fraction" in run else "")
                      + (f" book {100 * run['bookkeeping_fraction']:.1f}%" if "bookkeeping_fraction" in run else "")
                      + (" FEW INTERVALS" if run.get("few_intervals") else ""))
                      + f"  (host before: {run['host_before']})", file=sys.stderr, flush=True)  # fmt: skip
            save({**cell, "runs": runs, "summary": summarize(runs, labels), "reps_done": rep + 1})
    cell["runs"] = runs
    cell["host_after"] = {"load_avg": ec.load_average()}
    cell["summary"] = summarize(runs, labels)
    return cell


def summarize(runs: list[dict], labels: Sequence[str]) -> dict:
    """Per run label: median tokens/s, median of per-repetition ratios to `none`, median wait/bookkeeping."""
    by = {(r["label"], r["rep"]): r for r in runs if "tokens_per_s" in r}
    reps = sorted({r["rep"] for r in runs})
    out = {}
    for m in labels:
        mine = [by[(m, k)] for k in reps if (m, k) in by]
        if not mine:
            continue
        row = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine), "n": len(mine),
               "tau": mine[0]["tau"], "intervals": min(r["intervals"] for r in mine)}  # fmt: skip
        for flag in ("includes_startup", "few_intervals"):
            if any(r.get(flag) for r in mine):
                row[flag] = True
        ratios = [by[(m, k)]["tokens_per_s"] / by[("none", k)]["tokens_per_s"]
                  for k in reps if (m, k) in by and ("none", k) in by]  # fmt: skip
        if ratios:
            row["ratio_to_none"] = statistics.median(ratios)
            row["ratio_range"] = [min(ratios), max(ratios)]
        for key in ("wait_fraction", "bookkeeping_fraction", "round_s"):
            vals = [r[key] for r in mine if key in r]
            if vals and m != "none":
                row[key] = statistics.median(vals)
        out[m] = row
    return out


def _pct(row: dict, key: str) -> str:
    return f"{100 * row[key]:.1f}%" if key in row else ""


def _pick(wire: str, tuner: dict) -> str:
    """One wire format's tuner pick, with the one-round exchange it measured (time, bytes per rank)."""
    comm = tuner.get("comm", {})
    sent = f", {comm['bytes_sent'] / 1e6:.2f} MB" if "bytes_sent" in comm else ""
    return f"{wire} τ = {tuner['recommendation']['tau']} (t_comm {comm.get('t_comm', 0):.2f} s{sent})"


def markdown(result: dict) -> str:
    lines = [
        "# Throughput on the emulated cluster",
        "",
        f"Model/batch: `{result['model']}`, one thread per rank, {result['host']['cores']} cores. Figure of merit: "
        "steady-state tokens/s as a ratio of `none` (compute only, no communication) in the same repetition. "
        "Medians over repetitions (range of the ratio in brackets). `wait` = blocked on the exchange, "
        "`book` = round-end bookkeeping, as % of training time. τ: every run at the cell's common τ (fp32's "
        f"tuned τ, or --tau); `{TUNED}`: a co2 wire format at its own tuner's τ.",
        "",
        "| P | link | achieved all-reduce | comm/step | run | τ | tokens/s | × none | wait | book |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        chk = cell["self_check"]
        bits = chk.get("bus_bits_per_s")
        bw = "?" if bits is None else f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"
        if chk.get("status") == "host_limited":
            bw += " (host limit: not a real 10gbit)"
        elif chk.get("status") == "fail":
            bw += " (SELF-CHECK FAILED)"
        ratio = (cell.get("tuners") or {}).get("fp32", {}).get("recommendation", {}).get("comm_over_step")
        first = True
        for m, row in cell["summary"].items():
            rr = (f"{row['ratio_to_none']:.3f} [{row['ratio_range'][0]:.2f}–{row['ratio_range'][1]:.2f}]"
                  if "ratio_to_none" in row else "")  # fmt: skip
            head = (f"| {cell['nodes']} | {cell['rate']} | {bw} | {'' if ratio is None else f'{ratio:.2f}'} |"
                    if first else "| | | | |")  # fmt: skip
            star = "*" if row.get("includes_startup") else "†" if row.get("few_intervals") else ""
            lines.append(f"{head} {m}{star} | {row['tau']} | {row['tokens_per_s']:,.0f} | {rr} | "
                         f"{_pct(row, 'wait_fraction')} | {_pct(row, 'bookkeeping_fraction')} |")  # fmt: skip
            first = False
    lines += ["", "`comm/step`: the fp32 tuner's one-round exchange time over one inner step's compute time — also "
              "DDP's communication/compute ratio (DDP all-reduces the same bytes every step). `*`: too slow "
              "for a steady state within --max_seconds; its one logged interval, start-up included. `†`: fewer "
              "than --min_intervals steady-state intervals.", ""]  # fmt: skip
    for c in result["cells"]:
        picks = ", ".join(_pick(w, t) for w, t in (c.get("tuners") or {}).items())
        cut = f" (cut short: {c['reps_done']} of the repetitions done)" if "reps_done" in c else ""
        lines.append(f"- P={c['nodes']} {c['rate']}{cut}: tuner picks {picks or '(fixed --tau)'}; host load average "
                     f"before the cell {c['host_before']['load_avg']}")  # fmt: skip
    lines += ["", "Command:", "", f"    {result['command']}", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    ec.require_privileges()
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_root = Path("/tmp") / f"c2z-bench-{int(time.time())}"
    result = {
        "command": shlex.join(["python", "-m", "scripts.bench_throughput", *(sys.argv[1:] if argv is None else argv)]),
        "model": a.model, "co2_flags": a.co2_flags, "methods": a.methods, "reps": a.reps, "rounds": a.rounds,
        "host": {"cores": os.cpu_count(), "load_avg_start": ec.load_average()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": [],
    }  # fmt: skip
    stem = "throughput" + (f"_{a.tag}" if a.tag else "")
    began = time.time()

    def save(partial: dict) -> None:  # after every repetition: partial results
        so_far = {**result, "cells": [*result["cells"], partial]}
        (out_dir / f"{stem}.json").write_text(json.dumps(so_far, indent=1))
        (out_dir / f"{stem}.md").write_text(markdown(so_far))

    for spec in a.cells:
        nodes, rate = spec.split(":")
        result["cells"].append(run_cell(int(nodes), rate, a, log_root, save))
        (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out_dir / f"{stem}.md").write_text(markdown(result))
    result["total_s"] = round(time.time() - began, 1)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"logs: {log_root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
