"""What both CO2 strategies add to their Lightning strategy (`CO2Hooks`, mixed in first).

- at the start of training: a warning when the run's optimizer steps are not a multiple of tau
  (`finalize()` drops the steps since the last round end);
- after each round end: the round's figures (`co2/wait_s`, `co2/round_end_s`, ...) through the Trainer's
  loggers, at the round's optimizer step;
- when fit ends: `finalize()`, so every rank holds the same model;
- Lightning's own collectives (`reduce_boolean_decision`: ModelCheckpoint's and EarlyStopping's decisions;
  `barrier`; `broadcast`; `reduce`: `self.log(..., sync_dist=True)`) within the CO2 config's timeout_s: a lost
  rank is a CO2Error naming it (`co2_zero.core.deadline`);
- checkpoints: during fit, a Lightning checkpoint path is a directory of per-rank files written by
  `co2_zero.checkpoint` (tag `checkpoint`: module, inner optimizer and CO2 state of every rank, plus
  Lightning's own entries as the plain-data `extra`); after `finalize()` one model is left, so
  `trainer.save_checkpoint` writes Lightning's usual single file from rank 0, without optimizer state.

A strategy provides `co2` (its CO2Config), `co2_optimizer` and the two per-rank methods `_save_per_rank` /
`_load_per_rank`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed import ReduceOp

from ..core import deadline
from ..core.config import CO2Config
from ..core.errors import CO2Error
from ..core.topology import collective_device

TAG = "checkpoint"  # the co2_zero.checkpoint tag inside a Lightning checkpoint path (DeepSpeed's name)
PER_RANK = ("state_dict", "optimizer_states")  # what the per-rank files hold themselves


def round_figures(optimizer: Any) -> dict[str, float]:
    """The last round's numbers as `co2/<name>` metrics, and `co2/state_bytes` (CO2 state on this rank)."""
    figures = {
        f"co2/{key}": float(value)
        for key, value in optimizer.last_round.items()
        if key != "inner_step" and isinstance(value, (int, float))
    }
    figures["co2/state_bytes"] = float(optimizer.co2_state_bytes())
    return figures


def steps_warning(total_steps: float, tau: int) -> Optional[str]:
    """Why a run of `total_steps` optimizer steps (inf: unbounded) loses steps at `finalize()`, or None."""
    if math.isinf(total_steps) or int(total_steps) % tau == 0:
        return None
    left = int(total_steps) % tau
    return (
        f"co2: the run takes {int(total_steps)} optimizer steps (Trainer max_steps, or max_epochs x batches / "
        f"accumulate_grad_batches), not a multiple of tau={tau}: finalize() at the end of fit drops the last "
        f"{left} step(s); set max_steps to a multiple of tau"
    )


def _reduce_op(reduce_op: Optional[Union[ReduceOp, str]]) -> tuple[Any, bool]:
    """Lightning's `reduce_op` as a ReduceOp, and whether the sum is then divided into a mean (as Lightning
    does on gloo, which has no AVG): None is a sum, "mean"/"avg" a mean, another name its ReduceOp."""
    if not isinstance(reduce_op, str):
        return (ReduceOp.SUM if reduce_op is None else reduce_op), False
    if reduce_op.lower() in ("mean", "avg"):
        return ReduceOp.SUM, True
    return getattr(ReduceOp, reduce_op.upper()), False


class CO2Hooks:
    """Mixed in before a Lightning strategy class; see the module docstring."""

    _logged_round: Optional[int] = None
    co2: CO2Config

    @property
    def co2_optimizer(self) -> Any:
        """The strategy's CO2 optimizer, or None before fit built it."""
        raise NotImplementedError

    def _save_per_rank(self, directory: Path, lightning_state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _load_per_rank(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError

    # ---- the run ------------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        """Refuse a run without a CO2 optimizer; warn when finalize() will drop steps."""
        super().on_train_start()  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if self.co2_optimizer is None:
            raise CO2Error(f"co2: {type(self).__name__} built no CO2 optimizer; nothing would be averaged")
        problem = steps_warning(trainer.estimated_stepping_batches, self.co2_optimizer.config.tau)
        if problem is not None:
            warnings.warn(problem, stacklevel=2)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The strategy's step, then the round's figures to the loggers once per round end."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        co2 = self.co2_optimizer
        if co2 is not None and co2.round_ended and co2.last_round["round"] != self._logged_round:
            self._logged_round = co2.last_round["round"]
            for logger in self.lightning_module.trainer.loggers:  # type: ignore[attr-defined]
                logger.log_metrics(round_figures(co2), step=co2.last_round["inner_step"])
        return output

    def on_train_end(self) -> None:
        """Every rank ends with the same model (the start point the last round produced)."""
        super().on_train_end()  # type: ignore[misc]
        co2 = self.co2_optimizer
        if co2 is not None and not co2.engine.finalized:
            co2.finalize()

    # ---- Lightning's own collectives, within timeout_s -------------------------------------------------

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """`decision` of every rank, combined (all, or any), as Lightning's; a lost or stuck rank is a
        CO2Error naming it, as the library's own collectives fail, not a bare backend error."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return decision
        votes = torch.tensor(int(decision), dtype=torch.int64, device=collective_device())
        deadline.all_reduce(votes, "Lightning's reduce_boolean_decision", self.co2.timeout_s)
        return votes.item() == dist.get_world_size() if all else votes.item() > 0

    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Any:
        """`tensor` reduced over every rank in place, as Lightning's (`self.log(..., sync_dist=True)`: "mean",
        "sum", "max", "min" or a ReduceOp); a lost or stuck rank is a CO2Error naming it. Another `group`
        than the default is Lightning's own."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized() or group is not None:
            return super().reduce(tensor, group, reduce_op)  # type: ignore[misc]
        op, mean = _reduce_op(reduce_op)
        deadline.all_reduce(tensor, "Lightning's reduce (sync_dist)", self.co2.timeout_s, op)
        if not mean:
            return tensor
        world = dist.get_world_size()
        return tensor.div_(world) if torch.is_floating_point(tensor) else tensor.copy_(tensor / world)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank, as Lightning's (checkpoint paths, the tuner's choices); a lost or
        stuck rank is a CO2Error naming it."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        return deadline.broadcast_object(obj, src, "Lightning's broadcast", self.co2.timeout_s, collective_device())

    def barrier(self, name: Optional[str] = None) -> None:
        """Every rank got here (Lightning's barrier `name`), within timeout_s."""
        if not dist.is_initialized():
            return
        device = self.root_device  # type: ignore[attr-defined]  # the Lightning strategy's
        deadline.barrier(f"Lightning's barrier {name or ''}".rstrip(), self.co2.timeout_s, device)

    # ---- checkpoints --------------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore once the CO2 optimizer exists: its state comes from the same per-rank files."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The per-rank load restores the optimizers; Lightning restores only its LR schedulers."""
        return False

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing for Lightning's single file: the per-rank files hold every rank's optimizer state (and
        a finalized CO2 optimizer has none to give)."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """During fit: every rank's state under the directory `filepath` (collective). Once fit ended
        (or before it began): Lightning's single file of the one model, written by rank 0."""
        filepath = self.broadcast(filepath)  # type: ignore[attr-defined]  # a name from rank 0's metrics
        if storage_options is not None:
            raise TypeError("co2: trainer.save_checkpoint(storage_options=...) is not supported by the CO2 strategies")
        co2 = self.co2_optimizer
        if co2 is None or co2.engine.finalized:
            model_only = {key: value for key, value in checkpoint.items() if key != "optimizer_states"}
            Strategy.save_checkpoint(self, model_only, filepath)  # type: ignore[arg-type]
            return
        self._save_per_rank(Path(filepath), {k: v for k, v in checkpoint.items() if k not in PER_RANK})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """`fit(ckpt_path=...)`: every rank's state from a per-rank directory; `validate`/`test`/`predict`:
        a single file (the model saved after fit)."""
        path = Path(checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[attr-defined]
        if fitting and not path.is_dir():
            raise CO2Error(
                f"co2: fit(ckpt_path={str(path)!r}) needs a directory of per-rank CO2 files, as a CO2 strategy "
                f"saves during fit; {path} is a single file (a model saved after fit ended, or by another "
                f"strategy) and holds no CO2 state. To train on from its weights, load them into the module "
                f"(e.g. LitModel.load_from_checkpoint) and call fit without ckpt_path"
            )
        if not fitting and path.is_dir():
            raise CO2Error(
                f"co2: {path} holds each replica's own model in the middle of training (per-rank CO2 files); "
                f"validate, test and predict take one model: the file trainer.save_checkpoint writes after fit"
            )
        if not fitting:
            return Strategy.load_checkpoint(self, path, weights_only)  # type: ignore[arg-type]
        return self._load_per_rank(path)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A single file's model; a per-rank load has restored the module already."""
        if "state_dict" in checkpoint:
            Strategy.load_model_state_dict(self, checkpoint, strict=strict)  # type: ignore[arg-type]

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: the per-rank load has restored the optimizer and the CO2 state."""
