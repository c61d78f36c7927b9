"""One rank of scripts/bench_hetero.py: CO2 with one τ or with `replica_tau`, or DDP, on the training job's GPT.

Run under torchrun, one rank per node of the emulated cluster. Everything but the loop comes from
co2_zero.train (model, data streams, AdamW, LR schedule, held-out loss), so the runs match the
training job's; the loop is this file's because it runs the rounds that give a budget of tokens and
times each inner step apart from its round end, which `co2-train` (`--replica_tau`) does not.

- `--pacing fixed`: τ on every replica. `--pacing replica_tau`: each rank first measures its own speed
  (forward and backward for --calibrate_s and at least 4 steps on batches outside its data stream, after
  an untimed first step), the ranks all-gather the speeds and every rank builds `replica_tau =
  taus_for_speeds(speeds, tau)`; the rounds are then as many as give the tokens of --rounds rounds at
  one τ (rounded). Both with the CO2 defaults but the sync delay, the round end (what `replica_tau` runs
  with), so pacing is the only difference. `--pacing pinned --pinned_taus N,N,...`: the given τ_r (an `auto`
  run's, as logged), no calibration used. `--pacing auto`: `replica_tau: "auto"` (the job times its
  first steps at τ and fixes the τ_r itself, then corrects them from its first whole round at them); the
  rounds are as many as give the tokens of --rounds rounds at one τ (rounded), re-read as the τ_r change.
  `--pacing ddp`: DistributedDataParallel for --rounds × τ steps.
- `--handshake DIR`: after start-up (imports, process group, model, data) the rank writes DIR/ready<rank>
  (its pid) and waits for DIR/go: the harness puts it in its node's CPU cap in between, so start-up
  runs uncapped and training starts capped on every rank.
- Timing: the clock starts at a barrier after the calibration and stops after finalize() (the last
  exchange included); rank 0's held-out evaluations (every --eval_every rounds) are paused time. A
  rank's own speed is its tokens per step over its mean inner-step time (batch, forward, backward,
  clip, optimizer step), round-end steps excluded.

Rank 0 writes --result: the job's tokens, seconds and per-rank speeds, the held-out loss curve (training
seconds, tokens, loss) and the final held-out loss after finalize().
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from co2_zero.core.engine import RoundEngine
from co2_zero.core.pace import Pace, taus_for_speeds
from co2_zero.train.args import co2_config, replica_taus
from co2_zero.train.args import get_args as train_get_args
from co2_zero.train.data import Batches, get_batch
from co2_zero.train.engines import adamw_kwargs, lr_lambda
from co2_zero.train.loop import evaluate, setup_dist
from co2_zero.train.model import gpt_from_args

PACINGS = ("fixed", "replica_tau", "auto", "pinned", "ddp")
HANDSHAKE_TIMEOUT_S = 300.0


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """This worker's flags; every other flag is the training job's (model, data, optimizer, --tau, --seed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False, allow_abbrev=False)
    p.add_argument("--pacing", required=True, choices=PACINGS)
    p.add_argument("--rounds", type=int, required=True, help="rounds at one τ (replica_tau: the same tokens)")
    p.add_argument("--result", required=True, help="rank 0's JSON result")
    p.add_argument("--handshake", default=None, help="directory of the ready/go handshake (default: none)")
    p.add_argument("--calibrate_s", type=float, default=6.0, help="seconds of the speed measurement, at least")
    p.add_argument("--pinned_taus", type=replica_taus, default=None, help="--pacing pinned: the τ_r, e.g. 32,32,31,15")
    own, rest = p.parse_known_args(argv)
    if (own.pacing == "pinned") != (own.pinned_taus is not None):
        taus = f"--pinned_taus={own.pinned_taus} with --pacing {own.pacing}"
        p.error(f"{taus}; accepted: --pinned_taus with --pacing pinned only")
    args = train_get_args([*rest, "--method", "ddp" if own.pacing == "ddp" else "co2"])
    vars(args).update(vars(own))
    return args


def handshake(directory: Optional[str], rank: int) -> None:
    """Say this rank is ready (its pid), wait for the harness's go."""
    if directory is None:
        return
    import os

    Path(directory, f"ready{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while not Path(directory, "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {directory}/go within {HANDSHAKE_TIMEOUT_S:g}s")
        time.sleep(0.05)


CALIBRATION_STEPS = 4  # timed steps, at least, whatever --calibrate_s is: the slowest node's too


def calibrate(model: torch.nn.Module, batches: Batches, args: argparse.Namespace) -> float:
    """This rank's tokens/s of forward and backward, on batches outside its data stream (seeded by rank).
    The first step is not timed: its one-off costs (the gradients' first allocation) are not the speed."""
    gen = torch.Generator().manual_seed(10_000 + args.seed + dist.get_rank())

    def step() -> None:
        x, y = get_batch(batches.train, args.batch_size, args.block_size, gen)
        model(x, y).backward()

    step()
    steps, began = 0, time.perf_counter()
    while steps < CALIBRATION_STEPS or time.perf_counter() - began < args.calibrate_s:
        step()
        steps += 1
    elapsed = time.perf_counter() - began
    model.zero_grad(set_to_none=True)
    return steps * args.batch_size * args.block_size / elapsed


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length everywhere), by rank."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


class Run:
    """The loop's timing and log: training seconds without rank 0's evaluations, step times, the curve."""

    def __init__(self, model: torch.nn.Module, batches: Batches, args: argparse.Namespace, steps: int) -> None:
        self.model, self.batches, self.args = model, batches, args
        self.schedule = lr_lambda(argparse.Namespace(**{**vars(args), "max_steps": steps}))  # on the clock steps
        self.forward = model  # what trains (DDP's wrapper); `model` is what rank 0 evaluates
        self.rank = dist.get_rank()
        self.paused, self.step_s, self.round_end_step_s, self.curve, self.round_ends = 0.0, [], [], [], []
        self.began = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.began - self.paused

    def validate(self, tokens: int, final: bool = False) -> None:
        """Rank 0 evaluates its live model alone (the others wait): a point of the curve. The clock pauses
        once every rank is here: waiting for the slowest to get here is training time."""
        dist.barrier()
        start, elapsed = time.perf_counter(), self.seconds()
        if self.rank == 0:
            loss = evaluate(self.model, self.batches.val, 0, 1, alone=True, args=self.args)
            self.curve.append({"train_s": elapsed, "tokens": tokens, "val_loss": loss, "final": final})
        dist.barrier()
        self.paused += time.perf_counter() - start

    def train_round(self, opt: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
        """Inner steps until CO2's engine ends the round. Its length is the engine's to say: `replica_tau:
        "auto"` changes a replica's τ_r inside round 0 and at a round end (a count read up front, or re-read
        after the round end that raised it, runs into the next round)."""
        while not self.inner_step(opt, inner, opt.clock_step, opt.engine):
            pass

    def inner_step(self, opt: torch.optim.Optimizer, inner: torch.optim.Optimizer, clock_step: float,
                   engine: Optional[RoundEngine] = None) -> bool:  # fmt: skip
        """One optimizer step at the schedule's `clock_step`; whether it ended a round of `engine` (CO2's; DDP's
        steps have none). Its time counts towards the rank's own speed unless it ends a round (those are kept
        apart: what a round end costs beyond a step) or fixes the pace inside a round (`replica_tau: "auto"`:
        every rank waits there for every other's step times)."""
        a, start = self.args, time.perf_counter()
        for group in inner.param_groups:
            group["lr"] = a.lr * self.schedule(int(clock_step))
        opt.zero_grad(set_to_none=True)
        for x, y in self.batches.micro_batches():
            (self.forward(x, y) / a.grad_accum).backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
        rounds, pace = (engine.rounds, engine.pace) if engine is not None else (None, None)
        opt.step()
        ended = engine is not None and engine.rounds != rounds
        if ended or engine is None or engine.pace is pace:
            (self.round_end_step_s if ended else self.step_s).append(time.perf_counter() - start)
        return ended

    def finish(self, steps: int, taus: list[int], rounds: int, speeds: list[float], extra: dict) -> None:
        """Stop the clock (after a barrier), gather every rank's speed, rank 0 writes the result."""
        dist.barrier()
        train_s = self.seconds()
        per_step = self.args.batch_size * self.args.block_size * self.args.grad_accum
        round_end_step_s = statistics.mean(self.round_end_step_s) if self.round_end_step_s else 0.0
        mine = [float(steps), per_step / statistics.mean(self.step_s), train_s, round_end_step_s, *self.round_ends]
        ranks = gather(mine)
        round_ends = [max(r[4 + k] for r in ranks) for k in range(len(self.round_ends))]  # the last rank's
        self.validate(sum(int(r[0]) for r in ranks) * per_step, final=True)
        if self.rank != 0:
            return
        result = {"pacing": self.args.pacing, "taus": taus, "rounds": rounds, "tokens_per_step": per_step,
                  "steps": [int(r[0]) for r in ranks], "own_tokens_per_s": [r[1] for r in ranks],
                  "calibrated_tokens_per_s": speeds, "round_end_step_s": [r[3] for r in ranks],
                  "train_s": max(r[2] for r in ranks),
                  "tokens": sum(int(r[0]) for r in ranks) * per_step, "curve": self.curve,
                  "round_end_s": round_ends, "final_val_loss": self.curve[-1]["val_loss"], **extra}  # fmt: skip
        Path(self.args.result).write_text(json.dumps(result))


def run_co2(args: argparse.Namespace, model: torch.nn.Module, batches: Batches) -> None:
    from co2_zero import CO2Optimizer

    world, config = dist.get_world_size(), co2_config(args)
    speeds = [s[0] for s in gather([calibrate(model, batches, args)])]
    budget = args.rounds * config.tau * world  # the tokens of --rounds rounds at one τ, in steps
    replica_tau = {"fixed": None, "replica_tau": taus_for_speeds(speeds, config.tau), "auto": "auto",
                   "pinned": args.pinned_taus}[args.pacing]  # fmt: skip
    config = dataclasses.replace(config, sync_delay=None, replica_tau=replica_tau)
    inner = torch.optim.AdamW(model.parameters(), **adamw_kwargs(args))
    opt = CO2Optimizer(inner, config, model=model)
    rounds = rounds_for(opt.engine.pace, budget)
    run = Run(model, batches, args, args.rounds * config.tau)
    dist.barrier()
    run.began, per_step = time.perf_counter(), args.batch_size * args.block_size * args.grad_accum
    run.validate(0)
    r = 0
    while r < rounds:
        run.train_round(opt, inner)
        r += 1
        run.round_ends.append(run.seconds())
        rounds = rounds_for(opt.engine.pace, budget)  # "auto": the τ_r are fixed from a round end on
        if args.eval_every and r % args.eval_every == 0 and r < rounds:
            run.validate(steps_through(opt.engine.pace, r) * per_step)
    opt.finalize()
    pace = opt.engine.pace
    meter = opt.engine.schedule.pace_meter  # "auto": every rank's step time at each decision, against own speeds
    extra = {"config": config.to_dict(), "measured_rounds": pace.from_round, "paces": pace.segments,
             "round_tokens": [sum(pace.tau(q, k) for q in range(world)) * per_step for k in range(rounds)],
             "decision_step_ms": [[ns / 1e6 for ns in row] for row in meter.step_ns] if meter else None}  # fmt: skip
    run.finish(pace.steps_at_round(dist.get_rank(), rounds), list(pace.taus), rounds, speeds, extra)


def rounds_for(pace: Pace, budget: int) -> int:
    """The rounds whose steps, summed over the replicas, come nearest `budget` (the rounds before
    `pace.from_round` at the job's τ or the paces before it, the others at each replica's τ_r)."""
    first = steps_through(pace, pace.from_round)
    return pace.from_round + max(round((budget - first) / sum(pace.taus)), 1)


def steps_through(pace: Pace, rounds: int) -> int:
    """Inner steps of every replica together in the first `rounds` rounds."""
    return sum(pace.steps_at_round(q, rounds) for q in range(len(pace.taus)))


def run_ddp(args: argparse.Namespace, model: torch.nn.Module, batches: Batches) -> None:
    from torch.nn.parallel import DistributedDataParallel

    tau, world = args.tau, dist.get_world_size()
    steps = args.rounds * tau
    inner = torch.optim.AdamW(model.parameters(), **adamw_kwargs(args))
    run = Run(model, batches, args, steps)
    run.forward = DistributedDataParallel(model)
    dist.barrier()
    run.began, per_step = time.perf_counter(), world * args.batch_size * args.block_size * args.grad_accum
    run.validate(0)
    for s in range(steps):
        run.inner_step(inner, inner, s)
        if args.eval_every and (s + 1) % (tau * args.eval_every) == 0 and s + 1 < steps:
            run.validate((s + 1) * per_step)
    run.finish(steps, [], args.rounds, [], {})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("co2_zero.core.engine").setLevel(logging.INFO)  # "auto": the τ_r fixed and their times
    torch.set_num_threads(args.threads)
    setup_dist("cpu")
    torch.manual_seed(args.seed)
    model = gpt_from_args(args)
    batches = Batches(args, dist.get_rank(), torch.device("cpu"))
    handshake(args.handshake, dist.get_rank())
    dist.barrier()
    (run_ddp if args.pacing == "ddp" else run_co2)(args, model, batches)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
