"""What the engine averages: this rank's partition of the live parameters, and what it leaves alone.

An integration finds its rank's `Partition` (1-D fp32 views of the live master parameters it owns);
the engine reads and writes the live parameters only through it. `ParameterWatch` remembers which of
the model's parameters were trainable when the optimizer was built: the frozen ones are outside every
partition (docs/design.md §3).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from .outer import Segment
from .parameter_order import TensorIdentity


@dataclass
class Partition:
    """This rank's share of the live fp32 master parameters, as the integration found it.

    chunks: 1-D fp32 views of the live parameters, in partition order (one per ZeRO param group, or
    one flat buffer). segments: which global parameter tensor each piece of the concatenated chunks
    belongs to. num_tensors: parameter tensors in the whole model. tensors: the identity (name, shape)
    of each tensor id, which every rank must share (`agreement.agree_on_parameters`); empty: unnamed.
    """

    chunks: list[torch.Tensor]
    segments: Sequence[Segment]
    num_tensors: int
    signature: str  # parameter_signature() of the whole model (checkpoints carry it)
    tensors: Sequence[TensorIdentity] = ()

    @property
    def length(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def check_views(self) -> None:
        """Refuse chunks that are not 1-D fp32: the engine's flat buffers and the outer step are fp32."""
        for i, chunk in enumerate(self.chunks):
            if chunk.dtype != torch.float32 or chunk.dim() != 1:
                raise ValueError(
                    f"co2: partition chunk {i} is {chunk.dtype} with shape {tuple(chunk.shape)}; the "
                    f"live master parameters must be 1-D float32 views"
                )

    def _chunk_slices(self) -> Iterator[tuple[torch.Tensor, slice]]:
        offset = 0
        for chunk in self.chunks:
            yield chunk, slice(offset, offset + chunk.numel())
            offset += chunk.numel()

    @torch.no_grad()
    def gather_into(self, out: torch.Tensor) -> None:
        """out <- live partition."""
        for chunk, where in self._chunk_slices():
            out[where].copy_(chunk)

    @torch.no_grad()
    def subtract_from(self, start_point: torch.Tensor, out: torch.Tensor) -> None:
        """out <- start_point - live partition (the padding stays zero): the displacement D."""
        for chunk, where in self._chunk_slices():
            torch.sub(start_point[where], chunk, out=out[where])

    @torch.no_grad()
    def write_from(self, flat: torch.Tensor) -> None:
        """live partition <- flat (the caller refreshes the replica)."""
        for chunk, where in self._chunk_slices():
            chunk.copy_(flat[where])


def parameter_signature(shapes: Sequence[Sequence[int]]) -> str:
    """A short hash of the model's parameter shapes, in order."""
    return hashlib.sha256(repr([tuple(s) for s in shapes]).encode()).hexdigest()[:16]


def local_values(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local values: its shard for an FSDP2 DTensor, else itself (detached)."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()


class ParameterWatch:
    """The model's parameters as they were when the CO2 optimizer was built.

    Frozen parameters (requires_grad=False) are outside every partition, so CO2 never averages them:
    the engine broadcasts them from rank 0 at start-up and they stay identical as long as nobody
    writes them. Freezing or unfreezing a parameter later would change the partition (or train a
    tensor no replica averages), so a change of requires_grad is refused at the next round end.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.named = list(named)
        self.flags = [p.requires_grad for _, p in self.named]

    @classmethod
    def collect(cls, params: Sequence[torch.Tensor], module: Optional[torch.nn.Module]) -> ParameterWatch:
        """The module's named parameters, then those of `params` the module does not hold (deduplicated)."""
        named: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for name, p in module.named_parameters() if module is not None else ():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        for i, p in enumerate(params):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((f"inner optimizer parameter {i}", p))
        return cls(named)

    @property
    def frozen(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for (name, p), trainable in zip(self.named, self.flags) if not trainable]

    def frozen_values(self) -> list[torch.Tensor]:
        """The frozen parameters' local values (references): what an elastic peer that heals gets."""
        return [local_values(p) for _, p in self.frozen]

    def check_frozen(self, values: Any, source: str) -> None:
        """Raise ValueError unless `values` fit the frozen parameters one by one (shape and dtype)."""
        mine = self.frozen_values()
        fits = isinstance(values, list) and len(values) == len(mine)
        fits = fits and all(
            isinstance(v, torch.Tensor) and (v.shape, v.dtype) == (m.shape, m.dtype) for v, m in zip(values, mine)
        )
        if not fits:
            shapes = [tuple(m.shape) for m in mine]
            raise ValueError(f"co2 {source}: the frozen parameters sent do not fit this model's {len(mine)} {shapes}")

    def write_frozen(self, values: Sequence[torch.Tensor]) -> None:
        """Frozen parameters <- `values` (checked by `check_frozen`)."""
        for mine, value in zip(self.frozen_values(), values):
            mine.copy_(value)

    @staticmethod
    def refusal(changes: list[str]) -> str:
        """Why training cannot go on after `changes`, and what to do instead."""
        return (
            f"{'; '.join(changes)} since the CO2 optimizer was built. The CO2 partition and the set of frozen "
            f"parameters cannot change during training: save a checkpoint, change requires_grad, build a new "
            f"optimizer and load it with reshard=True"
        )

    def changes(self) -> list[str]:
        """One phrase per parameter whose requires_grad differs from construction time."""
        return [
            f"{name} (shape {tuple(p.shape)}) was {'trainable' if was else 'frozen'} and is now "
            f"{'trainable' if p.requires_grad else 'frozen'}"
            for (name, p), was in zip(self.named, self.flags)
            if p.requires_grad != was
        ]
