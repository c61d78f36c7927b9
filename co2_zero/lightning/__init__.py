"""CO2 under PyTorch Lightning (docs/lightning.md): two strategies, each a thin adapter.

- `CO2Strategy`: `CO2Optimizer` on Lightning's DDP machinery (process group, samplers, launchers)
  without the `DistributedDataParallel` wrapper, so CO2 is the only cross-rank traffic. The CO2
  config lives on the strategy; `configure_optimizers` returns a plain optimizer, which the strategy
  wraps, so one LightningModule trains under `strategy="ddp"` or `CO2Strategy(co2=...)` unchanged.
- `CO2DeepSpeedStrategy`: Lightning's `DeepSpeedStrategy` with a `"co2"` section in its config, built
  through `co2_zero.deepspeed.initialize` (no process-wide patch), on GPUs and on CPU.

Both check the run at its start, log each round's figures through the Trainer's loggers, call
`finalize()` when fit ends, and save and resume per rank through `co2_zero.checkpoint` (`common.py`).
`CO2DeepSpeedStrategy` is imported on first use, so `CO2Strategy` needs no DeepSpeed.
"""

from typing import Any

from ..core.errors import missing_extra

try:  # the lightning extra
    import lightning.pytorch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("PyTorch Lightning", "lightning", error) from error

from .strategy import CO2Strategy

__all__ = ["CO2DeepSpeedStrategy", "CO2Strategy"]


def __getattr__(name: str) -> Any:
    if name == "CO2DeepSpeedStrategy":  # needs DeepSpeed: imported when asked for
        from .deepspeed import CO2DeepSpeedStrategy

        return CO2DeepSpeedStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
