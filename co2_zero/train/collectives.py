"""The training job's process group and its own collectives: joining it, the validation loss, the loss
average of a log point, the deadline of each.

The loss average carries rank 0's --max_seconds verdict too. Like the validation loss and the barriers
(loop.py), it waits at most the job's timeout_s through `co2_zero.core.deadline`, the library's own
mechanism, and fails as a CO2Error naming the step, the collective and the lost rank, not as a bare
backend error inside the loop.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Optional

import torch
import torch._dynamo  # noqa: F401  before any process group: loop.py's note
import torch.distributed as dist

from ..core.config import CO2Config
from ..core.deadline import all_reduce
from .engines import autocast


def deadline_s(config: Optional[CO2Config], args: Any) -> float:
    """The job's deadline: its CO2 config's timeout_s; without one (ddp, none), --timeout_s or CO2Config's."""
    if config is not None:
        return float(config.timeout_s)
    given = getattr(args, "timeout_s", None)
    return float(given if given is not None else CO2Config().timeout_s)


def mean_loss_and_stop(
    loss_sum: Any, loss_n: int, out_of_time: bool, step: int, device: torch.device, timeout_s: float
) -> tuple[float, bool]:
    """The loss averaged over ranks and the steps since the last log line (`loss_sum` over `loss_n` steps
    here), and rank 0's --max_seconds verdict, in one all-reduce: all ranks stop together."""
    s = torch.stack(
        [
            torch.as_tensor(loss_sum, dtype=torch.float64, device=device).reshape(()),
            torch.tensor(float(loss_n), dtype=torch.float64, device=device),
            torch.tensor(float(out_of_time), dtype=torch.float64, device=device),
        ]
    )
    all_reduce(s, f"step {step}: the loss average", timeout_s)
    total, n, stop = s.tolist()
    return total / n, stop > 0


def setup_dist(device: str = "cpu", backend: Optional[str] = None) -> tuple[int, int]:
    """Join the launcher's process group (or make a world of one); on CUDA pick this rank's GPU."""
    if "WORLD_SIZE" not in os.environ:  # one plain process: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        _pick_gpu(backend)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _pick_gpu(backend: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here; accepted: --device cpu")
    gpus, local = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)  # torchrun, deepspeed
    if backend == "nccl" and per_node > gpus:
        raise RuntimeError(
            f"--device cuda --backend nccl needs one GPU per rank: {per_node} ranks on this node but "
            f"{gpus} GPU(s) visible; accepted: at most {gpus} ranks per node, or --backend gloo to share GPUs"
        )
    torch.cuda.set_device(local % gpus)


@torch.no_grad()
def evaluate(model, batches, rank, world, alone, args=None, shards=1) -> float:
    """Mean loss over the fixed held-out batches. Ranks split the batches and all-reduce
    (all hold the same model); alone=True: this rank evaluates every batch by itself. `shards` > 1
    (FSDP2: every forward is a collective over the replica): the ranks of a replica evaluate the same
    batches, which scales the sum and the count alike."""
    was_training = model.training
    model.eval()
    mine = batches if alone else batches[rank // shards :: world // shards]
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with autocast(args) if args is not None else contextlib.nullcontext():
        for x, y in mine:
            total += model(x, y).double()
    s = torch.stack([total, torch.tensor(float(len(mine)), dtype=torch.float64, device=device)])
    if not alone and world > 1:
        all_reduce(s, "the validation loss", deadline_s(None, args))
    model.train(was_training)
    return (s[0] / s[1]).item()
