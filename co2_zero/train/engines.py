"""The engines the training job runs on, each behind one small interface, `Trainer`.

plain: torch AdamW; CO2Optimizer around it (CO2 methods), DDP (--method ddp), or alone (--method none).
fairscale: CO2OSS + ShardedDataParallel inside a replica. deepspeed: ZeRO-1/2 from --deepspeed_config.
fsdp: PyTorch's fully_shard over each replica's ranks, CO2Optimizer across replicas. The optional
frameworks are imported only by the engine that needs them.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .ds_config import deepspeed_config
from .pacing import JobSteps


@dataclass
class Trainer:
    """What an engine builds.

    `train_step(micro_batches)` runs forward and backward on each (x, y) micro-batch, one optimizer step
    and the LR schedule, and returns the mean loss as a detached tensor (no host sync). `opt` carries
    the CO2 bookkeeping for the CO2 methods (round_ended, last_round, finalize(), co2_state_bytes());
    `co2` says whether it does. `model` is the bare module (evaluation, checkpoints); `ds_engine` the
    DeepSpeed engine, whose checkpoints hold the LR schedule; otherwise `sched` is the job's scheduler.
    `membership`: the elastic job's `co2_zero.elastic.Membership` (--lighthouse), else None.
    """

    train_step: Callable[[list], torch.Tensor]
    opt: Any
    lr: Callable[[], float]
    model: nn.Module
    co2: bool
    ds_engine: Any = None
    sched: Any = None
    membership: Any = None
    run_id: Optional[str] = None  # the run its checkpoints belong to (`ownership`): loaded, or claimed at launch

    def grid(self, world: int) -> tuple[int, int]:
        """(R, S) actually used: the CO2 topology's replicas and shards (elastic: the replicas of the
        latest quorum); ddp/none: every rank a replica."""
        if not self.co2:
            return world, 1
        topology = self.opt.engine.topology
        if self.membership is not None:
            return len(self.membership.quorum) or topology.replicas, topology.shards
        return topology.replicas, topology.shards


def adamw_kwargs(args) -> dict:
    kwargs = dict(lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
    if args.device == "cuda":
        kwargs["fused"] = True  # one kernel for the whole step
    return kwargs


def autocast(args):
    return torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")


def maybe_compile(module: nn.Module, args) -> nn.Module:
    return torch.compile(module) if args.compile else module


def lr_lambda(args, clock: Optional[Callable[[int], float]] = None) -> Callable[[int], float]:
    """The multiplier on --lr after `own` optimizer steps: linear warmup, then cosine to --min_lr. `clock`
    maps them to the job's steps (`co2_zero.train.pacing.JobSteps.clock`: with --replica_tau, the fastest
    replica's, so that every replica is at the same point of the schedule at every round end)."""

    def f(own):
        step = own if clock is None else clock(own)
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        t = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return (args.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (args.lr - args.min_lr)) / args.lr

    return f


def accumulating_step(args, module, opt, sched, clip, no_sync=None, set_to_none=True):
    """train_step of the engines that run the backward themselves: the gradient of the mean loss over
    the micro-batches (no gradient exchange before the last one when `no_sync` is given), clipping,
    the optimizer step and the LR schedule."""

    def train_step(micro):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for k, (x, y) in enumerate(micro):
            hold = no_sync() if no_sync is not None and k < len(micro) - 1 else contextlib.nullcontext()
            with hold:
                with autocast(args):
                    loss = module(x, y)
                (loss / len(micro)).backward()
            total = total + loss.detach()
        if args.grad_clip > 0:
            clip(args.grad_clip)
        opt.step()
        sched.step()
        return total / len(micro)

    return train_step


def _scheduled(args, opt, clock: Callable[[int], float]) -> tuple[Any, Callable[[], float]]:
    """The LR schedule on `opt`, read on `clock` (`lr_lambda`), and a reader of its current LR."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args, clock))
    return sched, lambda: sched.get_last_lr()[0]


def _fast_forward(sched: Any, steps: int) -> None:
    """Set the LR schedule to step `steps`, as if it had stepped that often (an elastic replica that
    joins a running job starts at the job's step)."""
    sched.last_epoch = steps - 1
    with warnings.catch_warnings():  # no optimizer step yet: torch would warn about the order
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        sched.step()


def _scheduled_from_job(args, opt, membership: Any, clock: Callable[[int], float]) -> tuple[Any, Callable[[], float]]:
    """`_scheduled`; an elastic replica that joined a running job starts its schedule at the job's step."""
    sched, lr = _scheduled(args, opt, clock)
    if membership is not None and opt.engine.inner_steps:
        _fast_forward(sched, opt.engine.inner_steps)
    return sched, lr


def elastic_membership(args) -> Any:
    """The job's `co2_zero.elastic.Membership` (--lighthouse), or None."""
    if args.lighthouse is None:
        return None
    # torchft's Rust core logs every quorum and commit at INFO, in several writes a line, into our
    # console's lines; it reads RUST_LOG once, when first imported (RUST_LOG=info brings them back)
    os.environ.setdefault("RUST_LOG", "warn")
    from co2_zero.elastic import Membership

    # what every replica's job must share beyond the co2 config and the model (refused naming both values)
    agree = {"dtype": args.dtype, "seed": args.seed}
    return Membership(args.lighthouse, args.replica_id, start_replicas=args.start_replicas, agree=agree)


def build_plain(args, model, co2, clock: Callable[[int], float]) -> Trainer:
    """torch AdamW; CO2Optimizer around it for the CO2 methods (elastic with --lighthouse: it joins the
    job, and a replica that joins a running job starts at its step), DDP for ddp, nothing for none."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(args))
    module, no_sync, membership = model, None, None
    if args.method == "ddp":
        module = nn.parallel.DistributedDataParallel(model)
        no_sync = module.no_sync
    elif co2 is not None:
        from co2_zero import CO2Optimizer

        membership = elastic_membership(args)
        opt = CO2Optimizer(opt, co2, model=model, membership=membership)
    sched, lr = _scheduled_from_job(args, opt, membership, clock)

    def clip(max_norm):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    step = accumulating_step(args, maybe_compile(module, args), opt, sched, clip, no_sync)
    return Trainer(step, opt, lr, model, co2=co2 is not None, sched=sched, membership=membership)


def build_fairscale(args, model, co2, clock: Callable[[int], float]) -> Trainer:
    """CO2OSS (OSS shards AdamW over the replica) + the fixed ShardedDataParallel inside the replica."""
    from co2_zero.fairscale import CO2OSS, ShardedDataParallel  # FairScale's SDP, fixed for replica groups

    if co2 is None:
        raise ValueError("--engine fairscale runs the CO2-family methods; use --engine plain for ddp/none")
    opt = CO2OSS(model.parameters(), optim=torch.optim.AdamW, co2=co2, **adamw_kwargs(args))
    module = ShardedDataParallel(maybe_compile(model, args), opt, process_group=opt.group)
    sched, lr = _scheduled(args, opt, clock)
    # the gradients are sharded: opt.clip_grad_norm takes the norm over the replica, as OSS computes it;
    # OSS + SDP keep their gradient buckets, so gradients are zeroed in place
    step = accumulating_step(args, module, opt, sched, opt.clip_grad_norm, module.no_sync, set_to_none=False)
    return Trainer(step, opt, lr, model, co2=True, sched=sched)


def build_deepspeed(args, model, co2, clock: Callable[[int], float]) -> Trainer:
    """DeepSpeed from --deepspeed_config: its ZeRO stage and precision (unless --dtype); its batch,
    accumulation, clipping, AdamW and LR scheduler unless a flag was given (ds_config.py); the co2 section
    `co2_config` resolved (--method ddp: none, i.e. plain DeepSpeed data parallelism)."""
    os.environ["DS_ACCELERATOR"] = args.device  # DeepSpeed's accelerator is this job's device
    import co2_zero.deepspeed

    if co2 is None and args.method != "ddp":
        raise ValueError("--engine deepspeed runs the CO2-family methods or ddp")
    config = deepspeed_config(args, co2, adamw_kwargs(args))

    def job_schedule(inner):  # warmup, then cosine to --min_lr
        return torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(args, clock))

    engine, opt, _, sched = co2_zero.deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=None if "scheduler" in config else job_schedule,  # the config's, unless an LR flag was given
    )
    if args.compile:
        engine.compile()

    def train_step(micro):  # DeepSpeed scales the loss for accumulation and steps at the boundary
        total = 0.0
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()  # zero_grad, gradient clipping, the LR schedule: DeepSpeed's
            total = total + loss.detach()
        return total / len(micro)

    return Trainer(train_step, opt, lambda: sched.get_last_lr()[0], model, co2=co2 is not None, ds_engine=engine)


def build_fsdp(args, model, co2, clock: Callable[[int], float]) -> Trainer:
    """PyTorch's FSDP2 inside each replica (fully_shard per block and the root over the replica's 1-D
    mesh), CO2Optimizer across replicas on the local shards (elastic with --lighthouse, as the plain engine)."""
    from torch.distributed.fsdp import fully_shard

    from co2_zero import CO2Optimizer
    from co2_zero.fsdp import replica_mesh

    if co2 is None:
        raise ValueError("--engine fsdp runs the CO2-family methods; use --engine plain for ddp/none")
    mesh = replica_mesh(co2)  # this rank's replica: S = --shards_per_replica ranks
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm and the tied head in the root group
    membership = elastic_membership(args)  # elastic (--lighthouse): the replica's S ranks are one launch
    opt = CO2Optimizer(
        torch.optim.AdamW(model.parameters(), **adamw_kwargs(args)), co2, model=model, membership=membership
    )
    sched, lr = _scheduled_from_job(args, opt, membership, clock)

    def clip(max_norm):  # DTensor gradients: the norm is taken over the replica
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    step = accumulating_step(args, maybe_compile(model, args), opt, sched, clip)
    return Trainer(step, opt, lr, model, co2=True, sched=sched, membership=membership)


BUILDERS: dict[str, Callable[[Any, nn.Module, Optional[Any], Callable[[int], float]], Trainer]] = {
    "plain": build_plain,
    "fairscale": build_fairscale,
    "deepspeed": build_deepspeed,
    "fsdp": build_fsdp,
}


def build_trainer(args, model: nn.Module, co2, steps: JobSteps) -> Trainer:
    """The --engine's Trainer around `model`; `co2`: the CO2Config, None for ddp / none. The LR schedule
    reads the job's steps (`lr_lambda`), which `steps` then counts on the trainer's CO2 pace."""
    trainer = BUILDERS[args.engine](args, model, co2, steps.clock)
    steps.bind(trainer)
    return trainer
