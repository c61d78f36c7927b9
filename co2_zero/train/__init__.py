"""Train a GPT with CO2 or a baseline: a tiny byte-level model on CPUs, GPT-2 sizes on GPUs.

The main job: `co2-train` installed (or `python -m co2_zero.train`; in a checkout, scripts/train_lm.py).
Every knob is a flag (`co2-train --help`); docs/training-job.md says what the job prints, writes and
refuses. loop.py reads top to bottom: build, start, train, finish.
"""

from typing import Optional, Sequence

from . import loop
from .args import program
from .cli import run_tool


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`co2-train` / `python -m co2_zero.train` / scripts/train_lm.py: one training job; returns 0, or 2 after
    a user error's one line (cli.py; --debug: its traceback)."""
    return run_tool(program(), loop.main, argv)


__all__ = ["main"]
