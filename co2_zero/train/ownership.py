"""A --save_dir belongs to one run: the run id in DIR/co2_run, claimed at launch (elastic: by every replica
of the job, with the id its replicas share). A run that finds another run's checkpoints there refuses before
it trains, naming both runs and what to do; two launches into one directory at the same time cannot both
claim it (the file is created by a hard link, which fails when it exists). A resumed run keeps its run id
(the CO2 state's `run_id`, and every checkpoint's `extra`), so --resume of the run that owns a directory goes
on saving there."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from co2_zero import checkpoint
from co2_zero.core.config import CO2Config
from co2_zero.core.deadline import broadcast_object
from co2_zero.core.errors import refusal
from co2_zero.core.topology import collective_device

from .checkpoints import newest_replica_checkpoint
from .collectives import deadline_s
from .engines import Trainer

OWNER = "co2_run"  # in a --save_dir: the id of the run whose checkpoints it holds


def claim_save_dir(args, trainer: Trainer, config: Optional[CO2Config]) -> None:
    """Rank 0 claims --save_dir for this launch's run (fresh: a new id) and every rank learns the outcome;
    a refused CO2Error (`errors.refusal`: one line from the tools) on every rank if the directory holds
    another run's checkpoints. The verdict travels within the job's deadline (`config`'s timeout_s).
    An elastic replica (each saves under `DIR/replica<N>`) claims DIR with the job's run id, which it drew or
    took from its peers when it joined (`RoundEngine`), so every replica of a job, a restarted one too, passes
    and another job is refused."""
    if not args.save_dir:
        return
    verdict = None
    if dist.get_rank() == 0:
        run_id = run_id_of(trainer) or secrets.token_hex(8)
        verdict = (run_id, claim(Path(args.save_dir), run_id, args.resume, elastic=bool(args.lighthouse)))
    what = "the --save_dir claim"
    run_id, problem = broadcast_object(verdict, 0, what, deadline_s(config, args), collective_device())
    if problem is not None:
        raise refusal(problem)
    trainer.run_id = run_id
    if trainer.co2 and trainer.opt.engine.run_id is None:  # its checkpoints' markers name the same run
        trainer.opt.engine.name_run(run_id)


def run_id_of(trainer: Trainer) -> Optional[str]:
    """The run a loaded checkpoint belonged to (the CO2 state's, else its `extra`'s), or None (a fresh run)."""
    if trainer.co2 and trainer.opt.engine.run_id is not None:
        return trainer.opt.engine.run_id
    return trainer.run_id


def claim(root: Path, run_id: str, resume: Optional[str], elastic: bool = False) -> Optional[str]:
    """Make `root` run `run_id`'s, or say why not: its owner file names another run; without one (written
    by an earlier version), a complete checkpoint of another run, or for a fresh run any `latest`.
    `elastic`: the checkpoints are the replicas' (`DIR/replica<N>/`), as the message names them."""
    owner = read_owner(root)
    if owner is None:
        others = sorted({marker.get("run_id") for _, marker in checkpoint.complete_checkpoints(root)} - {run_id, None})
        if others:
            owner = others[0]
        elif resume is None and (root / "latest").is_file():
            owner = "unknown (its checkpoints name none)"
        else:
            owner = _create_owner(root, run_id)
    if owner == run_id:
        return None
    this = f"resumed from {resume}" if resume is not None else "a new run"
    latest, one = (_newest_of_replicas(root), "replica<N>/step<k>") if elastic else (_latest(root), "step<N>")
    return (
        f"--save_dir {root} holds the checkpoints of run {owner} ({root / OWNER}; latest: {latest}), and "
        f"this launch is run {run_id} ({this}). A save directory belongs to one run, so nothing was written: "
        f"continue run {owner} with --resume (its latest checkpoint) or --resume {root}/{one}, or give this "
        f"run a new --save_dir"
    )


def read_owner(root: Path) -> Optional[str]:
    """The run id `root`'s owner file names, or None when it has none."""
    try:
        return (root / OWNER).read_text().strip()
    except FileNotFoundError:
        return None


def _create_owner(root: Path, run_id: str) -> str:
    """Write the owner file whole under a temporary name, then link it in place: of two launches claiming at
    once, one link fails (the file exists). Returns the owner the file names afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".{OWNER}.{secrets.token_hex(6)}.tmp"
    checkpoint.write_text_atomic(temp, run_id)
    try:
        os.link(temp, root / OWNER)
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)
    return read_owner(root) or run_id


def _newest_of_replicas(root: Path) -> str:
    """The checkpoint an elastic --resume of `root` would load, relative to it, or "none"."""
    try:
        return str(newest_replica_checkpoint(root).relative_to(root))
    except FileNotFoundError:
        return "none"


def _latest(root: Path) -> str:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return "none"
