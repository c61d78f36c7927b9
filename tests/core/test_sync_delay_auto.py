"""`sync_delay: "auto"` (docs/design.md §3, "The sync delay"): the meter's decisions as plain logic, and
CO2Optimizer on real gloo processes against the independent reference (`simulate(..., delay_from=)`)
at every inner step, the delay fixed from what the ranks measured, the same on every rank, and kept
(or measured anew) by a checkpoint.

A "gate" makes the exchange's length known: every pipeline waits until its rank has begun inner step
GATE of the next round, and that step waits for it, so every rank measures GATE steps exactly and the
delay is ceil(1.5 x GATE). Without the gate the exchange takes whatever it takes; the reference is then
given the delay the ranks fixed.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch

from co2_zero import CO2Optimizer, checkpoint
from co2_zero.core.schedule import MARGIN, DelayMeter, delay_for
from tests import models
from tests.compare import assert_close
from tests.dist_utils import run_ranks
from tests.reference import simulate
from tests.scenarios import HEAVY_BALL, NESTEROV

TAU, GATE = 6, 2  # the gated exchange takes 2 steps: the delay is ceil(1.5 x 2) = 3
SWITCH = 5  # the first round whose average is applied mid-round: measured 1-2, announced 2-3, fixed at 4
SCENARIOS = {
    # the quality study's winner: DiLoCo's outer step, the local stand-in, reduce_scatter
    "local-nesterov-gated": dict(
        config={
            **NESTEROV,
            "tau": TAU,
            "sync_delay": "auto",
            "gap_penalty": {"mode": "none"},
            "stand_in": "local",
            "collective": "reduce_scatter",
        },  # fmt: skip
        steps=8 * TAU + 2,
        gate=GATE,
    ),
    # the published outer step with the adaptive gap, whose staleness changes with the schedule
    "shared-heavyball-adaptive-gated": dict(
        config={
            **HEAVY_BALL,
            "tau": TAU,
            "sync_delay": "auto",
            "gap_penalty": {"mode": "adaptive", "strength": 1.5},
            "collective": "all_reduce",
        },  # fmt: skip
        steps=8 * TAU,
        gate=GATE,
        optimizer="adam",
    ),
    "shared-heavyball-ungated": dict(
        config={**HEAVY_BALL, "tau": TAU, "sync_delay": "auto", "collective": "reduce_scatter"}, steps=8 * TAU
    ),
    # an exchange of 5 of 6 steps: ceil(1.5 x 5) > tau, so the average stays a round late, with a warning
    "shared-heavyball-too-slow": dict(
        config={**HEAVY_BALL, "tau": TAU, "sync_delay": "auto", "collective": "all_reduce"}, steps=7 * TAU, gate=5
    ),
}
# a checkpoint after the delay was fixed keeps it; one before it makes the resumed run measure anew
RESUME = dict(config=SCENARIOS["local-nesterov-gated"]["config"], steps=10 * TAU, gate=GATE)
# (saved after step GATE of a round: no gated pipeline in flight; the fixed one before its apply point)
RESUME_AT = {"fixed": SWITCH * TAU + GATE, "measuring": 2 * TAU + GATE}


# ---- the meter as plain logic ------------------------------------------------------------------------------


def _feed(meter: DelayMeter, rounds: int, tau: int, finished_at: dict) -> list[tuple[int, int]]:
    """Drive `meter` as the engine does for `rounds` round ends (one rank: its own posts come back as the
    rows); `finished_at[t]`: the step of round t + 1 at which pipeline t is seen finished (absent: never).
    Returns [(round, delay)] for each switch."""
    switches, posted = [], None
    for t in range(rounds):
        for step in range(1, tau):
            meter.saw(step, t - 1 in finished_at and step >= finished_at[t - 1])
        if posted is not None:
            meter.collected(posted)
        posted = [meter.to_post()]
        meter.launched(t)
        delay = meter.fixed_after_launch(t)
        if delay is not None:
            switches.append((t, delay))
    return switches


def test_the_delay_is_fixed_once_from_the_counted_exchanges():
    """Pipeline 0 (set-up) is not counted; 1 and 2 are; the delay is fixed after round 4's launch."""
    assert _feed(DelayMeter(8), 10, 8, {0: 7, 1: 2, 2: 3, 3: 7, 4: 7}) == [(4, delay_for(3, 8))] == [(4, 5)]
    assert _feed(DelayMeter(8), 10, 8, {1: 1, 2: 1}) == [(4, 2)]  # a fast exchange: ceil(1.5)
    assert _feed(DelayMeter(8), 10, 8, {1: 6}) == [(4, 8)]  # pipeline 2 never finished in time: tau
    assert _feed(DelayMeter(4), 4, 4, {1: 1, 2: 1}) == []  # not fixed before round 4


def test_the_most_any_rank_needed_decides_with_the_margin():
    meter = DelayMeter(16)
    meter.collected([0, 0])  # pipeline 0's round: nothing counted
    meter.collected([3, 5])
    meter.collected([4, 2])
    assert meter.fixed_after_launch(4) == delay_for(5, 16) == 8 and MARGIN == 1.5
    meter.collected([16, 16])  # after the decision nothing moves it
    assert meter.fixed_after_launch(4) is None and meter.fixed == 8
    assert delay_for(0, 8) == 1 and delay_for(7, 8) == 8  # in [1, tau]


def test_a_resumed_meter_counts_anew_from_its_round():
    meter = DelayMeter(8)
    meter.restart(first_round=6)
    assert _feed(meter, 12, 8, {t: 1 for t in range(12)}) == [(10, 2)]
    fixed = DelayMeter(8)
    fixed.fix(3)
    assert _feed(fixed, 12, 8, {t: 7 for t in range(12)}) == [] and fixed.fixed == 3


def test_a_pipeline_counts_as_finished_once_its_device_work_has():
    """On a GPU the worker returns with its kernels queued (a CUDA event in the result): the count waits
    for the event, not only for the future."""
    from concurrent.futures import Future

    from co2_zero.core.in_flight import finished as _finished

    class Event:
        def __init__(self, ready: bool) -> None:
            self.ready = ready

        def query(self) -> bool:
            return self.ready

    running, cpu, queued, ran, failed = Future(), Future(), Future(), Future(), Future()
    cpu.set_result((None, None))
    queued.set_result((None, Event(False)))
    ran.set_result((None, Event(True)))
    failed.set_exception(RuntimeError("the collective failed"))
    assert [_finished(f) for f in (running, cpu, queued, ran, failed, None)] == [False, True, False, True, True, True]


# ---- real ranks against the reference ----------------------------------------------------------------------


def _gate(opt: CO2Optimizer, steps_in: int):
    """Every pipeline waits for the inner step `steps_in` of the next round to begin, which waits for the
    pipeline: the exchange takes exactly `steps_in` steps. Returns the function that removes the gate."""
    import co2_zero.core.comm

    original = co2_zero.core.comm.OuterExchange._average
    opened = threading.Event()

    def gated_average(self, *args):
        assert opened.wait(60), "the gate never opened"
        opened.clear()
        return original(self, *args)

    def pre_hook(optimizer, args, kwargs):
        pending = opt.engine.pending_round
        if pending is not None and opt.engine.inner_steps % opt.config.tau == steps_in - 1:
            opened.set()
            deadline = time.monotonic() + 60
            while not pending.done():
                assert time.monotonic() < deadline, "the gated pipeline did not finish"
                time.sleep(0.001)

    co2_zero.core.comm.OuterExchange._average = gated_average
    handle = opt.optimizer.register_step_pre_hook(pre_hook)

    def unpatch():  # a pipeline still gated (launched at the last step) goes through
        opened.set()
        co2_zero.core.comm.OuterExchange._average = original
        handle.remove()

    return unpatch


def _build(sc: dict) -> tuple[torch.nn.Module, CO2Optimizer]:
    model = models.make_model(sc.get("model", "mlp"))
    return model, CO2Optimizer(models.make_optimizer(sc.get("optimizer", "sgd"), model.parameters()), sc["config"],
                               model=model)  # fmt: skip


def _train(rank: int, model, opt, first: int, last: int, record: list) -> None:
    for step in range(first, last):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        record.append({n: p.detach().clone() for n, p in model.named_parameters()})


def _run(rank: int, sc: dict) -> dict:
    model, opt = _build(sc)
    unpatch = _gate(opt, sc["gate"]) if sc.get("gate") else (lambda: None)
    steps: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(rank, model, opt, 0, sc["steps"], steps)
    finally:
        unpatch()
    schedule = opt.engine.schedule
    delay, meter, reported = schedule.apply.steps, schedule.delay_meter, opt.last_round["sync_delay"]
    opt.finalize()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    notes = [str(w.message) for w in caught if "sync_delay 'auto'" in str(w.message)]
    return {"steps": steps, "final": final, "delay": delay, "fixed": meter.fixed, "reported": reported,
            "warnings": notes}  # fmt: skip


def _resume(rank: int, directory: str) -> dict:
    """Straight through, and resumed from a checkpoint at each of RESUME_AT (the model scrambled first)."""
    out = {"straight": _run(rank, RESUME)}
    for how, at in RESUME_AT.items():
        model, opt = _build(RESUME)
        unpatch = _gate(opt, GATE)
        try:
            _train(rank, model, opt, 0, at, [])
            checkpoint.save(os.path.join(directory, how), model, opt)
            opt.engine.close()
            model, opt = _build(RESUME)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0)
            unpatch()
            unpatch = _gate(opt, GATE)
            checkpoint.load(os.path.join(directory, how), model, opt)
            resumed: list = []
            _train(rank, model, opt, at, RESUME["steps"], resumed)
        finally:
            unpatch()
        out[how] = {"resumed": resumed, "delay": opt.engine.schedule.apply.steps}
        opt.finalize()
    return out


def _scenarios(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    return {**{name: _run(rank, sc) for name, sc in SCENARIOS.items()}, "resume": _resume(rank, directory)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("auto")))


def _reference(sc: dict, delay: int, delay_from: int, replicas: int) -> tuple[list, list]:
    per_step: list = []
    config = {k: v for k, v in sc["config"].items() if k != "collective"}
    finals = simulate(lambda: models.make_model(sc.get("model", "mlp")),
                      lambda params: models.make_optimizer(sc.get("optimizer", "sgd"), params), models.batch,
                      models.loss_fn, {**config, "sync_delay": delay}, replicas=replicas, steps=sc["steps"],
                      step_record=per_step, delay_from=delay_from)  # fmt: skip
    return per_step, finals


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_step_matches_the_reference_with_the_delay_the_ranks_fixed(results, name):
    sc = SCENARIOS[name]
    delays = {r[name]["delay"] for r in results}
    assert len(delays) == 1, f"the ranks fixed different delays: {delays}"
    delay = delays.pop()
    assert results[0][name]["fixed"] == results[0][name]["reported"] == delay  # last_round["sync_delay"]
    if sc.get("gate"):
        assert delay == delay_for(sc["gate"], TAU) == (3 if sc["gate"] == GATE else TAU)  # measured exactly
    for got in (r[name] for r in results):  # a warning where the delay stays a whole round, only there
        assert len(got["warnings"]) == (delay == TAU), got["warnings"]
        assert all(f"of tau={TAU} inner steps" in w and "tau of at least" in w for w in got["warnings"])
        if sc.get("gate") == 5:
            assert "took 5 of tau=6" in got["warnings"][0] and "tau of at least 9" in got["warnings"][0]
    per_step, finals = _reference(sc, delay, SWITCH, len(results))
    for rank, got in enumerate(r[name] for r in results):
        assert len(got["steps"]) == len(per_step) == sc["steps"]
        for k, (a, e) in enumerate(zip(got["steps"], per_step)):
            assert_close(a, e[rank], f"{name} rank {rank} after step {k + 1}")
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final")


def test_the_switch_is_where_the_reference_says_not_elsewhere(results):
    """The reference with the delay from another round, or never, differs from what the ranks did."""
    sc = SCENARIOS["local-nesterov-gated"]
    got = results[0]["local-nesterov-gated"]["steps"]
    for delay_from in (SWITCH - 1, SWITCH + 1, 10**6):
        per_step, _ = _reference(sc, 3, delay_from, len(results))
        assert any(not torch.allclose(a[n], e[0][n], atol=1e-5) for a, e in zip(got, per_step) for n in a)


def test_a_checkpoint_keeps_a_fixed_delay_and_a_resumed_run_measures_an_unfixed_one(results):
    for rank, got in enumerate(r["resume"] for r in results):
        straight = got["straight"]["steps"]
        at = RESUME_AT["fixed"]
        assert got["fixed"]["delay"] == got["straight"]["delay"] == 3
        for k, step in enumerate(got["fixed"]["resumed"]):
            assert all(torch.equal(step[n], straight[at + k][n]) for n in step), (rank, at + k + 1)
        # saved in round 2: counted anew from there (pipelines 3 and 4), fixed after round 6's launch
        at = RESUME_AT["measuring"]
        per_step, _ = _reference(RESUME, 3, 7, len(results))
        assert got["measuring"]["delay"] == 3
        for k, step in enumerate(got["measuring"]["resumed"]):
            assert_close(step, per_step[at + k][rank], f"resumed while measuring, rank {rank}, step {at + k + 1}")
