"""The contract between the round engine and each framework (`Adapter`, `CO2Steps`, `Integration`;
docs/design.md §6), and what the integrations share: the checks on the parameters they are given, tensors
held whole or by rows (`TensorRows`), and the checkpoint state of the optimizers that wrap a torch optimizer
(`InnerOptimizerState`). Imports no integration; the integrations import it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Protocol, Sequence

import torch

from .core import support
from .core.engine import RoundEngine
from .core.partition import Partition
from .core.plan import ResolvedPlan

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
    def plan(self) -> ResolvedPlan:
        """Every choice the rounds run with, each `auto` resolved (`co2_zero.core.plan.ResolvedPlan`)."""
        return self.engine.plan

    @property
    def last_round(self) -> dict[str, Any]:
        """The last round end: round, inner_step, wait_s and round_end_s (blocked on the exchange, and all
        the round end took; with a sync delay, the apply point's counted in), bytes_sent (what this rank sent
        since the previous report), skipped_rounds (rounds whose outer update was skipped so far),
        inner_state_reset (this rank reset its inner state), buffers_restored (some rank's float module
        buffers held NaN/Inf, so every rank kept the last agreed buffers instead of averaging)."""
        return self.engine.last_round

    @property
    def steps_per_round(self) -> int:
        """This replica's inner steps per round: `tau`, or its own with `replica_tau` (docs/configuration.md,
        "Replicas of different speeds"); a training loop runs rounds x this many steps. In elastic mode with
        `replica_tau: "auto"`, the current round's (measured each round): a loop runs until `engine.rounds`."""
        return self.engine.round_steps

    @property
    def clock_step(self) -> float:
        """This replica's inner steps on the fastest replica's clock (inner steps x tau / its own tau): what a
        learning-rate schedule written in the fastest replica's steps should read, so that every replica
        is at the same point of it at every round end. The inner steps themselves without `replica_tau`."""
        return self.engine.pace.clock_step(self.engine.topology.replica_index, self.engine.inner_steps)

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


# ---- how an integration holds its tensors ------------------------------------------------------------------


class TensorRows:
    """Tensors held whole (plain PyTorch, FairScale, DeepSpeed). An integration that holds rows of
    dim-0-sharded tensors (FSDP2's DTensors: `co2_zero.fsdp.DTENSOR_ROWS`) overrides both methods, so
    checkpoint files hold plain rows and never the framework's tensor type."""

    def local_rows(self, value: Any) -> Optional[tuple[int, torch.Tensor]]:
        """(first row, this rank's rows: the live storage, written in place on a load) of a tensor this
        rank holds only rows of; None when it holds `value` whole."""
        return None

    def like(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's rows of a tensor shaped like `param`, read from a file) held like `param`."""
        return local


WHOLE = TensorRows()


# ---- the checkpoint state of CO2Optimizer and CO2OSS ------------------------------------------------------


class InnerOptimizerState:
    """The framework state of `CO2Optimizer` and `CO2OSS`: the inner torch optimizer's state dict
    (for CO2OSS: OSS's local optimizer, this rank's shard). The wrapper's param groups are its own
    objects, kept in step with the inner optimizer's: `before_capture` brings the inner ones up to date
    (an LR scheduler writes the wrapper's), `after_load` makes the wrapper follow the loaded ones.
    `rows` says how the integration holds its tensors: state of FSDP2 parameters (DTensor moments) is
    stored as this rank's rows (`local_optimizer_state`) and made a DTensor like its parameter again on
    load; the module's entries likewise (`local_rows`, the `FrameworkState` method). The optimizers'
    `state_dict()` forms hold the torch state dict (`torch_state`) of this record (`framework_of` is the
    way back); `module` may be None there, a state dict holds no module."""

    def __init__(
        self,
        integration: str,
        engine: Any,
        module: Optional[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        after_load: Callable[[], None] = lambda: None,
        before_capture: Callable[[], None] = lambda: None,
        rows: TensorRows = WHOLE,
    ) -> None:
        self.integration, self.engine, self.module = integration, engine, module
        self.optimizer, self.after_load, self.before_capture = optimizer, after_load, before_capture
        self.rows = rows

    def module_excluded(self) -> set[str]:
        return set()

    def local_rows(self, value: torch.Tensor) -> Optional[tuple[int, torch.Tensor]]:
        return self.rows.local_rows(value)

    def capture(self) -> dict[str, Any]:
        self.before_capture()
        return self.framework_of(self.optimizer.state_dict())

    def framework_of(self, inner: Any) -> dict[str, Any]:
        """The framework state (as `capture` makes it) that a torch state dict of the inner optimizer
        stands for: FSDP2 moments as this rank's rows. Anything else is passed on for `check` to refuse."""
        if not _is_torch_state(inner):
            return {"inner_optimizer": inner, "sharded_state": []}
        inner, sharded = local_optimizer_state(inner, self.rows)
        return {"inner_optimizer": inner, "sharded_state": sharded}

    def check(self, saved: dict[str, Any]) -> None:
        inner = saved.get("inner_optimizer") if isinstance(saved, dict) else None
        if not _is_torch_state(inner):
            raise ValueError(
                f"the inner optimizer state is {type(inner).__name__}; expected a torch optimizer state dict "
                f"(a dict of 'state': {{index: dict}} and 'param_groups': [dict with 'params'])"
            )
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g["params"]) for g in inner["param_groups"]]
        if mine != theirs:
            raise ValueError(f"the inner optimizer has parameter groups of sizes {mine} here but {theirs} saved")
        self.torch_state(saved)  # the entries of FSDP2 parameters fit their shards
        current = local_optimizer_state(self.optimizer.state_dict(), self.rows)[0]["state"]  # where this run has state
        for index, entry in inner.get("state", {}).items():
            if not isinstance(index, int) or not 0 <= index < sum(mine):
                raise ValueError(f"the inner optimizer state names parameter {index!r}, which does not exist here")
            for key, value in entry.items():
                like = current.get(index, {}).get(key)
                if not isinstance(like, torch.Tensor):
                    continue
                if not isinstance(value, torch.Tensor) or value.shape != like.shape:
                    shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"the inner optimizer state {key!r} of parameter {index} is {shown} saved, "
                        f"{tuple(like.shape)} here"
                    )

    def restore(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self.torch_state(saved))
        self.after_load()

    def torch_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The inner optimizer's torch state dict that a framework state stands for: the entries
        `sharded_state` names made DTensors like their parameters (`rows.like`); ValueError when one does
        not fit. The inverse of `framework_of`."""
        inner, names = saved["inner_optimizer"], saved.get("sharded_state") or []
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {index: dict(entry) for index, entry in inner.get("state", {}).items()}
        for item in names:
            index, key = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
            value = state.get(index, {}).get(key)
            rows = self.rows.local_rows(params[index]) if isinstance(index, int) and 0 <= index < len(params) else None
            if rows is None or not isinstance(value, torch.Tensor) or value.shape != rows[1].shape:
                raise ValueError(
                    f"the inner optimizer state names {item!r} as the rows of an FSDP2 parameter, which does not "
                    f"fit this model's parameters"
                )
            state[index][key] = self.rows.like(value, params[index])
        return {**inner, "state": state}

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None:
        """The inner optimizer state starts fresh: its partition changed."""
        self.optimizer.state.clear()


def _is_torch_state(inner: Any) -> bool:
    """A torch optimizer state dict in shape: 'state' a dict of dicts, 'param_groups' dicts with 'params'."""
    if not isinstance(inner, dict) or not isinstance(inner.get("state", {}), dict):
        return False
    groups = inner.get("param_groups")
    return (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and all(isinstance(entry, dict) for entry in inner.get("state", {}).values())
    )


def local_optimizer_state(
    state_dict: dict[str, Any], rows: TensorRows = WHOLE
) -> tuple[dict[str, Any], list[list[Any]]]:
    """A torch optimizer state dict as plain data, and the [parameter index, key] of each entry held as
    rows (`rows.local_rows`: the state of an FSDP2 parameter, e.g. Adam's moments, a DTensor), now this
    rank's rows: a file holds no DTensor, which would need the saving run's device mesh to be read."""
    state, sharded = {}, []
    for index, entry in state_dict.get("state", {}).items():
        state[index] = dict(entry)
        for key, value in entry.items():
            held = rows.local_rows(value)
            if held is not None:
                state[index][key] = held[1]
                sharded.append([index, key])
    return {**state_dict, "state": state}, sharded


def refuse_membership(integration: str, given: dict[str, Any]) -> None:
    """Refuse a `membership` among `given` (an entry point's keyword arguments) as the support table does:
    only plain CO2Optimizer and FSDP2 are elastic (docs/design.md §12). Without this, FairScale's OSS or
    DeepSpeed would get it as an unknown keyword of the inner optimizer or of `deepspeed.initialize`."""
    if "membership" in given:
        support.check({"elastic": True, "integration": integration})


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """True when any parameter is a DTensor (the model went through FSDP2's `fully_shard`). Asked without
    importing torch.distributed.tensor, so `CO2Optimizer` over plain parameters imports no FSDP2 machinery
    (co2_zero.fsdp): a process that holds a DTensor has imported it already."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in params)
