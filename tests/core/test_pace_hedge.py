"""`replica_tau: "auto"`'s correction hedged against its own error (docs/design.md §3, "Replicas of different
speeds"): `taus_for_speeds(..., error)` picks the τ_r of the most expected steps per second when each speed is
known within ±error. The expected round length is checked against sampling, and the choice against every τ_r
vector near it, independently of the search that finds it."""

from __future__ import annotations

import itertools

import pytest
import torch

from co2_zero.core.pace import Pace, _expected_round, taus_for_speeds
from co2_zero.core.pace_meter import SPEED_ERROR, PaceMeter

SAMPLES = 400_000


def _errors(replicas: int, error: float, seed: int) -> torch.Tensor:
    """SAMPLES draws of every replica's e_r, uniform in [-error, error]."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(SAMPLES, replicas, generator=generator, dtype=torch.float64) * 2 - 1) * error


def _sampled_round(taus, speeds, errors: torch.Tensor) -> float:
    """The mean over `errors`' draws of max_r τ_r / (s_r (1 + e_r))."""
    steps, rates = torch.tensor(taus, dtype=torch.float64), torch.tensor(speeds, dtype=torch.float64)
    return (steps / (rates * (1 + errors))).max(dim=1).values.mean().item()


@pytest.mark.parametrize("taus, speeds", [([8, 4, 6], [1, 0.55, 0.83]), ([32, 32, 16, 8], [1, 1, 0.5, 0.25]),
                                          ([32, 29, 32, 16], [1, 0.95, 0.97, 0.51])])  # fmt: skip
def test_the_expected_round_is_what_sampling_gives(taus, speeds):
    for error in (0.05, 0.1):
        sampled = _sampled_round(taus, speeds, _errors(len(taus), error, seed=0))
        assert _expected_round(taus, speeds, error) == pytest.approx(sampled, rel=2e-3), (taus, error)


def test_no_error_is_the_exact_choice_and_a_bad_error_is_refused():
    assert taus_for_speeds([1, 0.55, 0.83], 8, 0.0) == taus_for_speeds([1, 0.55, 0.83], 8) == [8, 4, 7]
    with pytest.raises(ValueError, match=r"error=1\.5.*\[0, 1\)"):
        taus_for_speeds([1, 0.5], 8, 1.5)


@pytest.mark.parametrize("tau, speeds, exact, hedged", [
    (32, [1, 0.89, 0.55, 0.27], [32, 29, 18, 8], [32, 28, 17, 8]),  # 29 and 18 end the round 2% late: cut
    (8, [1, 0.5, 0.35], [8, 4, 2], [8, 4, 3]),  # the round is expected to last past 8 steps: 3 fit
])  # fmt: skip
def test_the_hedged_choice_has_the_most_expected_steps_per_second_near_the_exact_one(tau, speeds, exact, hedged):
    """Sampled, not searched: against every τ_r vector within 2 steps of the exact choice whose round the
    fastest does not outlast by a step; the exact choice expects fewer steps per second than the best."""
    assert taus_for_speeds(speeds, tau) == exact and taus_for_speeds(speeds, tau, SPEED_ERROR) == hedged
    errors = _errors(len(speeds), SPEED_ERROR, seed=1)

    def rate(taus) -> float:
        return sum(taus) / _sampled_round(taus, speeds, errors)

    near = [range(max(1, t - 2), t + 3) for t in exact[1:]]
    vectors = [[tau, *rest] for rest in itertools.product(*near)
               if all(t / s < (tau + 1) / speeds[0] for t, s in zip(rest, speeds[1:]))]  # fmt: skip
    best = max(rate(v) for v in vectors)
    assert rate(hedged) >= best * (1 - 1e-4) and rate(exact) < best * (1 - 1e-3)


def test_the_first_decision_is_exact_and_the_correction_hedged():
    """Speeds 1, 0.5 and 0.35 at τ = 8 (1, 2 and 2.857 ms a step): the first τ_r, which hold for a round or
    two while the next is timed, are the exact choice; the correction, which holds for the rest of the run,
    gives the slowest replica the step that ends before the round is expected to."""
    rows = [[0, 0, 0, 1_000_000], [0, 0, 0, 2_000_000], [0, 0, 0, 2_857_143]]
    meter = PaceMeter(8, shards=1, replica=0)
    first = meter.decide(rows)
    assert first == Pace((8, 4, 2), from_round=1)  # decided at step 5, past replica 2's 2
    corrected = meter.decide(rows)
    assert corrected == Pace((8, 4, 3), from_round=meter.fixed.from_round, before=first) and meter.settled
