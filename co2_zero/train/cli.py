"""How the command-line tools end on a user's mistake: one line, printed once (rank 0), exit status 2.

A bad flag, a refused setting or a checkpoint that cannot be loaded is the user's to fix, and under torchrun
a traceback per rank would bury the one line that says what to fix. Every rank of the launch raises the
same refusal (flags are checked before any process group; a checkpoint load refuses on every rank), so
rank 0 alone prints it (another rank prints its own only if rank 0 did not end the launch within half a
minute, i.e. did not refuse). `--debug` lets the exception through, with its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, NoReturn, Optional, Sequence

from ..core.errors import CO2Error

USAGE_ERROR = 2  # argparse's exit status for a bad command line
DEBUG_FLAG = "--debug"
DEBUG_HELP = "let an error through with its traceback (default: one line, printed by rank 0, exit status 2)"
# How long a rank other than 0 waits after a refusal before it prints and exits: torchrun ends the whole launch
# at the first rank's exit, so rank 0 must print first (its exit ends the others, which then print nothing).
RANK_0_FIRST_S = 30.0  # far longer than rank 0 takes to exit, even on a loaded host


def first_rank() -> bool:
    """Whether this process prints for the launch: rank 0 of torchrun's world, or a process of its own."""
    return os.environ.get("RANK", "0") == "0"


def report(prog: str, message: str) -> None:
    """Print `message` as the tool's one error line, a multi-line message joined into one: rank 0 at once; any
    other rank only if it is still running RANK_0_FIRST_S later (rank 0 did not end the launch: it did not
    refuse), naming itself."""
    text = "; ".join(line.strip() for line in str(message).splitlines() if line.strip())
    if first_rank():
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
        return
    time.sleep(RANK_0_FIRST_S)
    print(f"{prog}: error (rank {os.environ.get('RANK')}): {text}", file=sys.stderr, flush=True)


class ToolParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line from rank 0 (argparse prints the whole usage on every rank)."""

    def error(self, message: str) -> NoReturn:
        report(self.prog, f"{message} ({self.prog} --help lists the flags)")
        raise SystemExit(USAGE_ERROR)


def run_tool(prog: str, body: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run a tool's `body(argv)`; a user error (a refused setting: ValueError; a refused checkpoint load:
    `CO2Error.refused`) becomes `report`'s line and exit status 2 unless `--debug` is among the arguments. Any
    other exception keeps its traceback: it is not the user's."""
    given = sys.argv[1:] if argv is None else list(argv)
    if DEBUG_FLAG in given:
        return body(argv)
    try:
        return body(argv)
    except (ValueError, CO2Error) as error:
        if isinstance(error, CO2Error) and not error.refused:
            raise
        report(prog, str(error))  # before the groups end: a rank that alone refused must print before any fails
        _end_process_groups()
        return USAGE_ERROR


def _end_process_groups() -> None:
    """End the job's process groups while the interpreter is alive (gloo's threads, ended with it, can abort
    the process: docs/design.md §8); the refusal came from every rank, so no rank waits on another here."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
