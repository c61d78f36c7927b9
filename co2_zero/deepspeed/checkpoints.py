"""Per-rank, atomic checkpoints of a CO2 DeepSpeed engine (`save_checkpoint`, `load_checkpoint`).

The files, the agreement, the marker and the validation are co2_zero.checkpoint's; DeepSpeed contributes
only its own state (`ZeroCheckpointState`). DeepSpeed's own save_checkpoint names files after the rank
inside the data-parallel group, so with one ZeRO group per replica every replica would write the same names.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from .. import checkpoint
from ..integration import Integration
from .optimizer import CO2ZeroOptimizer


def _co2_optimizer(engine: Any) -> CO2ZeroOptimizer:
    zero = getattr(engine, "optimizer", None)
    if not isinstance(zero, CO2ZeroOptimizer):
        raise ValueError("co2: this engine was not built by co2_zero.deepspeed.initialize with a co2 section")
    return zero


class ZeroCheckpointState:
    """DeepSpeed's part of a `co2_zero.checkpoint` file: the ZeRO state dict in its rigid form (this rank's
    fp32 partition and inner optimizer state, as plain data), the LR scheduler and the engine's step
    counters; the module's trainable parameters are restored from the fp32 partition, not saved."""

    integration = Integration.DEEPSPEED

    def __init__(self, engine: Any) -> None:
        self.ds_engine, self.zero = engine, _co2_optimizer(engine)
        self.engine, self.module = self.zero.engine, engine.module

    def local_rows(self, value: torch.Tensor) -> None:
        """DeepSpeed's module holds every entry whole (ZeRO partitions only the optimizer's flat copy)."""
        return None

    def module_excluded(self) -> set[str]:
        trainable = {id(p) for group in self.zero.bit16_groups for p in group}
        return {name for name, p in self.module.named_parameters(remove_duplicate=False) if id(p) in trainable}

    def capture(self) -> dict[str, Any]:
        engine = self.ds_engine
        return {
            "zero": self._plain_zero_state(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "counters": {
                k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")
            },
        }

    def _plain_zero_state(self) -> dict[str, Any]:
        """DeepSpeed's rigid ZeRO state dict (loads alone, even with `elastic_checkpoint`), as plain data:
        the loss scaler as its attributes, the stage as an int, no universal-checkpoint mappings."""
        zero = self.zero
        elastic, zero.elastic_checkpoint = zero.elastic_checkpoint, False
        try:
            state = dict(zero.state_dict())
        finally:
            zero.elastic_checkpoint = elastic
        scaler = vars(zero.loss_scaler)
        state["loss_scaler"] = {k: v for k, v in scaler.items() if checkpoint.plain_data_problem(v) is None}
        state["zero_stage"] = int(state["zero_stage"])
        state.pop("param_slice_mappings", None)
        state.pop("universal_checkpoint_info", None)
        return state

    def check(self, saved: dict[str, Any]) -> None:
        zero_state = saved.get("zero") if isinstance(saved, dict) else None
        if not isinstance(zero_state, dict) or not isinstance(zero_state.get("single_partition_of_fp32_groups"), list):
            raise ValueError("the ZeRO state is missing")
        mine = [t.numel() for t in self.zero._get_groups_without_padding(self.zero.single_partition_of_fp32_groups)]
        theirs = [
            t.numel() if isinstance(t, torch.Tensor) else None for t in zero_state["single_partition_of_fp32_groups"]
        ]
        if mine != theirs:
            raise ValueError(f"the ZeRO fp32 partitions hold {theirs} elements in the file, {mine} here")
        if (saved.get("lr_scheduler") is None) != (self.ds_engine.lr_scheduler is None):
            raise ValueError("an LR scheduler is saved but none is configured here, or the reverse")

    def restore(self, saved: dict[str, Any]) -> None:
        zero = self.zero
        state = dict(saved["zero"])
        for key, value in state["loss_scaler"].items():
            setattr(zero.loss_scaler, key, value)
        state["loss_scaler"] = zero.loss_scaler
        states: list[Any] = [None] * zero.topology.shards
        states[zero.topology.shard_index] = state
        zero.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        zero.update_lp_params()  # the module's parameters from the restored fp32 masters
        self._restore_engine(saved)

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None:
        """The ZeRO inner state starts fresh (the partition changed); the schedule and counters carry on
        when the file came from DeepSpeed."""
        if saved is not None:
            self._restore_engine(saved)

    def _restore_engine(self, saved: dict[str, Any]) -> None:
        engine = self.ds_engine
        if engine.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        for key, value in saved["counters"].items():
            setattr(engine, key, value)


def save_checkpoint(
    engine: Any,
    save_dir: Union[str, os.PathLike],
    tag: Optional[str] = None,
    client_state: Optional[Mapping[str, Any]] = None,
    save_latest: bool = True,
) -> Path:
    """Save every rank's state as one complete checkpoint `save_dir/tag` (collective; see
    `co2_zero.checkpoint`). `tag` defaults to `global_step<N>` (with replica_tau N on the fastest replica's
    clock); `client_state` must be plain data. With
    `save_latest`, `save_dir/latest_co2` names it once it is complete. Call it after an `engine.step()`
    at a gradient accumulation boundary.

    Args:
        engine: the engine `initialize` returned.
        save_dir: the checkpoint root, on a file system every rank sees.
        tag: the checkpoint's directory name; defaults to `global_step<N>` (N on the fastest replica's clock).
        client_state: plain data saved with the checkpoint.
        save_latest: write `save_dir/latest_co2` once the checkpoint is complete.

    Returns:
        The checkpoint's directory.

    Raises:
        CO2Error: on every rank, when any rank failed; the previous state of a reused tag stays loadable."""
    # Accelerate sets the boundary itself and then calls engine.step() once per window: micro_steps counts
    # optimizer steps there, and the flag it set says whether the window is complete.
    boundary = engine._is_gradient_accumulation_boundary
    if (engine.micro_steps % engine.gradient_accumulation_steps()) if boundary is None else not boundary:
        raise ValueError(
            f"co2: save_checkpoint at micro step {engine.micro_steps} is inside a gradient accumulation "
            f"window of {engine.gradient_accumulation_steps()}; save right after an engine.step() that "
            f"stepped the optimizer"
        )
    state = ZeroCheckpointState(engine)
    tag = f"global_step{_agreed_global_step(state.zero, engine.global_steps)}" if tag is None else str(tag)
    return checkpoint.save_checkpoint(
        save_dir, state, extra=dict(client_state or {}), tag=tag, write_latest=save_latest
    )


def _agreed_global_step(zero: CO2ZeroOptimizer, global_steps: int) -> int:
    """DeepSpeed's step count as every replica names it: its own, or with replica_tau its own on the fastest
    replica's clock (`Pace.agreed_step`), so that the replicas' default tags agree at a round end."""
    return zero.engine.pace.agreed_step(zero.topology.replica_index, global_steps)


def load_checkpoint(
    engine: Any, load_dir: Union[str, os.PathLike], tag: Optional[str] = None, reshard: bool = False
) -> tuple[Optional[Path], dict[str, Any]]:
    """Load a complete checkpoint written by `save_checkpoint` (collective; see `co2_zero.checkpoint`).
    `tag` defaults to the one `load_dir/latest_co2` names, else the newest complete one. Returns
    (directory, client_state), like DeepSpeed's `load_checkpoint`; (None, {}) when there is none.
    `reshard=True` loads a checkpoint of another R x S or integration (training resumes at its last
    round start, the ZeRO inner state starts fresh). Training then continues exactly as if it had not
    stopped; a refused load raises CO2Error on every rank and changes nothing.

    Args:
        engine: the engine `initialize` returned.
        load_dir: the checkpoint root given to `save_checkpoint`.
        tag: load this checkpoint instead of the newest complete one.
        reshard: load a checkpoint of another R x S or integration.

    Returns:
        `(directory, client_state)`, or `(None, {})` when there is no complete checkpoint.

    Raises:
        CO2Error: on every rank, when any rank's file is missing, damaged or from another config or grid."""
    loaded = checkpoint.load_checkpoint(load_dir, ZeroCheckpointState(engine), tag=tag, reshard=reshard)
    if loaded is None:
        warnings.warn(f"co2: no complete checkpoint in {load_dir}; nothing loaded", stacklevel=2)
        return None, {}
    directory, client_state = loaded
    return directory, dict(client_state or {})
