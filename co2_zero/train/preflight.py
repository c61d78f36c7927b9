"""What the training job warns about before it trains, on rank 0: a run that would not do what its flags
suggest. A --max_steps shorter than one round is refused with the flags (args.py)."""

from __future__ import annotations

import warnings
from typing import Any, Optional


def fit_to_whole_rounds(args: Any, config: Optional[Any], rank: int) -> None:
    """Round a CO2 run's --max_steps up to whole rounds of tau (finalize() would drop a partial last round),
    and say so: the run then trains more steps than asked for."""
    if config is None or args.max_steps % config.tau == 0:
        return
    asked, tau = args.max_steps, config.tau
    args.max_steps += tau - asked % tau
    if rank == 0:
        warnings.warn(
            f"co2-train: --max_steps {asked} is not a multiple of tau={tau}: training {args.max_steps} steps "
            f"({args.max_steps // tau} whole rounds; finalize() would drop a partial last round); give a multiple "
            f"of tau ({asked - asked % tau} or {args.max_steps}) to train exactly what you ask",
            stacklevel=2,
        )


def warn_single_process(args: Any, config: Optional[Any], world: int) -> None:
    """A world of one process (no torchrun, or one rank) and no elastic membership: R x S = 1 x 1, so CO2 has
    no other replica to average with, as the library warns for every other R = 1 grid
    (`topology.warn_single_replica`). An elastic replica's peers are the other launches."""
    if config is None or world != 1 or args.lighthouse:
        return
    warnings.warn(
        "co2-train: one process (world size 1, e.g. not launched by torchrun): R x S = 1 x 1, so CO2 has nothing to "
        "average (each round's outer step sees this process's own displacement). Launch it with torchrun "
        "--nproc_per_node N (N >= 2) to train N replicas",
        stacklevel=2,
    )
