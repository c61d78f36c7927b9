"""Per-rank checkpoint files, written atomically (DESIGN.md §7).

A file is written to a temporary name in the same directory, flushed to disk, then renamed over the
target: a crash leaves either the previous complete file or the new complete one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Union

import torch

PathLike = Union[str, os.PathLike]


def save_atomic(obj: Any, path: PathLike) -> None:
    """torch.save `obj` to `path` atomically (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
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


def load(path: PathLike, map_location: Any = "cpu") -> Any:
    """Load a file written by `save_atomic`."""
    return torch.load(Path(path), map_location=map_location, weights_only=False)


def rank_file(directory: PathLike, rank: int, tag: str = "co2") -> Path:
    """The per-rank file name inside a checkpoint directory."""
    return Path(directory) / f"{tag}_rank{rank:05d}.pt"
