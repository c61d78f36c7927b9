"""The support table (co2_zero/core/support.py), checked through the real construction paths.

Every row of `support.TABLE` has a witness here: a co2 section and the entry point it is built with
(CO2Optimizer over plain parameters, FairScale's CO2OSS, co2_zero.deepspeed.initialize, Lightning's
CO2Strategy, an elastic membership), built on 2 gloo ranks (each its own replica); each is refused when
the optimizer is built, with that row's message. A row without a witness fails the suite. A grid of
allowed combinations (stand-in x overlap x wire format, and a few more) each runs a round and agrees
with the table, which allows it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from co2_zero import CO2Config
from co2_zero.core import support
from co2_zero.core.plan import ResolvedPlan, resolve
from co2_zero.core.round_schedule import RoundSchedule
from tests import models
from tests.dist_utils import run_ranks

TAU = 2
ELASTIC, PLAIN, FAIRSCALE, DEEPSPEED, LIGHTNING, TRAIN, RESHARD = (
    "elastic",
    "plain",
    "fairscale",
    "deepspeed",
    "lightning",
    "train",
    "reshard",
)

# str(row) -> (entry point, co2 section): the cheapest real build that meets the row (and no row before it)
WITNESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "collective: 'reduce_scatter', 'all_reduce' with topk: not 1.0": (PLAIN, {"collective": "all_reduce", "topk": 0.5}),
    "collective: 'all_gather' with topk: 1.0": (PLAIN, {"collective": "all_gather"}),
    "feedback_decay: not 1.0, 'auto' with topk: 1.0": (PLAIN, {"feedback_decay": 0.95}),
    "sync_delay: not null, 'auto' with overlap: false": (PLAIN, {"sync_delay": 1, "overlap": False}),
    "overlap: false with stand_in: 'local'": (PLAIN, {"overlap": False, "stand_in": "local"}),
    "plan.collective: 'reduce_scatter' with clip.mode: not 'none' and plan.stand_in: 'local'": (
        PLAIN,
        {"clip": {"mode": "norm"}, "collective": "reduce_scatter"},
    ),
    "sync_delay: not null, 'auto' with replica_tau: not null": (PLAIN, {"replica_tau": [2, 1], "sync_delay": 1}),
    "comm_dtype: 'bf16' with replica_tau: not null": (PLAIN, {"replica_tau": [2, 1], "comm_dtype": "bf16"}),
    "replica_tau: not null with driver: 'lightning', 'hf-trainer'": (LIGHTNING, {"replica_tau": [2, 1]}),
    "replica_tau: not null with driver: 'co2-train' and elastic: true": (f"{TRAIN}+{ELASTIC}", {"replica_tau": "auto"}),
    "replica_tau: not null, 'auto' with elastic: true": (ELASTIC, {"replica_tau": [2, 1]}),
    "replica_tau: not null with replicas_changed: true": (RESHARD, {"replica_tau": "auto"}),
    "shards_per_replica: not 'node', 1 with integration: 'plain'": (PLAIN, {"shards_per_replica": 2}),
    "elastic: true with integration: 'fairscale', 'deepspeed'": (FAIRSCALE + "+" + ELASTIC, {}),
    "topk: not 1.0 with elastic: true": (ELASTIC, {"topk": 0.5}),
    "comm_dtype: not 'fp32', 'bf16' with elastic: true": (ELASTIC, {"comm_dtype": "int8"}),
    "plan.collective: not 'all_reduce' with elastic: true": (ELASTIC, {"collective": "reduce_scatter"}),
    "overlap: false with elastic: true": (ELASTIC, {"overlap": False}),
    "plan.sync_delay: 'fixed' with elastic: true": (ELASTIC, {"sync_delay": 1}),
    "replicas: not 1 with elastic: true": (ELASTIC, {}),
    "float_buffers: not 0 with elastic: true": (ELASTIC + "+buffers", {}),
}
# Also refused: the deepspeed entry point with a membership (the same row as FairScale's).
EXTRA_WITNESSES = [
    ("elastic: true with integration: 'fairscale', 'deepspeed'", DEEPSPEED + "+" + ELASTIC, {}),
]

# Allowed: every stand-in with overlap and without, each wire format, and a few more; each runs a round.
GRID = [
    *({"stand_in": stand_in} for stand_in in ("auto", "shared", "local")),
    *({"stand_in": stand_in, "overlap": False} for stand_in in ("auto", "shared", "local")),
    {"comm_dtype": "int8"},
    {"comm_dtype": "bf16", "topk": 0.5},
    {"clip": {"mode": "norm"}, "collective": "all_reduce"},
    {"nonfinite": "skip_round", "sync_delay": 1},
    {"replica_tau": [2, 1]},
    {"replica_tau": [2, 1], "comm_dtype": "int4", "topk": 0.5},
    {"replica_tau": "auto"},
    {"collective": "reduce_scatter", "comm_dtype": "int4"},
]


def _build(entry: str, section: dict[str, Any]) -> Any:
    """Build `entry` with `section` on this rank (tau=TAU unless set); the optimizer, or what raised."""
    co2 = {"tau": TAU, **section}
    membership = None
    if ELASTIC in entry:
        from co2_zero.elastic import Membership

        membership = Membership("http://localhost:1", 0)  # never reached: the refusal comes first
    if entry.startswith(FAIRSCALE):
        from co2_zero.fairscale import CO2OSS

        kwargs = {"membership": membership} if membership is not None else {}
        return CO2OSS(models.make_model("mlp").parameters(), co2=co2, lr=0.1, **kwargs)
    if entry.startswith(DEEPSPEED):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from co2_zero import deepspeed as co2_deepspeed

        model = models.make_model("mlp")
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "co2": co2}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
        kwargs = {"membership": membership} if membership is not None else {}
        return co2_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)
    if entry == LIGHTNING:
        from co2_zero.lightning import CO2Strategy

        return CO2Strategy(co2=co2)
    if entry == RESHARD:  # checkpoint.load(..., reshard=True)'s check, of a saved run of R = 2 loaded at R = 1
        from co2_zero.checkpoint.loading import check_replicas_kept

        return check_replicas_kept(CO2Config.from_dict(co2), saved_replicas=2, replicas=1)
    if entry.startswith(TRAIN):  # co2-train's own check, as co2_zero.train.loop.build makes it
        from co2_zero.core.plan import check_given

        return check_given(CO2Config.from_dict(co2), driver="co2-train", elastic=membership is not None)
    from co2_zero import CO2Optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)) if "buffers" in entry else None
    model = model or models.make_model("mlp")
    return CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), co2, model=model, membership=membership)


def _one_round(rank: int, section: dict[str, Any]) -> dict[str, Any]:
    """Build a plain CO2Optimizer with `section` and run one round on the mlp; what it ended with."""
    from co2_zero import CO2Optimizer

    torch.manual_seed(0)
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), {"tau": TAU, **section}, model=model)
    models.train_steps(rank, model, opt, 0, opt.steps_per_round)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    rounds = opt.engine.rounds
    plan = repr(opt.plan)
    opt.engine.close()
    return {"rounds": rounds, "finite": finite, "plan": plan}


def _child(rank: int, world: int) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
    refused: dict[int, str] = {}
    cases = [(key, entry, section) for key, (entry, section) in WITNESSES.items()] + EXTRA_WITNESSES
    for i, (_, entry, section) in enumerate(cases):
        try:
            _build(entry, section)
            refused[i] = "built"
        except support.Unsupported as error:
            refused[i] = str(error)
    return {"refused": refused, "ran": [_one_round(rank, section) for section in GRID if _allowed(section)]}


def _allowed(section: dict[str, Any]) -> bool:
    """What the table says of `section` built as a plain CO2Optimizer (any refusal is an Unsupported)."""
    from co2_zero import CO2Config

    try:
        CO2Config.from_dict({"tau": TAU, **section})
    except support.Unsupported:
        return False
    return True


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_child, 2, timeout=600)


def test_every_row_has_a_witness():
    assert sorted(WITNESSES) == sorted(str(row) for row in support.TABLE)


CASES = [(key, entry, section) for key, (entry, section) in WITNESSES.items()] + EXTRA_WITNESSES


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{e}:{k}" for k, e, _ in CASES])
def test_every_refused_combination_is_refused_when_built_with_its_message(results, index):
    key, entry, section = CASES[index]
    (row,) = [row for row in support.TABLE if str(row) == key]
    for got in results:
        message = got["refused"][index]
        assert message.startswith("co2 config: ") and f"({row.why}); accepted: " in message, (entry, message)
        assert message.endswith(row.accepted.format(tau=TAU)), message
        subject = row.subject.removeprefix("plan.")
        assert re.search(rf"\b{re.escape(subject)}\b|elastic membership|replicas", message), message
        for name, _ in row.context:  # every setting it is refused with is named
            named = {
                "integration": "",
                "driver": "",
                "elastic": "elastic membership",
                "replicas_changed": "resharded",
            }.get(name, name.removeprefix("plan."))
            assert named in message, (name, message)


def test_every_allowed_combination_of_the_grid_runs_a_round(results):
    allowed = [section for section in GRID if _allowed(section)]
    assert len(allowed) == len(GRID) - 1  # local without overlap is the grid's only refused cell
    for got in results:
        assert len(got["ran"]) == len(allowed)
        for section, ran in zip(allowed, got["ran"]):
            assert ran["rounds"] == 1 and ran["finite"], (section, ran)
            assert ran["plan"].startswith("ResolvedPlan(config=CO2Config(tau=2"), ran["plan"]


ONE_REPLICA = SimpleNamespace(replicas=1, shards=1, outer_group=None)


@pytest.mark.parametrize(
    ("section", "backend", "elastic", "resolved", "first"),
    [
        ({}, "gloo", False, {"collective": "all_reduce", "stand_in": "local", "sync_delay": "measured"}, {}),
        ({}, "nccl", False, {"collective": "reduce_scatter"}, {"applies_at": TAU}),
        ({"clip": {"mode": "norm"}}, "nccl", False, {"collective": "all_reduce", "stand_in": "local"}, {}),
        ({"clip": {"mode": "value"}, "stand_in": "shared"}, "nccl", False, {"collective": "reduce_scatter"}, {}),
        ({"topk": 0.5}, "nccl", False, {"collective": "all_gather"}, {}),
        ({"overlap": False}, "gloo", False, {"stand_in": "shared", "sync_delay": "at once"}, {"applies_at": 0}),
        ({"sync_delay": None}, "gloo", False, {"sync_delay": "round end"}, {"applies_at": TAU}),
        ({"sync_delay": TAU}, "gloo", False, {"sync_delay": "round end"}, {}),
        ({"sync_delay": 1}, "gloo", False, {"sync_delay": "fixed"}, {"applies_at": 1}),
        ({"replica_tau": [TAU]}, "gloo", False, {"sync_delay": "round end"}, {"tau": TAU, "weights": (1.0,)}),
        ({"replica_tau": "auto"}, "gloo", False, {"replica_tau": "measured"}, {"tau": TAU}),
        ({"replica_tau": "auto"}, "gloo", True, {"replica_tau": "every round"}, {"tau": TAU}),
        ({}, "gloo", True, {"sync_delay": "round end", "stand_in": "local"}, {"applies_at": TAU}),
    ],
)
def test_the_plan_resolves_every_auto_once(section, backend, elastic, resolved, first):
    """docs/design.md §3, "How a round flows": the collective for the backend, the stand-in, the sync delay
    mode, the replicas' tau mode, an elastic membership's rewrite; immutable; repr names them all. The
    values decided while the run runs (the apply point, each round's steps) are the round schedule's: its
    first decision here."""
    plan = resolve(CO2Config(tau=TAU, **section), ONE_REPLICA, elastic=elastic, backend=backend)
    assert {key: getattr(plan, key) for key in resolved} == resolved
    decision = RoundSchedule(plan, 0).decision
    assert {key: getattr(decision, key) for key in first} == first, decision
    assert not {"taus", "steps_before_apply"} & {f.name for f in dataclasses.fields(ResolvedPlan)}
    assert all(f"{f.name}=" in repr(plan) for f in dataclasses.fields(ResolvedPlan)), repr(plan)
    assert repr(plan.config) in repr(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.collective = "all_reduce"
    assert plan.config.sync_delay == (None if elastic else CO2Config(tau=TAU, **section).sync_delay)
