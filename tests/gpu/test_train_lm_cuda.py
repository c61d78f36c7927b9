"""scripts/train_lm.py --device cuda: every engine trains in bf16 and reports MFU and GPU memory, its
checkpoints resume under NCCL, two ranks can share one GPU over gloo, every wire format runs on CUDA
tensors and sends the bytes it sends on the CPU, --compile works.

The runs use as many ranks as there are GPUs (at most 2; 1 on a one-GPU machine), NCCL, the tiny model
on a token file. Resume comparisons run in fp32 and allow for CUDA's non-deterministic kernels (a
resume that loses state is off by far more).
"""

from __future__ import annotations

import math

import pytest

from tests.gpu.devices import DEVICE, ON_GPU, nccl_world
from tests.tools.test_train_lm_smoke import TINY, TOKENS, by_step, launch, write_tokens

pytestmark = pytest.mark.gpu

ENGINES = {
    "plain": ["--engine", "plain"],
    "fairscale": ["--engine", "fairscale", "--shards_per_replica", "1"],
    "deepspeed": ["--engine", "deepspeed", "--shards_per_replica", "1"],  # configs/ds_zero2_co2.json
    "fsdp": ["--engine", "fsdp", "--shards_per_replica", "1"],  # fully_shard over a CUDA replica mesh
}  # fmt: skip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tokens"))


def flags(tokens, *more: str, device: str = DEVICE) -> list[str]:
    return [*TINY, *TOKENS, "--data", str(tokens), "--device", device, "--tau", "4", *more]


def check_trains(records: list[dict], dtype: str) -> None:
    summary = records[-1]
    assert summary["summary"] and summary["args"]["device"] == DEVICE
    assert summary["val_loss"] < summary["initial_val_loss"] - 1.0, (summary["initial_val_loss"], summary["val_loss"])
    lines = [r for r in records if not r.get("summary") and r["step"] > 0]
    assert lines and all(math.isfinite(r["loss"]) for r in lines)
    if ON_GPU:
        assert all(0 < r["mfu"] < 1 and r["max_memory_gib"] > 0 for r in lines), lines
    assert summary["args"]["dtype"] == dtype


@pytest.mark.parametrize("engine", list(ENGINES))
def test_bf16_training(engine, tokens, tmp_path):
    records = launch(tmp_path, flags(tokens, *ENGINES[engine], "--max_steps", "40", "--dtype", "bfloat16"),
                     ranks=nccl_world())  # fmt: skip
    check_trains(records, "bfloat16")
    assert records[-1]["co2_state_bytes"] > 0


def test_ddp_baseline(tokens, tmp_path):
    records = launch(tmp_path, flags(tokens, "--method", "ddp", "--max_steps", "40", "--log_every", "4"),
                     ranks=nccl_world())  # fmt: skip
    check_trains(records, "bfloat16" if ON_GPU else "float32")  # the device's default


def test_two_ranks_share_a_gpu_over_gloo(tokens, tmp_path):
    """R = 2 even on a one-GPU machine: gloo carries the CUDA tensors."""
    records = launch(tmp_path, flags(tokens, "--backend", "gloo", "--max_steps", "40"), ranks=2)
    check_trains(records, "bfloat16" if ON_GPU else "float32")
    assert records[-1]["world_size"] == 2
    assert all(r["round_end_s"] >= r["wait_s"] >= 0 for r in records if not r.get("summary") and r["step"] > 0)


WIRE_FORMATS = {
    "int8": ["--comm_dtype", "int8"],
    "fp8": ["--comm_dtype", "fp8"],
    "int4": ["--comm_dtype", "int4"],
    "int2": ["--comm_dtype", "int2"],
    "topk-int2-decay": ["--comm_dtype", "int2", "--topk", "0.015", "--feedback_decay", "0.95"],
    "topk-int4": ["--comm_dtype", "int4", "--topk", "0.03"],
}  # fmt: skip


@pytest.mark.parametrize("wire", list(WIRE_FORMATS))
def test_wire_format_on_cuda_tensors(wire, tokens, tmp_path):
    """R = 2 sharing one GPU over gloo: the format's codec runs on CUDA tensors, the job trains, and every
    round sends exactly the bytes the same job sends from the CPU (a format's size is the device's to keep)."""
    more = ["--backend", "gloo", "--max_steps", "40", "--dtype", "float32", *WIRE_FORMATS[wire]]
    records = launch(tmp_path, flags(tokens, *more), ranks=2)
    check_trains(records, "float32")
    on_cpu = launch(tmp_path, flags(tokens, *more, device="cpu"), ranks=2)
    sent = records[-1]["bytes_sent"], on_cpu[-1]["bytes_sent"]
    assert sent[0] == sent[1] > 0, sent


@pytest.mark.parametrize("engine", list(ENGINES))
def test_checkpoint_resume(engine, tokens, tmp_path):
    """Saved at step 4 (an exchange in flight) and resumed: the same losses as the uninterrupted run."""
    common = flags(tokens, *ENGINES[engine], "--dtype", "float32", "--max_steps", "8", "--tau", "2",
                   "--batch_size", "4", "--grad_accum", "2", "--eval_every", "1")  # fmt: skip
    straight = launch(tmp_path, [*common, "--save_dir", "ckpt", "--save_every", "4"], ranks=nccl_world())
    again = launch(tmp_path, [*common, "--save_dir", "ckpt2", "--resume", "ckpt/step00000004"], ranks=nccl_world())
    first, rest = by_step(straight), by_step(again)
    assert sorted(rest) == [4, 6, 8]
    for step in (6, 8):
        assert rest[step]["loss"] == pytest.approx(first[step]["loss"], rel=2e-5), step
    assert rest[4]["val_loss"] == pytest.approx(first[4]["val_loss"], rel=2e-5)
    assert again[-1]["val_loss"] == pytest.approx(straight[-1]["val_loss"], rel=2e-5)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile is exercised on CUDA only (CPU inductor builds take minutes)")
@pytest.mark.parametrize("engine", list(ENGINES))
def test_compile(engine, tokens, tmp_path):
    more = [*ENGINES[engine], "--compile", "--max_steps", "40", "--dtype", "bfloat16"]
    records = launch(tmp_path, flags(tokens, *more), ranks=nccl_world(), timeout=600)
    check_trains(records, "bfloat16")
