"""The pipeline in flight, as the engine sees it: its lifecycle (`Phase`), waiting for a pipeline's
result within a deadline while watching the step announcements, and shutting the worker and the CO2
process groups down (docs/design.md §3, §8)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

from .comm import OuterExchange
from .parameter_order import StepAnnouncements
from .topology import Topology

WATCH_S = 0.05  # how often a wait for the pipeline looks at the step announcements


class Phase(enum.Enum):
    """Where the engine is in its life. Round ends run from IDLE or IN_FLIGHT; the last two are final."""

    IDLE = "idle"  # no pipeline in flight (before the first round end, in blocking mode between rounds)
    IN_FLIGHT = "in flight"  # a pipeline runs round `pending_index` in the background
    FAILED = "failed"  # a wait, a collective or a check failed: the worker and groups are released
    FINALIZED = "finalized"  # finalize() gave every rank the same model


def result_watching_steps(
    future: Future, announcements: StepAnnouncements, timeout_s: float, check_steps: Callable[[], object]
) -> Any:
    """The pipeline's result within timeout_s; meanwhile, a step announcement that arrives is checked
    (`check_steps`): a peer that called finalize() will never run this round, so report the counts now."""
    deadline = time.monotonic() + timeout_s
    while True:
        if announcements.ready():
            check_steps()
        try:
            return future.result(timeout=min(WATCH_S, max(deadline - time.monotonic(), 0.0)))
        except FutureTimeout:
            if time.monotonic() >= deadline:
                raise


def finished(pending: Optional[Future]) -> bool:
    """Whether a pipeline has finished, on the device too (its CUDA event), without blocking: the
    worker returns once its kernels are queued. None (waited for already) counts as finished; a failed
    one too (its wait reports it)."""
    if pending is None:
        return True
    if not pending.done():
        return False
    if pending.exception() is not None:
        return True
    _, done = pending.result()
    return done is None or done.query()


def shutdown(
    exchange: OuterExchange,
    topology: Topology,
    announcements: StepAnnouncements,
    join_s: float = 1.0,
    release: bool = False,
) -> None:
    """Stop the exchange's worker and release the CO2 groups (`RoundEngine.close`)."""
    # A worker still blocked in a collective keeps its groups: destroying them under it would crash.
    # So does a step announcement a peer never answered (it is a collective on the control group).
    if exchange.close(join_s) and not (announcements.in_flight and not announcements.ready()):
        if release:
            announcements.release()
        topology.destroy(release=release)
