"""Replicas of different speeds (docs/design.md §3, "Replicas of different speeds").

With `replica_tau`, replica r ends its rounds every τ_r inner steps instead of every τ, so that replicas of
different speeds reach each round end at about the same wall-clock time and none waits for the slowest.
The exchange then weighs replica r's displacement by its share of the tokens trained, w_r = τ_r / Στ
(every inner step being one batch of the same size). `Pace` is that bookkeeping and nothing else: which τ
a replica runs, the factor its displacement is scaled by before the exchange's plain mean, and how a step
count reads as rounds (what it combines with is the support table's, `co2_zero.core.support`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .config import CO2Config


@dataclass(frozen=True)
class Pace:
    """Every replica's inner steps per round, `taus[r]` (all `tau` without `replica_tau`)."""

    taus: tuple[int, ...]

    @classmethod
    def of(cls, config: CO2Config, replicas: int) -> Pace:
        """The pace `config` sets for `replicas` replicas; ValueError naming `replica_tau` when its length
        is not R. `"auto"` (elastic) starts every replica at `tau`; its exchange sets each round's steps
        (`co2_zero.elastic.speeds`)."""
        if config.replica_tau in (None, "auto"):
            return cls((config.tau,) * replicas)
        if len(config.replica_tau) != replicas:
            raise ValueError(
                f"co2 config: replica_tau={list(config.replica_tau)!r} is invalid for this job of R={replicas} "
                f"replicas; accepted: a list of {replicas} integers in [1, tau={config.tau}], one per replica"
            )
        return cls(tuple(config.replica_tau))

    @property
    def uniform(self) -> bool:
        """Every replica runs the same τ: the exchange is the plain mean, the agreement compares steps."""
        return len(set(self.taus)) == 1

    def tau(self, replica: int) -> int:
        """Inner steps per round of `replica`."""
        return self.taus[replica]

    def weight(self, replica: int) -> float:
        """w_r = τ_r / Στ, `replica`'s share of the tokens of a round."""
        return self.taus[replica] / sum(self.taus)

    def displacement_scale(self, replica: int) -> float:
        """R·w_r: the factor that turns the exchange's plain mean over R into the weighted average
        Σ w_r D_r (1.0, and no multiplication at all, when uniform)."""
        return 1.0 if self.uniform else len(self.taus) * self.weight(replica)

    def taus_by_rank(self, shards: int) -> Optional[list[int]]:
        """τ of every global rank (replica r is ranks [r·S, (r+1)·S)), for the step agreement; None when
        uniform (every rank then has to be at the same inner step)."""
        return None if self.uniform else [tau for tau in self.taus for _ in range(shards)]

    def agreed_step(self, replica: int, inner_steps: int) -> int:
        """The step every rank names a save by (and must agree on): its inner steps, on the fastest replica's
        clock with replica_tau (rounded down); at a round end, rounds x tau on every replica."""
        return inner_steps * max(self.taus) // self.taus[replica]

    def clock_step(self, replica: int, inner_steps: int) -> float:
        """`inner_steps` of `replica` on the clock of the fastest replica: inner_steps · τ / τ_r, so that a
        learning-rate schedule written in the fastest replica's steps reads the same value on every
        replica at every round end."""
        return inner_steps * max(self.taus) / self.taus[replica]


def taus_for_speeds(speeds: Sequence[float], tau: int) -> list[int]:
    """`replica_tau` for replicas of these relative speeds (steps per second, or 1 / step time): the fastest
    runs `tau`, each other round(tau x its speed / the fastest's), at least 1."""
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"co2: speeds={list(speeds)!r}; expected a positive number per replica")
    return [max(1, round(tau * s / max(speeds))) for s in speeds]


def rounds_of(steps: Sequence[int], taus: Sequence[int]) -> list[int]:
    """Round ends passed by each rank at its `steps`, with its τ."""
    return [s // tau for s, tau in zip(steps, taus)]
