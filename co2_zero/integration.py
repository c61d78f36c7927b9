"""The contract between the round engine and each framework (docs/design.md §6).

Every integration is an adapter: an optimizer of its framework with `CO2Steps` mixed in, which finds
this rank's `Partition`, says how to spread a rewritten partition over its replica, names itself with
an `Integration` value (checkpoints record it) and offers its framework's own state for checkpoints
(a `checkpoint.FrameworkState`). The checks every adapter needs on the parameters it is given are
written once, here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import torch

from .engine import RoundEngine
from .partition import Partition

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import FrameworkState


class Integration:
    """The integration names that checkpoints and messages use. Plain strings, not an Enum: they go
    into JSON markers and weights_only-loadable files. Hugging Face routes through DeepSpeed."""

    PLAIN = "plain"  # CO2Optimizer over plain parameters (S = 1)
    FSDP2 = "fsdp2"  # CO2Optimizer over fully_shard'ed parameters
    FAIRSCALE = "fairscale"  # CO2OSS
    DEEPSPEED = "deepspeed"  # co2_zero.deepspeed (and co2_zero.hf)
    ALL = (PLAIN, FSDP2, FAIRSCALE, DEEPSPEED)


class Adapter(Protocol):
    """What an integration's optimizer provides besides its framework's step.

    `integration`: its `Integration` name. `find_partition()`: this rank's live fp32 master views and
    the tensor each piece belongs to (docs/design.md §2). `refresh_replica()`: after the engine rewrote
    the partition, make the rest of the replica see it (ZeRO all-gather, OSS broadcast; nothing for
    S = 1 or FSDP2). `checkpoint_state(model)`: its framework's own state for `co2_zero.checkpoint`
    (DeepSpeed's is made from the DeepSpeed engine, which owns the scheduler and counters).
    """

    integration: str
    engine: RoundEngine

    def find_partition(self) -> Partition: ...

    def refresh_replica(self) -> None: ...

    def checkpoint_state(self, model: torch.nn.Module) -> FrameworkState: ...


# ---- the checks every adapter shares ------------------------------------------------------------------


def trainable_parameters(groups: Iterable[Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    """The trainable tensors of `groups` (param groups' parameter lists), in order, each once."""
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for group in groups:
        for p in group:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def check_fp32(dtypes: Iterable[tuple[str, torch.dtype]], needs: str) -> None:
    """Refuse the first (what, dtype) that is not float32: the partition and the outer step are fp32.
    The ValueError reads "co2: {what} {dtype}; {needs}" (`what` ends with its verb)."""
    for what, dtype in dtypes:
        if dtype != torch.float32:
            raise ValueError(f"co2: {what} {dtype}; {needs}")


def check_fp32_parameters(params: Sequence[torch.Tensor], needs: str) -> None:
    """`check_fp32` over parameters, each named by its index and shape."""
    check_fp32(((f"parameter {i} (shape {tuple(p.shape)}) is", p.dtype) for i, p in enumerate(params)), needs)


def one_device(params: Iterable[torch.Tensor]) -> torch.device:
    """The one device every parameter lives on; ValueError naming them when there are several."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"co2: parameters live on several devices {sorted(map(str, devices))}; expected one")
    return devices.pop()


# ---- the optimizer side every adapter mixes in --------------------------------------------------------


class CO2Steps:
    """What every integration's optimizer adds to its framework's optimizer, around `self.engine`."""

    engine: RoundEngine
    round_ended: bool = False  # did the last step() end a round

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding this rank's inner state (its moments)."""
        return self.optimizer  # type: ignore[attr-defined]

    def _count_step(self, applied: bool = True) -> None:
        """After the framework's step: count it for CO2 if it was applied (not skipped on overflow)."""
        self.round_ended = applied and self.engine.inner_step_done()
        if self.round_ended and self.engine.last_round["inner_state_reset"]:
            self.inner_optimizer.state.clear()  # nonfinite="skip_round": this partition's moments were NaN/Inf

    @property
    def last_round(self) -> dict[str, Any]:
        """The last round end: round, inner_step, wait_s, round_end_s, bytes_sent (what this rank sent
        since the previous report), skipped_rounds (rounds whose outer update was skipped so far),
        inner_state_reset (this rank reset its inner state), buffers_restored (some rank's float module
        buffers held NaN/Inf, so every rank kept the last agreed buffers instead of averaging)."""
        return self.engine.last_round

    def finalize(self) -> None:
        """Wait for the round in flight and give every rank the same model (docs/design.md §3)."""
        self.engine.finalize()

    def co2_state_bytes(self) -> int:
        """Bytes of CO2 state on this rank (docs/design.md §4)."""
        return self.engine.state_bytes()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "engine"):
            raise RuntimeError("co2: parameters cannot be added after the CO2 partition was built")
        super().add_param_group(param_group)  # type: ignore[misc]
