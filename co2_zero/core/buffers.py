"""Float module buffers (BatchNorm statistics), averaged over every rank (docs/design.md §3).

They start as rank 0's (as the parameters start as replica 0's) and are averaged at every round end
and at finalize, on the main thread's control group. A non-finite buffer on any rank is never
averaged in: a running mean never forgets a NaN. Every rank learns of it before writing anything and
follows `nonfinite` ("raise": NonFiniteError, nothing changed; "skip_round": the last agreed buffers).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .comm import wire_bytes
from .config import CO2Config
from .deadline import wait_within
from .errors import NonFiniteError, collective_error
from .topology import Topology, collective_device


class ModuleBuffers:
    """The float buffers of a model and the last agreed copy of them (one fp32 vector)."""

    def __init__(self, buffers: Sequence[torch.Tensor], topology: Topology, config: CO2Config) -> None:
        unique = {id(b): b for b in buffers}
        self.tensors = [b for b in unique.values() if b.is_floating_point()]
        self.topology, self.config = topology, config
        self.agreed: Optional[torch.Tensor] = None  # what a round end with non-finite buffers falls back to

    def __len__(self) -> int:
        return len(self.tensors)

    def flat(self) -> torch.Tensor:
        """This rank's float module buffers, concatenated as fp32 on the control group's device."""
        device = collective_device(self.topology.control_group)
        return torch.cat([b.detach().reshape(-1).float().to(device) for b in self.tensors])

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        offset = 0
        for b in self.tensors:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    def take_current_as_agreed(self) -> None:
        """The buffers the module holds now are the agreed ones (a checkpoint load wrote them)."""
        if self.tensors:
            self.agreed = self.flat()

    @torch.no_grad()
    def start_common(self) -> None:
        """Every rank starts from rank 0's float buffers: the first agreed buffers, which a non-finite
        first round end falls back to."""
        if not self.tensors:
            return
        flat, group = self.flat(), self.topology.control_group
        what = f"start-up broadcast of the module buffers on the {self.topology.describe_control()}"
        wait_within(lambda: dist.broadcast(flat, src=0, group=group, async_op=True), what, self.config.timeout_s)
        self.write(flat)
        self.agreed = flat

    def average(self, where: str) -> tuple[int, bool]:
        """Average the buffers over every rank. Returns the bytes this rank sent (`comm.wire_bytes`)
        and whether the last agreed buffers were kept instead. Raises CO2Error (the collective failed)
        or NonFiniteError (`nonfinite: "raise"`) with no buffer changed.

        One all-reduce carries the buffers followed by one non-finite flag per rank (the sum is
        element-wise: a NaN buffer cannot reach the flags), so every rank learns whether some rank's
        buffers hold NaN/Inf before writing anything.
        """
        if not self.tensors:
            return 0, False
        world = self.topology.world_size
        values = self.flat()
        flags = values.new_zeros(world)
        flags[self.topology.rank] = (~torch.isfinite(values)).any()
        flat = torch.cat([values, flags])
        try:
            dist.all_reduce(flat, group=self.topology.control_group)
        except Exception as error:
            what = f"{where}: averaging the module buffers on the {self.topology.describe_control()}"
            raise collective_error(what, error, self.config.timeout_s) from error
        sent = wire_bytes("all_reduce", flat.numel() * flat.element_size(), world)
        bad = [rank for rank, flag in enumerate(flat[-world:].tolist()) if flag > 0]
        if bad:
            self._keep_agreed(bad, where)
            return sent, True
        self.agreed = flat[:-world].div_(world)
        self.write(self.agreed)
        return sent, False

    def _keep_agreed(self, bad: list[int], where: str) -> None:
        """Some ranks' buffers hold NaN/Inf: raise (`nonfinite: "raise"`), or restore the last agreed
        buffers on this rank and say so ("skip_round")."""
        replicas = sorted({rank // self.topology.shards for rank in bad})
        holders = f"the float module buffers (e.g. BatchNorm statistics) of rank(s) {bad} (replica(s) {replicas})"
        if self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"co2: {where}: {holders} hold NaN or Inf; no rank's buffers were changed. Set "
                f"nonfinite='skip_round' in the co2 config to keep the last agreed buffers instead."
            )
        self.write(self.agreed)
        warnings.warn(
            f"co2: {where}: {holders} held NaN or Inf; every rank keeps the last agreed buffers (those of "
            f"the last round end that averaged them) instead of averaging (nonfinite='skip_round')",
            stacklevel=6,
        )
