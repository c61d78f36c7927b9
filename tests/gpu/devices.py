"""Where the GPU suite runs, and how its ranks are laid out.

`CO2_TEST_GPU_DEVICE` (default `cuda`). Set to `cpu`, the suite runs the same scenarios with gloo on
the CPU instead of CUDA and NCCL: a check of the suite's own plumbing on a machine without a GPU,
which proves nothing about CUDA.
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("CO2_TEST_GPU_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
GPU_BACKEND = "nccl" if ON_GPU else "gloo"  # what a real GPU job uses
SKIP_REASON = (
    "tests/gpu needs a CUDA device (torch.cuda.is_available() is False); "
    "CO2_TEST_GPU_DEVICE=cpu runs its plumbing on the CPU"
)


def cuda_missing() -> bool:
    return ON_GPU and not torch.cuda.is_available()


def nccl_world() -> int:
    """Ranks of the NCCL runs: one per GPU, at most 2 (1 on a one-GPU machine; 1 in a CPU run)."""
    return max(1, min(2, torch.cuda.device_count())) if ON_GPU and torch.cuda.is_available() else 1


# (backend, ranks): two ranks sharing one GPU over gloo with CUDA tensors (R = 2 on any GPU machine),
# and NCCL with one rank per GPU.
LAYOUTS = {"gloo-shared-gpu": ("gloo", 2), "nccl": (GPU_BACKEND, nccl_world())}

# The reference runs on the CPU; CUDA kernels sum in another order (no TF32: torch's default for fp32
# matmuls). A wrong outer step is off by 1e-2 or more.
RTOL, ATOL = (1e-4, 1e-5) if ON_GPU else (1e-5, 1e-6)
