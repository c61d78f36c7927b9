"""A config's identity (`CO2Config.math_hash`, what a checkpoint is checked against) survives new fields:
a field added at its `"neutral"` value leaves every existing config's hash, and the checkpoints saved
with it, as they were."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from co2_zero import CO2Optimizer, checkpoint
from co2_zero.core.config import PUBLISHED, CO2Config
from tests import models
from tests.dist_utils import run_ranks

# math_hash() of these configs as the code before `topk` existed computed it (the hashes in checkpoints)
EXISTING = [
    ({}, "60dcf12d30d96517"),
    (PUBLISHED, "f24a5a9ea77b8c21"),
    ({"comm_dtype": "int8", "clip": {"mode": "norm"}}, "aa28fc50245629bd"),
    ({"overlap": False, "tau": 8}, "2990688362401fe3"),
]


@dataclasses.dataclass(frozen=True)
class Extended(CO2Config):
    """CO2Config with a field added later, at its neutral value by default."""

    future: float = dataclasses.field(default=0.0, metadata={"doc": "A later field.", "neutral": 0.0})


@pytest.mark.parametrize("fields,expected", EXISTING)
def test_existing_hashes_are_unchanged_by_neutral_fields(fields, expected):
    assert CO2Config(**fields).math_hash() == expected
    assert CO2Config(**fields, topk=1.0).math_hash() == expected  # topk's neutral value
    assert Extended(**fields).math_hash() == expected  # and a field added after it
    assert Extended(**fields, future=0.5).math_hash() != expected  # away from it, the identity changes
    assert CO2Config(**fields, topk=0.5).math_hash() != expected


def test_a_field_without_a_neutral_value_still_changes_the_identity():
    """The rule is opt-in: a field that declares no neutral value enters the hash (the old behaviour)."""

    @dataclasses.dataclass(frozen=True)
    class Plain(CO2Config):
        future: float = 0.0

    assert Plain().math_hash() != CO2Config().math_hash()


def save_then_load_with_a_new_field(rank: int, world: int, directory: str) -> dict:
    """Save with today's defaults, then load into an optimizer whose config class has a new field."""
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), {"tau": 2}, model=model)
    models.train_steps(rank, model, opt, 0, 3)
    checkpoint.save(directory, model, opt, extra={"step": 3})
    opt.finalize()
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), Extended(tau=2), model=model)
    step = checkpoint.load(directory, model, opt)["step"]
    models.train_steps(rank, model, opt, step, 5)
    opt.finalize()
    return {"step": step}


def test_a_checkpoint_saved_before_a_field_existed_still_loads(tmp_path):
    directory = tmp_path / "ckpt"
    results = run_ranks(save_then_load_with_a_new_field, 2, str(directory), timeout=240.0)
    assert [r["step"] for r in results] == [3, 3]
    marker = next(p for p in Path(directory).rglob("*.json") if "config_hash" in p.read_text())
    assert json.loads(marker.read_text())["config_hash"] == CO2Config(tau=2).math_hash()
