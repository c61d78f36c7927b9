"""Pick CO2's τ for a cluster and a model: the fewest local steps that hide one round's exchange.

CO2 overlaps round t's exchange with the τ inner steps of round t+1; it is hidden when those steps
take longer than the exchange. This command measures, on the cluster it runs on and with the model
and per-rank batch of the training job, co2_zero.train (same flags):

  t_step  one inner step (forward, backward, AdamW step) with no communication at all, median over
          a few steps, slowest rank (the slowest replica gates every round);
  t_comm  one round's exchange: the collective CO2 runs on the outer group (what `collective: auto`
          resolves to for this backend, in `comm_dtype` and `topk`: the format's own bytes, codec
          and error feedback included) on a buffer of the partition's size, median
          of a few, slowest rank; every outer group exchanges at once, as in training;

and recommends

    tau_comm = ceil(margin * t_comm / t_step)        (margin 1.5 by default: slack for the compute
                                                      and the exchange competing for CPU and memory)

That is the smallest τ that hides the exchange *if* compute and communication did not compete. On
real hosts they do (CPU for gloo's reductions and the TCP stack, memory bandwidth; on an
oversubscribed host even the cores), so (--verify_rounds > 0, the default) it then trains the real
model for a few rounds of tau_comm steps, without and then with CO2, and measures what a round
really costs: the efficiency compute-only round / CO2 round (= CO2's throughput as a fraction of
compute-only), the bookkeeping t_book (round_end_s - wait_s: D = B - x, setting the new start
point) and the seconds blocked on the exchange. If the targets are not met (efficiency >=
--target_efficiency 0.95, bookkeeping <= --max_overhead 2% of a round) it raises τ: first to the
estimate from the measured round (a round costs tau * t_step + O, with O roughly independent of τ:

    tau_efficiency = ceil(e / (1 - e) * O / t_step),   tau_book = ceil(t_book / (max_overhead * t_step))

), then bisects down to the smallest τ that passed. The recommendation is that τ (>= tau_comm); when no
τ tried met the targets, it says so and recommends the τ measured best (`choose_tau`). Every
measurement is printed, and written as JSON with --tune_json, so it can be checked.

Installed, the command is `co2-tune-tau` (or `python -m co2_zero.train.tune_tau`); in a checkout,
scripts/tune_tau.py runs the same.

Run it exactly like the training job, e.g. on a real 4-node cluster (one rank per node here; any
torchrun layout works):

    torchrun --nnodes 4 --nproc_per_node 1 --node_rank $I --master_addr $HEAD --master_port 29500 \\
        scripts/tune_tau.py --n_layer 4 --n_embd 320 --batch_size 1

or inside the emulated cluster:

    python scripts/emulated_cluster.py run --nodes 4 --rate 1gbit -- scripts/tune_tau.py --n_embd 320 --batch_size 1

For another model use the functions: `measure_step_time(step_fn)`, `measure_exchange_time(numel)`
and `recommend_tau(...)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer
from co2_zero.core.schedule import MARGIN, delay_for
from co2_zero.core.topology import collective_device
from co2_zero.train.args import HelpWithDefaults, co2_config
from co2_zero.train.args import get_args as training_args
from co2_zero.train.cli import ToolParser, run_tool
from co2_zero.train.link import link_seconds, round_bytes, round_messages
from co2_zero.train.loop import setup_dist
from co2_zero.train.model import gpt_from_args
from co2_zero.train.tune_report import recommendation_line, report

__all__ = ["choose_tau", "measure_exchange_time", "measure_step_time", "recommend_tau", "recommendation_line"]


def _slowest(seconds: float) -> float:
    """Max over all ranks (the slowest replica gates a round)."""
    device = collective_device() if dist.is_initialized() else "cpu"
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_step_time(step_fn: Callable[[], None], steps: int = 10, warmup: int = 3) -> dict:
    """Median seconds of `step_fn()` (one inner step, no communication), slowest rank."""
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t)
    return {"t_step": _slowest(statistics.median(times)), "samples": [round(x, 4) for x in times]}


def measure_exchange_time(numel: int, config: Optional[CO2Config] = None, reps: int = 5) -> dict:
    """Median seconds of one round's exchange of `numel` partition elements, slowest rank.

    Times the library's own pipeline (co2_zero.core.comm: the collective `config.collective` resolves to,
    in `config.comm_dtype`, quantization and error feedback included, and the outer step) on a
    partition of one flat tensor: CO2 rounds of τ = 1 with nothing to compute, so each round's wait
    is the previous round's whole pipeline. Every rank is a replica (CO2Optimizer's S = 1), as in
    the training job's plain engine. Every rank must call this (it creates process groups).
    """
    # sync_delay None: the pipeline alone, timed at each round end (there is no delay to measure at tau 1)
    config = dataclasses.replace(config or CO2Config(), tau=1, shards_per_replica=1, overlap=True, sync_delay=None)
    device = collective_device()  # where training's partition (hence its exchange) lives
    flat = torch.nn.Parameter(torch.zeros(numel, device=device))
    flat.grad = torch.zeros_like(flat)
    opt = CO2Optimizer(torch.optim.SGD([flat], lr=0.0), config)
    times, sent = [], []
    for round_index in range(reps + 2):  # round 0 has nothing in flight; round 1 warms up connections
        dist.barrier()
        t = time.perf_counter()
        opt.step()
        if round_index >= 2:
            times.append(time.perf_counter() - t)
            sent.append(opt.last_round["bytes_sent"])
    opt.finalize()
    opt.topology.destroy()
    t_comm = _slowest(statistics.median(times))
    replicas = opt.topology.replicas
    return {
        "t_comm": t_comm,
        "samples": [round(x, 4) for x in times],
        "collective": opt.plan.collective,
        "comm_dtype": config.comm_dtype,
        "topk": config.topk,
        "partition_elems": numel,
        "bytes_sent": statistics.median(sent),
        "outer_group_size": replicas,
        "sent_bits_per_s": statistics.median(sent) * 8 / t_comm if replicas > 1 else None,
    }


def recommend_tau(t_comm: float, t_step: float, margin: float = MARGIN, t_book: Optional[float] = None,
                  max_overhead: float = 0.02, round_overhead: Optional[float] = None,
                  target_efficiency: float = 0.95) -> dict:  # fmt: skip
    """The candidate τs and the recommendation (the largest of them, >= 1).

    tau_comm       = ceil(margin * t_comm / t_step): the exchange is shorter than the round's compute.
    tau_book       = ceil(t_book / (max_overhead * t_step)): round-end bookkeeping <= max_overhead.
    tau_efficiency = ceil(e / (1 - e) * round_overhead / t_step), e = target_efficiency: a round of τ
                     steps costs τ * t_step + round_overhead (blocked time, bookkeeping, and the compute
                     the background exchange steals from the shared cores), so throughput relative to
                     compute-only is τ * t_step / (τ * t_step + round_overhead) >= e.
    """
    out = {"comm_over_step": t_comm / t_step, "margin": margin, "tau_comm": max(1, math.ceil(margin * t_comm / t_step))}
    if t_book is not None:
        out["max_overhead"] = max_overhead
        out["tau_book"] = max(1, math.ceil(t_book / (max_overhead * t_step)))
    if round_overhead is not None and 0 < target_efficiency < 1:
        out["target_efficiency"] = target_efficiency
        out["round_overhead_s"] = round_overhead
        ratio = target_efficiency / (1 - target_efficiency)
        out["tau_efficiency"] = max(1, math.ceil(ratio * max(0.0, round_overhead) / t_step))
    out["tau"] = max(v for k, v in out.items() if k.startswith("tau_"))
    return out


def verify(args, tau: int, rounds: int, t_step: float) -> dict:
    """Time `rounds` rounds of `tau` steps of the real model twice: compute-only, then with CO2.

    Each round ends, as in a training loop, with a tiny all-reduce on the default group (the loss
    for the log), which also makes the compute-only rounds pay the ranks' skew like CO2's rounds
    do. Efficiency = compute-only round / CO2 round (means; CO2's round 0, with nothing in flight,
    is not counted). Also reports CO2's blocked time, bookkeeping (round_end_s - wait_s) and, with
    `sync_delay: "auto"`, the inner steps the exchange took as the training job measures them
    (`exchange_steps`) and the sync delay that gives (`sync_delay`; the job's warning that the exchange
    fills the round is this report's `hidden: false` instead).
    """
    args = argparse.Namespace(**vars(args))
    args.tau = tau
    torch.manual_seed(args.seed)
    model = gpt_from_args(args, vocab_size=256)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = CO2Optimizer(inner, co2_config(args), model=model)
    x, y = _batch(args)
    log = torch.zeros(2, dtype=torch.float64, device=collective_device())

    def run(step_fn, n_rounds):
        """n_rounds rounds of tau steps; per-round seconds."""
        seconds = []
        for _ in range(n_rounds):
            t = time.perf_counter()
            for _ in range(tau):
                loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                step_fn()
            dist.all_reduce(log)
            seconds.append(time.perf_counter() - t)
        return seconds

    base = run(opt.optimizer.step, rounds)  # the inner optimizer alone: no CO2 round ends
    waits, books = [], []

    def co2_step():
        opt.step()
        if opt.round_ended:
            waits.append(opt.last_round["wait_s"])
            books.append(opt.last_round["round_end_s"] - opt.last_round["wait_s"])

    with warnings.catch_warnings():  # what it says is `exchange_steps` below, in the report
        warnings.filterwarnings("ignore", message="co2: sync_delay 'auto': the exchange took", category=UserWarning)
        co2 = run(co2_step, rounds + 1)[1:]
        waits, books = waits[1:], books[1:]
        opt.finalize()
    opt.topology.destroy()
    steps = opt.engine.exchange_steps
    base_round = _slowest(statistics.mean(base))
    co2_round = _slowest(statistics.mean(co2))
    noise = _slowest(statistics.stdev(base) / statistics.mean(base) if len(base) > 1 else 0.0)
    return {
        "noise": noise,
        "tau": tau,
        "rounds": rounds,
        "compute_round_s": base_round,
        "round_s": co2_round,
        "efficiency": base_round / co2_round,
        "round_overhead_s": co2_round - base_round,
        "wait_s": _slowest(statistics.mean(waits)),
        "t_book": _slowest(statistics.mean(books)),
        "wait_fraction": _slowest(statistics.mean(waits)) / co2_round,
        "book_fraction": _slowest(statistics.mean(books)) / co2_round,
        **exchange_hidden(steps or None, tau),
    }


def exchange_hidden(steps: Optional[int], tau: int) -> dict:
    """What `sync_delay: "auto"` makes of an exchange that took `steps` inner steps (the most any rank
    counted; None: not measured): the delay, and whether it is hidden inside the round (a delay below tau;
    at tau every average stays a round late, and the job warns)."""
    if steps is None:
        return {"exchange_steps": None, "sync_delay": None, "hidden": True}
    delay = delay_for(steps, tau)
    return {"exchange_steps": steps, "sync_delay": delay, "hidden": delay < tau}


def search_tau(args, ours, rec: dict, t_step: float) -> list[dict]:
    """The smallest tau >= tau_comm whose measured round meets the efficiency and bookkeeping targets.

    Starts at tau_comm. While no tau passed, jumps to the estimate from the last round (a round of
    tau steps costs tau * t_step + O with O roughly independent of tau: tau_efficiency, tau_book);
    once one passed, bisects between the largest failing and the smallest passing tau.
    """
    checks: list[dict] = []
    failing, passing = rec["tau_comm"] - 1, None
    tau = rec["tau_comm"]
    for _ in range(ours.max_verifies):
        rounds = max(ours.verify_rounds, math.ceil(ours.verify_seconds / (tau * t_step)))
        v = verify(args, tau, rounds, t_step)
        v["verdict"] = verdict(v, ours.target_efficiency, ours.max_overhead)
        v["passes"] = v["verdict"] == "pass"
        checks.append(v)
        if v["passes"]:
            passing = tau if passing is None else min(passing, tau)
        else:
            failing = max(failing, tau)
        if passing is None:
            step_s = v["compute_round_s"] / v["tau"]
            est = recommend_tau(
                0.0,
                step_s,
                t_book=v["t_book"],
                max_overhead=ours.max_overhead,
                round_overhead=v["round_overhead_s"],
                target_efficiency=ours.target_efficiency,
            )
            hides = math.ceil(MARGIN * v["exchange_steps"]) + 1 if v["exchange_steps"] else 0
            tau = min(ours.max_tau, max(tau + 1, est["tau"], hides))
            if tau == v["tau"]:  # at --max_tau already
                break
        elif passing - failing <= 1:
            break
        else:
            tau = (failing + passing) // 2
    return checks


def verdict(v: dict, target_efficiency: float, max_overhead: float) -> str:
    """ "pass" (the targets met, the exchange hidden), "fail", or "noise": an efficiency above 1.0, CO2's
    round faster than the compute-only one, says the host's noise exceeds what CO2 costs: no evidence."""
    if v["efficiency"] > 1.0:
        return "noise"
    fast = v["efficiency"] >= target_efficiency and v["book_fraction"] <= max_overhead
    return "pass" if fast and v["hidden"] else "fail"


def choose_tau(checks: Sequence[dict]) -> dict:
    """The recommendation from the verified taus, monotone in tau: the smallest tau at and above which every
    tau tried passed (verified=True); when there is none, the one measured best: the highest efficiency of
    those that are not noise, the smaller tau on a tie (verified=False). Never a tau that was not measured."""
    ordered = sorted(checks, key=lambda v: v["tau"])
    settled = [v["tau"] for i, v in enumerate(ordered) if all(w["passes"] for w in ordered[i:])]
    if settled:
        return {"tau": settled[0], "verified": True}
    measured = [v for v in checks if v.get("verdict") != "noise"] or list(checks)
    best = max(measured, key=lambda v: (v["efficiency"], -v["tau"]))
    return {"tau": best["tau"], "verified": False, "best_efficiency": best["efficiency"]}


def _batch(args):
    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    x = torch.randint(256, (args.batch_size, args.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def get_args(argv: Optional[Sequence[str]] = None):
    epilog = "Every other flag is the training job's (co2-train --help)."
    prog = (
        "python -m co2_zero.train.tune_tau"
        if sys.argv[0].endswith("tune_tau.py") and "co2_zero" in sys.argv[0]
        else None
    )
    p = ToolParser(prog=prog, description=__doc__.split("\n")[0], epilog=epilog,
                   formatter_class=HelpWithDefaults)  # fmt: skip
    p.add_argument("--margin", type=float, default=MARGIN, help="safety factor on t_comm / t_step")
    p.add_argument("--max_overhead", type=float, default=0.02, help="round-end bookkeeping / round, at most")
    p.add_argument("--target_efficiency", type=float, default=0.95,
                   help="CO2 throughput / compute-only throughput, at least (0: ignore)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed inner steps")
    p.add_argument("--reps", type=int, default=5, help="timed exchanges")
    p.add_argument("--verify_rounds", type=int, default=3, help="CO2 rounds per verified tau, at least (0: skip)")
    p.add_argument("--verify_seconds", type=float, default=4.0, help="... and at least this many seconds (each)")
    p.add_argument("--max_verifies", type=int, default=6, help="taus tried at most")
    p.add_argument("--max_tau", type=int, default=64, help="largest tau tried")
    p.add_argument("--link_mbit", type=float, default=None,
                   help="a link to compute tau for, in Mbit/s, without a network: t_comm from the wire format's bytes "
                        "(nothing verified); default: measure the link the ranks are on")  # fmt: skip
    p.add_argument("--latency_ms", type=float, default=0.0, help="--link_mbit: the link's latency per message")
    p.add_argument("--replicas", type=int, default=None,
                   help="--link_mbit: the replicas that exchange (default: the world size, at least 2)")  # fmt: skip
    p.add_argument(
        "--tune_json", default=None, help="write measurements and recommendation here (rank 0); default: nowhere"
    )
    ours, rest = p.parse_known_args(argv)
    if ours.link_mbit is not None and ours.link_mbit <= 0:
        p.error(f"--link_mbit={ours.link_mbit:g} is invalid; accepted: a rate in Mbit/s > 0")
    if ours.replicas is not None and ours.replicas < 2:
        p.error(f"--replicas={ours.replicas} is invalid; accepted: an integer >= 2 (one replica exchanges nothing)")
    model_args = training_args(rest)
    model_args.method = "co2"  # the tuner is about CO2 rounds; the other CO2 knobs come from the flags
    return ours, model_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`co2-tune-tau` / `python -m co2_zero.train.tune_tau` / scripts/tune_tau.py; returns 0, or 2 after a user
    error's one line (cli.py)."""
    return run_tool("co2-tune-tau", _tune_and_succeed, argv)


def _tune_and_succeed(argv: Optional[Sequence[str]]) -> int:
    tune(argv)
    return 0


def link_exchange(numel: int, config: CO2Config, replicas: int, link_mbit: float, latency_ms: float) -> dict:
    """t_comm on a link the tuner is asked about (link.py): the format's bytes at its rate, no network."""
    sent = round_bytes(numel, replicas, config.comm_dtype, config.topk)
    seconds = link_seconds(sent, round_messages(replicas, config.topk), link_mbit, latency_ms)
    return {"t_comm": seconds, "comm_dtype": config.comm_dtype, "topk": config.topk, "partition_elems": numel,
            "bytes_sent": sent, "outer_group_size": replicas, "link_mbit": link_mbit, "latency_ms": latency_ms,
            "collective": "computed", "sent_bits_per_s": link_mbit * 1e6}  # fmt: skip


def tune(argv: Optional[Sequence[str]] = None) -> dict:
    """Measure, verify and recommend (collective: every rank calls it); rank 0 prints the report.
    Returns every measurement and the recommendation."""
    ours, args = get_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = setup_dist()
    config = co2_config(args)

    torch.manual_seed(args.seed)
    model = gpt_from_args(args, vocab_size=256)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    numel = sum(p.numel() for p in model.parameters())
    x, y = _batch(args)

    def step():
        loss = model(x, y)
        inner.zero_grad()
        loss.backward()
        inner.step()

    compute = measure_step_time(step, steps=ours.steps)
    if ours.link_mbit is not None:
        replicas = ours.replicas or max(2, world)
        comm = link_exchange(numel, config, replicas, ours.link_mbit, ours.latency_ms)
    else:
        comm = measure_exchange_time(numel, config, reps=ours.reps) if world > 1 else {"t_comm": 0.0}
    rec = recommend_tau(comm["t_comm"], compute["t_step"], ours.margin)
    if ours.link_mbit is not None:
        rec["link_mbit"] = ours.link_mbit
    result = {"world_size": world, "params": numel, "tokens_per_rank_step": args.batch_size * args.block_size,
              "compute": compute, "comm": comm, "recommendation": rec,
              "host": {"cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in os.getloadavg()]},
              "argv": list(sys.argv[1:] if argv is None else argv)}  # fmt: skip
    if ours.verify_rounds > 0 and world > 1 and ours.link_mbit is None:  # a link asked about is not this one
        result["verify"] = search_tau(args, ours, rec, compute["t_step"])
        rec = recommend_tau(comm["t_comm"], compute["t_step"], ours.margin)
        rec.update(target_efficiency=ours.target_efficiency, max_overhead=ours.max_overhead,
                   **choose_tau(result["verify"]))  # fmt: skip
        result["recommendation"] = rec
    result["host"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    if rank == 0:
        report(result)
        if ours.tune_json:
            Path(ours.tune_json).parent.mkdir(parents=True, exist_ok=True)
            Path(ours.tune_json).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
