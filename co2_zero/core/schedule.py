"""When a round's average is applied: `ApplySchedule`, and `DelayMeter` for `sync_delay: "auto"`, the
sync delay measured on the running job (docs/design.md §3, "The sync delay").

With "auto", until the delay is fixed every round's average is applied at the next round end, as
published. Each rank notes after how many inner steps of the next round it found a pipeline finished
(tau when not by the round end) and posts that count with its step announcement at the round end
(`agreement.StepAnnouncements`). The first pipeline of a run, or of a resumed run, is not counted: it
pays for the collectives' set-up. Once MEASURED pipelines are counted, every rank holds the same
all-gathered rows and so fixes the same delay at the same round end: ceil(MARGIN x the most steps any
rank counted), at most tau. It holds for the rest of the run and is saved in checkpoints.

Plain bookkeeping: the engine feeds the meter what it sees and asks it after each launch; no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class RoundPlan:
    """Which partition buffer plays which part at one round end."""

    base: torch.Tensor  # the start point the outer update applies to
    work: torch.Tensor  # receives D; the pipeline leaves the next start point in it
    wait_at_once: bool  # wait for the pipeline before step 3 (blocking mode)
    swap: bool  # the buffers trade roles at this round end (else when the average is applied mid-round)
    gap: Optional[torch.Tensor]  # the previous update's per-tensor squared norms (staleness), or None


@dataclass(frozen=True)
class ApplySchedule:
    """When a round's average is applied, decided here only (docs/design.md §3, "Blocking mode" and
    "The sync delay"): `steps` inner steps into the next round.

    - tau (overlap, the default): at the next round end, a round late, with a staleness gap. D
      overwrites the retiring start point B and the update applies to x_{t+1}; the buffers swap.
    - 0 (blocking): at once. D goes to the spare buffer, the update applies to x_t without a gap.
    - 0 < d < tau (a sync delay): D goes to the spare buffer, the update applies to the base D was
      measured from, and the buffers swap when it is applied, d steps into the next round.
    """

    steps: int
    tau: int

    def plan(self, start_point: torch.Tensor, next_start: torch.Tensor, gap: Optional[torch.Tensor]) -> RoundPlan:
        if self.steps == self.tau:
            return RoundPlan(base=next_start, work=start_point, wait_at_once=False, swap=True, gap=gap)
        if self.steps == 0:
            return RoundPlan(base=start_point, work=next_start, wait_at_once=True, swap=True, gap=None)
        return RoundPlan(base=start_point, work=next_start, wait_at_once=False, swap=False, gap=gap)

    def applies_mid_round(self, inner_steps: int) -> bool:
        """Whether the average in flight is applied after this inner step (not at a round end)."""
        return 0 < self.steps < self.tau and inner_steps % self.tau == self.steps

    def last_start(self, start_point: torch.Tensor, next_start: torch.Tensor) -> torch.Tensor:
        """The start point the last finished round produced, once applied, which finalize() gives every
        rank."""
        return next_start if self.steps == self.tau else start_point

    def carried_next_start(self, next_start: torch.Tensor, unapplied: bool) -> Optional[torch.Tensor]:
        """The next start point as state, None when none is pending: in blocking mode the buffer is a spare,
        and with a sync delay it is one from the apply point to the round end (`unapplied`: the average
        launched at the last round end is still to be applied)."""
        if self.steps == self.tau:
            return next_start
        return next_start if self.steps and unapplied else None


MARGIN = 1.5  # the headroom over the measured exchange, as co2-tune-tau's tau_comm = ceil(1.5 t_comm / t_step)
WARMUP = 1  # pipelines not counted at the start of a run (or a resumed run)
MEASURED = 2  # pipelines counted before the delay is fixed


def delay_for(steps_needed: int, tau: int, margin: float = MARGIN) -> int:
    """The sync delay that hides an exchange needing `steps_needed` inner steps: ceil(margin x steps),
    in [1, tau]."""
    return max(1, min(tau, math.ceil(margin * steps_needed)))


class DelayMeter:
    """Counts the inner steps each pipeline needs and decides, the same on every rank, when and to what
    the sync delay is fixed. Rounds are the engine's round indices (`RoundEngine.rounds` at a round end).

    Per round end of round t, in order: `to_post()` (what this rank announces: the steps the pipeline
    of round t - 1 took, or 0), `fixed_after_launch(t)` (the delay to switch to after launching round
    t's pipeline, once); meanwhile `saw(...)` after every inner step and `collected(rows)` for every
    announcement that arrives.
    """

    def __init__(self, tau: int, first_round: int = 0) -> None:
        self.tau = tau
        self.fixed: Optional[int] = None  # the delay once fixed
        self.restart(first_round)

    def restart(self, first_round: int) -> None:
        """Measure anew from round `first_round` (a resumed run whose delay was not fixed yet; a delay this
        meter had fixed is dropped)."""
        self.fixed = None
        self._counted = range(first_round + WARMUP, first_round + WARMUP + MEASURED)  # pipelines counted
        # their counts are posted at round ends counted + 1 and arrive by the next round end's launch
        self._decide_at = self._counted.stop + 1
        self._watching: Optional[int] = None  # the counted pipeline in flight
        self._seen_at = 0  # the inner step of its round at which it was first seen finished (0: not yet)
        self._most = 0  # the most steps any rank announced so far

    def launched(self, round_index: int) -> None:
        """Round `round_index`'s pipeline started (at its round end)."""
        self._watching = round_index if self.fixed is None and round_index in self._counted else None
        self._seen_at = 0

    @property
    def watching(self) -> bool:
        """Whether a counted pipeline is in flight and not yet seen finished (only then is `saw` asked)."""
        return self._watching is not None and not self._seen_at

    def saw(self, step_in_round: int, finished: bool) -> None:
        """After inner step `step_in_round` (1 .. tau-1) of a round: whether the pipeline was finished."""
        if self._watching is not None and finished and not self._seen_at:
            self._seen_at = step_in_round

    def to_post(self) -> int:
        """At a round end, before waiting: the inner steps the counted pipeline in flight took (tau: all of
        the round, or more), 0 when none is counted."""
        if self._watching is None:
            return 0
        return self._seen_at or self.tau

    def collected(self, counts: Sequence[int]) -> None:
        """Every rank's posted count of one announcement (the same rows on every rank)."""
        if self.fixed is None:
            self._most = max(self._most, *counts)

    def fixed_after_launch(self, round_index: int) -> Optional[int]:
        """The delay to apply from the next round on, returned once: after round `round_index`'s launch
        at the deciding round end (the last pipeline applied at a round end is the one just launched)."""
        if self.fixed is not None or round_index != self._decide_at:
            return None
        self.fixed = delay_for(max(self._most, 1), self.tau)
        return self.fixed

    @property
    def most_steps(self) -> int:
        """The most inner steps any rank counted for an exchange so far."""
        return self._most

    def fix(self, delay: int) -> None:
        """A checkpoint's fixed delay."""
        self.fixed, self._watching = delay, None


def late_average_warning(most_steps: int, tau: int) -> str:
    """sync_delay "auto" fixed the delay at tau: what that costs, and the tau that would avoid it."""
    return (
        f"co2: sync_delay 'auto': the exchange took {most_steps} of tau={tau} inner steps on the slowest rank "
        f"(at least that many: the round end waited), so every average stays a whole round late, as with "
        f"sync_delay null. A tau of at least {math.ceil(MARGIN * most_steps) + 1} would let it apply earlier, "
        f"and one above the exchange's steps keeps the round end from waiting (docs/configuration.md)"
    )
