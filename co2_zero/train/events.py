"""Machine-readable events of a run (--events_jsonl) and the stop file a benchmark ends it with (--stop_file).

The elastic benchmark (scripts/bench_elastic.py) measures what a failure costs from outside the processes
it kills; docs/training-job.md lists the events. One JSON object per line, `{"t": ..., "event": ...}`, at
the host's wall clock; a SIGKILLed writer may leave a partial last line, which readers skip.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch


class Events:
    """Appends event lines to `path` (None: writes nothing). One line per call, flushed at once."""

    def __init__(self, path: Optional[str]) -> None:
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered, lives as long as the run)

    @property
    def on(self) -> bool:
        return self.file is not None

    def emit(self, event: str, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def parameter_digest(parameters: Iterable[torch.Tensor]) -> str:
    """sha256 of the parameters' bytes in order (their local values: the shards of a sharded one)."""
    digest = hashlib.sha256()
    for p in parameters:
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(_raw_bytes(local.detach().cpu().contiguous().view(torch.uint8).reshape(-1)))
    return digest.hexdigest()


def _raw_bytes(flat: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes: through numpy where installed (fast), else through a list (the base
    install has no numpy; torch then raises "Numpy is not available")."""
    try:
        return flat.numpy().tobytes()
    except RuntimeError:
        return bytes(flat.tolist())


def stop_step(path: Optional[str]) -> Optional[int]:
    """The step the stop file names (an integer, written once by the benchmark), or None (no file yet)."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"--stop_file {path}: holds {text[:40]!r}; accepted: a step number (digits)")
    return int(text)
