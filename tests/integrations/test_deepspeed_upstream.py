"""DeepSpeed's own behaviour behind a workaround in co2_zero.deepspeed, pinned on plain DeepSpeed.

co2_zero/deepspeed/workarounds.py keeps the DeepSpeed workarounds, one entry per upstream behaviour. The
tests here watch the upstream behaviour itself, so that a DeepSpeed release that changes it turns the suite
red and the workaround gets reviewed (and deleted):

- `gradient_clipping` absent: DeepSpeed 0.19.8 clips the global gradient norm at 1.0 (its
  GRADIENT_CLIPPING_DEFAULT, changed from 0.0 to 1.0 by deepspeedai/DeepSpeed PR #8068), so the optimizer
  receives a gradient other than the batch's. The expected failure below is strict: the day plain
  DeepSpeed hands the true gradient again it XPASSes, which fails the suite.

One spawned gloo rank (world size 1), fp32, torch AdamW, ZeRO-1 and ZeRO-2. A step pre-hook on the
torch optimizer inside the ZeRO optimizer compares the flat fp32 gradient it is about to apply with
the gradient of the batch at the parameters it holds, computed on a separate copy of the model.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests import models
from tests.dist_utils import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children
pytest.importorskip("deepspeed")

STEPS = 6
DEEPSPEED_CLIP_DEFAULT = 1.0  # deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT in 0.19.8


def _config(stage: int, **top) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        **top,
    }


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _gradients_received(initialize, config: dict) -> list[dict]:
    """Train STEPS steps; per step, the flat gradient the torch optimizer received and the true one."""
    model = models.make_model()
    engine, zero, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    (flat_master,) = zero.optimizer.param_groups[0]["params"]  # world size 1: the whole model, in order
    reference = models.make_model()
    records: list[dict] = []
    batch: list = []

    def compare(optimizer, args, kwargs):
        n = sum(p.numel() for p in reference.parameters())
        assert torch.equal(flat_master.detach()[:n], _flat_params(engine.module)), "layout assumption broken"
        with torch.no_grad():
            for p, q in zip(reference.parameters(), engine.module.parameters()):
                p.copy_(q)
        reference.zero_grad(set_to_none=True)
        models.loss_fn(reference(batch[0]), batch[1]).backward()
        received = flat_master.grad.detach().clone()
        records.append(
            {
                "true": torch.cat([p.grad.reshape(-1) for p in reference.parameters()]),
                "received": received[:n],
                "padding": received[n:],
            }
        )

    zero.optimizer.register_step_pre_hook(compare)
    for step in range(STEPS):
        x, y = models.batch(1, step)  # targets offset by 1: gradient norms above 1 on several steps
        batch[:] = [x, y]
        engine.backward(models.loss_fn(engine(x), y))
        engine.step()
    return records


def run_all(rank: int, world: int) -> dict:
    import deepspeed

    import co2_zero.deepspeed as co2_deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    co2_deepspeed.init_distributed()  # DeepSpeed's comm backend, without its 40-85 s JIT build of an unused op
    out = {}
    for stage in (1, 2):
        out[f"plain-absent-z{stage}"] = _gradients_received(deepspeed.initialize, _config(stage))
        out[f"plain-zero-z{stage}"] = _gradients_received(deepspeed.initialize, _config(stage, gradient_clipping=0.0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[f"co2_zero-absent-z{stage}"] = _gradients_received(co2_deepspeed.initialize, _config(stage))
        out[f"co2_zero-absent-z{stage}-warnings"] = [str(w.message) for w in caught]
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks(run_all, 1, timeout=240)[0]


def _assert_true_gradient(records: list[dict], what: str) -> None:
    assert len(records) == STEPS, what
    for step, r in enumerate(records):
        torch.testing.assert_close(r["received"], r["true"], rtol=1e-5, atol=1e-7, msg=f"{what}, step {step}")
        assert not r["padding"].any(), f"{what}, step {step}: alignment padding holds a gradient"


STAGES = pytest.mark.parametrize("stage", [1, 2])


@STAGES
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="DeepSpeed 0.19.8 clips at gradient norm 1.0 when gradient_clipping is absent (GRADIENT_CLIPPING_DEFAULT "
    "= 1.0 since deepspeedai/DeepSpeed PR #8068; applied in DeepSpeedZeroOptimizer.unscale_and_clip_grads). "
    "If this passes, review _explicit_gradient_clipping in co2_zero/deepspeed/workarounds.py",
)
def test_plain_deepspeed_without_gradient_clipping_hands_the_true_gradient(results, stage):
    _assert_true_gradient(results[f"plain-absent-z{stage}"], f"plain DeepSpeed ZeRO-{stage}, no gradient_clipping")


@STAGES
def test_plain_deepspeed_without_gradient_clipping_clips_at_norm_1(results, stage):
    """The whole difference is DeepSpeed's clip at its default 1.0: received = g * min(1, 1/(|g| + 1e-6)),
    with the formula of `unscale_and_clip_grads`; and it is active on this data (else the test above
    could not fail)."""
    clipped = 0
    for step, r in enumerate(results[f"plain-absent-z{stage}"]):
        norm = torch.linalg.vector_norm(r["true"]).item()
        factor = 1.0 / max(1.0, (norm + 1e-6) / DEEPSPEED_CLIP_DEFAULT)
        torch.testing.assert_close(r["received"], r["true"] * factor, rtol=1e-5, atol=1e-7, msg=f"step {step}")
        clipped += factor < 1.0
    assert clipped >= 2, "the data must give gradient norms above 1 on some steps"


@STAGES
def test_plain_deepspeed_with_gradient_clipping_0_hands_the_true_gradient(results, stage):
    _assert_true_gradient(results[f"plain-zero-z{stage}"], f"plain DeepSpeed ZeRO-{stage}, gradient_clipping=0")


@STAGES
def test_co2_zero_initialize_without_gradient_clipping_hands_the_true_gradient(results, stage):
    """Plain DeepSpeed through co2_zero.deepspeed.initialize (no co2 section): the workaround applies, and
    says so."""
    _assert_true_gradient(results[f"co2_zero-absent-z{stage}"], f"co2_zero initialize ZeRO-{stage}, no clipping key")
    messages = results[f"co2_zero-absent-z{stage}-warnings"]
    assert any("gradient_clipping" in m and "does not clip" in m for m in messages), messages


# ---- the deprecated collective names DeepSpeed binds (workarounds._quiet_renamed_collectives) ---------------


def test_deepspeed_binds_the_collective_names_torch_warns_about():
    """DeepSpeed 0.19.8's comm backend binds torch's old names, and torch warns on them with the message the
    workaround ignores. When either changes, review `_quiet_renamed_collectives`."""
    import re

    from deepspeed.comm.torch import TorchBackend

    from co2_zero.deepspeed.workarounds import RENAMED_COLLECTIVES

    old = (torch.distributed.all_gather_into_tensor, torch.distributed.reduce_scatter_tensor)
    assert (TorchBackend.get_all_gather_function(), TorchBackend.get_reduce_scatter_function()) == old
    for function in old:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError):  # no process group: the warning comes first
                function(torch.zeros(2), torch.zeros(1))
        assert any(w.category is FutureWarning and re.match(RENAMED_COLLECTIVES, str(w.message)) for w in caught)


def _sharded_run_warnings(rank: int, world: int) -> list[str]:
    """Two ZeRO-2 steps over a ZeRO group of 2 ranks (its all-gathers), recording what is warned as a script
    would see it (the default filters, no "always")."""
    import co2_zero.deepspeed as co2_deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    config = _config(2, gradient_clipping=1.0, co2={"tau": 2, "shards_per_replica": 2})
    with warnings.catch_warnings(record=True) as caught:
        model = models.make_model()
        engine, zero, _, _ = co2_deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for step in range(2):
            x, y = models.shard_batch(0, rank, step, world)
            engine.backward(models.loss_fn(engine(x), y))
            engine.step()
        zero.finalize()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_sharded_co2_run_shows_no_deprecated_collective_warning():
    for caught in run_ranks(_sharded_run_warnings, 2, timeout=240):
        assert not [w for w in caught if "all_gather_into_tensor" in w or "reduce_scatter_tensor" in w], caught
