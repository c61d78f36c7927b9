"""The training job's checkpoints: one directory per save, DIR/step<8 digits>/, named in DIR/latest.

The CO2 engines write through the library's checkpoints (co2_zero.checkpoint; co2_zero.deepspeed's for
--engine deepspeed), ddp / none one atomic file per rank. Each holds the job's `extra`: the step, the
data sampler's and torch's random state and (not deepspeed) the LR schedule.

Elastic (--lighthouse): every replica is its own launch and saves its own checkpoints under
DIR/replica<N>/ (the same layout, its own `latest`), so checkpoints go on while any replica lives. They
all hold the same CO2 state at a step (every replica keeps the whole outer state), so a whole-job
restart, with any number of replicas, resumes from the newest one any replica completed
(`newest_replica_checkpoint`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from co2_zero import CO2Error, checkpoint

from .data import Batches
from .engines import Trainer

OLD_LAYOUT_LATEST = "latest_co2"  # inside DIR/step<7 digits>/: the nested layout of earlier versions


def tag(step: int) -> str:
    """The name of step `step`'s checkpoint directory."""
    return f"step{step:08d}"


def save(trainer: Trainer, save_dir: Path, step: int, extra: dict) -> Path:
    """Write this rank's part of checkpoint save_dir/step<step> (collective); returns its directory."""
    name = tag(step)
    extra = {**extra, "run_id": trainer.run_id}  # the run its --save_dir belongs to (`ownership`)
    if trainer.ds_engine is not None:  # co2_zero.deepspeed's per-rank files, or plain DeepSpeed's own
        trainer.ds_engine.save_checkpoint(save_dir, tag=name, client_state=extra, save_latest=False)
        return save_dir / name
    extra = {**extra, "sched": trainer.sched.state_dict()}
    if trainer.co2:  # CO2Optimizer, CO2OSS: model, inner optimizer, CO2 state
        framework = checkpoint.framework_state(trainer.model, trainer.opt)
        return checkpoint.save_checkpoint(save_dir, framework, extra=extra, tag=name, write_latest=False)
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict(), "extra": extra}
    checkpoint.save_atomic(state, save_dir / name / _rank_file())  # ddp / none: every rank its own file
    return save_dir / name


def load(trainer: Trainer, directory: Path, reshard: bool = False) -> dict:
    """Restore what `save` wrote into `directory` (collective); returns its `extra`. `reshard`: the
    checkpoint may come from another R x S, world size or engine (CO2 methods only). A load the library
    refuses for want of reshard=True says which flag gives it."""
    try:
        extra = _load(trainer, directory, reshard)
    except CO2Error as error:
        if reshard or "reshard=True" not in str(error):
            raise
        raise CO2Error(f"{error} (with this job: --reshard)") from error
    trainer.run_id = extra.get("run_id")  # None: saved before checkpoints said it (the CO2 state may)
    return extra


def _load(trainer: Trainer, directory: Path, reshard: bool) -> dict:
    if trainer.ds_engine is not None:
        kwargs = {"reshard": reshard} if trainer.co2 else {}
        loaded, extra = trainer.ds_engine.load_checkpoint(directory.parent, tag=directory.name, **kwargs)
        if loaded is None:
            raise FileNotFoundError(f"--resume {directory}: DeepSpeed found no checkpoint there")
        return extra
    if trainer.co2:  # also the older nested layout, DIR/step<N>/step<N>/
        nested = (directory / OLD_LAYOUT_LATEST).is_file()
        root, name = (directory, None) if nested else (directory.parent, directory.name)
        extra = checkpoint.load(root, trainer.model, trainer.opt, reshard=reshard, tag=name)
    else:
        state = checkpoint.load_file(directory / _rank_file())
        trainer.model.load_state_dict(state["model"])
        trainer.opt.load_state_dict(state["optimizer"])
        extra = state["extra"]
    trainer.sched.load_state_dict(extra["sched"])
    return extra


def _rank_file() -> str:
    return f"rank{dist.get_rank():05d}.pt"


def save_root(args) -> Path:
    """Where this launch's checkpoints go: --save_dir; elastic, --save_dir/replica<N>/ (its own)."""
    root = Path(args.save_dir)
    return root / f"replica{args.replica_id}" if args.lighthouse else root


def newest_replica_checkpoint(save_dir: Path) -> Path:
    """The newest checkpoint any replica of an elastic job completed: the highest step that a
    save_dir/replica<N>/latest names, the lowest N among equal steps; every replica of a restarted job
    that reads the same directory picks the same one."""
    found = []
    for latest in save_dir.glob("replica*/latest"):
        replica, name = re.fullmatch(r"replica(\d+)", latest.parent.name), latest.read_text().strip()
        step = re.fullmatch(r"step(\d+)", name)
        if replica and step:
            found.append((-int(step.group(1)), int(replica.group(1)), latest.parent / name))
    if not found:
        raise FileNotFoundError(
            f"--resume: no {save_dir}/replica<N>/latest; give a checkpoint directory, or the --save_dir of an "
            f"earlier elastic run"
        )
    return min(found)[2]


def resume_directory(args) -> Path:
    """The checkpoint --resume names: the one DIR/latest names (--resume alone; elastic: the newest of
    every replica's), or the directory given."""
    if args.resume != "latest":
        return Path(args.resume)
    if args.lighthouse:
        return newest_replica_checkpoint(Path(args.save_dir))
    latest = Path(args.save_dir) / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume: no {latest}; give a checkpoint directory, or --save_dir of an earlier run")
    return Path(args.save_dir) / latest.read_text().strip()


def write_latest(save_dir: Path, directory: Path) -> None:
    """Name `directory` (complete on every rank) in save_dir/latest, atomically (rank 0)."""
    checkpoint.write_text_atomic(save_dir / "latest", directory.name)


def rng_state(gen: torch.Generator) -> dict:
    """This rank's random streams: its data sampler, torch's CPU and (on CUDA) device generators."""
    state = {"data": gen.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def resume(args, trainer: Trainer, batches: Batches, console: Any) -> int:
    """Load the --resume checkpoint into the trainer and the data sampler; returns the step to go on from."""
    directory = resume_directory(args)
    extra = load(trainer, directory, reshard=args.reshard)
    step = resume_position(trainer, batches, extra, resharded=args.reshard)
    console.line(f"resumed from {directory} at step {step}" + (" (resharded)" if args.reshard else ""))
    return step


def resume_position(trainer: Trainer, batches: Batches, extra: dict, resharded: bool) -> int:
    """Put this rank's random streams where a resume from a checkpoint's `extra` goes on; returns the job's
    step there. As saved; resharded, the last round start the engine resumed at: the data stream at this
    rank's own optimizer steps there, the job's step on the fastest replica's clock (with replica_tau a slow
    replica took fewer steps; --max_steps and --save_every count the fastest one's)."""
    if not resharded:
        restore_data_position(batches, extra["rng"], extra["step"], resharded=False)
        return extra["step"]
    engine = trainer.opt.engine
    restore_data_position(batches, extra["rng"], engine.inner_steps, resharded=True)
    return engine.agreed_step


def restore_data_position(batches: Batches, state: dict, step: int, resharded: bool) -> None:
    """This rank's random streams on a resume from `state` (`rng_state` as saved). The same world: its own
    saved streams. Resharded (another world size: the file is rank `rank % saved world`'s, and the
    partial round is dropped): torch's random state from the file, and this rank's own data stream where
    an uninterrupted run of this world size reads at `step`, so new ranks do not replay old ones' data."""
    set_rng_state(batches.gen, state)
    if resharded:
        batches.seek(step)


def set_rng_state(gen: torch.Generator, state: dict) -> None:
    gen.set_state(state["data"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
