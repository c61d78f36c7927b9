"""Per-rank checkpoint files, written atomically (DESIGN.md §7).

A file is written to a temporary name in the same directory, flushed to disk, then renamed over the
target: a crash leaves either the previous complete file or the new complete one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Union

import torch

from .sync import consolidate

PathLike = Union[str, os.PathLike]


def _write_atomic(path: PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(file) on a temp file beside `path`, fsync it, rename it over `path`, fsync the dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: PathLike) -> None:
    """torch.save `obj` to `path` atomically."""
    _write_atomic(path, lambda f: torch.save(obj, f))


def write_text_atomic(path: PathLike, text: str) -> None:
    """Write a small text file (e.g. a "latest" tag) atomically."""
    _write_atomic(path, lambda f: f.write(text.encode()))


def load_file(path: PathLike, map_location: Any = "cpu") -> Any:
    """Load a file written by `save_atomic`."""
    return torch.load(Path(path), map_location=map_location, weights_only=False)


def rank_file(directory: PathLike, rank: int, tag: str = "co2") -> Path:
    """The per-rank file name inside a checkpoint directory."""
    return Path(directory) / f"{tag}_rank{rank:05d}.pt"


def save(directory: PathLike, model: torch.nn.Module, optimizer: Any, extra: Any = None) -> Path:
    """Write this rank's checkpoint file: model, optimizer (inner and CO2 state) and `extra`.

    For `CO2Optimizer` and `CO2OSS`. Every rank calls it; taking the optimizer state waits for the
    round in flight so its result is saved. Returns the file written.
    """
    import torch.distributed as dist

    topology = optimizer.engine.topology
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "extra": extra,
        "meta": {"world_size": dist.get_world_size(), "grid": (topology.replicas, topology.shards)},
    }
    path = rank_file(directory, dist.get_rank())
    save_atomic(state, path)
    return path


def load(directory: PathLike, model: torch.nn.Module, optimizer: Any, reshard: bool = False) -> Any:
    """Load what `save` wrote; returns its `extra`.

    Same topology: restores this rank's own file; the run continues bit for bit. `reshard=True`
    assembles the CO2 state from every rank's file per parameter tensor, so R and S may differ from
    the saved run: the model comes from the file of rank `rank % saved_world_size`, the inner
    optimizer state is not restored (its partition changed), and training resumes at the saved
    run's last round start.
    """
    import torch.distributed as dist

    directory, rank, world = Path(directory), dist.get_rank(), dist.get_world_size()
    engine = optimizer.engine
    if not reshard:
        state = load_file(rank_file(directory, rank))
        grid = (engine.topology.replicas, engine.topology.shards)
        if tuple(state["meta"]["grid"]) != grid or state["meta"]["world_size"] != world:
            raise ValueError(
                f"co2 checkpoint {directory}: saved with (replicas, shards)={tuple(state['meta']['grid'])} on "
                f"{state['meta']['world_size']} ranks, this run has {grid} on {world} ranks; "
                f"pass reshard=True to load it on a different topology"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["extra"]
    files = sorted(directory.glob("co2_rank*.pt"))
    saved = [load_file(f) for f in files]
    if not saved or len(saved) != saved[0]["meta"]["world_size"]:
        raise ValueError(
            f"co2 checkpoint {directory}: found {len(saved)} co2_rank*.pt files; expected one per rank of the saved run"
        )
    mine = saved[rank % len(saved)]
    model.load_state_dict(mine["model"])
    engine.load_consolidated([consolidate(s["optimizer"]["co2"]) for s in saved])
    return mine["extra"]
