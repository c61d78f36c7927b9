"""What the integrations share (`CO2Optimizer` over plain or FSDP2 parameters, `CO2OSS`, DeepSpeed).

Kept small, one section per shared concern:

- how an integration holds its tensors: whole, or this rank's rows of a tensor sharded by rows
  (`TensorRows`; FSDP2's lives in `co2_zero.fsdp`);
- the checkpoint state of the optimizers that wrap a torch optimizer (`InnerOptimizerState`, the
  `co2_zero.checkpoint.FrameworkState` of CO2Optimizer and CO2OSS; DeepSpeed's is in `co2_zero.deepspeed`).

Imports no integration; the integrations import it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

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
    load; the module's entries likewise (`local_rows`, the `FrameworkState` method)."""

    def __init__(
        self,
        integration: str,
        engine: Any,
        module: torch.nn.Module,
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
        inner, sharded = local_optimizer_state(self.optimizer.state_dict(), self.rows)
        return {"inner_optimizer": inner, "sharded_state": sharded}

    def check(self, saved: dict[str, Any]) -> None:
        inner = saved.get("inner_optimizer") if isinstance(saved, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
            raise ValueError("the inner optimizer state is missing or not a torch optimizer state dict")
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g.get("params", ())) for g in inner["param_groups"]]
        if mine != theirs:
            raise ValueError(f"the inner optimizer has parameter groups of sizes {mine} here but {theirs} in the file")
        self._sharded_state(saved)  # the entries of FSDP2 parameters fit their shards
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
                        f"the inner optimizer state {key!r} of parameter {index} is {shown} in the file, "
                        f"{tuple(like.shape)} here"
                    )

    def restore(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self._sharded_state(saved))
        self.after_load()

    def _sharded_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The saved inner state dict with the entries `sharded_state` names made DTensors like their
        parameters (`rows.like`); ValueError when one does not fit."""
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
