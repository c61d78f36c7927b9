"""Replicas of different speeds (docs/design.md §3, "Replicas of different speeds").

With `replica_tau`, replica r ends its rounds every τ_r inner steps instead of every τ, so that replicas of
different speeds reach each round end at about the same wall-clock time and none waits for the slowest.
The exchange then weighs replica r's displacement by its share of the tokens trained, w_r = τ_r / Στ
(every inner step being one batch of the same size). `Pace` is that bookkeeping and nothing else: which τ
a replica runs, the factor its displacement is scaled by before the exchange's plain mean, and how a step
count reads as rounds (what it combines with is the support table's, `co2_zero.core.support`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .config import CO2Config


@dataclass(frozen=True)
class Pace:
    """Every replica's inner steps per round, `taus[r]` (all `tau` without `replica_tau`), from round
    `from_round` on. The rounds before it ran `before`, an earlier pace of the run (`replica_tau: "auto"`
    corrects its first one, `co2_zero.core.pace_meter`), or, without one, every replica at max(taus), the
    job's tau (`"auto"` while it measured)."""

    taus: tuple[int, ...]
    from_round: int = 0
    before: Optional[Pace] = None

    @classmethod
    def of(cls, config: CO2Config, replicas: int) -> Pace:
        """The pace `config` sets for `replicas` replicas (`replica_tau: "auto"`: every replica at tau until
        measured; with an elastic membership its exchange sets each round's steps, `co2_zero.elastic.speeds`);
        ValueError naming `replica_tau` when its length is not R."""
        if config.replica_tau in (None, "auto"):
            return cls((config.tau,) * replicas)
        if len(config.replica_tau) != replicas:
            raise ValueError(
                f"co2 config: replica_tau={list(config.replica_tau)!r} is invalid for this job of R={replicas} "
                f"replicas; accepted: a list of {replicas} integers in [1, tau={config.tau}], one per replica, "
                f"or 'auto'"
            )
        return cls(tuple(config.replica_tau))

    @classmethod
    def of_segments(cls, segments: Sequence[tuple[int, Sequence[int]]]) -> Pace:
        """The pace of `segments`, (from_round, taus) in the order they start: each the `before` of the next."""
        pace = None
        for from_round, taus in segments:
            pace = cls(tuple(taus), from_round, pace)
        if pace is None:
            raise ValueError("co2: a pace of no segments")
        return pace

    @property
    def segments(self) -> list[tuple[int, tuple[int, ...]]]:
        """(from_round, taus) of this pace and the ones before it, in the order they start."""
        earlier = [] if self.before is None else self.before.segments
        return [*earlier, (self.from_round, self.taus)]

    @property
    def uniform(self) -> bool:
        """Every replica runs the same τ in every round: the exchange is the plain mean, the agreement compares
        steps."""
        return len(set(self.taus)) == 1 and (self.before is None or self.before.uniform)

    def _tau_before(self, replica: int, round_index: int) -> int:
        return max(self.taus) if self.before is None else self.before.tau(replica, round_index)

    def tau(self, replica: int, round_index: Optional[int] = None) -> int:
        """Inner steps per round of `replica` in round `round_index` (None: from `from_round` on)."""
        if round_index is not None and round_index < self.from_round:
            return self._tau_before(replica, round_index)
        return self.taus[replica]

    def steps_at_round(self, replica: int, round_index: int) -> int:
        """The inner steps `replica` took before round `round_index` (0-based) starts."""
        first = min(round_index, self.from_round)
        earlier = first * max(self.taus) if self.before is None else self.before.steps_at_round(replica, first)
        return earlier + max(round_index - self.from_round, 0) * self.taus[replica]

    def rounds_at(self, replica: int, inner_steps: int) -> int:
        """The round ends `replica` passed at `inner_steps`."""
        first = self.steps_at_round(replica, self.from_round)
        if inner_steps > first:
            return self.from_round + (inner_steps - first) // self.taus[replica]
        return inner_steps // max(self.taus) if self.before is None else self.before.rounds_at(replica, inner_steps)

    def step_in_round(self, replica: int, inner_steps: int) -> int:
        """Inner steps `replica` took since its last round end (0: `inner_steps` ends a round)."""
        return inner_steps - self.steps_at_round(replica, self.rounds_at(replica, inner_steps))

    def weight(self, replica: int) -> float:
        """w_r = τ_r / Στ, `replica`'s share of the tokens of a round (from `from_round` on)."""
        return self.taus[replica] / sum(self.taus)

    def displacement_scale(self, replica: int, round_index: Optional[int] = None) -> float:
        """R·w_r: the factor that turns the exchange's plain mean over R into the weighted average
        Σ w_r D_r of round `round_index` (None: from `from_round` on); 1.0, and no multiplication at all,
        in a round every replica ran at the same τ."""
        if round_index is not None and round_index < self.from_round:
            return 1.0 if self.before is None else self.before.displacement_scale(replica, round_index)
        return 1.0 if len(set(self.taus)) == 1 else len(self.taus) * self.weight(replica)

    def displacement_scales(self, round_index: Optional[int] = None) -> tuple[float, ...]:
        """`displacement_scale` of every replica, in replica order."""
        return tuple(self.displacement_scale(r, round_index) for r in range(len(self.taus)))

    def agreed_step(self, replica: int, inner_steps: int) -> int:
        """The step every rank names a save by (and must agree on): its inner steps, on the fastest replica's
        clock with replica_tau (rounded down); at a round end, rounds x tau on every replica."""
        segment, into = self._segment_at(replica, inner_steps)
        tau = max(self.taus)
        return segment.from_round * tau + into * tau // segment.taus[replica] if segment else inner_steps

    def clock_step(self, replica: int, inner_steps: int) -> float:
        """`inner_steps` of `replica` on the clock of the fastest replica: its steps since the start of the pace
        it runs times τ / τ_r, past that pace's first round times τ, so that a learning-rate schedule written
        in the fastest replica's steps reads the same value on every replica at every round end."""
        segment, into = self._segment_at(replica, inner_steps)
        tau = max(self.taus)
        return segment.from_round * tau + into * tau / segment.taus[replica] if segment else float(inner_steps)

    def _segment_at(self, replica: int, inner_steps: int) -> tuple[Optional[Pace], int]:
        """The pace (of this one and those before it) `replica` runs at `inner_steps`, and its steps since that
        pace began; (None, inner_steps) in the rounds before any, every replica at tau."""
        first = self.steps_at_round(replica, self.from_round)
        if inner_steps > first:
            return self, inner_steps - first
        return (None, inner_steps) if self.before is None else self.before._segment_at(replica, inner_steps)


def taus_for_speeds(speeds: Sequence[float], tau: int, error: float = 0.0) -> list[int]:
    """`replica_tau` for replicas of these relative speeds (steps per second, or 1 / step time): the most
    steps per second the job can train with the fastest replica at `tau`. A round lasts T, at least the
    fastest's tau steps and less than its tau + 1; each replica runs the whole steps it completes in T, at
    least 1. T is the fastest's tau steps or a time at which another replica fits one step more, whichever
    trains the most steps per second of the slowest replica's round: none is rounded up past the others'
    round end, and one a hair slower than the fastest still runs tau when that is worth the others' wait.

    `error` > 0: each speed is known within ±error of it (a fraction). The τ_r then maximise the expected
    steps per second, Σ τ_r / E[round], with each replica's speed uniform in s_r·(1 ± error), independently
    (`_hedged`): a slow replica's step too many makes every replica wait for it every round, a step too few
    costs only its own share, so a τ_r within the error of the round's end is cut, and the others may take
    the time the round is then expected to last."""
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"co2: speeds={list(speeds)!r}; expected a positive number per replica")
    if not 0 <= error < 1:
        raise ValueError(f"co2: error={error!r}; expected a fraction in [0, 1)")
    shortest = tau / max(speeds)
    lengths = sorted({shortest} | {(_fits(shortest, s) + 1) / s for s in speeds})
    choices = [_steps_in(t, speeds) for t in lengths if _fits(t, max(speeds)) == tau]

    exact = max(choices, key=lambda taus: steps_per_second(taus, speeds))  # the first of equals: the shortest round
    return _hedged(exact, speeds, tau, error) if error > 0 else exact


def steps_per_second(taus: Sequence[int], speeds: Sequence[float]) -> float:
    """The steps a round of `taus` trains per unit of time at `speeds`: it lasts its slowest replica's τ_r / s_r."""
    return sum(taus) / max(t / s for t, s in zip(taus, speeds))


def _hedged(taus: list[int], speeds: Sequence[float], tau: int, error: float) -> list[int]:
    """From `taus`, one step of one replica (not the fastest, which runs tau) at a time, the τ_r of the most
    expected steps per second under the speeds' `error`, each still within the fastest's tau + 1 steps at its
    speed; deterministic, so every rank fixes the same."""
    fastest = list(speeds).index(max(speeds))
    longest = (tau + 1) / max(speeds)

    def rate(candidate: list[int]) -> float:
        return sum(candidate) / _expected_round(candidate, speeds, error)

    current = rate(taus)
    while True:
        moves = [
            taus[:r] + [taus[r] + d] + taus[r + 1 :]
            for r in range(len(taus))
            for d in (-1, 1)
            if r != fastest and 1 <= taus[r] + d and (taus[r] + d) / speeds[r] < longest
        ]
        best_rate, best = max(((rate(m), m) for m in moves), key=lambda rated: rated[0], default=(current, taus))
        if best_rate <= current * (1 + 1e-12):
            return taus
        taus, current = best, best_rate


def _expected_round(taus: Sequence[int], speeds: Sequence[float], error: float, points: int = 256) -> float:
    """E[max_r τ_r / (s_r·(1 + e_r))], each e_r uniform in [-error, error]: the round's expected length,
    ∫ P(round > x) dx, whose distribution is the product of the replicas' (midpoint rule between the
    shortest and longest the round can last)."""
    low = max(t / (s * (1 + error)) for t, s in zip(taus, speeds))
    high = max(t / (s * (1 - error)) for t, s in zip(taus, speeds))
    width = (high - low) / points

    def done_by(x: float) -> float:  # P(round <= x): every replica done by x
        return math.prod(min(1.0, max(0.0, (1 + error - t / (s * x)) / (2 * error))) for t, s in zip(taus, speeds))

    return low + width * sum(1 - done_by(low + (k + 0.5) * width) for k in range(points))


def _fits(seconds: float, speed: float) -> int:
    """The whole steps a replica of `speed` completes in `seconds` (an exact product counts: 1e-9 of slack)."""
    return math.floor(seconds * speed * (1 + 1e-9))


def _steps_in(seconds: float, speeds: Sequence[float]) -> list[int]:
    return [max(1, _fits(seconds, s)) for s in speeds]
