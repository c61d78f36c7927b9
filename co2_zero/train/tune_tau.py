"""Pick CO2's τ for a cluster and a model: the fewest local steps that hide one round's exchange.

With the training job's flags and on its cluster it measures one inner step (t_step) and one round's
exchange (t_comm, every outer group at once, the format's bytes and codec included; slowest rank of
each), recommends tau_comm = ceil(margin * t_comm / t_step), then (--verify_rounds > 0) trains the real
model for rounds of that τ with and without CO2 and raises τ until a round meets --target_efficiency and
--max_overhead (`recommend_tau`, `search_tau`; the τ measured best when none does: `choose_tau`).
Measurements: tune_measure.py; the report and --tune_json: tune_report.py; docs/configuration.md says
how to use the recommendation.

    torchrun --nnodes 4 --nproc_per_node 1 --node_rank $I --master_addr $HEAD --master_port 29500 \\
        scripts/tune_tau.py --n_layer 4 --n_embd 320 --batch_size 1

Installed: `co2-tune-tau` (or `python -m co2_zero.train.tune_tau`). For another model use the functions:
`measure_step_time(step_fn)`, `measure_exchange_time(numel)` and `recommend_tau(...)`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from co2_zero.core import deadline
from co2_zero.core.schedule import MARGIN
from co2_zero.core.topology import collective_device
from co2_zero.train.args import HelpWithDefaults
from co2_zero.train.args import get_args as training_args
from co2_zero.train.cli import ToolParser, run_tool
from co2_zero.train.co2_flags import co2_config
from co2_zero.train.collectives import setup_dist
from co2_zero.train.model import gpt_from_args
from co2_zero.train.tune_measure import (
    link_exchange,
    measure_exchange_time,
    measure_step_time,
    training_batch,
    verify,
)
from co2_zero.train.tune_report import recommendation_line, report

__all__ = ["choose_tau", "measure_exchange_time", "measure_step_time", "recommend_tau", "recommendation_line"]


def recommend_tau(
    t_comm: float,
    t_step: float,
    margin: float = MARGIN,
    t_book: Optional[float] = None,
    max_overhead: float = 0.02,
    round_overhead: Optional[float] = None,
    target_efficiency: float = 0.95,
) -> dict:
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
        v = verify(args, tau, rounds)
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


def get_args(argv: Optional[Sequence[str]] = None):
    epilog = "Every other flag is the training job's (co2-train --help)."
    prog = (
        "python -m co2_zero.train.tune_tau"
        if sys.argv[0].endswith("tune_tau.py") and "co2_zero" in sys.argv[0]
        else None
    )
    p = ToolParser(prog=prog, description=__doc__.split("\n")[0], epilog=epilog, formatter_class=HelpWithDefaults)
    p.add_argument("--margin", type=float, default=MARGIN, help="safety factor on t_comm / t_step")
    p.add_argument("--max_overhead", type=float, default=0.02, help="round-end bookkeeping / round, at most")
    p.add_argument(
        "--target_efficiency",
        type=float,
        default=0.95,
        help="CO2 throughput / compute-only throughput, at least (0: ignore)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed inner steps")
    p.add_argument("--reps", type=int, default=5, help="timed exchanges")
    p.add_argument("--verify_rounds", type=int, default=3, help="CO2 rounds per verified tau, at least (0: skip)")
    p.add_argument("--verify_seconds", type=float, default=4.0, help="... and at least this many seconds (each)")
    p.add_argument("--max_verifies", type=int, default=6, help="taus tried at most")
    p.add_argument("--max_tau", type=int, default=64, help="largest tau tried")
    p.add_argument(
        "--link_mbit",
        type=float,
        default=None,
        help="a link to compute tau for, in Mbit/s, without a network: t_comm from the wire format's bytes "
        "(nothing verified); default: measure the link the ranks are on",
    )
    p.add_argument("--latency_ms", type=float, default=0.0, help="--link_mbit: the link's latency per message")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="--link_mbit: the replicas that exchange (default: the world size, at least 2)",
    )
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
    x, y = training_batch(args)

    def step():
        loss = model(x, y)
        inner.zero_grad()
        loss.backward()
        inner.step()

    compute = measure_step_time(step, steps=ours.steps, timeout_s=config.timeout_s)
    if ours.link_mbit is not None:
        replicas = ours.replicas or max(2, world)
        comm = link_exchange(numel, config, replicas, ours.link_mbit, ours.latency_ms)
    else:
        comm = measure_exchange_time(numel, config, reps=ours.reps) if world > 1 else {"t_comm": 0.0}
    rec = recommend_tau(comm["t_comm"], compute["t_step"], ours.margin)
    if ours.link_mbit is not None:
        rec["link_mbit"] = ours.link_mbit
    result = {
        "world_size": world,
        "params": numel,
        "tokens_per_rank_step": args.batch_size * args.block_size,
        "compute": compute,
        "comm": comm,
        "recommendation": rec,
        "host": {"cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in os.getloadavg()]},
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    if ours.verify_rounds > 0 and world > 1 and ours.link_mbit is None:  # a link asked about is not this one
        result["verify"] = search_tau(args, ours, rec, compute["t_step"])
        rec = recommend_tau(comm["t_comm"], compute["t_step"], ours.margin)
        rec.update(
            target_efficiency=ours.target_efficiency, max_overhead=ours.max_overhead, **choose_tau(result["verify"])
        )
        result["recommendation"] = rec
    result["host"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    if rank == 0:
        report(result)
        if ours.tune_json:
            Path(ours.tune_json).parent.mkdir(parents=True, exist_ok=True)
            Path(ours.tune_json).write_text(json.dumps(result, indent=1))
    deadline.barrier("the tuner's last barrier", config.timeout_s, collective_device())
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
