"""Run a function on N real processes joined by a gloo process group (torch.multiprocessing spawn).

`run_ranks(fn, world_size, *args)` returns what each rank's `fn(rank, world_size, *args)` returned
(anything torch.save can pickle). A rank that raises fails the call with its traceback; a run that
outlives `timeout` is killed and fails, so a hang is a test failure, not a stuck suite.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn: Callable, rank: int, world_size: int, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{workdir}/result{rank}.pt")
    except BaseException:
        Path(f"{workdir}/error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)  # do not wait on peers that may be stuck in a collective with us
    dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, allow_exit: tuple = ()) -> list[Any]:
    """Run fn on world_size ranks; ranks in `allow_exit` may exit without a result (None)."""
    with tempfile.TemporaryDirectory(prefix="co2test") as workdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, workdir, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world_size):
            err = Path(f"{workdir}/error{r}.txt")
            if err.exists():
                errors.append(f"--- rank {r} raised:\n{err.read_text()}")
            elif procs[r].exitcode != 0 and r not in allow_exit and r not in hung:
                errors.append(f"--- rank {r} exited with code {procs[r].exitcode}")
        if hung:
            errors.append(f"ranks {hung} still running after {timeout:.0f} s (killed)")
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        results = []
        for r in range(world_size):
            path = Path(f"{workdir}/result{r}.pt")
            results.append(torch.load(path, weights_only=False) if path.exists() else None)
        return results
