"""Replicas of different speeds (issue 40's evidence): one τ, `replica_tau` and torchft's DiLoCo on an
emulated cluster whose nodes have different CPU caps, beside a uniform cluster of equal total compute.

P = 4 nodes of scripts/emulated_cluster.py (network namespaces, every link shaped to --rate), one rank
each; node i's CPU is capped by a cgroup quota of speed_i × --core cores (CFS quota, a real limit, not a
sleep). Start-up runs uncapped; the caps apply before the first training step (a ready/go handshake,
scripts/hetero_worker.py; torchft's replicas once each has written its first record). The model is the
training job's GPT (--model flags), the data its streams; every method trains the same total tokens.
Per case and repetition, in a rotated order:

  uniform        CO2, one τ, every node capped at the mean of the case's caps (equal total compute)
  fixed_tau      CO2, one τ, the case's caps
  replica_tau    CO2, τ_r = taus_for_speeds(speeds measured by the ranks at the run's start, τ), as many
                 rounds as give the same tokens (rounded); every CO2 run with the defaults but the sync
                 delay, the round end (what replica_tau runs with), so pacing is the only difference
  auto           CO2, `replica_tau: "auto"`: the job fixes its τ_r at step 5 and corrects them once from its
                 first whole round at them, then as many rounds as give the tokens
  pinned         CO2, `replica_tau` given: the same case and repetition's `auto` run's final τ_r (what a
                 user copies from its log to pin them), run after it
  torchft_diloco torchft 0.2.0's DiLoCo (scripts/torchft_peer.py), one τ, the case's caps, the same outer
                 lr and momentum as CO2's, fp32 on the wire whatever --comm_dtype --extra gives
and once per repetition (its seed) DDP, unshaped and uncapped on the host, for --ddp_rounds rounds' tokens
(default: the methods'; fewer make its final loss a target the local-step runs reach), its final loss the
target of the times below; its speed is not measured here.

Per method and repetition: `tokens_per_s_over_own_speeds` (the job's tokens over its training seconds,
over the sum of its ranks' own speeds: each rank's tokens per step over its mean inner-step time, round
ends excluded, measured in the run itself; torchft's replicas do not time their steps, so its
denominator is the same repetition's fixed_tau run's, same caps), `final_val_loss` (also over the
uniform run's at equal tokens), and the training seconds to DDP's final loss and to within 2, 5 and 10%
of it, and to the uniform run's loss at equal tokens (interpolated between held-out evaluations), over
the uniform run's. `runs.json` keeps every run (--summary rebuilds the tables, --resume goes on).
Host facts (cores, load before each run) go with every run: the host is
shared with other jobs.

    sudo PYTHONPATH=. OMP_NUM_THREADS=1 python -m scripts.bench_hetero --reps 3 --rounds 6   # ~47 min here
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import bench_hetero_report as report
from scripts import emulated_cluster as ec
from scripts import torchft_peer

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "scripts" / "hetero_worker.py")
CASES = {"half": [1.0, 1.0, 1.0, 0.5], "quarter": [1.0, 1.0, 0.5, 0.25]}
METHODS = ("uniform", "fixed_tau", "replica_tau", "auto", "pinned", "torchft_diloco")
LIGHTHOUSE_PORT, STORE_PORT = 29510, 29400
# a run's deadline: fixed τ and torchft run every round at the slowest node's pace (here up to a minute)
RUN_TIMEOUT_S, RUN_TIMEOUT_PER_ROUND_S = 900, 90
PACING = {m: m for m in ("replica_tau", "auto", "pinned")} | {"uniform": "fixed", "fixed_tau": "fixed"}  # the worker's


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--core", type=float, default=0.4, help="cores of a speed-1 node (caps sum below the host's)")
    p.add_argument("--weight", type=float, default=2.0,
                   help="scheduler weight of a speed-1 node (cpu.shares / 1024), the others' pro rata")  # fmt: skip
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--tau", type=int, default=12)
    p.add_argument("--rounds", type=int, default=8, help="rounds at one τ (every method trains these tokens)")
    p.add_argument("--ddp_rounds", type=int, nargs="+", default=None,
                   help="DDP's tokens in rounds at one τ (default: --rounds); several: a DDP run at each, the "
                   "first the main target, each other's final loss a target of its own")  # fmt: skip
    p.add_argument("--eval_every", type=int, default=2, help="rounds between held-out evaluations")
    p.add_argument("--model", default="--n_layer 4 --n_embd 320 --n_head 4 --block_size 64 --batch_size 4",
                   help="the training job's model/batch flags (5 M parameters, 256 tokens/rank/step)")  # fmt: skip
    p.add_argument("--extra", default="--lr 3e-3 --min_lr 3e-4 --warmup_steps 16 --eval_batches 8 --outer_lr 0.5 "
                   "--outer_momentum 0.9", help="more flags of every run")  # fmt: skip
    p.add_argument("--no_ddp", action="store_true", help="skip DDP (no time-to-target)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "heterogeneous"))
    p.add_argument("--summary", action="store_true", help="only rebuild the tables from <out>/runs.json")
    p.add_argument("--resume", action="store_true", help="keep <out>/runs.json's runs, run only the others")
    a = p.parse_args(argv)
    a.ddp_rounds = [a.rounds] if a.ddp_rounds is None else a.ddp_rounds
    if len(set(a.ddp_rounds)) != len(a.ddp_rounds) or min(a.ddp_rounds) < 1:
        p.error(f"--ddp_rounds {a.ddp_rounds}: expected distinct positive round counts")
    return a


def caps(method: str, speeds: Sequence[float], core: float) -> list[float]:
    """Each node's CPU cap in cores: the case's, or (uniform) their mean on every node."""
    if method == "uniform":
        return [core * sum(speeds) / len(speeds)] * len(speeds)
    return [core * s for s in speeds]


def common_flags(a: argparse.Namespace, seed: int) -> list[str]:
    return [*a.model.split(), *a.extra.split(), "--tau", str(a.tau), "--seed", str(seed), "--no_progress"]


def run_timeout_s(rounds: int) -> float:
    """The deadline of one run of `rounds` rounds' tokens."""
    return max(RUN_TIMEOUT_S, RUN_TIMEOUT_PER_ROUND_S * rounds)


def fp32_wire(flags: list[str]) -> list[str]:
    """`flags` without a --comm_dtype: torchft's DiLoCo sends fp32 (its peer refuses any other)."""
    out, rest = [], iter(flags)
    for flag in rest:
        if flag == "--comm_dtype":
            next(rest, None)  # its value
        elif not flag.startswith("--comm_dtype="):
            out.append(flag)
    return out


def host_facts() -> dict:
    return {"load_avg": ec.load_average(), "cpu_busy": round(ec.host_cpu_busy(0.5), 3)}


def run_worker(cluster: ec.EmulatedCluster, flags: list[str], work: Path, timeout_s: float) -> dict:
    """hetero_worker on every node: start uncapped, cap every rank once all are ready, then go."""
    shake, result = work / "shake", work / "result.json"
    shake.mkdir()
    args = [*flags, "--handshake", str(shake), "--result", str(result)]
    procs = [cluster.popen(i, cluster.torchrun_argv(i, WORKER, args), log=work / f"node{i}.log", capped=False)
             for i in range(cluster.nodes)]  # fmt: skip
    ready = [shake / f"ready{i}" for i in range(cluster.nodes)]
    _wait_for(lambda: all(r.exists() and r.read_text() for r in ready), procs, work, "the ranks' start-up")
    for i, r in enumerate(ready):
        cluster.caps.admit(i, int(r.read_text()))
    (shake / "go").write_text("")
    _check(cluster.wait_all(procs, timeout_s), work)
    return json.loads(result.read_text())


def run_torchft(cluster: ec.EmulatedCluster, flags: list[str], rounds: int, tau: int, work: Path) -> dict:
    """torchft's DiLoCo, one replica per node (bench_throughput's layout), capped once every replica has
    written its first record (after start-up and its initial evaluation)."""
    lighthouse = cluster.popen(0, torchft_peer.lighthouse_argv(cluster.nodes, f"[::]:{LIGHTHOUSE_PORT}"),
                               log=work / "lighthouse.log", capped=False)  # fmt: skip
    parts = [work / f"replica{i}.jsonl" for i in range(cluster.nodes)]
    url = f"http://{cluster.ip(0)}:{LIGHTHOUSE_PORT}"
    peer_flags = ["--peer", "diloco", "--method", "diloco", *fp32_wire(flags), "--max_steps", str(rounds * tau)]
    try:
        procs = [cluster.popen(i, torchft_peer.replica_argv(peer_flags, url, i, part), cwd=str(ROOT),
                               env={"MASTER_ADDR": cluster.ip(i), "MASTER_PORT": str(STORE_PORT)},
                               log=part.with_suffix(".log"), own_hostname=True, capped=False)
                 for i, part in enumerate(parts)]  # fmt: skip
        _wait_for(lambda: all(p.exists() and p.read_text().strip() for p in parts), procs, work, "torchft's start-up")
        for i, proc in enumerate(procs):
            cluster.caps.admit(i, proc.pid)
        _check(cluster.wait_all(procs, run_timeout_s(rounds)), work)
    finally:
        cluster.kill(lighthouse)
    records = torchft_peer.merge_records([[json.loads(x) for x in p.read_text().splitlines()] for p in parts])
    return report.from_peer_records(records, tau, peer_flags)


def _wait_for(done, procs: list, work: Path, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                ec._kill_group(p)
            raise ec.HarnessError(f"bench_hetero: {what} failed or took over {timeout_s:g}s; logs in {work}")
        time.sleep(0.05)


def _check(codes: list[int], work: Path) -> None:
    if any(codes):
        raise ec.HarnessError(f"bench_hetero: exit codes {codes}; logs in {work}")


def run_method(
    method: str, speeds: list[float], a: argparse.Namespace, seed: int, taus: Optional[list[int]], work: Path
) -> dict:
    """One run of `method` in a fresh cluster with its caps (`pinned`: at `taus`)."""
    node_caps = caps(method, speeds, a.core)
    flags = [*common_flags(a, seed), "--eval_every", str(a.eval_every)]
    flags += ["--pinned_taus", ",".join(map(str, taus))] if method == "pinned" else []
    before = host_facts()
    began = time.time()
    weights = [a.weight * c / a.core for c in node_caps]
    with ec.EmulatedCluster(len(speeds), a.rate, cpus_per_node=node_caps, cpu_weights=weights) as cluster:
        if method == "torchft_diloco":
            run = run_torchft(cluster, flags, a.rounds, a.tau, work)
        else:
            pacing = PACING[method]
            run = run_worker(
                cluster, [*flags, "--pacing", pacing, "--rounds", str(a.rounds)], work, run_timeout_s(a.rounds)
            )
            run["command"] = shlex.join(["scripts/hetero_worker.py", *flags, "--pacing", pacing,
                                         "--rounds", str(a.rounds)])  # fmt: skip
    run.pop("config", None)
    return {**run, "method": method, "seed": seed, "caps_cores": node_caps, "cpu_weights": weights,
            "host_before": before, "wall_s": round(time.time() - began, 1)}  # fmt: skip


def run_ddp(a: argparse.Namespace, seed: int, rounds: int, work: Path) -> dict:
    """DDP on the host's loopback, uncapped, for `rounds` rounds' tokens: its final loss is a target."""
    flags = [*common_flags(a, seed), "--eval_every", str(a.eval_every), "--pacing", "ddp",
             "--rounds", str(rounds)]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", WORKER, *flags,
           "--result", str(work / "ddp.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(work / "ddp.log", "w") as log:
        subprocess.run(cmd, check=True, timeout=run_timeout_s(rounds), stdout=log, stderr=subprocess.STDOUT, env=env)
    run = json.loads((work / "ddp.json").read_text())
    return {**run, "method": "ddp", "seed": seed, "command": shlex.join(["torchrun", "--standalone",
            "--nproc_per_node", "4", "scripts/hetero_worker.py", *flags])}  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    if a.summary:
        saved = json.loads(Path(a.out, "runs.json").read_text())
        write(a, saved["meta"], saved["runs"])
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.time()
    with ec.EmulatedCluster(4, a.rate) as cluster:
        check = cluster.self_check()
    given = shlex.join(["python", "-m", "scripts.bench_hetero", *(sys.argv[1:] if argv is None else argv)])
    saved = json.loads(Path(a.out, "runs.json").read_text()) if a.resume else {"runs": []}
    meta, runs = study_meta(a, given, check, saved.get("meta")), saved["runs"]
    done = {(r["case"], r["method"], r["rep"], r["rounds"] if r["method"] == "ddp" else None) for r in runs}
    with tempfile.TemporaryDirectory(prefix="c2z-hetero-") as tmp:
        for rep in range(a.reps):
            seed = 1337 + rep
            for rounds in [] if a.no_ddp else [b for b in a.ddp_rounds if (None, "ddp", rep, b) not in done]:
                runs.append(_logged(Path(tmp, f"ddp_{rep}_{rounds}"), "", rep, run_ddp, a, seed, rounds))
                write(a, progress(meta, began, rep), runs)
            for case in a.cases:
                for method in (m for m in rotated(a.methods, rep) if (case, m, rep, None) not in done):
                    work = Path(tmp, f"{case}_{method}_{rep}")
                    taus = pinned_taus(runs, case, rep) if method == "pinned" else None
                    runs.append(_logged(work, case, rep, run_method, method, CASES[case], a, seed, taus))
                    write(a, progress(meta, began, rep), runs)
    for case in a.cases:
        print(Path(a.out, f"{case}.md").read_text())
    return 0


def rotated(methods: Sequence[str], rep: int) -> list[str]:
    """Repetition `rep`'s order of `methods`: rotated by `rep`, `pinned` moved after `auto` (it runs its τ_r)."""
    order = [*methods[rep % len(methods) :], *methods[: rep % len(methods)]]
    if "pinned" in order and "auto" in order and order.index("pinned") < order.index("auto"):
        order.remove("pinned")
        order.insert(order.index("auto") + 1, "pinned")
    return order


def pinned_taus(runs: Sequence[dict], case: str, rep: int) -> list[int]:
    """The final τ_r of `case`'s `auto` run in repetition `rep`; ValueError naming what is missing."""
    for run in runs:
        if (run.get("case"), run["method"], run["rep"]) == (case, "auto", rep):
            return run["taus"]
    raise ValueError(f"bench_hetero: method 'pinned' ({case}, repetition {rep}) needs that case and repetition's "
                     f"'auto' run; accepted: --methods with auto, or --resume of a study that has it")  # fmt: skip


def study_meta(a: argparse.Namespace, command: str, check: dict, saved: Optional[dict]) -> dict:
    """The study's facts. Resumed (`saved`: the study's own), they stay, DDP's budgets grow by this
    command's, and the command with its link self-check is listed under `resumed_with`."""
    if saved is not None:
        budgets, resumed = report.ddp_budgets(saved), {"command": command, "self_check": check}
        return {**saved, "ddp_rounds": [*budgets, *(b for b in a.ddp_rounds if b not in budgets)],
                "resumed_with": [*saved.get("resumed_with", []), resumed]}  # fmt: skip
    return {"command": command, "self_check": check, "host": {"cores": os.cpu_count(), "shared": True},
            "rate": a.rate, "tau": a.tau, "rounds": a.rounds, "ddp_rounds": a.ddp_rounds,
            "core_at_speed_1": a.core, "weight_at_speed_1": a.weight, "model": a.model, "extra": a.extra,
            "reps": a.reps}  # fmt: skip


def progress(meta: dict, began: float, rep: int) -> dict:
    """`meta` with this command's seconds so far and the repetition it is at (resumed: in its own entry
    of `resumed_with`, so that the study's own stay)."""
    now = {"budget_s": round(time.time() - began), "reps_done": rep}
    if "resumed_with" not in meta:
        return {**meta, **now}
    return {**meta, "resumed_with": [*meta["resumed_with"][:-1], {**meta["resumed_with"][-1], **now}]}


def write(a: argparse.Namespace, meta: dict, runs: list[dict]) -> None:
    """Every case's JSON and table from the runs so far (after every run: a stopped study keeps its runs),
    and the runs themselves (runs.json: --summary rebuilds the rest from it)."""
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}) + "\n")
    for case in CASES:
        mine = [r for r in runs if r["case"] in (case, None)]
        if not any(r["case"] == case for r in mine):
            continue
        doc = report.case_report(case, CASES[case], meta, mine)
        Path(a.out, f"{case}.json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(a.out, f"{case}.md").write_text(report.markdown(doc))


def _logged(work: Path, case: str, rep: int, fn, *args) -> dict:
    """fn(*args, work) with a line on stderr; the run with its repetition and case (DDP's: None, both)."""
    work.mkdir(parents=True)
    t = time.time()
    run = fn(*args, work)
    print(f"[{time.strftime('%H:%M:%S')}] {case or 'both'} rep {rep} {run['method']}: {time.time() - t:.0f}s, "
          f"tokens {run['tokens']}, val {run['final_val_loss']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
    return {**run, "rep": rep, "case": case or None}


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
