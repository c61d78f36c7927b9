"""Float module buffers (BatchNorm statistics) at round ends and finalize: a NaN on one rank never
reaches the others (docs/design.md §3, non-finite rounds)."""

from __future__ import annotations

import warnings

import pytest
import torch

from co2_zero import CO2Config, CO2Error, CO2Optimizer, NonFiniteError
from co2_zero.core.config import PUBLISHED
from tests import models
from tests.dist_utils import run_ranks

TIMEOUT_S = 10.0
NAN_STEP = 3  # rank 1's input holds a NaN at this inner step: the last step of round 1 (tau = 2)


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = models.batch(rank, step)
    if rank == 1 and step == NAN_STEP:
        x[0, 0] = float("nan")
    return x, y


def _build(policy: str) -> tuple[torch.nn.Module, CO2Optimizer]:
    model = models.make_model("bn")
    # CO2 as published (the shared start: every replica identical at round starts), for both policies alike
    config = CO2Config(**{**PUBLISHED, "tau": 2}, nonfinite=policy, timeout_s=TIMEOUT_S)
    return model, CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config, model=model)


def skip_round(rank: int) -> dict:
    """A NaN input on rank 1 in round 1; later, a NaN forward pass (no step) on rank 1 just before
    finalize(). Every rank must keep the last agreed buffers both times."""
    model, opt = _build("skip_round")
    agreed, restored = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            x, y = _batch(rank, step)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            opt.step()
            if opt.round_ended:
                agreed.append(_buffers(model))
                restored.append(opt.last_round["buffers_restored"])
        if rank == 1:
            with torch.no_grad():  # e.g. an evaluation forgotten in train mode
                model(torch.full((4, 4), float("nan")))
        opt.finalize()
    model.eval()
    with torch.no_grad():
        output = model(models.batch(0, 100)[0])
    return {
        "agreed": agreed,
        "restored": restored,
        "final": _buffers(model),
        "output": output,
        "warnings": [str(w.message) for w in caught],
    }


def raise_on_nan(rank: int) -> dict:
    """The same NaN input under nonfinite='raise': every rank raises, no rank's buffers change."""
    model, opt = _build("raise")
    before = {}
    try:
        for step in range(6):
            x, y = _batch(rank, step)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            before = _buffers(model)  # what this rank holds before the round end in opt.step()
            opt.step()
    except CO2Error as error:
        return {"error": error, "before": before, "after": _buffers(model)}
    return {"error": None}


def buffer_runs(rank: int, world: int) -> dict:
    return {"skip_round": skip_round(rank), "raise": raise_on_nan(rank)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(buffer_runs, 2, timeout=120)


def test_skip_round_keeps_the_last_agreed_buffers_on_every_rank(results):
    first, second = (r["skip_round"] for r in results)
    for got in (first, second):
        assert got["restored"] == [False, True, False], got["restored"]
        # round 1's end restored round 0's agreed buffers instead of averaging rank 1's NaN
        for name, value in got["agreed"][1].items():
            assert torch.isfinite(value).all(), name
            assert torch.equal(value, got["agreed"][0][name]), name
        assert any("round 1" in w and "rank(s) [1]" in w and "last agreed buffers" in w for w in got["warnings"]), got[
            "warnings"
        ]
        assert any("finalize" in w and "rank(s) [1]" in w for w in got["warnings"]), got["warnings"]
        # finalize() found rank 1's NaN too: every rank keeps round 2's agreed buffers
        for name, value in got["final"].items():
            assert torch.equal(value, got["agreed"][2][name]), name
    for t in range(3):
        for name, value in first["agreed"][t].items():
            assert torch.equal(value, second["agreed"][t][name]), (t, name)
    still_averaging = first["agreed"][2]["1.running_mean"], first["agreed"][0]["1.running_mean"]
    assert not torch.equal(*still_averaging)
    assert torch.isfinite(first["output"]).all() and torch.equal(first["output"], second["output"])


def test_raise_fails_every_rank_before_any_buffer_is_written(results):
    for rank, result in enumerate(r["raise"] for r in results):
        error = result["error"]
        assert isinstance(error, NonFiniteError), f"rank {rank}: {error!r}"
        assert "round 1" in str(error) and "rank(s) [1]" in str(error) and "replica(s) [1]" in str(error), error
        for name, value in result["after"].items():
            assert torch.allclose(value, result["before"][name], rtol=0, atol=0, equal_nan=True), (rank, name)
    healthy = results[0]["raise"]["after"]
    assert all(torch.isfinite(value).all() for value in healthy.values()), healthy
