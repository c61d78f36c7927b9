"""`replica_tau: "auto"` (docs/design.md §3, "Replicas of different speeds"): at tau = 4 round 0 runs every
replica at tau while each rank times its inner steps; its round end's step announcement carries the times,
and from round 1 every replica runs the τ_r fixed from them. Each rank then times round 1, the first whole
round at that pace, and its round end fixes them again, from round 2 on (the same τ_r here: every replica's
clock runs at one speed; tests/core/test_pace_auto_within_round.py has one that slows).

Real gloo processes against the independent reference (`reference.simulate_paced` with `uniform_rounds`)
at every inner step of every replica, with the defaults otherwise: R = 2 (plain CO2Optimizer) and
S x R = 2 x 2 (FSDP2; FairScale OSS among the slow tests, and DeepSpeed ZeRO-1 in
tests/integrations/test_deepspeed_pace.py). Replica 1 is made slower deterministically by a
clock of its own (`pace_meter.clock`, read by the real meter; the times still travel through the real
announcement), and once with a real sleep. Checkpoints saved before and after the τ_r are fixed resume as
the reference says: before, the run measures anew; after, bit for bit.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer, checkpoint
from co2_zero.core import pace_meter
from co2_zero.core.pace import Pace
from co2_zero.core.pace_meter import MEASURED_STEPS, PaceMeter
from tests import models
from tests.core.test_pace import _assert_close, _finalize, _params, round_taus
from tests.dist_utils import run_ranks
from tests.reference import simulate_paced

TAU = 4
AUTO = {"tau": TAU, "replica_tau": "auto"}  # the defaults otherwise
MEASURED_ROUNDS = 1  # at tau = 4 round 0 ends before MEASURED_STEPS timed steps: decided at its end, from round 1
SLOWER = [1, 2]  # replica r's clock runs SLOWER[r] ms per inner step: replica 1 at half speed
FIXED = [4, 2]  # what that fixes
CORRECTED = MEASURED_ROUNDS + 1  # the round the τ_r timed in round 1 run from


def _paces(*paces: tuple[int, list[int]]) -> list[dict]:
    """A checkpoint's `fixed_replica_tau` of (from_round, taus) in order."""
    return [{"taus": taus, "from_round": first} for first, taus in paces]


SETTLED = _paces((MEASURED_ROUNDS, FIXED), (CORRECTED, FIXED))
ROUNDS, EXTRA = 5, [3, 1]  # rounds, then a partial round of each replica (dropped by finalize())
REAL_ROUNDS = 3


def _slow_clock(replica: int) -> None:
    """This process's meter reads a clock that advances SLOWER[replica] ms per read: every step it times
    lasts exactly that long."""
    ticks = itertools.count()
    pace_meter.clock = lambda: next(ticks) * SLOWER[replica] * 1e-3


def _round(replica: int, model, opt, record: list, clock: list) -> None:
    """Inner steps on the replica's own batches (from its own inner step on) until a round end."""
    while True:
        _step(replica, model, opt, record)
        if opt.round_ended:
            clock.append(opt.clock_step)
            return


def _step(replica: int, model, opt, record: list, sleep_s: float = 0.0) -> None:
    x, y = models.batch(replica, opt.engine.inner_steps)
    opt.zero_grad()
    models.loss_fn(model(x), y).backward()
    time.sleep(sleep_s)
    opt.step()
    record.append(_params(model))


def _build(config: dict = AUTO) -> tuple[torch.nn.Module, CO2Optimizer]:
    model = models.make_model("mlp")
    return model, CO2Optimizer(models.make_optimizer("sgd", model.parameters()), config, model=model)


def _finish(replica: int, model, opt, record: list, clock: list, rounds: int = ROUNDS) -> dict:
    """Rounds up to `rounds`, the partial round, finalize()."""
    while opt.engine.rounds < rounds:
        _round(replica, model, opt, record, clock)
    extra = EXTRA[replica] % opt.steps_per_round
    for _ in range(extra):
        _step(replica, model, opt, record)
    fixed = opt.engine.schedule.fixed_replica_tau
    _finalize(opt, extra)
    return {"steps": record, "final": _params(model), "clock": clock, "fixed": fixed}


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _straight(replica: int, config: dict = AUTO) -> dict:
    logged, logger = _Logged(), logging.getLogger("co2_zero.core.engine")
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)
    model, opt = _build(config)
    record: list = []
    clock: list = []
    plan = repr(opt.plan)
    out = _finish(replica, model, opt, record, clock)
    logger.removeHandler(logged)
    return {**out, "plan": plan, "steps_per_round": opt.steps_per_round, "logged": logged.messages}


def _saved_and_resumed(replica: int, directory: str, rounds: int, extra: list[int]) -> dict:
    """Train `rounds` rounds and `extra[replica]` steps, save, load into a fresh (scrambled) run, finish."""
    model, opt = _build()
    for _ in range(rounds):
        _round(replica, model, opt, [], [])
    for _ in range(extra[replica]):
        _step(replica, model, opt, [])
    checkpoint.save(directory, model, opt)
    saved = {"at": opt.engine.inner_steps, "fixed": opt.engine.schedule.fixed_replica_tau}
    opt.engine.close()
    model, opt = _build()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    checkpoint.load(directory, model, opt)
    loaded = {"at": opt.engine.inner_steps, "pace": opt.engine.pace}
    return {"saved": saved, "loaded": loaded, **_finish(replica, model, opt, [], [])}


def _real_sleep(replica: int) -> dict:
    """Replica 1 sleeps 100 ms in each inner step: the real clock measures it slower."""
    model, opt = _build()
    record: list = []
    while opt.engine.rounds < MEASURED_ROUNDS:
        _step(replica, model, opt, record, sleep_s=0.1 * replica)
    return {"taus": list(opt.engine.pace.taus), **_finish(replica, model, opt, record, [], rounds=REAL_ROUNDS)}


# a saved fixed_replica_tau altered: each is refused naming the field (the run saved [4, 2] from 1, then 2)
BAD_PACES = {
    "not a list": {"taus": FIXED, "from_round": 1},
    "three paces": SETTLED + SETTLED[-1:],
    "rounds not increasing": _paces((2, FIXED), (1, FIXED)),
    "a round after the next": _paces((1, FIXED), (ROUNDS + 2, FIXED)),
    "no replica at tau": _paces((1, [3, 2])),
    "a replica short": _paces((1, [4])),
}


def _refused(replica: int) -> dict:
    """A state dict saved after both decisions (round 2, mid-round), loaded with each of BAD_PACES: the error;
    then unaltered: the paces it loads."""
    model, opt = _build()
    while opt.engine.rounds < ROUNDS - 1:
        _step(replica, model, opt, [])
    state = opt.state_dict()
    out = {}
    for name, paces in BAD_PACES.items():
        try:
            opt.load_state_dict({**state, "co2": {**state["co2"], "fixed_replica_tau": paces}})
            out[name] = "loaded"
        except ValueError as error:
            out[name] = str(error)
    opt.load_state_dict(state)
    out["unaltered"] = opt.engine.schedule.fixed_replica_tau
    opt.finalize()
    return out


def _children(rank: int, world: int, directory: str) -> dict:
    out = {"real": _real_sleep(rank)}
    _slow_clock(rank)
    out["straight"] = _straight(rank)
    out["int8"] = _straight(rank, {**AUTO, "comm_dtype": "int8"})
    out["topk"] = _straight(rank, {**AUTO, "topk": 0.25, "comm_dtype": "int4"})
    out["before"] = [_saved_and_resumed(rank, os.path.join(directory, f"before{k}"), 0, [k, k]) for k in range(TAU)]
    out["refused"] = _refused(rank)
    out["after"] = [_saved_and_resumed(rank, os.path.join(directory, f"after{k}"), k, [2, 1]) for k in (1, 2)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_children, 2, str(tmp_path_factory.mktemp("pace_auto")), timeout=300)


def _reference(
    taus: list[int],
    uniform_rounds: int,
    rounds: int = ROUNDS,
    shards: int = 1,
    config: dict = AUTO,
    exchange=None,
    each_round: list[list[int]] | None = None,
) -> tuple[list, list]:
    """Per replica, its parameters after each of its inner steps; and after finalize(). `each_round`: every
    round's steps instead of `uniform_rounds` at tau, then `taus`."""
    per_step: list = []
    extra = [e % tau for e, tau in zip(EXTRA, taus)]
    math = {k: v for k, v in config.items() if k != "replica_tau"}
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, math, taus, rounds, extra, shards=shards,
                            shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards), step_record=per_step,
                            exchange=exchange, uniform_rounds=uniform_rounds, round_taus=each_round)  # fmt: skip
    return per_step, finals


def _assert_every_step(runs: list[dict], per_step: list, finals: list, what: str) -> None:
    for replica, run in enumerate(runs):
        assert len(run["steps"]) == len(per_step[replica]), what
        for k, (actual, expected) in enumerate(zip(run["steps"], per_step[replica])):
            _assert_close(actual, expected, f"{what} replica {replica} after its step {k + 1}")
        _assert_close(run["final"], finals[replica], f"{what} replica {replica} final")


# ---- the bookkeeping, in one process ---------------------------------------------------------------------


def test_a_pace_fixed_from_a_round_reads_steps_as_rounds():
    """Two rounds at tau 4, then 4 and 2: replica 1 ends rounds at its steps 4, 8, 10, 12."""
    pace = Pace((4, 2), from_round=2)
    assert [pace.rounds_at(1, s) for s in (3, 4, 8, 9, 10, 12)] == [0, 1, 2, 2, 3, 4]
    assert [pace.step_in_round(1, s) for s in (3, 4, 8, 9, 10)] == [3, 0, 0, 1, 0]
    assert [pace.tau(1, t) for t in (0, 1, 2, 3)] == [4, 4, 2, 2] and pace.tau(1) == 2
    assert [pace.agreed_step(1, s) for s in (6, 8, 9, 10)] == [6, 8, 10, 12]
    assert pace.clock_step(1, 12) == pace.clock_step(0, 16) == 16.0


def test_the_meter_fixes_the_same_taus_from_the_same_rows():
    """The slowest shard of each replica counts; the fastest replica runs tau. Measured from step 24 (a round
    start at tau 8) it decides at step 29, MEASURED_STEPS timed steps later: from the round in progress when
    every replica is short of its τ_r there, else from the next; a step announcement without a time is
    refused."""
    assert MEASURED_STEPS == 4
    meter = PaceMeter(8, shards=2, replica=1, first_step=24)
    assert [s for s in range(48) if meter.decides_at(s)] == [29]
    rows = [[0, 0, 0, ns] for ns in (1000, 1100, 4000, 2000)]  # replicas at 1100 and 4000 ns: [8, 2]
    assert meter.decide(rows) == Pace((8, 2), from_round=4)  # replica 1 passed its 2 steps: the next round
    meter = PaceMeter(8, shards=2, replica=1, first_step=24)
    rows = [[0, 0, 0, ns] for ns in (1000, 1000, 1200, 1300)]  # [8, 6]: both short of their τ_r at step 5
    assert meter.decide(rows) == Pace((8, 6), from_round=3)
    assert meter.step_ns == [[1000, 1000, 1200, 1300]]  # what it decided from, per rank
    with pytest.raises(ValueError, match="posted no step time"):
        PaceMeter(8, shards=1, replica=0).decide([[0, 0, 0, 5], [0, 0, 0, 0]])


def test_the_meter_decides_at_the_end_of_a_short_round():
    """A round that ends before MEASURED_STEPS timed steps: the meter decides at its end, and the pace starts
    with the next round; resumed one step before a round end (no step left to time), at the end of the next
    round."""
    assert [s for s in range(20) if PaceMeter(4, shards=1, replica=0).decides_at(s)] == [4]
    assert [s for s in range(20) if PaceMeter(4, shards=1, replica=0, first_step=2).decides_at(s)] == [4]
    assert [s for s in range(20) if PaceMeter(4, shards=1, replica=0, first_step=3).decides_at(s)] == [8]
    meter = PaceMeter(4, shards=1, replica=0, first_step=3)
    assert meter.decide([[0, 0, 0, 1000], [0, 0, 0, 2000]]) == Pace((4, 2), from_round=2)


def _timed(meter: PaceMeter, step_round: list[int], monkeypatch) -> None:
    """Feed `meter` steps whose round indexes are `step_round`, each 1 s on a clock of its own."""
    ticks = itertools.count()
    monkeypatch.setattr(pace_meter, "clock", lambda: float(next(ticks)))
    for round_index in step_round:
        meter.step_began(round_index)
        meter.step_ended()


def test_the_meter_corrects_the_taus_from_the_first_whole_round_at_their_pace(monkeypatch):
    """Once fixed (from round 4, decided inside round 3), each replica times only the first whole round at its
    new τ_r, round 4, which the replicas start together (round 3's end collects its announcement at once),
    and posts its mean at that round's own end (replica 1 of [8, 2]: its step 34); the
    correction runs from the next round, after the first pace, and then nothing more is timed or decided. A
    resumed run times the first whole round after the step it loaded."""
    first = Pace((8, 2), from_round=4)
    meter = PaceMeter(8, shards=1, replica=1)
    meter.fix(first, 29)  # decided at step 29, inside round 3
    assert (meter.timed_round, meter.settled) == (4, False)
    assert [s for s in range(60) if meter.decides_at(s)] == [first.steps_at_round(1, 5)] == [34]
    assert [s for s in range(60) if meter.aligns_at(s)] == [32]  # the end of round 3: round 4 starts together
    _timed(meter, [3, 3, 4, 4, 5], monkeypatch)  # only round 4's two steps count
    assert meter.to_post(34) == 1_000_000_000 and meter.to_post(33) == 0
    corrected = meter.decide([[0, 0, 0, 1000], [0, 0, 0, 2500]])
    assert corrected == Pace((8, 3), from_round=5, before=first) and meter.settled
    assert corrected.segments == [(4, (8, 2)), (5, (8, 3))]
    assert not any(meter.decides_at(s) or meter.aligns_at(s) for s in range(80))
    resumed = PaceMeter(8, shards=1, replica=1)
    resumed.fix(first, 32, resumed=True)  # at replica 1's end of round 3: its first step is not timed
    assert resumed.timed_round == 5 and (resumed.aligning_step, resumed.deciding_step) == (34, 36)
    resumed.fix(corrected, 36, resumed=True)
    assert resumed.settled and resumed.timed_round is None


def test_auto_is_accepted_and_names_the_field_when_misspelt():
    assert CO2Config(tau=TAU, replica_tau="auto").replica_tau == "auto"
    with pytest.raises(ValueError, match=r"replica_tau='measured' is invalid; accepted: null, 'auto'"):
        CO2Config(tau=TAU, replica_tau="measured")
    assert CO2Config(tau=TAU, replica_tau="auto").math_hash() != CO2Config(tau=TAU, replica_tau=[4, 4]).math_hash()


# ---- real processes -------------------------------------------------------------------------------------


def test_every_inner_step_matches_the_reference(results):
    """The first MEASURED_ROUNDS rounds at tau, then the measured [4, 2] (confirmed by round 1's times), at
    every inner step; the plan says it measures; the log names the times, the τ_r and the round they start
    from."""
    per_step, finals = _reference(FIXED, MEASURED_ROUNDS)
    runs = [got["straight"] for got in results]
    _assert_every_step(runs, per_step, finals, "auto")
    for replica, run in enumerate(runs):
        assert run["steps_per_round"] == FIXED[replica]
        assert run["fixed"] == SETTLED
        assert "replica_tau='measured'" in run["plan"]
        assert run["logged"] == [
            f"co2: replica_tau 'auto': one inner step took 1, 2 ms (per rank): replica_tau fixed at [4, 2] from "
            f"round {MEASURED_ROUNDS} on",
            f"co2: replica_tau 'auto': one inner step took 1, 2 ms (per rank): replica_tau corrected to [4, 2] from "
            f"round {CORRECTED} on",
        ]
    assert runs[0]["clock"] == runs[1]["clock"] == [float(TAU * (t + 1)) for t in range(ROUNDS)]


@pytest.mark.parametrize(("name", "fields"), [("int8", {"comm_dtype": "int8"}),
                                              ("topk", {"topk": 0.25, "comm_dtype": "int4"})])  # fmt: skip
def test_the_compressed_exchanges_match_the_reference(results, name, fields):
    """Each replica compresses its displacement scaled by R·w_r (1 while measured) plus its residual: the
    residual carries over from the uniform rounds into the paced ones."""
    from tests.reference_compress import CompressedExchange, feedback_decay

    strategy = "all_gather" if "topk" in fields else "all_reduce"  # what collective: auto resolves to on gloo
    exchange = CompressedExchange(
        fields["comm_dtype"], strategy, 2, topk=fields.get("topk", 1.0), decay=feedback_decay(fields)
    )
    per_step, finals = _reference(FIXED, MEASURED_ROUNDS, config={**AUTO, **fields}, exchange=exchange)
    _assert_every_step([got[name] for got in results], per_step, finals, name)
    assert all(got[name]["fixed"] == SETTLED for got in results)


def test_a_real_slow_replica_gets_fewer_steps(results):
    """Replica 1's 100 ms sleep per step in round 0, measured by the real clock: it runs fewer steps per round
    than replica 0, which runs tau; round 1, without the sleep, corrects them (to whatever the real clock
    says); every step then matches the reference with the τ_r fixed."""
    taus, fixed = results[0]["real"]["taus"], results[0]["real"]["fixed"]
    assert results[1]["real"]["taus"] == taus and taus[0] == TAU and taus[1] < TAU, taus
    assert results[1]["real"]["fixed"] == fixed and fixed[0] == {"taus": taus, "from_round": MEASURED_ROUNDS}
    each_round = round_taus(fixed, REAL_ROUNDS, TAU)
    per_step, finals = _reference(fixed[-1]["taus"], 0, rounds=REAL_ROUNDS, each_round=each_round)
    _assert_every_step([got["real"] for got in results], per_step, finals, "real sleep")


def test_a_checkpoint_saved_before_the_taus_are_fixed_measures_anew(results):
    """Saved at every step of round 0, before its end fixed the τ_r: the resumed run times the steps it has
    left of that round but its first, and decides at its end; saved one step before the end, none would be
    left to time, so it measures round 1 too and paces from round 2. Each corrects from the round after."""
    for into, from_round in enumerate([1, 1, 1, 2]):
        per_step, finals = _reference(FIXED, from_round)
        for replica, got in enumerate(results):
            run, where = got["before"][into], f"resumed before, saved {into} steps into the round: replica {replica}"
            assert run["saved"] == {"at": into, "fixed": None}, where
            assert run["loaded"]["pace"] == Pace((TAU, TAU)), where
            assert run["fixed"] == _paces((from_round, FIXED), (from_round + 1, FIXED)), where
            resumed_from = run["loaded"]["at"]
            for k, (actual, expected) in enumerate(zip(run["steps"], per_step[replica][resumed_from:])):
                _assert_close(actual, expected, f"{where} after its step {resumed_from + k + 1}")
            assert len(run["steps"]) == len(per_step[replica]) - resumed_from, where
            _assert_close(run["final"], finals[replica], f"{where} final")


def test_a_checkpoint_saved_after_the_taus_are_fixed_resumes_bit_for_bit(results):
    """Saved mid-round 1 (replica 0 at step 6, replica 1 at step 5: the same share of the round), before the
    correction: the τ_r come back from the checkpoint and the resumed run times round 2, correcting from
    round 3. Saved mid-round 2, after it: both paces come back, settled. Every later step is the straight
    run's, bit for bit (the same τ_r)."""
    first = Pace(tuple(FIXED), from_round=MEASURED_ROUNDS)
    for k, (saved, pace, fixed) in enumerate([
        (_paces((MEASURED_ROUNDS, FIXED)), first, _paces((MEASURED_ROUNDS, FIXED), (CORRECTED + 1, FIXED))),
        (SETTLED, Pace(tuple(FIXED), CORRECTED, first), SETTLED),
    ]):  # fmt: skip
        for replica, got in enumerate(results):
            _assert_resumed_bit_for_bit(got["after"][k], got["straight"], replica, MEASURED_ROUNDS + k, saved)
            assert got["after"][k]["loaded"]["pace"] == pace and got["after"][k]["fixed"] == fixed, (k, replica)


def _assert_resumed_bit_for_bit(run: dict, straight: dict, replica: int, rounds: int, saved: list) -> None:
    """`run` saved `rounds` rounds and [2, 1] steps in (round 0 at tau), with `saved` paces, then resumed:
    every later step and the final model are `straight`'s."""
    at = TAU + (rounds - 1) * FIXED[replica] + [2, 1][replica]
    assert run["saved"] == {"at": at, "fixed": saved} and run["loaded"]["at"] == at, (rounds, replica)
    assert len(run["steps"]) == len(straight["steps"]) - at
    for k, (a, b) in enumerate(zip(run["steps"], straight["steps"][at:])):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=f"replica {replica} step {k}": f"{w}: {m}")
    torch.testing.assert_close(run["final"], straight["final"], rtol=0, atol=0)


def test_a_saved_pace_that_does_not_fit_is_refused_naming_the_field(results):
    """Not a list, more paces than the two decisions, rounds out of order or past the next, τ_r without one at
    tau or of the wrong length: refused, naming fixed_replica_tau and what is accepted; unaltered, it loads."""
    for got in results:
        refused = got["refused"]
        for name in BAD_PACES:
            assert "fixed_replica_tau=" in refused[name] and "expected null or a list of 1 to 2" in refused[name], name
        assert refused["unaltered"] == SETTLED


# ---- S x R = 2 x 2 ----------------------------------------------------------------------------------------

SHARDS = 2


def _sharded_child(rank: int, world: int, integration: str) -> dict:
    from tests.core.test_pace import SHARDED

    replica, shard_index = divmod(rank, SHARDS)
    _slow_clock(replica)
    opt, net, whole = SHARDED[integration]({**AUTO, "shards_per_replica": SHARDS})
    record: list = []

    def step() -> None:
        x, y = models.shard_batch(replica, shard_index, opt.engine.inner_steps, SHARDS)
        opt.zero_grad()
        models.loss_fn(net(x), y).backward()
        opt.step()
        record.append(whole())

    while opt.engine.rounds < ROUNDS:
        step()
    extra = EXTRA[replica] % opt.steps_per_round
    for _ in range(extra):
        step()
    fixed = opt.engine.schedule.fixed_replica_tau
    _finalize(opt, extra)
    out = {"steps": record, "final": whole(), "fixed": fixed}
    dist.barrier()
    return out


@pytest.mark.parametrize("integration", ["fsdp2", pytest.param("fairscale", marks=pytest.mark.slow)])
def test_two_by_two_matches_the_reference_at_every_step(integration):
    results = run_ranks(_sharded_child, 4, integration, timeout=300)
    per_step, finals = _reference(FIXED, MEASURED_ROUNDS, shards=SHARDS)
    for rank, got in enumerate(results):
        assert got["fixed"] == SETTLED, rank
    _assert_every_step(results[0::SHARDS], per_step, finals, f"{integration} shard 0")
    _assert_every_step(results[1::SHARDS], per_step, finals, f"{integration} shard 1")
