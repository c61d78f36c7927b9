"""co2_zero.lightning.CO2DeepSpeedStrategy on 4 real CPU ranks, S = 2 shards x R = 2 replicas of ZeRO-2:
every step against the independent reference, resume bit for bit mid-round through fit(ckpt_path=...),
the model saved after fit, and the refusals of a bad config.

Rank (r, s) trains on slice s of replica r's batch at every step (tests.models.shard_batch), as the
reference's replica r averages the gradients of its S slices.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children
pytest.importorskip("lightning", reason="pip install -e '.[lightning]'")
pytest.importorskip("co2_zero.deepspeed")

from co2_zero.lightning import CO2DeepSpeedStrategy  # noqa: E402
from tests import models  # noqa: E402
from tests.dist_utils import environment, run_ranks  # noqa: E402
from tests.integrations.test_deepspeed import ds_config, reference  # noqa: E402
from tests.lightning_app import Lit, Recorder, as_torchrun, loader, params, trainer  # noqa: E402
from tests.scenarios import co2  # noqa: E402

WORLD, SHARDS = 4, 2
CO2 = {"shards_per_replica": SHARDS, **co2("overlap-heavyball-adaptive-t3")}
# the shipped ZeRO-2 config (AdamW, WarmupDecayLR, clipping); Lightning sets the accumulation itself
SCENARIO = dict(config=ds_config("ds_zero2_co2", CO2, drop=("gradient_accumulation_steps",)), steps=8)


def _slice(rank: int, step: int):
    replica, shard = divmod(rank, SHARDS)
    return models.shard_batch(replica, shard, step, SHARDS)


def run_all(rank: int, world: int, directory: str) -> dict:
    """Uninterrupted with a save every 2 steps, then fit(ckpt_path=...) from step 4 (mid-round: the round
    that ended at step 3 is in flight), then the model saved after fit, read back by validate."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    as_torchrun(rank, world)
    saves, data = Path(directory) / "saves", loader(lambda i: torch.zeros(1), 100)
    runs = {}
    for start in (None, "epoch=0-step=4.ckpt"):
        recorder = Recorder()
        callbacks = [recorder]
        if start is None:
            callbacks.append(ModelCheckpoint(dirpath=saves, save_top_k=-1, every_n_train_steps=2))
        strategy = CO2DeepSpeedStrategy(config=SCENARIO["config"])
        run = trainer(
            WORLD, strategy, max_steps=SCENARIO["steps"], callbacks=callbacks, enable_checkpointing=start is None
        )
        run.fit(Lit(by_step=_slice), data, ckpt_path=None if start is None else saves / start)
        runs[start] = {"steps": recorder.steps, "final": params(run.lightning_module)}
    final = Path(directory) / "final.ckpt"
    run.save_checkpoint(final)  # after fit: one model, Lightning's single file from rank 0
    runs["saved"] = params(Lit.load_from_checkpoint(final))
    evaluated = Lit()  # validate builds Lightning's inference engine, on CPU too
    checks = loader(lambda i: _slice(rank, i), 2)
    trainer(WORLD, CO2DeepSpeedStrategy(config=SCENARIO["config"])).validate(evaluated, checks, ckpt_path=final)
    runs["validated"] = params(evaluated)
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with environment(TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions"))):  # the children's JIT
        return run_ranks(run_all, WORLD, str(tmp_path_factory.mktemp("lightning_ds")), timeout=400)


def _close(actual: dict, expected: dict, what: str) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{what}/{k}: {m}")


def test_every_step_matches_the_reference(results):
    _, steps, finals = reference(SCENARIO, SHARDS)
    for rank, per_rank in enumerate(results):
        got = per_rank[None]
        assert sorted(got["steps"]) == list(range(1, SCENARIO["steps"] + 1))
        for k in range(SCENARIO["steps"]):
            _close(got["steps"][k + 1], steps[k][rank // SHARDS], f"rank {rank} after step {k + 1}")
        _close(got["final"], finals[rank // SHARDS], f"rank {rank} final")


def test_resume_mid_round_continues_bit_for_bit(results):
    for rank, per_rank in enumerate(results):
        whole, resumed = per_rank[None], per_rank["epoch=0-step=4.ckpt"]
        assert sorted(resumed["steps"]) == list(range(5, SCENARIO["steps"] + 1))
        for step, values in resumed["steps"].items():
            assert all(torch.equal(whole["steps"][step][k], v) for k, v in values.items()), (rank, step)
        assert all(torch.equal(whole["final"][k], v) for k, v in resumed["final"].items()), rank


def test_every_rank_ends_with_the_model_the_file_after_fit_holds(results):
    final = results[0][None]["final"]
    for per_rank in results:
        resumed = per_rank["epoch=0-step=4.ckpt"]["final"]
        for got in (per_rank[None]["final"], resumed, per_rank["saved"], per_rank["validated"]):
            assert all(torch.equal(final[k], v) for k, v in got.items())


def test_a_config_without_a_valid_co2_section_is_refused_when_built():
    with pytest.raises(ValueError, match="needs a DeepSpeed config with a co2 section"):
        CO2DeepSpeedStrategy(config=ds_config("ds_zero2_co2", plain=True))
    with pytest.raises(ValueError, match="tau"):
        CO2DeepSpeedStrategy(config=ds_config("ds_zero2_co2", {"tau": 0}))
    with pytest.raises(ValueError, match="stage"):
        CO2DeepSpeedStrategy(config=ds_config("ds_zero2_co2", zero={"stage": 3}))
    with pytest.raises(ValueError, match="CO2"):  # a misspelt section is named
        config = ds_config("ds_zero2_co2")
        config["CO2"] = config.pop("co2")
        CO2DeepSpeedStrategy(config=config)
