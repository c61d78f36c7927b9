"""Tiny models and deterministic data shared by the distributed tests and the reference runs.

Models and batches are created on the CPU (the same values everywhere) and moved to `DEVICE`: the CPU,
unless a process of the GPU suite (tests/gpu) set it to its CUDA device. The reference always runs in
the test process itself, on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

DEVICE = torch.device("cpu")


def set_device(device: str | torch.device) -> None:
    """Where this process's models and batches live (tests/dist_utils.py sets it in each rank)."""
    global DEVICE
    DEVICE = torch.device(device)


def make_model(kind: str = "mlp") -> nn.Module:
    """Identically initialised on every call (and every rank)."""
    torch.manual_seed(1234)
    return _model(kind).to(DEVICE)


def _model(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(4, 3)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    if kind == "bn":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    if kind == "square":  # every tensor the same shape: a mixed-up parameter order keeps every shape in place
        square = [nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False), nn.Tanh()]
        return nn.Sequential(*square, nn.Linear(4, 4, bias=False), FirstColumns(3))
    if kind == "uneven":  # parameters of very different sizes, for uneven shard partitions
        return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 3), nn.Tanh(), nn.Linear(3, 3))
    raise ValueError(kind)


class FirstColumns(nn.Module):
    """The first `n` columns of the input (a square model's output fitted to 3 targets)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.n]


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.5)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(kind)


def batch(replica: int, step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch at inner step `step`: different data on every replica."""
    g = torch.Generator().manual_seed(10_000 * replica + step)
    x = torch.randn(rows, 4, generator=g)
    y = torch.randn(rows, 3, generator=g) + replica  # replicas disagree: displacements differ
    return x.to(DEVICE), y.to(DEVICE)


def shard_batch(replica: int, shard: int, step: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch of rank (replica, shard): a 1/S slice of the replica's batch."""
    x, y = batch(replica, step, rows=4 * shards)
    return x[4 * shard : 4 * (shard + 1)], y[4 * shard : 4 * (shard + 1)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def train_steps(replica: int, model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
    """Inner steps first .. last - 1 of `model` on replica `replica`'s batches."""
    for step in range(first, last):
        x, y = batch(replica, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def teacher_batch(
    replica: int, shard: int, step: int, shards: int, rows: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch of rank (replica, shard) for a learnable task: targets from a fixed random teacher
    MLP (the same on every replica) plus a little noise, so a training loss can be seen to fall."""
    teacher = torch.Generator().manual_seed(99)
    a, b = torch.randn(4, 8, generator=teacher), torch.randn(8, 3, generator=teacher)
    g = torch.Generator().manual_seed(20_000 * replica + 100 * step + shard)
    x = torch.randn(rows, 4, generator=g)
    y = torch.tanh(x @ a) @ b + 0.05 * torch.randn(rows, 3, generator=g)
    return x.to(DEVICE), y.to(DEVICE)
