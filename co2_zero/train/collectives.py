"""The training job's own collectives: the loss average of a log point and the deadline of each.

The loss average carries rank 0's --max_seconds verdict too. Like the validation loss and the barriers
(loop.py), it waits at most the job's timeout_s through `co2_zero.core.deadline`, the library's own
mechanism, and fails as a CO2Error naming the step, the collective and the lost rank, not as a bare
backend error inside the loop.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..core.config import CO2Config
from ..core.deadline import all_reduce


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
