"""`replica_tau: "auto"` deciding inside round 0 (docs/design.md §3, "Replicas of different speeds"): at
tau = 12 the τ_r are fixed after MEASURED_STEPS timed steps, at inner step 5, not at the round's end, so the
slow replica's round 0 already ends at its own τ_r, and a replica that has passed its τ_r by then waits for
round 1 instead. Round 1, the first whole round at the τ_r, is timed again and corrects them from round 2:
here a replica that slows from 2 to 3 ms a step after round 0 (as the exchange's background work slows a
slow replica once it is in flight) goes from 6 to 4 steps.

Real gloo processes (R = 2, plain CO2Optimizer, the defaults otherwise) against the independent reference
(`reference.simulate_paced`, `uniform_rounds` the rounds before the pace) at every inner step of every
replica. Each replica's speed is a clock of its own (`pace_meter.clock`, read by the real meter; the times
travel through the real announcement). Checkpoints saved at every step of round 0, before and after the
first decision, and in rounds 1 and 2, before and after the correction, resume as the reference says.
"""

from __future__ import annotations

import os

import pytest

from co2_zero import CO2Optimizer, checkpoint
from co2_zero.core import pace_meter
from co2_zero.core.pace import Pace
from co2_zero.core.pace_meter import MEASURED_STEPS
from tests import models
from tests.core.test_pace import _assert_close, _finalize, _params, round_taus
from tests.dist_utils import run_ranks
from tests.reference import simulate_paced

TAU = 12
AUTO = {"tau": TAU, "replica_tau": "auto"}  # the defaults otherwise
ROUNDS, EXTRA = 4, [3, 1]  # rounds, then a partial round of each replica (dropped by finalize())
HALF, THIRD = [1, 2], [1, 3]  # ms per inner step of replicas 0 and 1
SLOWING = [[1, 1], [2, 3]]  # replica r's ms per inner step in round 0, then from round 1 on
# replicas 0 and 1's inner steps at a save, at the same share of a round: in round 0 before the first decision
# at step 5, then after it (replica 1 at its step 5 when replica 0 is at 10, then both at their round end);
# in round 1 (at [12, 6]) before the correction, at its end (just after it), and in round 2 (at [12, 4])
SAVED_AT = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (10, 5), (12, 6), (18, 9), (24, 12), (30, 14)]
_ms = [0.0]  # what this process's clock advances per read


def _clock(ms_per_step: float) -> None:
    """This process's meter reads a clock that advances `ms_per_step` per read: every step it times lasts
    exactly that long (`_step` may change it round by round)."""
    _ms[0], now = ms_per_step, [0.0]

    def read() -> float:
        now[0] += _ms[0] * 1e-3
        return now[0]

    pace_meter.clock = read


def _build() -> tuple:
    model = models.make_model("mlp")
    return model, CO2Optimizer(models.make_optimizer("sgd", model.parameters()), AUTO, model=model)


def _step(replica: int, model, opt, record: list, slowing: bool = False) -> None:
    """One inner step; `slowing`: at replica's SLOWING speed of the round it is in."""
    if slowing:
        _ms[0] = SLOWING[replica][min(opt.engine.rounds, 1)]
    x, y = models.batch(replica, opt.engine.inner_steps)
    opt.zero_grad()
    models.loss_fn(model(x), y).backward()
    opt.step()
    record.append(_params(model))


def _finish(replica: int, model, opt, record: list, slowing: bool = False) -> dict:
    """Rounds up to ROUNDS, the partial round, finalize()."""
    while opt.engine.rounds < ROUNDS:
        _step(replica, model, opt, record, slowing)
    extra = EXTRA[replica] % opt.steps_per_round
    for _ in range(extra):
        _step(replica, model, opt, record, slowing)
    fixed = opt.engine.schedule.fixed_replica_tau
    _finalize(opt, extra)
    return {"steps": record, "final": _params(model), "fixed": fixed}


def _straight(replica: int, slowing: bool = False) -> dict:
    """A run to the end, with replica's steps in round 0, and whether a step announcement was left in flight
    after each of the first 3 round ends (collected at once: the round end before the timed round)."""
    model, opt = _build()
    record: list = []
    round_zero, in_flight = None, []
    while opt.engine.rounds < 3:
        _step(replica, model, opt, record, slowing)
        if opt.round_ended:
            round_zero = round_zero or opt.engine.inner_steps
            in_flight.append(opt.engine.announcements.in_flight)
    out = _finish(replica, model, opt, record, slowing)
    return {"round_zero": round_zero, "in_flight": in_flight, **out}


def _saved_and_resumed(replica: int, directory: str, steps: int) -> dict:
    """Train `steps` inner steps, save, load into a fresh run, finish; every replica at its SLOWING speed."""
    model, opt = _build()
    for _ in range(steps):
        _step(replica, model, opt, [], slowing=True)
    checkpoint.save(directory, model, opt)
    saved = opt.engine.schedule.fixed_replica_tau
    opt.engine.close()
    model, opt = _build()
    checkpoint.load(directory, model, opt)
    return {"saved": saved, "at": opt.engine.inner_steps, **_finish(replica, model, opt, [], slowing=True)}


def _children(rank: int, world: int, directory: str) -> dict:
    _clock(THIRD[rank])
    out = {"third": _straight(rank)}
    _clock(HALF[rank])
    out["half"] = _straight(rank)
    _clock(SLOWING[rank][0])
    out["slowing"] = _straight(rank, slowing=True)
    out["resumed"] = [_saved_and_resumed(rank, os.path.join(directory, str(k)), at[rank])
                      for k, at in enumerate(SAVED_AT)]  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_children, 2, str(tmp_path_factory.mktemp("pace_within")), timeout=300)


def _paces(*paces: tuple[int, list[int]]) -> list[dict]:
    """A checkpoint's `fixed_replica_tau` of (from_round, taus) in order."""
    return [{"taus": taus, "from_round": first} for first, taus in paces]


def _reference(fixed: list[dict]) -> tuple[list, list]:
    """Per replica, its parameters after each of its inner steps under the paces `fixed`; and after
    finalize()."""
    per_step: list = []
    taus = fixed[-1]["taus"]
    extra = [e % tau for e, tau in zip(EXTRA, taus)]
    math = {k: v for k, v in AUTO.items() if k != "replica_tau"}
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, math, taus, ROUNDS, extra, step_record=per_step,
                            round_taus=round_taus(fixed, ROUNDS, TAU))  # fmt: skip
    return per_step, finals


def _assert_from(run: dict, per_step: list, finals: list, replica: int, first: int, what: str) -> None:
    """`run`'s steps from its step `first` + 1 on and its final parameters match the reference's."""
    assert len(run["steps"]) == len(per_step[replica]) - first, what
    for k, (actual, expected) in enumerate(zip(run["steps"], per_step[replica][first:])):
        _assert_close(actual, expected, f"{what} after its step {first + k + 1}")
    _assert_close(run["final"], finals[replica], f"{what} final")


def test_a_half_speed_replica_ends_round_zero_at_its_own_steps(results):
    """Decided at step 5, 1 + MEASURED_STEPS: [12, 6], both short of their τ_r there, so the pace runs from
    round 0 and replica 1's round 0 ends at its step 6; round 1 confirms them from round 2; every step
    matches the reference."""
    assert MEASURED_STEPS == 4
    fixed = _paces((0, [12, 6]), (2, [12, 6]))
    per_step, finals = _reference(fixed)
    for replica, got in enumerate(results):
        run = got["half"]
        assert run["fixed"] == fixed
        assert run["round_zero"] == [12, 6][replica]
        _assert_from(run, per_step, finals, replica, 0, f"half speed, replica {replica}")


def test_a_replica_past_its_steps_at_the_decision_waits_for_round_one(results):
    """A third of the speed: [12, 4], but replica 1 is at its step 5 when they are fixed; round 0 runs at tau
    on both and the pace starts with round 1, which also confirms it from round 2."""
    fixed = _paces((1, [12, 4]), (2, [12, 4]))
    per_step, finals = _reference(fixed)
    for replica, got in enumerate(results):
        run = got["third"]
        assert run["fixed"] == fixed
        assert run["round_zero"] == TAU
        _assert_from(run, per_step, finals, replica, 0, f"third speed, replica {replica}")


def test_a_replica_that_slows_after_round_zero_is_corrected_from_round_two(results):
    """Replica 1 at 2 ms a step in round 0, 3 ms after: [12, 6] from round 0 (step 5), then round 1's times
    correct them to [12, 4] from round 2; every step matches the reference with those rounds. Round 0's end
    collects its announcement at once (the replicas start the timed round together), as round 1's end does
    to decide; round 2's is left in flight, as any round end's."""
    fixed = _paces((0, [12, 6]), (2, [12, 4]))
    per_step, finals = _reference(fixed)
    for replica, got in enumerate(results):
        assert got["slowing"]["fixed"] == fixed, replica
        assert got["slowing"]["in_flight"] == [False, False, True], replica  # round 1 timed, starting together
        _assert_from(got["slowing"], per_step, finals, replica, 0, f"slowing, replica {replica}")


def test_a_checkpoint_of_the_first_rounds_resumes_as_the_reference_says(results):
    """Saved at every step of round 0 before the first decision (steps 0-4): the resumed run measures anew
    from its second step and decides MEASURED_STEPS timed steps later, at step 6 or later, where replica 1
    (6 steps) is no longer short of its τ_r: from round 1 (saved at step 0: at step 5, from round 0); round 1
    still corrects them from round 2. Saved after it, before the correction (replica 1 at its step 5, at its
    round-0 end, mid-round 1): the first pace comes back, and the resumed run times the first whole round after
    its first step: round 1 from step 5, else round 2, correcting from round 3. Saved at round 1's end and in
    round 2, after the correction: both paces come back and every later step is the straight run's."""
    first, corrected = (0, [12, 6]), (2, [12, 4])
    saved = [None] * 5 + [_paces(first)] * 3 + [_paces(first, corrected)] * 2
    fixed = [_paces((0, [12, 6]), corrected)] + [_paces((1, [12, 6]), corrected)] * 4
    fixed += [_paces(first, corrected)] + [_paces(first, (3, [12, 4]))] * 2 + [_paces(first, corrected)] * 2
    for k, at_step in enumerate(SAVED_AT):
        per_step, finals = _reference(fixed[k])
        for replica, got in enumerate(results):
            run, at = got["resumed"][k], at_step[replica]
            what = f"saved at step {at}, replica {replica}"
            assert run["saved"] == saved[k], what
            assert run["at"] == at and run["fixed"] == fixed[k], what
            _assert_from(run, per_step, finals, replica, at, what)


def test_a_pace_fixed_within_round_zero_reads_its_steps():
    """Pace((12, 6), from_round=0): replica 1's rounds end at its steps 6, 12, ...; on the fastest's clock
    its step 3 is 6. Corrected to (12, 4) from round 2: its rounds end at 6, 12, 16, 20, and its step 14 is
    the fastest's 30."""
    pace = Pace((12, 6), from_round=0)
    assert [pace.rounds_at(1, s) for s in (5, 6, 11, 12)] == [0, 1, 1, 2]
    assert pace.clock_step(1, 3) == 6.0 and pace.agreed_step(1, 6) == 12
    corrected = Pace((12, 4), from_round=2, before=pace)
    assert [corrected.steps_at_round(1, t) for t in range(5)] == [0, 6, 12, 16, 20]
    assert [corrected.rounds_at(1, s) for s in (11, 12, 15, 16, 17)] == [1, 2, 2, 3, 3]
    assert corrected.clock_step(1, 14) == 30.0 and corrected.agreed_step(1, 13) == 27
    assert [corrected.tau(1, t) for t in range(4)] == [6, 6, 4, 4] and not corrected.uniform
    assert [corrected.displacement_scale(1, t) for t in (1, 2)] == [2 * 6 / 18, 2 * 4 / 16]


# ---- S x R = 2 x 2 ----------------------------------------------------------------------------------------

SHARDS = 2


def _sharded_child(rank: int, world: int, integration: str) -> dict:
    from tests.core.test_pace import SHARDED

    replica, shard_index = divmod(rank, SHARDS)
    _clock(HALF[replica] * (1 + shard_index))  # a replica's time is its slowest shard's: 2 and 4 ms a step
    opt, net, whole = SHARDED[integration]({**AUTO, "shards_per_replica": SHARDS})
    record: list = []
    while opt.engine.rounds < ROUNDS:
        x, y = models.shard_batch(replica, shard_index, opt.engine.inner_steps, SHARDS)
        opt.zero_grad()
        models.loss_fn(net(x), y).backward()
        opt.step()
        record.append(whole())
    fixed = opt.engine.schedule.fixed_replica_tau
    _finalize(opt, 0)
    return {"steps": record, "final": whole(), "fixed": fixed}


def test_two_by_two_fsdp2_decides_within_round_zero():
    """FSDP2, S x R = 2 x 2: each replica's time is its slowest shard's (2 and 4 ms); [12, 6] from round 0,
    confirmed from round 2, every shard at every step as the reference."""
    results = run_ranks(_sharded_child, 4, "fsdp2", timeout=300)
    per_step: list = []
    math = {k: v for k, v in AUTO.items() if k != "replica_tau"}
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, math, [12, 6], ROUNDS, [0, 0], shards=SHARDS,
                            shard_batch=lambda r, s, k: models.shard_batch(r, s, k, SHARDS),
                            step_record=per_step)  # fmt: skip
    for rank, got in enumerate(results):
        assert got["fixed"] == _paces((0, [12, 6]), (2, [12, 6])), rank
        _assert_from(got, per_step, finals, rank // SHARDS, 0, f"fsdp2 rank {rank}")
