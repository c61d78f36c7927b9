"""The collectives the training job issues itself on the default group, each within a deadline.

The loss average of a log point (with rank 0's --max_seconds verdict), the validation loss and the
barriers. As the library's own do (`co2_zero.core.errors.wait_within`), each waits at most the job's
timeout_s and fails as a CO2Error naming the collective, the group's ranks and the ranks this one waited
for (a lost rank: at once, its connection closed), not as a bare backend error inside the loop.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core.config import CO2Config
from ..core.errors import wait_within


def deadline_s(config: Optional[CO2Config], args: Any) -> float:
    """The job's deadline: its CO2 config's timeout_s; without one (ddp, none), --timeout_s or CO2Config's."""
    if config is not None:
        return float(config.timeout_s)
    given = getattr(args, "timeout_s", None)
    return float(given if given is not None else CO2Config().timeout_s)


def on_default_group(what: str) -> str:
    """`what`, with the default group's ranks and the ones this rank waits for (a lost one is among them)."""
    ranks, me = list(range(dist.get_world_size())), dist.get_rank()
    others = [r for r in ranks if r != me]
    peers = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
    return f"{what} on the default group (global ranks {ranks}), where rank {me} waited for {peers},"


def all_reduce(tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    """Sum `tensor` over every rank in place, within `timeout_s` (CO2Error naming `what` otherwise)."""
    wait_within(lambda: dist.all_reduce(tensor, async_op=True), on_default_group(what), timeout_s)


def barrier(what: str, timeout_s: float, device: torch.device) -> None:
    """Every rank got here, within `timeout_s` (NCCL's barrier must know the rank's GPU, `device`)."""
    ids = [device.index] if dist.get_backend() == "nccl" else None
    wait_within(lambda: dist.barrier(async_op=True, device_ids=ids), on_default_group(what), timeout_s)


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
