"""The GPU suite (tests/gpu) with CPU tensors: its plumbing, layouts and comparisons with the reference,
which a CUDA machine runs for real. On CPU-only CI that suite is skipped, so its expectations could drift
unseen (they once compared the replicas' round starts with the shared start after the defaults became
the local stand-in); `CO2_TEST_GPU_DEVICE=cpu` runs the same ranks and checks here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the test suite's own drift check, not the library's: about 100 s of 2 idle cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs tests/gpu itself, on the GPU")
def test_the_gpu_suite_passes_with_cpu_tensors():
    env = dict(os.environ, CO2_TEST_GPU_DEVICE="cpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
