"""`CO2Optimizer`: CO2 around any `torch.optim.Optimizer` (docs/design.md §6.1, §6.4).

Plain parameters: every rank is its own replica (S = 1), so the partition is the whole model: the
parameters are re-pointed into one flat fp32 buffer and that buffer is the live partition. The model
must not be wrapped in DDP; CO2 is the only cross-rank traffic.

DTensor parameters (a model sharded by FSDP2's `fully_shard` over `co2_zero.fsdp.replica_mesh`): the
replica is the mesh's S ranks and the partition is this rank's local shards (`co2_zero.fsdp`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from .checkpoint.record import load_record, optimizer_record, refused
from .core.config import CO2Config
from .core.engine import RoundEngine
from .core.outer import Segment
from .core.parameter_order import identify, in_model_order
from .core.partition import Partition, parameter_signature
from .core.plan import check_given
from .core.topology import Topology
from .integration import (
    WHOLE,
    CO2Steps,
    InnerOptimizerState,
    Integration,
    check_fp32_parameters,
    is_sharded,
    one_device,
    trainable_parameters,
)


def flatten_parameters_(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Move the parameters' storage into one contiguous fp32 buffer (in order); return it."""
    check_fp32_parameters(
        params,
        "CO2Optimizer needs fp32 parameters (use the DeepSpeed integration for bf16/fp16 models with fp32 masters)",
    )
    device = one_device(params)
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()
    return flat


def _nothing_to_spread() -> None:
    """S = 1: the replica is this rank alone, so a rewritten partition needs no refresh or check."""


class CO2Optimizer(CO2Steps, torch.optim.Optimizer):
    """Wraps an inner optimizer: `step()` is the inner step plus, every `tau`-th, a CO2 round end.

    `param_groups`, `state` and `defaults` are the inner optimizer's own, so LR schedulers and
    gradient clipping work on either object. Requires `torch.distributed` to be initialised. Plain
    parameters: S = 1. DTensor parameters from `fully_shard` over `co2_zero.fsdp.replica_mesh(config)`:
    the mesh is the replica (S = its size), the partition the local shards.

    Args:
        optimizer: the inner optimizer over the model's fp32 parameters (all on one device).
        config: a `CO2Config`, a dict of its fields, or None for the defaults.
        model: optional; its float buffers (e.g. BatchNorm statistics) are averaged across the replicas
            at every round end, and its frozen parameters are watched for `requires_grad` changes.
        membership: optional `co2_zero.elastic.Membership`: elastic training, replicas that come and go
            (docs/elastic.md).

    Raises:
        ValueError: the model is wrapped in DDP, the inner optimizer holds no trainable parameters, a
            config field is invalid, or `shards_per_replica` > 1 over plain (non-DTensor) parameters.
        CO2Error: the ranks disagree on the config, the grid or the model (docs/design.md §5).
        CO2TimeoutError: a rank did not build its optimizer within `timeout_s`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: Union[CO2Config, Mapping[str, Any], None] = None,
        model: Optional[torch.nn.Module] = None,
        membership: Any = None,
    ) -> None:
        config = CO2Config.coerce(config)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                "co2: the model is wrapped in DistributedDataParallel; CO2Optimizer replaces its "
                "gradient all-reduce, so pass the bare module"
            )
        # Optimizer.__init__ installs the hook machinery (step pre/post hooks, profiling); the
        # parameter groups and state are then the inner optimizer's own objects.
        super().__init__([torch.zeros(1, requires_grad=True)], {})
        self.optimizer, self.config, self._model = optimizer, config, model
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

        params = trainable_parameters(group["params"] for group in optimizer.param_groups)
        if not params:
            raise ValueError("co2: the inner optimizer holds no trainable parameters")
        if model is not None:  # this optimizer lays out the partition: in the model's order, not the groups'
            params = in_model_order(params, model)
        self._params = params
        self.integration = Integration.FSDP2 if is_sharded(params) else Integration.PLAIN
        self.flat_params: Optional[torch.Tensor] = None
        self._replica_group: Any = None  # FSDP2: the replica mesh's group
        self._check_shards: Callable[[], None] = _nothing_to_spread
        check_given(config, integration=self.integration, elastic=membership is not None)  # before the flattening
        partition = self.find_partition()
        shards = None if self.integration == Integration.FSDP2 else 1  # FSDP2: the replica mesh's size
        self.topology = Topology.build(config, shards=shards, inner_group=self._replica_group)
        inner_params = [p for group in optimizer.param_groups for p in group["params"]]
        self.engine = RoundEngine(
            partition,
            config,
            self.topology,
            refresh=self.refresh_replica,
            module=model,
            params=inner_params,
            membership=membership,
            integration=self.integration,
        )

    def find_partition(self) -> Partition:
        """FSDP2: the local shards (`fsdp.find_partition`); plain: the parameters flattened into one buffer."""
        if self.integration == Integration.FSDP2:
            from .fsdp import find_partition

            partition, self._replica_group, self._check_shards = find_partition(self._params, self.config, self._model)
            return partition
        return self._flat_partition(self._params, self.config, self._model)

    def refresh_replica(self) -> None:
        """Nothing to spread: with S = 1 the replica is this rank; FSDP2 all-gathers the shards it holds
        for every forward (only check that they did not move)."""
        self._check_shards()

    def _flat_partition(
        self, params: list[torch.nn.Parameter], config: CO2Config, model: Optional[torch.nn.Module]
    ) -> Partition:
        """S = 1: the parameters re-pointed into one flat fp32 buffer, which is the partition."""
        self.flat_params = flatten_parameters_(params)
        segments, offset = [], 0
        for i, p in enumerate(params):
            segments.append(Segment(i, offset, offset + p.numel()))
            offset += p.numel()
        return Partition(
            chunks=[self.flat_params],
            segments=segments,
            num_tensors=len(params),
            signature=parameter_signature([p.shape for p in params]),
            tensors=identify(params, model),
        )

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """The inner optimizer's step; every `tau`-th applied step also ends a CO2 round.

        Args:
            closure: passed to the inner optimizer's `step`.

        Returns:
            What the inner optimizer's `step` returned (the closure's loss, if any).

        Raises:
            CO2Error: the exchange of the previous round failed, or `finalize()` was called.
            NonFiniteError: a replica's displacement held NaN or Inf (`nonfinite: "raise"`).
        """
        loss = self.optimizer.step(closure)
        self._count_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def finalize(self) -> None:
        """Wait for the round in flight and give every rank the same model (docs/design.md §3).

        Steps taken since the last round end are dropped, with a warning. The optimizer refuses to step
        afterwards.

        Raises:
            CO2Error: the ranks took different numbers of inner steps, or the exchange failed.
        """
        self.engine.finalize()
        self.topology.destroy(inner=True, release=True)  # the single-rank replica groups; not a given (FSDP2) one

    def state_dict(self) -> dict[str, Any]:
        """`{"optimizer": the inner optimizer's state, "co2": the CO2 state}`; waits for the round in flight.

        A view of this rank's record (`checkpoint.optimizer_record`, what a checkpoint file holds
        besides the module): "co2" is its CO2 state, "optimizer" the torch state dict its framework state
        stands for (for an FSDP2 model, moments are DTensors over the rows the record holds)."""
        framework = self.checkpoint_state(self._model)
        record = optimizer_record(framework)
        return {"optimizer": framework.torch_state(record["framework"]), "co2": record["co2"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` of the same topology and config, as `checkpoint.load` restores a
        rank's record: every check first, so a refused state changes nothing.

        Raises:
            ValueError: naming the field ("optimizer" or "co2") and what does not fit: a CO2 state of
                another config, grid or partition, an inner state of other parameter groups or shapes.
            CO2Error: the exchange of a round failed, or `finalize()` was called.
        """
        missing = [key for key in ("optimizer", "co2") if not isinstance(state_dict, dict) or key not in state_dict]
        if missing:
            raise refused("CO2Optimizer.load_state_dict", f"the state dict lacks {missing}; expected a state_dict()")
        framework = self.checkpoint_state(self._model)
        record = {"co2": state_dict["co2"], "framework": framework.framework_of(state_dict["optimizer"])}
        fields = {"co2": "state_dict['co2']", "framework": "state_dict['optimizer']"}
        load_record(framework, record, "CO2Optimizer.load_state_dict", fields)

    def _share_inner_state(self) -> None:
        """torch's `load_state_dict` replaces the inner optimizer's group list and state: share the new
        ones, or an LR scheduler built on this optimizer would no longer reach the inner one."""
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def checkpoint_state(self, model: Optional[torch.nn.Module]) -> InnerOptimizerState:
        """This optimizer's part of a `co2_zero.checkpoint` file: the inner optimizer's state (for an
        FSDP2 model, this rank's rows of its moments and of the module's entries); `model` None: for a
        state dict, which holds no module."""
        rows = WHOLE
        if self.integration == Integration.FSDP2:
            from .fsdp import DTENSOR_ROWS

            rows = DTENSOR_ROWS
        return InnerOptimizerState(
            self.integration, self.engine, model, self.optimizer, after_load=self._share_inner_state, rows=rows
        )

    def __repr__(self) -> str:
        return f"CO2Optimizer({self.config}, inner={self.optimizer!r})"
