"""`replica_tau: "auto"`: each replica's inner steps per round measured on the running job, then fixed
(docs/design.md §3, "Replicas of different speeds").

The first MEASURED_ROUNDS rounds of a run (or of a run resumed before its τ_r were fixed) run every replica
at tau, the plain mean. Meanwhile each rank times two things on its own clock:
- its inner steps, from the moment `inner_step_done` returns to the next call (not the first step of a
  run, which pays for start-up); their median is its step time, which an exchange running in the
  background on the same CPU does not move;
- what its rounds cost besides those steps: the time inside `inner_step_done` (the round end, the apply
  point) and the steps' time beyond the median (the exchange's own work in the background), less the
  waits for the exchange and the peers (`waited`), which are another replica's lateness, not this one's.
At the last measured round end, before its own round end is timed, those spans hold MEASURED_ROUNDS - 1
round ends, apply points and exchanges: their cost over MEASURED_ROUNDS - 1 is its round cost.

Each rank posts both with its step announcement (`parameter_order.StepAnnouncements`), which the engine
then collects at once, within timeout_s: every rank holds the same rows, takes each replica's step time and
round cost as the largest of its S ranks', and fixes the same τ_r = `pace.taus_for_rounds` (the replica of
the shortest round runs tau). From the next round on they hold for the rest of the run and are saved in
checkpoints (`Pace`, with the round they start from).

Plain bookkeeping: the engine feeds the meter what it sees and hands it the collected rows; no collectives.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

from .pace import Pace, taus_for_rounds

MEASURED_ROUNDS = 2  # rounds run at tau and timed before the τ_r are fixed
STEP_NS, ROUND_NS = 3, 4  # the columns of a step announcement that carry the step time and round cost, in ns

clock: Callable[[], float] = time.perf_counter  # seconds; a test replaces it to make a replica slower


class PaceMeter:
    """Times this rank's inner steps and round costs until the τ_r are fixed, and fixes them from every
    rank's. Rounds are the engine's round indices (`RoundState.rounds` at a round end)."""

    def __init__(self, tau: int, shards: int, first_round: int = 0) -> None:
        self.tau, self.shards = tau, shards
        self.fixed: Optional[Pace] = None
        self.restart(first_round)

    def restart(self, first_round: int) -> None:
        """Measure anew from round `first_round` (a resumed run whose τ_r were not fixed yet)."""
        self.fixed = None
        self.deciding_round = first_round + MEASURED_ROUNDS - 1  # whose round end posts and fixes
        self._steps_s: list[float] = []
        self._engine_s = 0.0  # inside inner_step_done, less its waits
        self._began: Optional[float] = None  # of the step under way
        self._entered: Optional[float] = None  # of the inner_step_done under way
        self._waits_s = 0.0  # of the inner_step_done under way

    def step_ended(self) -> None:
        """`inner_step_done` was called: the step under way, if its start was seen, ends."""
        if self.fixed is None:
            self._entered = clock()
            if self._began is not None:
                self._steps_s.append(self._entered - self._began)

    def waited(self, seconds: float) -> None:
        """The engine was blocked for `seconds` (the exchange, a peer) inside `inner_step_done`."""
        if self.fixed is None:
            self._waits_s += seconds

    def step_began(self) -> None:
        """`inner_step_done` returns: what it took, less its waits, counts; the next step starts."""
        if self.fixed is None:
            self._began = clock()
            if self._entered is not None:
                self._engine_s += max(self._began - self._entered - self._waits_s, 0.0)
            self._entered, self._waits_s = None, 0.0

    def decides_at(self, round_index: int) -> bool:
        """Whether the end of round `round_index` posts this rank's times and fixes the τ_r."""
        return self.fixed is None and round_index == self.deciding_round

    def to_post(self, round_index: int) -> tuple[int, int]:
        """What this rank announces at the end of round `round_index`: its step time and round cost in ns
        (the step time at least 1) at the deciding round end, else (0, 0)."""
        if not self.decides_at(round_index):
            return 0, 0
        step_s = statistics.median(self._steps_s) if self._steps_s else 0.0
        beyond_s = sum(self._steps_s) - step_s * len(self._steps_s)
        round_s = max(beyond_s + self._engine_s, 0.0) / max(MEASURED_ROUNDS - 1, 1)
        return max(1, round(1e9 * step_s)), round(1e9 * round_s)

    def decide(self, rows: Sequence[Sequence[int]]) -> Pace:
        """The τ_r from every rank's announcement `rows` (the same on every rank), from the next round on."""
        steps, costs = [row[STEP_NS] for row in rows], [row[ROUND_NS] for row in rows]
        if min(steps) < 1:
            raise ValueError(f"co2: replica_tau 'auto': a rank posted no step time ({steps} ns)")
        ranks = range(0, len(rows), self.shards)
        step_ns = [max(steps[r : r + self.shards]) for r in ranks]
        round_ns = [max(costs[r : r + self.shards]) for r in ranks]
        self.fixed = Pace(tuple(taus_for_rounds(step_ns, round_ns, self.tau)), from_round=self.deciding_round + 1)
        return self.fixed

    def fix(self, pace: Pace) -> None:
        """A checkpoint's fixed τ_r."""
        self.fixed, self._began, self._entered = pace, None, None


def fixed_message(pace: Pace, rows: Sequence[Sequence[int]]) -> str:
    """What the job logs when the τ_r are fixed from announcement `rows`."""
    steps = ", ".join(f"{row[STEP_NS] / 1e6:.3g}" for row in rows)
    rounds = ", ".join(f"{row[ROUND_NS] / 1e6:.3g}" for row in rows)
    return (
        f"co2: replica_tau 'auto': inner steps of {steps} ms and rounds' own costs of {rounds} ms (per rank) "
        f"fix replica_tau={list(pace.taus)} from round {pace.from_round} on"
    )
