"""The training job, top to bottom: build the run, validate, train, finish.

The run's state is a few small named objects: `Job` (what `build` made, fixed for the run) and, in
state.py, `Clock` (training time, validation and checkpoints excluded), `Tally` (losses since the last
log line, the round ends since the start) and `Console` (rank 0's log lines, progress bar, JSON records).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.deadline import barrier
from ..core.plan import check_given
from .args import get_args
from .checkpoints import resume, rng_state, save, save_root, write_latest
from .co2_flags import CO2_METHODS, co2_config
from .collectives import deadline_s, evaluate, mean_loss_and_stop, setup_dist
from .data import Batches, elastic_stream
from .engines import Trainer, build_trainer
from .events import Events, parameter_digest, stop_step
from .model import flops_per_token, gpt_from_args
from .ownership import claim_save_dir
from .pacing import JobSteps
from .preflight import fit_to_whole_rounds, warn_single_process
from .state import Clock, Console, RoundEnd, Tally
from .summary import elastic_record, elastic_summary, summary_line

# Every process group of the job must end before the interpreter shuts down: gloo's threads, ended with
# it, can abort the process ("terminate called without an active exception"; docs/design.md §8). Two
# things keep a group past destroy_process_group(): torch._dynamo imported after init_process_group (the
# first torch.optim optimizer imports it) holds the default group to the end, hence its import beside
# setup_dist (collectives.py); and reference cycles among the job's objects hold the CO2 groups until a
# collection, hence gc in main().
DESCRIPTION = "Train a GPT with CO2 or a baseline: a tiny byte-level model on CPUs, GPT-2 sizes on GPUs."


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`co2-train` / `python -m co2_zero.train` / scripts/train_lm.py: one training job; returns 0."""
    run(get_args(argv, DESCRIPTION))
    gc.collect()  # the finished job's process groups end here, with the interpreter alive (note above)
    return 0


def run(args: Any) -> None:
    """Build, train and finish one job."""
    job = build(args)
    clock, tally = Clock(), Tally()
    initial = start(job, clock)
    step = train(job, clock, tally)
    finish(job, clock, tally, step, initial)


# ---- the run's state ---------------------------------------------------------------------------------


@dataclass
class Job:
    """What `build` made: fixed for the whole run."""

    args: Any
    rank: int
    world: int
    device: torch.device
    config: Any  # CO2Config, or None for ddp / none
    trainer: Trainer
    batches: Batches
    console: Console
    n_params: int
    steps: JobSteps  # the job's step and tokens from this rank's optimizer steps (--replica_tau: they differ)
    start_step: int  # 0, or the step a resumed run (or an elastic replica that joined a running job) starts at
    joined_at: Optional[int] = None  # elastic: the step at which this replica joined a running job
    events: Events = dataclasses.field(default_factory=lambda: Events(None))  # --events_jsonl (rank 0)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def timeout_s(self) -> float:
        return deadline_s(self.config, self.args)  # the deadline of the job's own collectives

    def barrier(self) -> None:
        barrier("a barrier of the training job", self.timeout_s, self.device)

    def memory_gib(self) -> Optional[float]:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


# ---- build -------------------------------------------------------------------------------------------


def build(args) -> Job:
    """Process group, data, model and engine; resume if asked; the header line."""
    torch.set_num_threads(args.threads)
    rank, world = setup_dist(args.device, args.backend)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    config = co2_config(args) if args.method in CO2_METHODS else None
    if config is not None:
        check_given(config, driver="co2-train", elastic=args.lighthouse is not None)
    fit_to_whole_rounds(args, config, rank)
    warn_single_process(args, config, world)
    batches = Batches(args, elastic_stream(args.replica_id, rank, world) if args.lighthouse else rank, device)
    torch.manual_seed(args.seed)  # identical init on every rank
    with device:
        model = gpt_from_args(args)
    steps = JobSteps(args.batch_size * args.block_size * args.grad_accum, world)
    trainer = build_trainer(args, model, config, steps)  # elastic: joins the job
    console = Console(rank == 0, args.out_json, progress=not args.no_progress)
    joined_at = joined_step(args, trainer, console)
    start_step = joined_at
    if start_step is None:
        start_step = resume(args, trainer, batches, console) if args.resume else 0
    claim_save_dir(args, trainer, config)  # before it trains: a --save_dir with another run's checkpoints is refused
    if args.lighthouse:  # this replica's own stream (by --replica_id), at the step it starts from
        batches.seek(start_step)
    job = Job(
        args=args,
        rank=rank,
        world=world,
        device=device,
        config=config,
        trainer=trainer,
        batches=batches,
        console=console,
        n_params=sum(p.numel() for p in model.parameters()),
        steps=steps,
        start_step=start_step,
        joined_at=joined_at,
        events=Events(args.events_jsonl if rank == 0 else None),
    )
    console.line(header(job))
    if not args.resume:
        console.new_json()
    return job


def joined_step(args, trainer: Trainer, console: Console) -> Optional[int]:
    """Elastic: the job's step when this replica joined a running job (it received the job's state from
    a live peer, newer than any checkpoint, so --resume is not loaded then); else None."""
    engine = trainer.opt.engine if trainer.membership is not None else None
    if engine is None or engine.inner_steps == 0:
        return None
    skipped = " (a live peer's state is newer: --resume not loaded)" if args.resume else ""
    console.line(f"replica {args.replica_id} joined the running job at step {engine.inner_steps}{skipped}")
    return engine.inner_steps


def header(job: Job) -> str:
    """The run's first line: what runs where, on which data, and the R x S and the CO2 plan really used (every
    `auto` resolved: `co2_zero.core.plan.ResolvedPlan`)."""
    a = job.args
    replicas, shards = job.trainer.grid(job.world)
    b = job.batches
    data = f"--data {a.data}" if a.data else "stdlib bytes"
    dtype = a.dtype or str(next(job.trainer.model.parameters()).dtype).replace("torch.", "")  # deepspeed: its config's
    line = (
        f"method={a.method} engine={a.engine} world={job.world} R x S = {replicas} x {shards} device={a.device} "
        f"dtype={dtype} model={a.model} params={job.n_params / 1e6:.2f}M data={data} "
        f"train={len(b.train) / 1e6:.2f}M val={b.val_tokens / 1e6:.2f}M tokens tokens/step={job.steps.per_step} "
        f"max_steps={a.max_steps}"
    )
    if job.config is not None:
        line += f" {job.trainer.opt.plan}"
    if a.lighthouse:
        line += f" elastic: replica {a.replica_id} of the job at {a.lighthouse} (start_replicas={a.start_replicas})"
    return line


# ---- validate, train, finish -------------------------------------------------------------------------


def validate(job: Job, clock: Clock) -> Optional[float]:
    """The held-out loss (`none`: rank 0's own model, evaluated by rank 0 alone; None elsewhere)."""
    with clock.paused():
        alone = job.args.method == "none"
        v = None
        if job.master or not alone:
            shards = job.trainer.grid(job.world)[1] if job.args.engine == "fsdp" else 1
            v = evaluate(job.trainer.model, job.batches.val, job.rank, job.world, alone, job.args, shards)
        job.barrier()  # nobody trains while rank 0 evaluates alone: the pause is every rank's
    return v


def start(job: Job, clock: Clock) -> Optional[float]:
    """The first validation and record; then every rank starts the clock together. Returns the loss."""
    a, step = job.args, job.start_step
    v0 = validate(job, clock)
    if job.master:
        job.console.line(f"step {step} | val {v0:.4f}")
    step_record(job, step, elapsed_s=0.0, loss=None, tokens_per_s=None, wait_s=None, round_end_s=None, val_loss=v0)
    clock.start(step)  # after validate's barrier
    job.events.emit("start", step=step, replica_id=a.replica_id, joined_at=job.joined_at)
    return v0


def train(job: Job, clock: Clock, tally: Tally) -> int:
    """The loop: one optimizer step per iteration; a log point at every round end (CO2 methods) or
    every --log_every steps; checkpoints every --save_every steps. Returns the step it stopped at."""
    a, trainer = job.args, job.trainer
    step = job.start_step
    job.console.open_bar(a.max_steps, step)
    trainer.model.train()
    own = job.steps.own_at(step)  # this rank's optimizer steps (--replica_tau: fewer on a slower replica)
    while step < a.max_steps:
        tally.add_loss(trainer.train_step(job.batches.micro_batches()))
        own += 1
        step, before = job.steps.after(own), step
        job.console.advance(step - before)
        if a.save_every and step % a.save_every == 0:
            save_job(job, clock, step)
        end = round_end(job, step)
        report_membership(job, tally)
        if job.events.on:
            quorum = replicas_of_step(job)
            job.events.emit("step", step=step, replicas=len(quorum), quorum=quorum)
        if end is not None and log_point(job, clock, tally, step, end):
            job.console.line(f"--max_seconds {a.max_seconds} reached at step {step}")
            break
        if end is not None and step < a.max_steps and step >= (stop_step(a.stop_file) or a.max_steps):
            job.console.line(f"--stop_file {a.stop_file}: stopping at step {step}")
            break
    job.console.close_bar()
    return step


def report_membership(job: Job, tally: Tally) -> None:
    """Elastic: what this replica saw of the membership since the last call, as it happens: the
    changes of the quorum on the console ("replicas 4 -> 3 at round 17"; rank 0), and every round's
    quorum and commit in the events log (`--events_jsonl`)."""
    membership = job.trainer.membership
    if membership is None:
        return
    for change in membership.changes[tally.changes_shown :]:
        job.console.line(change)
    tally.changes_shown = len(membership.changes)
    for record in membership.history[tally.rounds_reported :]:
        job.events.emit("round", round=record.round, replicas=len(record.replicas), committed=record.committed)
    tally.rounds_reported = len(membership.history)


def replicas_of_step(job: Job) -> list[int]:
    """The replicas this step trained with: elastic, the latest quorum's replica ids; else 0..R-1."""
    membership = job.trainer.membership
    if membership is not None and membership.quorum:
        return list(membership.quorum)
    return list(range(job.trainer.grid(job.world)[0]))


def round_end(job: Job, step: int) -> Optional[RoundEnd]:
    """What this step's log point reports, or None when `step` is no log point: a CO2 round end (or
    the last step), else every --log_every steps and the last."""
    a, opt = job.args, job.trainer.opt
    if job.trainer.co2:
        if not opt.round_ended:
            return RoundEnd(0.0, 0.0) if step >= a.max_steps else None
        info = opt.last_round
        return RoundEnd._make(info.get(name, 0.0) for name in RoundEnd._fields)
    if step % a.log_every and step != a.max_steps:
        return None
    return RoundEnd(0.0 if a.method == "none" else None, None)  # ddp: overlapped inside backward, unmeasured


def save_job(job: Job, clock: Clock, step: int) -> None:
    """A checkpoint of every rank, then DIR/latest names it."""
    with clock.paused():
        t = time.perf_counter()
        save_dir = save_root(job.args)  # elastic: this replica's own subdirectory
        extra = {"step": step, "rng": rng_state(job.batches.gen)}
        directory = save(job.trainer, save_dir, step, extra)
        job.barrier()  # every rank's part is written before `latest` names it
        if job.master:
            write_latest(save_dir, directory)
        job.console.line(f"step {step} | checkpoint {directory} ({time.perf_counter() - t:.1f}s)")


def log_point(job: Job, clock: Clock, tally: Tally, step: int, end: RoundEnd) -> bool:
    """Average the loss over ranks, log, validate every --eval_every points. Returns True when rank 0
    says --max_seconds is up."""
    a = job.args
    tally.add_round_end(end, co2=job.trainer.co2 and job.trainer.opt.round_ended)
    out_of_time = job.master and a.max_seconds > 0 and clock.training_s() >= a.max_seconds
    loss, stop = mean_loss_and_stop(tally.loss_sum, tally.loss_n, out_of_time, step, job.device, job.timeout_s)
    tally.loss_sum, tally.loss_n = 0.0, 0
    # After the all-reduce (and its .tolist() sync): the interval ends when the slowest rank got here,
    # so the time rank 0 waits for the others is counted in this interval, not lost between two.
    now = time.perf_counter()
    tally.log_lines += 1
    tps = (job.steps.tokens(step) - job.steps.tokens(clock.step_last)) / max(now - clock.t_last, 1e-9)
    mfu = job_mfu(job, tps)
    tally.last_mfu = mfu
    v = None
    if a.eval_every > 0 and tally.log_lines % a.eval_every == 0 and step < a.max_steps and not stop:
        v = validate(job, clock)
    msg = f"step {step} | loss {loss:.4f} | {tps:,.0f} tok/s"
    msg += f" | wait {end.wait_s:.3f}s" if end.wait_s is not None else ""
    msg += f" | round_end {end.round_end_s:.3f}s" if end.round_end_s is not None else ""
    msg += f" | mfu {100 * mfu:.1f}% | mem {job.memory_gib():.1f} GiB" if mfu is not None else ""
    msg += f" | val {v:.4f}" if v is not None else ""
    job.console.line(msg + f" | lr {job.trainer.lr():.2e}")
    step_record(
        job,
        step,
        lr=job.trainer.lr(),
        elapsed_s=clock.training_s(now),
        loss=loss,
        tokens_per_s=tps,
        wait_s=end.wait_s,
        round_end_s=end.round_end_s,
        val_loss=v,
        mfu=mfu,
        max_memory_gib=job.memory_gib(),
    )
    clock.mark(step)
    return stop


def step_record(job: Job, step: int, **fields: Any) -> None:
    """One step's JSON record (rank 0): the method, the job's step and its tokens, then `fields`."""
    job.console.record(method=job.args.method, step=step, tokens=job.steps.tokens(step), **fields)


def job_mfu(job: Job, tokens_per_s: float) -> Optional[float]:
    """Model FLOPs utilisation against --peak_flops per GPU (CUDA only)."""
    if job.device.type != "cuda":
        return None
    return flops_per_token(job.n_params, job.args) * tokens_per_s / (job.world * job.args.peak_flops)


def finish(job: Job, clock: Clock, tally: Tally, step: int, initial: Optional[float]) -> None:
    """One model everywhere (CO2: finalize), the final validation and the summary line and record."""
    a, trainer = job.args, job.trainer
    if trainer.co2:  # waits for the round in flight: part of the training time
        t_fin = time.perf_counter()
        trainer.opt.finalize()
        tally.bytes_sent += trainer.opt.engine.finalize_bytes_sent  # the last exchange, which finalize() waited for
        job.console.line(f"finalize {time.perf_counter() - t_fin:.3f}s")
    if job.events.on:  # the digest reads every parameter: only for a run that logs events
        job.events.emit("final", step=step, digest=parameter_digest(trainer.model.parameters()))
    job.events.close()
    train_s = clock.training_s()
    steps_run = step - job.start_step  # by this process (a resumed run: since the resume)
    tokens_per_s = (job.steps.tokens(step) - job.steps.tokens(job.start_step)) / train_s
    final = validate(job, clock)
    replicas, shards = trainer.grid(job.world)
    if job.master:
        resumed_at = job.start_step if a.resume else None
        line = summary_line(
            final,
            initial,
            steps_run,
            resumed_at,
            train_s,
            tokens_per_s,
            (replicas, shards),
            tally if trainer.co2 else None,
        )
        job.console.line(line + elastic_summary(job))
    job.console.record(
        summary=True,
        method=a.method,
        engine=a.engine,
        world_size=job.world,
        steps=step,
        steps_run=steps_run,
        resumed_at=job.start_step if a.resume else None,
        tokens=job.steps.tokens(step),
        elapsed_s=train_s,
        tokens_per_s=tokens_per_s,
        wait_s=tally.wait_s if trainer.co2 or a.method == "none" else None,
        round_end_s=tally.round_end_s if trainer.co2 else None,
        initial_val_loss=initial,
        val_loss=final,
        replicas=replicas,
        shards=shards,
        **(tally.exchange_record() if trainer.co2 else {"rounds": None, "bytes_sent": None}),
        co2_state_bytes=trainer.opt.co2_state_bytes() if trainer.co2 else 0,
        n_params=job.n_params,
        mfu=tally.last_mfu,
        max_memory_gib=job.memory_gib(),
        args=vars(a),
        **elastic_record(job),
    )
    job.barrier()
    dist.destroy_process_group()
