"""The round schedule (`co2_zero.core.round_schedule`), the one owner of the job's run-time decisions, without
processes: at every round its frozen decision (steps, apply point, staleness, every replica's weight) under
`sync_delay: "auto"` as its meter fixes the delay, `replica_tau: "auto"` as its pace is fixed, and an elastic
exchange's round lengths; and what it takes from a checkpoint."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from co2_zero import CO2Config
from co2_zero.core.pace import Pace
from co2_zero.core.plan import resolve
from co2_zero.core.round_schedule import RoundDecision, RoundSchedule

TAU = 8


def _schedule(replicas: int = 1, replica: int = 0, elastic: bool = False, **fields) -> RoundSchedule:
    topology = SimpleNamespace(replicas=replicas, shards=1, outer_group=None)
    plan = resolve(CO2Config(tau=TAU, **fields), topology, elastic=elastic, backend="gloo")
    return RoundSchedule(plan, replica)


def _decided(schedule: RoundSchedule) -> tuple:
    d = schedule.decision
    return d.round_index, d.tau, d.steps, d.applies_at, d.staleness, d.weights


def test_sync_delay_auto_applies_at_the_round_end_until_its_meter_fixes_the_delay():
    """Rounds 0-4 apply at the round end; the pipelines of rounds 1 and 2 are counted (3 and 2 steps); after the
    launch at round end 4 the delay is 5 (ceil(1.5 x 3)), from round 5's decision on, and nothing else moves."""
    schedule = _schedule(sync_delay="auto")
    assert _decided(schedule) == (0, TAU, TAU, TAU, 1.0, (1.0,))
    counted = {1: 3, 2: 2}
    for round_index in range(6):
        if round_index:
            schedule.start_round(round_index)
        decision = schedule.decision
        assert (decision.round_index, decision.steps, decision.tau) == (round_index, TAU, TAU)
        assert decision.applies_at == (5 if round_index == 5 else TAU), round_index
        assert decision.staleness == decision.applies_at / TAU
        schedule.delay_meter.collected([schedule.delay_meter.to_post()])
        assert schedule.after_launch(round_index) is None
        if round_index in counted:
            schedule.delay_meter.saw(counted[round_index], True)
    assert schedule.fixed_sync_delay == 5 and schedule.apply.steps == 5


def test_replica_tau_auto_decides_each_replicas_steps_and_weights_once_fixed():
    """Every replica runs tau (weights 1) until the pace is fixed inside round 1: the round in progress is decided
    anew (replica 1: 2 steps), with every replica's displacement weight R·τ_r/Στ."""
    schedule = _schedule(replicas=2, replica=1, replica_tau="auto")
    assert _decided(schedule) == (0, TAU, TAU, TAU, 1.0, (1.0, 1.0))
    schedule.start_round(1)
    schedule.fix_pace(Pace((TAU, 2), from_round=1), round_index=1)
    assert _decided(schedule) == (1, 2, 2, 2, 1.0, (1.6, 0.4))
    assert schedule.fixed_replica_tau is None  # the meter fixes it; a pace handed in is the engine's
    schedule.start_round(2)
    assert _decided(schedule) == (2, 2, 2, 2, 1.0, (1.6, 0.4))


def test_an_elastic_round_trains_the_steps_the_exchange_chose_and_counts_tau_on_the_clock():
    schedule = _schedule(elastic=True, replica_tau="auto", sync_delay="auto")
    assert schedule.delay_meter is None and schedule.pace_meter is None  # "auto" is the round end / every round
    for round_index, chosen in ((1, 5), (2, 3), (3, TAU)):
        schedule.start_round(round_index, lambda tau, chosen=chosen: chosen)
        assert _decided(schedule) == (round_index, TAU, chosen, TAU, 1.0, (1.0,))


def test_a_checkpoint_s_fixed_decisions_are_taken_and_a_decision_is_frozen():
    schedule = _schedule(sync_delay="auto")
    schedule.load(None, 3, inner_steps=6 * TAU, rounds=6)
    assert _decided(schedule) == (6, TAU, TAU, 3, 3 / TAU, (1.0,))
    schedule.load(None, None, inner_steps=6 * TAU, rounds=6)  # saved while it measured: measure anew
    assert _decided(schedule) == (6, TAU, TAU, TAU, 1.0, (1.0,)) and schedule.fixed_sync_delay is None
    paced = _schedule(replicas=2, replica=1, replica_tau="auto")
    paced.load([{"taus": [TAU, 4], "from_round": 0}], None, inner_steps=8, rounds=2)
    assert _decided(paced) == (2, 4, 4, 4, 1.0, (4 / 3, 2 / 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        paced.decision.steps = 1  # type: ignore[misc]
    assert isinstance(paced.decision, RoundDecision)


def test_a_loaded_state_keeps_the_steps_its_round_was_deciding():
    """An elastic `replica_tau: "auto"` round of fewer steps than tau, saved mid-round: loaded, the round in
    progress still trains those steps (a state without them: tau); a value that does not fit is refused naming it."""
    schedule = _schedule(elastic=True, replica_tau="auto", sync_delay="auto")
    schedule.start_round(3, lambda tau: 5)
    schedule.load(None, None, 3 * TAU + 2, 3, round_steps=schedule.decision.steps)
    assert (schedule.decision.round_index, schedule.decision.steps) == (3, 5)
    schedule.load(None, None, 3 * TAU + 2, 3)
    assert schedule.decision.steps == TAU
    for bad in (0, TAU + 1, 2.0, True, "5"):
        with pytest.raises(
            ValueError, match=rf"co2 checkpoint: round_steps={bad!r}; expected null or an integer in \[1, tau={TAU}\]"
        ):
            schedule.check_round_steps(bad, "checkpoint")
    schedule.check_round_steps(None, "checkpoint")
