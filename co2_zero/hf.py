"""CO2 under Hugging Face Trainer (docs/huggingface.md; docs/design.md §6.3): `CO2Callback` calls
`co2_zero.deepspeed.patch()` when it is created (adding it to a Trainer is the opt-in), so Accelerate's
`deepspeed.initialize` builds CO2 for a config with a "co2" section; it checks that section and the engine,
logs each round's figures and calls `finalize()` at the end of training. Checkpoints go through the patched
engine's per-rank `save_checkpoint` / `load_checkpoint`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

try:
    import transformers
except ImportError as error:  # an optional extra
    raise ImportError(
        "co2_zero.hf needs Hugging Face transformers and accelerate: pip install -e '.[hf]' in the clone"
    ) from error
try:
    from . import deepspeed as co2_deepspeed
except ImportError as error:
    raise ImportError(f"co2_zero.hf needs DeepSpeed ({error}): pip install -e '.[hf]'") from error

from . import checkpoint
from .core.config import dotted
from .core.errors import CO2Error
from .core.plan import check_given
from .core.step_budget import step_budget_problem

__all__ = ["CO2Callback", "check_co2_section"]


def check_co2_section(ds_config: Mapping[str, Any]) -> None:
    """Validate the co2 section of a DeepSpeed config as Trainer and Accelerate will pass it on.

    Trainer and Accelerate replace `"auto"` values by their own arguments and refuse an `"auto"` they
    have no argument for: every key of `co2`. Raises ValueError naming the field for an `"auto"` value,
    and for whatever `co2_zero.deepspeed.split_config` refuses.
    """
    for field, value in dotted(ds_config.get("co2") or {}, "co2").items():
        if value == "auto":
            raise ValueError(
                f"co2 config: {field}='auto' is invalid here; accepted: an explicit value, or leave the key out "
                f"for its default. Trainer and Accelerate fill 'auto' only for their own DeepSpeed keys and "
                f"refuse it everywhere else"
            )
    co2_deepspeed.split_config(ds_config)


def _check_world_size(args: Any) -> None:
    """Trainer fills the DeepSpeed batch sizes for the processes it counts; on CPU without `use_cpu=True`
    it counts one, and DeepSpeed then fails with a bare "train_batch_size is not equal to
    micro_batch_per_gpu * gradient_acc_step * world_size". Say what to do instead."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, DeepSpeed's and Accelerate's launchers set it
    counted = getattr(args, "world_size", launched)
    if counted < launched:
        raise ValueError(
            f"co2: Trainer counts world_size={counted} process(es) but the launch started {launched} (WORLD_SIZE), "
            f"so DeepSpeed would refuse the batch sizes Trainer fills in ('train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size'); on CPU give TrainingArguments(use_cpu=True) "
            f"(with DS_ACCELERATOR=cpu), which counts every rank"
        )


def _co2_optimizer(optimizer: Any) -> Optional[co2_deepspeed.CO2ZeroOptimizer]:
    """The CO2ZeroOptimizer inside Accelerate's optimizer wrapper, or None."""
    for _ in range(4):  # AcceleratedOptimizer(.optimizer = the ZeRO optimizer), and a little more
        if optimizer is None or isinstance(optimizer, co2_deepspeed.CO2ZeroOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class CO2Callback(transformers.TrainerCallback):
    """Trainer callback for a DeepSpeed config with a "co2" section; creating it calls `patch()`.

    `trainer = Trainer(..., args=TrainingArguments(deepspeed="ds.json", ...), callbacks=[CO2Callback()])`.
    The patch (which rewrites DeepSpeed's `initialize` for the whole process, see
    `co2_zero.deepspeed.patch`) stays on after training; `co2_zero.deepspeed.unpatch()` undoes it.
    The logged figures are rank 0's: `co2/round` (the last round ended), `co2/wait_s` and `co2/round_end_s`
    (means over the rounds ended since the previous log: time blocked on the exchange, and the whole
    round end), any other number the round reports, and `co2/state_bytes` (CO2 state on rank 0).

    Raises:
        ValueError: (when the Trainer is built) `"auto"` or an invalid value inside the `co2` section, or a
            ZeRO stage other than 1 or 2.
        CO2Error: (when training starts) the engine is plain DeepSpeed, because `unpatch()` undid the patch.
    """

    def __init__(self) -> None:
        co2_deepspeed.patch()  # before the Trainer builds its engine
        self.optimizer: Optional[co2_deepspeed.CO2ZeroOptimizer] = None
        self._rounds: list[dict[str, Any]] = []  # round figures since the last log

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        config = getattr(args, "hf_deepspeed_config", None)
        ds_config = {} if config is None else config.config
        if "co2" not in ds_config:
            co2_deepspeed.split_config(ds_config)  # names a misspelt section ("CO2", "co_2")
            raise ValueError(
                f"co2: CO2Callback needs a DeepSpeed config with a co2 section; accepted: "
                f'TrainingArguments(deepspeed=<config with "co2": {{...}}>), got deepspeed={args.deepspeed!r}'
            )
        check_co2_section(ds_config)
        check_given(co2_deepspeed.split_config(ds_config)[1], driver="hf-trainer")
        _check_world_size(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.optimizer = _co2_optimizer(optimizer)
        self._rounds.clear()
        if self.optimizer is None:
            raise CO2Error(
                "co2: Trainer built a plain DeepSpeed engine although its config has a co2 section: its "
                "deepspeed.initialize call did not go through co2_zero (co2_zero.deepspeed.unpatch() was called, "
                "or the engine came from another initialize, e.g. MS-AMP's); call co2_zero.deepspeed.patch() "
                "before trainer.train()"
            )
        problem = step_budget_problem(state.max_steps, self.optimizer.config.tau, "max_steps", "co2.tau")
        if problem is not None:
            warnings.warn(f"co2: {problem}", stacklevel=2)
        if args.save_strategy != "no" and args.save_only_model:
            warnings.warn(
                "co2: save_only_model=True: Trainer's checkpoints hold no DeepSpeed/CO2 state and cannot resume",
                stacklevel=2,
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.optimizer is not None and self.optimizer.round_ended:
            self._rounds.append(dict(self.optimizer.last_round))

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        """Add the round figures to Trainer's log entry (printed by the progress callback, which runs
        after user callbacks, and kept in `trainer.state.log_history`)."""
        if not self._rounds or logs is None or self.optimizer is None:
            return
        figures: dict[str, Any] = {"co2/round": self._rounds[-1]["round"]}
        for key, value in self._rounds[-1].items():
            if key not in ("round", "inner_step") and isinstance(value, (int, float)):
                figures[f"co2/{key}"] = sum(r[key] for r in self._rounds) / len(self._rounds)
        figures["co2/state_bytes"] = self.optimizer.co2_state_bytes()
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
        self._rounds.clear()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Rank 0 (which names the saved tag once every rank has written) checks the checkpoint is CO2's."""
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        latest = directory / checkpoint.LATEST
        if state.is_world_process_zero and not args.save_only_model and directory.is_dir() and not latest.is_file():
            warnings.warn(f"co2: {directory} holds no CO2 state ({latest.name} missing)", stacklevel=2)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Every rank ends with the same model (the start point the last round produced)."""
        if self.optimizer is not None and not self.optimizer.engine.finalized:
            self.optimizer.finalize()
