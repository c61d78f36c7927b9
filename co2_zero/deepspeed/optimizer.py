"""The ZeRO-1/2 optimizer with CO2 rounds: this rank's fp32 master partition as a CO2 `Partition`, and
`CO2ZeroOptimizer`, the class DeepSpeed's own optimizer object is re-classed to (step bookkeeping on the
partition; a round end refreshes the low-precision parameters with DeepSpeed's `update_lp_params`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..core.config import CO2Config
from ..core.engine import RoundEngine
from ..core.errors import CO2Error
from ..core.outer import Segment
from ..core.parameter_order import identify
from ..core.partition import Partition, parameter_signature
from ..core.topology import Topology
from ..integration import CO2Steps, Integration, check_fp32, trainable_parameters


def zero_partition(zero: DeepSpeedZeroOptimizer, module: Optional[torch.nn.Module] = None) -> Partition:
    """This rank's fp32 master partition in a ZeRO-1/2 optimizer, mapped to global parameter tensors.

    Chunk i is `single_partition_of_fp32_groups[i]`: elements [p*size, (p+1)*size) of param group i's
    flat buffer, p = this rank's index in the replica. The flat buffer holds the group's tensors in
    `round_robin_bit16_groups` order at `round_robin_bit16_offsets` (alignment padding between and
    after them belongs to no tensor and gets no segment). Tensor ids count `bit16_groups` in order, the
    same on every rank. The result is checked against DeepSpeed's own `params_in_partition`. `module`
    names the tensors for the start-up check (DeepSpeed keeps the layout of the user's param groups,
    so ranks that list them in different orders are refused there, naming the parameters).
    """
    params = trainable_parameters(zero.bit16_groups)  # DeepSpeed's trainable parameters, each once
    tensor_ids = {id(p): i for i, p in enumerate(params)}
    shapes = [p.shape for p in params]
    segments: list[Segment] = []
    base = 0
    for i, chunk in enumerate(zero.single_partition_of_fp32_groups):
        size = int(zero.partition_size[i])
        index = dist.get_rank(group=zero.real_dp_process_group[i])
        if chunk.numel() != size:
            raise CO2Error(
                f"co2: ZeRO param group {i}: fp32 partition has {chunk.numel()} elements but partition_size "
                f"is {size}; this DeepSpeed version's layout is not supported"
            )
        lo, hi = index * size, (index + 1) * size
        tensors = zero.round_robin_bit16_groups[i]
        # Shapes and offsets from DeepSpeed's bookkeeping (offload may swap p.data for an empty tensor);
        # older versions without per-tensor padding have neither: the tensors are then back to back.
        metas = getattr(zero, "round_robin_bit16_meta", None)
        numels = [m.numel() for m in (metas[i] if metas is not None else tensors)]
        offsets = getattr(zero, "round_robin_bit16_offsets", None)
        offsets = offsets[i] if offsets is not None else [sum(numels[:k]) for k in range(len(numels))]
        owned = []
        for tensor, offset, numel in zip(tensors, offsets, numels):
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                segments.append(Segment(tensor_ids[id(tensor)], base + start - lo, base + end - lo, start - offset))
                owned.append(id(tensor))
        expected = [id(t) for t in zero.params_in_partition[i] if t.numel() > 0]
        if owned != expected:
            raise CO2Error(
                f"co2: ZeRO param group {i}: the tensors found in this rank's partition do not match "
                f"DeepSpeed's params_in_partition; this DeepSpeed version's layout is not supported"
            )
        base += size
    return Partition(
        chunks=list(zero.single_partition_of_fp32_groups),
        segments=segments,
        num_tensors=len(tensor_ids),
        signature=parameter_signature(shapes),
        tensors=identify(params, module),
    )


class CO2ZeroOptimizer(CO2Steps, DeepSpeedZeroOptimizer):
    """DeepSpeed's ZeRO-1/2 optimizer whose `step()` also ends a CO2 round every `tau` applied steps.

    Made by `initialize` from the optimizer DeepSpeed built (see `attach`); it adds methods and the
    CO2 state, nothing of DeepSpeed's changes. `finalize()` as in `CO2Optimizer`.
    """

    integration = Integration.DEEPSPEED
    engine: RoundEngine  # the round state machine (as in CO2Optimizer and CO2OSS)
    config: CO2Config
    topology: Topology

    @classmethod
    def attach(
        cls, zero: DeepSpeedZeroOptimizer, config: CO2Config, topology: Topology, module: torch.nn.Module
    ) -> CO2ZeroOptimizer:
        """Turn the ZeRO optimizer DeepSpeed built into a CO2ZeroOptimizer, in place.

        DeepSpeedEngine constructs its ZeRO optimizer itself (some forty arguments); re-classing the
        finished object avoids patching DeepSpeed's module globals during construction.
        """
        if type(zero) is not DeepSpeedZeroOptimizer:
            raise ValueError(
                f"co2: DeepSpeed built a {type(zero).__name__} optimizer; a co2 section needs its ZeRO stage "
                f"1/2 optimizer (DeepSpeedZeroOptimizer). ZenFlow, and bf16 with ZeRO-1 and "
                f"data_types.grad_accum_dtype=fp32 (DeepSpeed's BF16_Optimizer), are not supported"
            )
        if zero.has_moe_layers:
            raise ValueError("co2: mixture-of-experts layers (expert-parallel ZeRO groups) are not supported")
        masters = [("the ZeRO master weights are", zero.master_weights_and_grads_dtype)]
        check_fp32(masters, "CO2 needs fp32 masters (leave fp16/bf16_master_weights_and_grads off)")
        zero.__class__ = cls
        zero._co2_attach(config, topology, module)
        return zero

    def _co2_attach(self, config: CO2Config, topology: Topology, module: torch.nn.Module) -> None:
        self.config, self.topology, self._co2_module = config, topology, module
        self.engine = RoundEngine(
            self.find_partition(), config, topology, self.refresh_replica, module=module, integration=self.integration
        )

    def find_partition(self) -> Partition:
        """This rank's fp32 master partition (`zero_partition`)."""
        return zero_partition(self, self._co2_module)

    def refresh_replica(self) -> None:
        """The low-precision parameters from the rewritten fp32 masters, DeepSpeed's `update_lp_params`."""
        self.update_lp_params()

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's step; then, if it was applied (not skipped on fp16 overflow), count it for CO2."""
        super().step(closure)
        self._count_step(applied=not self.overflow)
