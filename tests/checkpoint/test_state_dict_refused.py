"""The optimizers' `load_state_dict` validates like `checkpoint.load` (2 gloo ranks, R = 2 x S = 1).

A state dict that does not fit (an inner optimizer moment of another shape, state for a parameter the
optimizer lacks, a CO2 state of another partition) is refused with a ValueError naming the field, and
changes nothing: the weights, the inner optimizer state and the CO2 state are what they were. The
same dict, unaltered, then loads. Covered: `CO2Optimizer`, and `CO2OSS`'s own share and its
consolidated form.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from co2_zero import CO2Config, CO2Optimizer
from tests import models
from tests.compare import clone_state, same
from tests.dist_utils import run_ranks

# a fixed schedule (sync_delay null): a saved fixed_sync_delay is refused there, as it is not "auto"
CONFIG = {
    "tau": 2,
    "outer_lr": 0.8,
    "outer_momentum": 0.5,
    "sync_delay": None,
    "timeout_s": 4.0,
    "shards_per_replica": 1,
}
HAS_FAIRSCALE = importlib.util.find_spec("fairscale") is not None

# how each form is altered: (what the error must name, the alteration)
CASES = {
    "inner moment of another shape": ("exp_avg", lambda inner, co2: inner["state"][0].update(exp_avg=torch.zeros(3))),
    "inner state of a parameter it lacks": ("99", lambda inner, co2: inner["state"].update({99: {}})),
    "co2 state of another partition": ("momentum", lambda inner, co2: co2.update(momentum=torch.zeros(5))),
    "co2 fixed sync delay, not auto": ("fixed_sync_delay", lambda inner, co2: co2.update(fixed_sync_delay=2)),
}


def _plain(rank: int):
    """A CO2Optimizer mid-round (3 steps at tau = 2), its state dict, and where its parts are."""
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(**CONFIG), model=model)
    models.train_steps(rank, model, opt, 0, 3)
    return model, opt, opt.optimizer, lambda sd: (sd["optimizer"], sd["co2"]), opt.state_dict()


def _oss(rank: int, consolidated: bool):
    """A CO2OSS mid-round, and its own share or its consolidated state dict."""
    from co2_zero.fairscale import CO2OSS

    model = models.make_model("mlp")
    opt = CO2OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01, co2=CONFIG, model=model)
    models.train_steps(rank, model, opt, 0, 3)
    if consolidated:
        parts = lambda sd: (sd, sd["co2_replica"]["states"][opt.rank])  # noqa: E731
        return model, opt, opt.optim, parts, opt.state_dict(all_ranks=True)
    return model, opt, opt.optim, lambda sd: (sd["oss_shard"]["state"], sd["co2"]), opt.state_dict()


def _snapshot(model, opt, inner) -> dict:
    return {
        "params": clone_state(dict(model.named_parameters())),
        "inner": clone_state(inner.state_dict()),
        "co2": clone_state(opt.engine.state_dict()),
    }


def refusals(rank: int, world_size: int) -> dict:
    """For each form and case: the error of the refused load ("Type: message"), whether it changed
    nothing, and whether the unaltered dict then loads and gives back the same state."""
    builders = {"CO2Optimizer": lambda: _plain(rank)}
    if HAS_FAIRSCALE:
        builders["CO2OSS own share"] = lambda: _oss(rank, consolidated=False)
        builders["CO2OSS consolidated"] = lambda: _oss(rank, consolidated=True)
    out = {}
    for form, build in builders.items():
        model, opt, inner, parts, state = build()
        state = clone_state(state)
        before = _snapshot(model, opt, inner)
        for case, (_, alter) in CASES.items():
            bad = clone_state(state)
            alter(*parts(bad))
            try:
                opt.load_state_dict(bad)
                error = None
            except Exception as refusal:  # any kind: the test says which one it expects
                error = f"{type(refusal).__name__}: {refusal}"
            out[form, case] = (error, same(before, _snapshot(model, opt, inner)))
        opt.load_state_dict(clone_state(state))
        out[form, "the unaltered dict loads"] = (None, same(before, _snapshot(model, opt, inner)))
        opt.finalize()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(refusals, 2)


def reload_before_the_delay_was_fixed(rank: int, world_size: int) -> dict:
    """sync_delay "auto": a state saved with a fixed delay, then one saved before it was fixed, loaded into
    one optimizer: the second must put back the measuring schedule (the round end), not keep the first's."""
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), {**CONFIG, "sync_delay": "auto"}, model=model)
    models.train_steps(rank, model, opt, 0, 3)
    state = clone_state(opt.state_dict())
    before = _snapshot(model, opt, opt.optimizer)
    fixed = clone_state(state)
    fixed["co2"]["fixed_sync_delay"] = 1
    opt.load_state_dict(fixed)
    after_fixed = (opt.engine.schedule.apply.steps, opt.engine.schedule.delay_meter.fixed)
    opt.load_state_dict(clone_state(state))
    out = {
        "after_fixed": after_fixed,
        "after_unfixed": (opt.engine.schedule.apply.steps, opt.engine.schedule.delay_meter.fixed),
        "same": same(before, _snapshot(model, opt, opt.optimizer)),
    }
    opt.finalize()
    return out


def test_a_state_saved_before_the_delay_was_fixed_measures_anew_on_any_engine():
    for result in run_ranks(reload_before_the_delay_was_fixed, 2):
        assert result["after_fixed"] == (1, 1), result
        assert result["after_unfixed"] == (CONFIG["tau"], None) and result["same"], result


FORMS = ["CO2Optimizer", "CO2OSS own share", "CO2OSS consolidated"]
FIELDS = {
    "CO2Optimizer": ("state_dict['optimizer']", "state_dict['co2']"),
    "CO2OSS own share": ("state_dict['oss_shard']['state']", "state_dict['co2']"),
    "CO2OSS consolidated": ("state_dict", "state_dict['co2_replica']['states']"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", FORMS)
def test_a_refused_state_dict_names_the_field_and_changes_nothing(results, form, case):
    if form.startswith("CO2OSS") and not HAS_FAIRSCALE:
        pytest.skip("needs fairscale")
    inner_field, co2_field = FIELDS[form]
    for rank, result in enumerate(results):
        error, unchanged = result[form, case]
        assert error is not None, f"rank {rank}: {form} loaded a state dict with {case}"
        assert error.startswith("ValueError: ") and "refused, nothing was changed" in error, error
        assert CASES[case][0] in error, error
        assert (co2_field if case.startswith("co2") else inner_field) in error, error
        assert unchanged, f"rank {rank}: the refused {form} load changed weights, inner or CO2 state"


@pytest.mark.parametrize("form", FORMS)
def test_the_unaltered_state_dict_then_loads(results, form):
    if form.startswith("CO2OSS") and not HAS_FAIRSCALE:
        pytest.skip("needs fairscale")
    for rank, result in enumerate(results):
        assert result[form, "the unaltered dict loads"] == (None, True), f"rank {rank}: {form}"


# how a peer's state (`RoundEngine.state_for_peer`, an elastic heal) is altered: the field the error names
PEER_CASES = {
    "config_hash": lambda served: served.update(config_hash="another config"),
    "momentum": lambda served: served.update(momentum=torch.zeros(5)),
    "own_momentum": lambda served: served.update(own_momentum=torch.zeros(5)),
    "rounds": lambda served: served.update(rounds=served["rounds"] + 2),
    "fixed_sync_delay": lambda served: served.update(fixed_sync_delay=1),
    "frozen": lambda served: served.update(frozen=[torch.zeros(3)]),
}


def adopt_from_a_peer(rank: int, world_size: int) -> dict:
    """A peer's state taken after 2 rounds, then 2 more rounds trained: each altered form is refused and
    changes nothing; the unaltered one is adopted whole (next start, outer momentum and local's copy of it,
    this replica's stand-in start, gap norms, counters)."""
    model = models.make_model("mlp")
    config = {**CONFIG, "collective": "reduce_scatter", "stand_in": "local"}  # local keeps a momentum copy
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(**config), model=model)
    models.train_steps(rank, model, opt, 0, 4)
    opt.engine.state_dict()  # no round in flight: the state between two rounds
    served = clone_state(opt.engine.state_for_peer())
    models.train_steps(rank, model, opt, 4, 8)
    before = clone_state(opt.engine.state_dict())
    out = {}
    for case, alter in PEER_CASES.items():
        bad = clone_state(served)
        alter(bad)
        try:
            opt.engine.adopt(bad, source="elastic heal")
            error = None
        except ValueError as refusal:
            error = str(refusal)
        out[case] = (error, same(before, clone_state(opt.engine.state_dict())))
    opt.engine.adopt(clone_state(served), source="elastic heal")
    after = opt.engine.state_dict()
    kept = ("next_start", "momentum", "own_momentum", "previous_update_sq_norms", "rounds", "inner_steps")
    out["adopted"] = [key for key in kept if not same(after[key], served[key])]
    out["stand-in start"] = same(after["own_start"], served["next_start"])
    out["changed"] = not same(before["momentum"], served["momentum"])
    opt.finalize()
    return out


def test_a_peer_state_is_adopted_whole_or_not_at_all():
    """`RoundEngine.adopt(source="elastic heal")` checks a peer's state as a checkpoint load does."""
    for result in run_ranks(adopt_from_a_peer, 2):
        assert result["changed"], "the peer's state must differ from the engine's for the test to mean anything"
        for case in PEER_CASES:
            error, unchanged = result[case]
            assert error is not None and error.startswith(f"co2 elastic heal: {case}") or case == "frozen", result
            assert error is not None and unchanged, (case, result[case])
        assert "frozen parameters" in result["frozen"][0], result["frozen"]
        assert result["adopted"] == [] and result["stand-in start"], result
