"""Ranks that list the same-shaped parameters in different orders (issue 20, item 1).

Every rank sees the same sequence of shapes, so a check of shapes alone passes, and CO2 would average
weight i of one rank with weight j of another. Where co2_zero lays out the partition itself
(CO2Optimizer, plain and FSDP2) it orders it by the model, so the result is the one of identically
ordered ranks; where the framework keeps the user's order (FairScale's OSS buckets, DeepSpeed's ZeRO
groups) construction is refused on every rank, naming the first position and both ranks' parameters.
Two real gloo ranks, S = 1 x R = 2, the "square" model (every tensor 4 x 4).
"""

from __future__ import annotations

import os

import pytest
import torch

from co2_zero import CO2Error, CO2Optimizer
from tests import models
from tests.dist_utils import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children

CONFIG = {
    "tau": 2,
    "outer_lr": 0.8,
    "outer_momentum": 0.5,
    "gap_penalty": {"mode": "adaptive", "strength": 1.5},
    "shards_per_replica": 1,
    "timeout_s": 60,
}
STEPS = 8
REVERSED = "rank 0 has '0.weight' (shape (4, 4)) where rank 1 has '4.weight' (shape (4, 4))"


def in_rank_order(model: torch.nn.Module, rank: int) -> list[torch.nn.Parameter]:
    """The model's parameters, reversed on rank 1: the same shapes in the same places, other tensors."""
    params = list(model.parameters())
    return params if rank == 0 else params[::-1]


def in_set_order(model: torch.nn.Module, rank: int) -> list[torch.nn.Parameter]:
    """The parameters of a set of their names: its order follows this process's string hashing."""
    named = dict(model.named_parameters())
    return [named[name] for name in set(named)]


def in_model_order(model: torch.nn.Module, rank: int) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    full = {n: getattr(p, "full_tensor", p.detach)() for n, p in model.named_parameters()}
    return {n: t.detach().clone() for n, t in full.items()}


def _refusal(build) -> str | None:
    try:
        build()
    except CO2Error as error:
        return str(error)
    return None


# ---- the children -----------------------------------------------------------------------------------------


def train_co2optimizer(rank: int, order, mesh=None) -> dict:
    """CO2Optimizer (FSDP2-sharded when `mesh` is given) over the model's parameters in `order`."""
    model = models.make_model("square")
    if mesh is not None:
        from tests.integrations.test_fsdp import shard

        shard(model, mesh)
    params = order(model, rank)
    opt = CO2Optimizer(torch.optim.Adam(params, lr=0.01), CONFIG, model=model)
    models.train_steps(rank, model, opt, 0, STEPS)
    opt.finalize()
    return {"names": [dict((id(p), n) for n, p in model.named_parameters())[id(p)] for p in params], **_params(model)}


def build_co2oss(rank: int, order) -> None:
    from co2_zero.fairscale import CO2OSS

    model = models.make_model("square")
    CO2OSS(order(model, rank), optim=torch.optim.Adam, co2=CONFIG, model=model, lr=0.01)


def build_deepspeed(rank: int, order) -> None:
    from co2_zero.deepspeed import initialize

    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
    model = models.make_model("square")
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "co2": CONFIG,
    }
    initialize(model=model, model_parameters=order(model, rank), config=config)


def reversed_on_rank_1(rank: int, world: int) -> dict:
    from co2_zero.fsdp import replica_mesh

    mesh = replica_mesh(CONFIG)
    return {
        "plain": train_co2optimizer(rank, in_rank_order),
        "plain_model_order": train_co2optimizer(rank, in_model_order),
        "fsdp": train_co2optimizer(rank, in_rank_order, mesh),
        "fsdp_model_order": train_co2optimizer(rank, in_model_order, mesh),
        "fairscale": _refusal(lambda: build_co2oss(rank, in_rank_order)),
        "deepspeed": _refusal(lambda: build_deepspeed(rank, in_rank_order)),
    }


def set_of_names(rank: int, world: int) -> dict:
    return {
        "plain": train_co2optimizer(rank, in_set_order),
        "plain_model_order": train_co2optimizer(rank, in_model_order),
        "fairscale": _refusal(lambda: build_co2oss(rank, in_set_order)),
    }


@pytest.fixture(scope="module")
def reversed_results():
    return run_ranks(reversed_on_rank_1, 2, timeout=300)


@pytest.fixture(scope="module")
def set_results():
    """PYTHONHASHSEED 1 and 2 iterate {'0.weight', '2.weight', '4.weight'} in different orders."""
    return run_ranks(set_of_names, 2, timeout=240, rank_env=[{"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "2"}])


# ---- the tests --------------------------------------------------------------------------------------------


def _assert_same_model(results: list, name: str) -> None:
    """Both ranks end with one model, and it is the one of ranks that list the parameters alike."""
    first, second = (r[name] for r in results)
    assert first["names"] != second["names"], f"{name}: the ranks listed the parameters alike; nothing tested"
    for key in ("0.weight", "2.weight", "4.weight"):
        assert torch.equal(first[key], second[key]), f"{name}: the ranks differ in {key} after finalize()"
        expected = results[0][f"{name}_model_order"][key]
        assert torch.equal(first[key], expected), f"{name}: {key} differs from identically ordered ranks"


@pytest.mark.parametrize("integration", ["plain", "fsdp"])
def test_co2optimizer_orders_the_partition_by_the_model(reversed_results, integration):
    _assert_same_model(reversed_results, integration)


def test_co2optimizer_over_a_set_of_names_trains_like_identically_ordered_ranks(set_results):
    _assert_same_model(set_results, "plain")


@pytest.mark.parametrize("integration", ["fairscale", "deepspeed"])
def test_frameworks_keeping_the_given_order_refuse_it_naming_the_parameters(reversed_results, integration):
    messages = [r[integration] for r in reversed_results]
    assert messages[0] is not None and messages[0] == messages[1], messages  # the same error on every rank
    assert "position 0 of the CO2 partition order" in messages[0] and REVERSED in messages[0], messages[0]
    assert "in the same order on every rank" in messages[0], messages[0]


def test_fairscale_over_a_set_of_names_is_refused_on_every_rank(set_results):
    first, second = (r["fairscale"] for r in set_results)
    assert first is not None and first == second and "rank 0 has '2.weight'" in first, (first, second)
