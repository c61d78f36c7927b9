"""CO2OSS checkpoints and parameter changes on real gloo processes (2 ranks, S = 1 x R = 2).

A consolidated state taken earlier must not leak into a later save (it went stale when the optimizer
stepped); a refused load (another co2 config) changes neither the weights nor OSS's inner state nor the
CO2 state, through `co2_zero.checkpoint.load` and through CO2OSS's own `load_state_dict`; frozen
parameters are broadcast at start and a change of requires_grad is refused at the next round end.
"""

from __future__ import annotations

import pytest
import torch

from co2_zero import CO2Error, checkpoint
from tests import models
from tests.compare import clone_state, same
from tests.dist_utils import run_ranks

co2_fairscale = pytest.importorskip("co2_zero.fairscale")

TIMEOUT_S = 4.0
CONFIG = {"tau": 2, "outer_lr": 0.8, "outer_momentum": 0.5, "timeout_s": TIMEOUT_S, "shards_per_replica": 1}


def _build(model=None, **overrides):
    model = model if model is not None else models.make_model("mlp")
    opt = co2_fairscale.CO2OSS(
        model.parameters(), optim=torch.optim.Adam, lr=0.01, co2={**CONFIG, **overrides}, model=model
    )
    return model, opt


def _snapshot(model, opt) -> dict:
    return {
        "params": clone_state(dict(model.named_parameters())),
        "inner": clone_state(opt.optim.state_dict()),
        "co2": clone_state(opt.engine.state_dict()),
    }


def stale_consolidation(rank: int, root: str) -> dict:
    """state_dict(all_ranks=True) at step 4, then checkpoint.save at step 10, then a load."""
    model, opt = _build()
    models.train_steps(rank, model, opt, 0, 4)
    consolidated = opt.state_dict(all_ranks=True)
    models.train_steps(rank, model, opt, 4, 10)
    out = {
        "consolidated_steps": consolidated["co2"]["inner_steps"],
        "state_dict_steps_after_stepping": opt.state_dict()["co2"]["inner_steps"],
    }
    checkpoint.save(f"{root}/stale", model, opt)
    saved = _snapshot(model, opt)
    model2, opt2 = _build()
    checkpoint.load(f"{root}/stale", model2, opt2)
    out["loaded_is_step_10"] = same(saved, _snapshot(model2, opt2))
    opt.finalize()
    opt2.finalize()
    return out


def refused_loads(rank: int, root: str) -> dict:
    """A checkpoint (and a consolidated state) of a tau=2 run, loaded into a tau=3 run: refused, and
    the weights, OSS's inner state and the CO2 state are what they were."""
    model, opt = _build()
    models.train_steps(rank, model, opt, 0, 4)
    checkpoint.save(f"{root}/refused", model, opt)
    consolidated = clone_state(opt.state_dict(all_ranks=True))
    opt.finalize()
    out = {}
    for how in ("checkpoint.load", "CO2OSS.load_state_dict"):
        model, opt = _build(tau=3)
        models.train_steps(rank, model, opt, 0, 1)
        before = _snapshot(model, opt)
        try:
            if how == "checkpoint.load":
                checkpoint.load(f"{root}/refused", model, opt)
            else:
                opt.load_state_dict(consolidated)
            out[how] = None
        except (CO2Error, ValueError) as error:
            out[how] = str(error)
        out[f"{how} unchanged"] = same(before, _snapshot(model, opt))
        opt.finalize()
    return out


def frozen(rank: int) -> dict:
    out = {}
    model = models.make_model("mlp")
    model[0].weight.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    model, opt = _build(model)
    out["frozen_after_build"] = model[0].weight.detach().clone()
    models.train_steps(rank, model, opt, 0, 3)
    model[0].weight.requires_grad_(True)
    try:
        models.train_steps(rank, model, opt, 3, 4)
        out["unfreeze"] = None
    except CO2Error as error:
        out["unfreeze"] = str(error)
    return out


def run_all(rank: int, world: int, root: str) -> dict:
    return {"stale": stale_consolidation(rank, root), "refused": refused_loads(rank, root), "frozen": frozen(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(run_all, 2, str(tmp_path_factory.mktemp("fsckpt")), timeout=240)


def test_a_consolidated_state_goes_stale_when_the_optimizer_steps(results):
    for result in results:
        got = result["stale"]
        assert got["consolidated_steps"] == 4
        assert got["state_dict_steps_after_stepping"] == 10, "state_dict() returned the step-4 consolidation"
        assert got["loaded_is_step_10"], "the checkpoint did not hold the step-10 state"


@pytest.mark.parametrize("how", ["checkpoint.load", "CO2OSS.load_state_dict"])
def test_a_load_refused_for_another_config_changes_nothing(results, how):
    for result in results:
        got = result["refused"]
        assert got[how] is not None and "config_hash" in got[how], got[how]
        assert got[f"{how} unchanged"], f"{how}: the refused load changed weights or optimizer state"


def test_frozen_parameters_are_broadcast_and_unfreezing_is_refused(results):
    first, second = (r["frozen"] for r in results)
    assert torch.equal(first["frozen_after_build"], second["frozen_after_build"])
    for result in (first, second):
        assert result["unfreeze"] is not None and "0.weight" in result["unfreeze"], result["unfreeze"]
        assert "was frozen and is now trainable" in result["unfreeze"], result["unfreeze"]
