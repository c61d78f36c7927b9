"""Checkpoints at every inner step of a round, with every schedule (no sync delay, a fixed one, "auto")
and every stand-in (local, its momentum read or copied; shared), on plain CO2Optimizer over real
gloo processes (docs/checkpoints.md, docs/design.md §3 "checkpoints").

Each run saves at the three steps of one round: its start (the round end just passed), before the sync
delay's apply point and after it. The same R resumes each one and trains on; R = 4 -> 2 and 2 -> 4
reshard each one. Both are compared at every further inner step with the independent reference
(tests/reference.py): the straight run for the same R, and for another R the reference's resharded load
at the round start (`simulate(..., reshard_at=)`), which is the same whichever step of the round was
saved: every replica continues saved replica m % R from its round start (its stand-in), or, with a sync
delay, from the newest shared start with the arrived average applied at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from co2_zero import CO2Optimizer, checkpoint
from tests import models
from tests.compare import assert_close, param_copies
from tests.core.test_sync_delay_auto import _gate
from tests.dist_utils import run_ranks
from tests.reference import simulate

TAU, DELAY = 3, 2
SCHEDULES = {  # sync_delay, the round whose three steps are saved, the run's last step
    "no-delay": (None, 2, 4 * TAU),
    "delay": (DELAY, 2, 4 * TAU),
    "auto": ("auto", 5, 7 * TAU),  # round 5: the first applied mid-round once "auto" fixed d = 2 (design §3)
}
STAND_INS = {
    "local": {},  # the defaults': gloo's collective is all_reduce, local reads the momentum itself
    "local-copy": {"stand_in": "local", "collective": "reduce_scatter"},  # its own copy of the momentum
    "shared": {"stand_in": "shared", "gap_penalty": {"mode": "adaptive", "strength": 1.5}},
}
OUTER = {"tau": TAU, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
CASES = [(schedule, stand_in) for schedule in SCHEDULES for stand_in in STAND_INS]
RESHARDS = {"4->2": (4, 2), "2->4": (2, 4)}


def _config(schedule: str, stand_in: str) -> dict:
    return {**OUTER, "sync_delay": SCHEDULES[schedule][0], **STAND_INS[stand_in]}


def _name(schedule: str, stand_in: str) -> str:
    return f"{schedule}-{stand_in}"


def _build(schedule: str, stand_in: str):
    model = models.make_model("mlp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, CO2Optimizer(optimizer, _config(schedule, stand_in), model=model)


def _save_steps(schedule: str) -> list[int]:
    start = SCHEDULES[schedule][1] * TAU
    return list(range(start, start + TAU))


def _train(rank: int, model, opt, first: int, last: int) -> list[dict]:
    """Steps first .. last - 1, each step's parameters."""
    steps = []
    for step in range(first, last):
        models.train_steps(rank, model, opt, step, step + 1)
        steps.append(param_copies(model))
    return steps


def _save_every_step_of_a_round(rank: int, root: str) -> dict:
    """Per case: save at each step of its round (tag s<step>); the delay "auto" fixed, from an exchange
    gated to take one step (so d = 2 < tau)."""
    out = {}
    for schedule, stand_in in CASES:
        model, opt = _build(schedule, stand_in)
        ungate = _gate(opt, 1) if schedule == "auto" else (lambda: None)
        try:
            models.train_steps(rank, model, opt, 0, _save_steps(schedule)[0])
        finally:
            ungate()
        for step in _save_steps(schedule):
            if step > _save_steps(schedule)[0]:
                models.train_steps(rank, model, opt, step - 1, step)
            checkpoint.save(f"{root}/{_name(schedule, stand_in)}", model, opt, extra={"step": step}, tag=f"s{step}")
            if schedule == "delay":
                _save_an_older_state(f"{root}/{_name(schedule, stand_in)}", model, opt, step)
        out[_name(schedule, stand_in)] = {"delay": opt.engine.schedule.apply.steps}
    return out


def _save_an_older_state(directory: str, model, opt, step: int) -> None:
    """Tag o<step>: the files a run wrote before states said whether a start point is pending: no
    `applies_at`, and `next_start` at every step (after the apply point scratch, here garbage)."""
    engine = opt.engine
    current = engine.state_dict

    def older() -> dict:
        state = {k: v for k, v in current().items() if k != "applies_at"}
        if state["next_start"] is None:
            state["next_start"] = torch.full_like(state["start_point"], 7.0)
        return state

    engine.state_dict = older
    try:
        checkpoint.save(directory, model, opt, extra={"step": step}, tag=f"o{step}")
    finally:
        del engine.state_dict


def _resume(rank: int, directory: str, schedule: str, stand_in: str, step: int, reshard: bool, tag="s") -> dict:
    model, opt = _build(schedule, stand_in)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resharding drops the saved partial round, with a warning
        checkpoint.load(directory, model, opt, reshard=reshard, tag=f"{tag}{step}")
    first = opt.engine.inner_steps
    steps = _train(rank, model, opt, first, SCHEDULES[schedule][2])
    opt.finalize()
    return {"first": first, "steps": steps, "final": param_copies(model)}


def _resume_an_older_state(rank: int, directory: str, schedule: str, stand_in: str, step: int) -> dict:
    """The same R, from a state written before states said whether a start point is pending: no
    `applies_at`, and after the apply point `next_start` held scratch (here: garbage); loaded with
    `load_state_dict` and finalized at once, mid-round (where a pending start point is applied)."""
    model, opt = _build(schedule, stand_in)
    checkpoint.load(directory, model, opt, tag=f"s{step}")
    state = opt.state_dict()
    co2 = {k: v for k, v in state["co2"].items() if k != "applies_at"}
    co2["next_start"] = torch.full_like(co2["start_point"], 7.0) if co2["next_start"] is None else co2["next_start"]
    model, opt = _build(schedule, stand_in)
    checkpoint.load(directory, model, opt, tag=f"s{step}")  # the module (and a state to overwrite)
    opt.load_state_dict({**state, "co2": co2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finalize drops the partial round, with a warning
        opt.finalize()
    return param_copies(model)


def saving_run(rank: int, world: int, root: str, other_root: str) -> dict:
    """Save at every step of a round; with no `other_root`, resume each of these checkpoints, else reshard
    each of those `other_root` holds (saved by the other world size)."""
    out = {"saved": _save_every_step_of_a_round(rank, f"{root}/w{world}")}
    for schedule, stand_in in CASES:
        name = _name(schedule, stand_in)
        for step in _save_steps(schedule):
            if not other_root:
                directory = f"{root}/w{world}/{name}"
                out[("same", name, step)] = _resume(rank, directory, schedule, stand_in, step, False)
                if schedule == "delay":
                    out[("older", name, step)] = _resume_an_older_state(rank, directory, schedule, stand_in, step)
            else:
                directory = f"{other_root}/{name}"
                out[("reshard", name, step)] = _resume(rank, directory, schedule, stand_in, step, True)
                if schedule == "delay":
                    out[("reshard-older", name, step)] = _resume(rank, directory, schedule, stand_in, step, True, "o")
    return out


def resharding_run(rank: int, world: int, root: str, other_root: str) -> dict:
    """Reshard each checkpoint the other world size saved."""
    out = {}
    for schedule, stand_in in CASES:
        name = _name(schedule, stand_in)
        for step in _save_steps(schedule):
            out[("reshard", name, step)] = _resume(rank, f"{other_root}/{name}", schedule, stand_in, step, True)
            if schedule == "delay":
                older = _resume(rank, f"{other_root}/{name}", schedule, stand_in, step, True, "o")
                out[("reshard-older", name, step)] = older
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """World 2 saves and resumes; world 4 saves and reshards 2 -> 4; world 2 reshards 4 -> 2."""
    root = str(tmp_path_factory.mktemp("phases"))
    two = run_ranks(saving_run, 2, root, "", timeout=600)
    four = run_ranks(saving_run, 4, root, f"{root}/w2", timeout=600)
    back = run_ranks(resharding_run, 2, root, f"{root}/w4", timeout=600)
    return {2: two, 4: four, "4->2": back, "2->4": four}


def _delay(results: list, name: str) -> int:
    delays = {r["saved"][name]["delay"] for r in results}
    assert delays == {DELAY if name.startswith(("delay", "auto")) else TAU}, f"{name}: applied at steps {delays}"
    return delays.pop()


def _reference(
    schedule: str, stand_in: str, delay: int, replicas: int, reshard_at=None, steps=None
) -> tuple[list, list]:
    """Every inner step's parameters per replica, and the final model, of the reference run."""
    config = {k: v for k, v in _config(schedule, stand_in).items() if k != "collective"}
    per_step: list = []
    finals = simulate(
        lambda: models.make_model("mlp"),
        lambda params: torch.optim.Adam(params, lr=0.01),
        models.batch,
        models.loss_fn,
        {**config, "sync_delay": delay},
        replicas=replicas,
        steps=SCHEDULES[schedule][2] if steps is None else steps,
        step_record=per_step,
        delay_from=5 if schedule == "auto" else 0,
        reshard_at=reshard_at,
    )
    return per_step, finals


def _check(results: list, key: tuple, first: int, expected: list, finals: list) -> None:
    for rank, result in enumerate(results):
        got = result[key]
        assert got["first"] == first, (key, rank, got["first"])
        for k, params in enumerate(got["steps"]):
            assert_close(params, expected[first + k][rank], f"{key} rank {rank} after step {first + k + 1}")
        assert_close(got["final"], finals[rank], f"{key} rank {rank} final")


@pytest.mark.parametrize("schedule,stand_in", CASES)
def test_a_checkpoint_at_any_step_resumes_as_the_reference(runs, schedule, stand_in):
    """The same R x S (2): each of the round's three checkpoints resumes at its step and trains on as the
    reference run straight through."""
    name = _name(schedule, stand_in)
    delay = _delay(runs[2], name)
    expected, finals = _reference(schedule, stand_in, delay, 2)
    for step in _save_steps(schedule):
        _check(runs[2], ("same", name, step), step, expected, finals)


@pytest.mark.parametrize("stand_in", list(STAND_INS))
def test_a_state_that_does_not_say_whether_a_start_is_pending_resumes_by_the_step_counter(runs, stand_in):
    """A state without `applies_at` whose `next_start` held scratch after the apply point: finalized at
    once, it gives the reference's final model at that step (the step counter says whether the average
    was applied), at every step of the round."""
    name = _name("delay", stand_in)
    for step in _save_steps("delay"):
        _, finals = _reference("delay", stand_in, DELAY, 2, steps=step)
        for rank, result in enumerate(runs[2]):
            assert_close(result[("older", name, step)], finals[rank], f"{name} step {step} rank {rank}")


@pytest.mark.parametrize("direction", list(RESHARDS))
@pytest.mark.parametrize("schedule,stand_in", CASES)
def test_a_checkpoint_at_any_step_reshards_to_the_same_round_start(runs, direction, schedule, stand_in):
    """Another R: each of the round's three checkpoints resumes at the round start, and every further
    step is the reference's resharded load there (the same for all three)."""
    saved, target = RESHARDS[direction]
    name = _name(schedule, stand_in)
    delay = _delay(runs[saved], name)
    start = _save_steps(schedule)[0]
    expected, finals = _reference(schedule, stand_in, delay, saved, reshard_at=(start, target))
    for step in _save_steps(schedule):
        _check(runs[direction], ("reshard", name, step), start, expected, finals)


@pytest.mark.parametrize("direction", list(RESHARDS))
@pytest.mark.parametrize("stand_in", list(STAND_INS))
def test_an_older_state_reshards_to_the_same_round_start(runs, direction, stand_in):
    """Files without `applies_at`, whose `next_start` held scratch after the apply point, reshard as the
    files that say it: the delay and the step counter tell whether the saved start point is pending."""
    saved, target = RESHARDS[direction]
    name = _name("delay", stand_in)
    start = _save_steps("delay")[0]
    expected, finals = _reference("delay", stand_in, DELAY, saved, reshard_at=(start, target))
    for step in _save_steps("delay"):
        _check(runs[direction], ("reshard-older", name, step), start, expected, finals)
