"""Replicas of different speeds (`replica_tau`, docs/design.md §3) on DeepSpeed ZeRO-1 in a loop of the user's
own (`co2_zero.deepspeed.initialize`): each replica runs rounds x `opt.steps_per_round` engine steps.

S x R = 2 x 2 on real gloo processes against the independent reference (`reference.simulate_paced`, with
DeepSpeed's AdamW and WarmupLR schedule, stepped at each replica's own steps as DeepSpeed's engine does) at
every inner step of every rank; the default checkpoint tag agrees across replicas of different step
counts; HF Trainer (which runs the same steps on every replica) refuses it when built. `replica_tau: "auto"`
(slow): 2 rounds at tau, then the τ_r fixed from each replica's step times (replica 1's clock runs at half
speed), against the reference at every inner step.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests import models
from tests.dist_utils import environment, run_ranks
from tests.integrations.test_deepspeed import ReferenceInner, _assert_close, _params, ds_config
from tests.reference import simulate_paced

TAU, PACED, SHARDS = 4, [4, 2], 2
ROUNDS, EXTRA = 3, [1, 1]  # then a partial round, dropped by finalize()
SAVE_AT_ROUND = 2  # a checkpoint with the default tag at this round end


def _config() -> dict:
    co2 = {"tau": TAU, "replica_tau": PACED, "shards_per_replica": SHARDS}  # the defaults otherwise
    return ds_config("ds_zero1_co2", co2, co2_only=True, drop=("gradient_clipping",))


def _child(rank: int, world: int, directory: str) -> dict:
    from co2_zero.deepspeed import initialize

    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
    replica, shard = divmod(rank, SHARDS)
    model = models.make_model("mlp")
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=_config())
    trajectory: list = []
    saved: list = []
    for step in range(ROUNDS * opt.steps_per_round + EXTRA[replica]):  # its own steps: its data position
        x, y = models.shard_batch(replica, shard, step, SHARDS)
        engine.backward(models.loss_fn(engine(x).float(), y))
        engine.step()
        trajectory.append(_params(engine.module))
        if opt.round_ended and opt.engine.rounds == SAVE_AT_ROUND:
            saved.append(engine.save_checkpoint(directory).name)
    out = {"trajectory": trajectory, "steps_per_round": opt.steps_per_round, "saved": saved}
    out["global_steps"] = engine.global_steps
    opt.finalize()
    out["final"] = _params(engine.module)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with environment(TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions"))):  # the children's JIT
        return run_ranks(_child, 2 * SHARDS, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_every_inner_step_matches_the_reference(results):
    config = _config()
    per_step: list = []
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: ReferenceInner(p, config), models.batch,
                            models.loss_fn, config["co2"], PACED, ROUNDS, EXTRA, shards=SHARDS,
                            shard_batch=lambda r, s, k: models.shard_batch(r, s, k, SHARDS),
                            step_record=per_step)  # fmt: skip
    for rank, got in enumerate(results):
        replica = rank // SHARDS
        assert got["steps_per_round"] == PACED[replica]
        assert got["global_steps"] == len(got["trajectory"]) == len(per_step[replica])
        assert len(got["trajectory"]) == ROUNDS * PACED[replica] + EXTRA[replica]
        for k, (actual, expected) in enumerate(zip(got["trajectory"], per_step[replica])):
            _assert_close(actual, expected, f"deepspeed rank {rank} after its step {k + 1}")
        _assert_close(got["final"], finals[replica], f"deepspeed rank {rank} final")


def test_the_default_checkpoint_tag_is_the_same_on_every_replica(results):
    """DeepSpeed's engine counts each replica's own steps (8 and 4 at the end of round 2); the default tag
    counts them on the fastest replica's clock, so both replicas save into one checkpoint."""
    assert [got["saved"] for got in results] == [[f"global_step{SAVE_AT_ROUND * TAU}"]] * len(results)


def test_hf_trainer_refuses_it_when_built():
    """CO2Callback's check when the Trainer is built (called unbound: creating the callback patches DeepSpeed)."""
    from co2_zero.hf import CO2Callback

    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=_config()), deepspeed="ds.json")
    with pytest.raises(ValueError, match=r"replica_tau=\[4, 2\] is not supported with Hugging Face Trainer"):
        CO2Callback.on_init_end(None, args, None, None)


# ---- replica_tau "auto": measured in the first rounds, then fixed (tests/core/test_pace_auto.py) --------------

AUTO_ROUNDS = 4  # replica 1's clock makes it half as fast: [4, 2]
MEASURED_ROUNDS = 1  # round 0 at tau: at tau = 4 its end comes before MEASURED_STEPS timed steps, and decides


def _auto_config() -> dict:
    co2 = {"tau": TAU, "replica_tau": "auto", "shards_per_replica": SHARDS}
    return ds_config("ds_zero1_co2", co2, co2_only=True, drop=("gradient_clipping",))


def _auto_child(rank: int, world: int) -> dict:
    from co2_zero.deepspeed import initialize
    from tests.core.test_pace_auto import _slow_clock

    os.environ.setdefault("LOCAL_RANK", str(rank))
    replica, shard = divmod(rank, SHARDS)
    _slow_clock(replica)
    model = models.make_model("mlp")
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=_auto_config())
    trajectory: list = []

    def step() -> None:
        x, y = models.shard_batch(replica, shard, len(trajectory), SHARDS)  # its own steps: its data position
        engine.backward(models.loss_fn(engine(x).float(), y))
        engine.step()
        trajectory.append(_params(engine.module))

    while opt.engine.rounds < AUTO_ROUNDS:
        step()
    for _ in range(EXTRA[replica]):
        step()
    out = {"trajectory": trajectory, "steps_per_round": opt.steps_per_round, "global_steps": engine.global_steps}
    opt.finalize()
    out["final"] = _params(engine.module)
    dist.barrier()
    return out


@pytest.mark.slow
def test_auto_measures_then_matches_the_reference_at_every_step(tmp_path):
    with environment(TORCH_EXTENSIONS_DIR=str(tmp_path)):  # the children's JIT
        results = run_ranks(_auto_child, 2 * SHARDS, timeout=300)
    config = _auto_config()
    per_step: list = []
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: ReferenceInner(p, config), models.batch,
                            models.loss_fn, config["co2"], PACED, AUTO_ROUNDS, EXTRA, shards=SHARDS,
                            shard_batch=lambda r, s, k: models.shard_batch(r, s, k, SHARDS),
                            step_record=per_step, uniform_rounds=MEASURED_ROUNDS)  # fmt: skip
    for rank, got in enumerate(results):
        replica = rank // SHARDS
        assert got["steps_per_round"] == PACED[replica]
        assert got["global_steps"] == len(got["trajectory"]) == len(per_step[replica])
        for k, (actual, expected) in enumerate(zip(got["trajectory"], per_step[replica])):
            _assert_close(actual, expected, f"deepspeed auto rank {rank} after its step {k + 1}")
        _assert_close(got["final"], finals[replica], f"deepspeed auto rank {rank} final")
