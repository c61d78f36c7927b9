"""`replica_tau: "auto"`: each replica's inner steps per round measured on the running job, then fixed
(docs/design.md §3, "Replicas of different speeds").

Two decisions, each from every rank's mean inner step time. The first comes early: every replica runs at tau
while it is measured, and after MEASURED_STEPS timed steps (or at the end of the round in progress if that
comes first) the τ_r are fixed, from the round in progress when every replica is still short of its τ_r
there, else from the next one. The second corrects them once: each rank times the first whole round it runs
at that pace, with the exchange of the round before in flight (whose background work slows the slower
replicas more; a few steps at the start also misjudge a speed by several percent), and at that round's end
the τ_r are fixed again from the next round, for the rest of the run, hedged against the timed round's own
error, SPEED_ERROR (`taus_for_speeds`). The replicas start the timed round
together: the end of the round before it collects its step announcement at once (after a decision inside
round 0 a slow replica is ahead of the others by their wait for it, and would run the timed round while
the exchange it then waits for has not even started). A rank times its inner steps from the
moment `inner_step_done` returns to the next call, so round ends and the waits for the exchange are not
counted, nor is the first step of a run (or of a resumed one), which pays for start-up.

At a deciding step each rank posts its mean step time with a step announcement
(`parameter_order.StepAnnouncements`), which the engine collects at once, within timeout_s: every rank holds
the same rows, takes each replica's time as the slowest of its S ranks, and fixes the same τ_r =
`pace.taus_for_speeds` (the fastest replica tau). The paces are saved in checkpoints (`Pace`, each with the
round it starts from). Plain bookkeeping: the engine feeds the meter what it sees and hands it the collected
rows; no collectives.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from .pace import Pace, taus_for_speeds
from .parameter_order import Announcement

MEASURED_STEPS = 4  # timed inner steps before the first τ_r (fewer if the round in progress ends first)
DECISIONS = 2  # the first τ_r, then their correction from a whole round timed at that pace
# how far a timed round's speeds may be from those a replica trains at over the run (on a shared host: within
# ±7% in 90 of 96 replicas of four studies, at most 10.8%; scripts/pace_replay.py, docs/benchmarks.md)
SPEED_ERROR = 0.07

clock: Callable[[], float] = time.perf_counter  # seconds; a test replaces it to make a replica slower


class PaceMeter:
    """Times this rank's inner steps until the τ_r are settled and fixes them from every rank's times. Steps
    are the engine's inner steps (`RoundState.inner_steps`) of replica `replica`."""

    def __init__(self, tau: int, shards: int, replica: int, first_step: int = 0) -> None:
        self.tau, self.shards, self.replica = tau, shards, replica
        self.fixed: Optional[Pace] = None
        self.step_ns: list[list[int]] = []  # every rank's time at each decision this process made (also logged)
        self.restart(first_step)

    def restart(self, first_step: int) -> None:
        """Measure anew from inner step `first_step` (a resumed run whose τ_r were not fixed yet): decide after
        MEASURED_STEPS timed steps, or at the end of the round in progress if that comes first and leaves a
        step to time (the first is not timed), else at the end of the next."""
        self.fixed, self.settled, self.timed_round, self.aligning_step = None, False, None, None
        round_end = (first_step // self.tau + 1) * self.tau
        if round_end - first_step < 2:
            round_end += self.tau
        self.deciding_step = min(first_step + 1 + MEASURED_STEPS, round_end)
        self._clear()

    def fix(self, pace: Pace, first_step: int, resumed: bool = False) -> None:
        """Run `pace` from inner step `first_step`: settled with both decisions made (a checkpoint's), else time
        the first whole round at this pace that starts at or after `first_step`; after `first_step` when
        `resumed` (a loaded run does not time its first step)."""
        self.fixed, self.settled = pace, len(pace.segments) == DECISIONS  # settled: nothing is timed or decided
        self.timed_round = self.aligning_step = self.deciding_step = None
        if not self.settled:
            rounds = pace.rounds_at(self.replica, first_step)
            started = resumed or pace.step_in_round(self.replica, first_step) > 0
            self.timed_round = max(pace.from_round, rounds + started)
            self.aligning_step = pace.steps_at_round(self.replica, self.timed_round)
            self.deciding_step = pace.steps_at_round(self.replica, self.timed_round + 1)
        self._clear()

    def _clear(self) -> None:
        self._total_s, self._steps = 0.0, 0
        self._began: Optional[float] = None

    def step_began(self, round_index: int) -> None:
        """Control went back to the training loop (after `inner_step_done`) for a step of round `round_index`."""
        if not self.settled and self.timed_round in (None, round_index):
            self._began = clock()

    def step_ended(self) -> None:
        """An inner step was applied (`inner_step_done` was called): count it if its start was seen."""
        if self._began is not None:
            self._total_s += clock() - self._began
            self._steps += 1
            self._began = None

    def aligns_at(self, inner_steps: int) -> bool:
        """Whether inner step `inner_steps` ends the round before the timed one: its announcement is collected
        at once, so that every replica starts the timed round together."""
        return inner_steps == self.aligning_step

    def decides_at(self, inner_steps: int) -> bool:
        """Whether inner step `inner_steps` posts this rank's time and fixes the τ_r."""
        return inner_steps == self.deciding_step

    def to_post(self, inner_steps: int) -> int:
        """What this rank announces at inner step `inner_steps`: its mean step in ns (at least 1) at a deciding
        step, else 0."""
        if not self.decides_at(inner_steps):
            return 0
        return max(1, round(1e9 * self._total_s / max(self._steps, 1)))

    def decide(self, rows: Sequence[Sequence[int]]) -> Pace:
        """The τ_r from every rank's announcement `rows` (the same on every rank). First decision: from the round
        in progress (or, at a round end, the one starting) when every replica is still short of its τ_r there,
        else from the next round. The correction, at the timed round's end: from the next round, hedged
        against SPEED_ERROR."""
        times = [Announcement(*row).step_ns for row in rows]
        if min(times) < 1:
            raise ValueError(f"co2: replica_tau 'auto': a rank posted no step time ({times} ns)")
        self.step_ns.append(times)
        per_replica = [max(times[r : r + self.shards]) for r in range(0, len(times), self.shards)]
        speeds = [1.0 / t for t in per_replica]
        if self.fixed is None:
            taus = tuple(taus_for_speeds(speeds, self.tau))
            current, into = divmod(self.deciding_step, self.tau)  # at a round end (into 0): the round starting
            pace = Pace(taus, from_round=current if into < min(taus) else current + 1)
        else:
            taus = tuple(taus_for_speeds(speeds, self.tau, SPEED_ERROR))
            pace = Pace(taus, from_round=self.timed_round + 1, before=self.fixed)
        self.fix(pace, self.deciding_step)
        return pace


def fixed_message(pace: Pace, step_ns: Sequence[int]) -> str:
    """What the job logs when the τ_r are fixed."""
    times = ", ".join(f"{ns / 1e6:.3g}" for ns in step_ns)
    which = "fixed at" if pace.before is None else "corrected to"
    return (
        f"co2: replica_tau 'auto': one inner step took {times} ms (per rank): replica_tau {which} "
        f"{list(pace.taus)} from round {pace.from_round} on"
    )
