"""CO2 under PyTorch Lightning (docs/lightning.md): `CO2Strategy` (CO2Optimizer on Lightning's DDP
machinery without the DistributedDataParallel wrapper) and `CO2DeepSpeedStrategy` (DeepSpeedStrategy with a
`"co2"` section, on GPUs and CPU), their shared hooks in `common.py`. `CO2DeepSpeedStrategy` is imported on
first use, so `CO2Strategy` needs no DeepSpeed.
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
