"""What the τ tuner measures (tune_tau.py advises from it, tune_report.py prints it): one inner step, one
round's exchange (measured, or computed for a link the tuner is asked about), and whole rounds of the real
model with and without CO2."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer
from co2_zero.core import deadline
from co2_zero.core.schedule import delay_for
from co2_zero.core.topology import collective_device
from co2_zero.train.co2_flags import co2_config
from co2_zero.train.link import link_seconds, round_bytes, round_messages
from co2_zero.train.model import gpt_from_args

TIMEOUT_S = CO2Config().timeout_s  # the deadline of the tuner's own collectives unless a config gives one


def slowest_rank(seconds: float, timeout_s: float = TIMEOUT_S) -> float:
    """Max over all ranks (the slowest replica gates a round), within `timeout_s`: a lost rank is a CO2Error
    naming it (`co2_zero.core.deadline`)."""
    device = collective_device() if dist.is_initialized() else "cpu"
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        deadline.all_reduce(t, "the tuner's slowest-rank time", timeout_s, op=dist.ReduceOp.MAX)
    return t.item()


def measure_step_time(
    step_fn: Callable[[], None], steps: int = 10, warmup: int = 3, timeout_s: float = TIMEOUT_S
) -> dict:
    """Median seconds of `step_fn()` (one inner step, no communication), slowest rank."""
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t)
    return {"t_step": slowest_rank(statistics.median(times), timeout_s), "samples": [round(x, 4) for x in times]}


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
        deadline.barrier("the tuner's barrier before an exchange", config.timeout_s, device)
        t = time.perf_counter()
        opt.step()
        if round_index >= 2:
            times.append(time.perf_counter() - t)
            sent.append(opt.last_round["bytes_sent"])
    opt.finalize()
    opt.topology.destroy()
    t_comm = slowest_rank(statistics.median(times), config.timeout_s)
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


def verify(args: argparse.Namespace, tau: int, rounds: int) -> dict:
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
    x, y = training_batch(args)
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
            deadline.all_reduce(log, "the tuner's round-end all-reduce", opt.config.timeout_s)
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
    steps = opt.engine.exchange_steps or None
    return round_figures(base, co2, waits, books, rounds, tau, steps, opt.config.timeout_s)


def round_figures(
    base: list[float],
    co2: list[float],
    waits: list[float],
    books: list[float],
    rounds: int,
    tau: int,
    steps: Optional[int],
    timeout_s: float = TIMEOUT_S,
) -> dict:
    """What `verify` reports of its rounds' seconds (compute-only `base`, `co2`), CO2's blocked `waits` and
    bookkeeping `books`, each the slowest rank's (collective: every rank calls it in the same order, each
    within `timeout_s`)."""
    base_round = slowest_rank(statistics.mean(base), timeout_s)
    co2_round = slowest_rank(statistics.mean(co2), timeout_s)
    noise = slowest_rank(statistics.stdev(base) / statistics.mean(base) if len(base) > 1 else 0.0, timeout_s)
    wait_s, t_book = slowest_rank(statistics.mean(waits), timeout_s), slowest_rank(statistics.mean(books), timeout_s)
    return {
        "noise": noise,
        "tau": tau,
        "rounds": rounds,
        "compute_round_s": base_round,
        "round_s": co2_round,
        "efficiency": base_round / co2_round,
        "round_overhead_s": co2_round - base_round,
        "wait_s": wait_s,
        "t_book": t_book,
        "wait_fraction": wait_s / co2_round,
        "book_fraction": t_book / co2_round,
        **exchange_hidden(steps, tau),
    }


def exchange_hidden(steps: Optional[int], tau: int) -> dict:
    """What `sync_delay: "auto"` makes of an exchange that took `steps` inner steps (the most any rank
    counted; None: not measured): the delay, and whether it is hidden inside the round (a delay below tau;
    at tau every average stays a round late, and the job warns)."""
    if steps is None:
        return {"exchange_steps": None, "sync_delay": None, "hidden": True}
    delay = delay_for(steps, tau)
    return {"exchange_steps": steps, "sync_delay": delay, "hidden": delay < tau}


def training_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of random bytes for this rank (the tuner times steps; what it learns is beside the point)."""
    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    x = torch.randint(256, (args.batch_size, args.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def link_exchange(numel: int, config: CO2Config, replicas: int, link_mbit: float, latency_ms: float) -> dict:
    """t_comm on a link the tuner is asked about (link.py): the format's bytes at its rate, no network."""
    sent = round_bytes(numel, replicas, config.comm_dtype, config.topk)
    seconds = link_seconds(sent, round_messages(replicas, config.topk), link_mbit, latency_ms)
    return {
        "t_comm": seconds,
        "comm_dtype": config.comm_dtype,
        "topk": config.topk,
        "partition_elems": numel,
        "bytes_sent": sent,
        "outer_group_size": replicas,
        "link_mbit": link_mbit,
        "latency_ms": latency_ms,
        "collective": "computed",
        "sent_bits_per_s": link_mbit * 1e6,
    }
