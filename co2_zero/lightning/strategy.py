"""`CO2Strategy`: `CO2Optimizer` on Lightning's DDP machinery, without the gradient all-reduce.

Lightning's `DDPStrategy` brings the launchers, the process group and the distributed samplers (every
rank its own data); this strategy keeps those and drops the `DistributedDataParallel` wrapper, so CO2's
exchange is the only cross-rank traffic. The CO2 config is the strategy's: `configure_optimizers`
returns a plain optimizer (and schedulers on it, as usual), which the strategy wraps in a
`CO2Optimizer` over the whole LightningModule (its float buffers are averaged at round ends too).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy

from .. import checkpoint
from ..core.config import CO2Config
from ..core.errors import CO2Error
from ..core.plan import check_given
from ..integration import CO2Steps
from ..optim import CO2Optimizer
from .common import TAG, CO2Hooks

_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def refuse_ddp_wrapper(module: torch.nn.Module) -> None:
    """ValueError when the module or one of its submodules is wrapped in DistributedDataParallel: its
    gradient all-reduce would run at every step, under CO2's outer steps."""
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.parallel.DistributedDataParallel):
            where = f"its submodule {name!r}" if name else "the model"
            raise ValueError(
                f"co2: {where} is wrapped in DistributedDataParallel; CO2Strategy replaces DDP's gradient "
                f"all-reduce (with it, every step would be synchronous DDP under the outer steps): pass the "
                f"bare module"
            )


def wrap_optimizers(optimizers: list[Any], config: CO2Config, module: torch.nn.Module) -> CO2Optimizer:
    """The one plain optimizer `configure_optimizers` returned, wrapped in a `CO2Optimizer`."""
    kinds = [type(o).__name__ for o in optimizers]
    if len(optimizers) != 1 or isinstance(optimizers[0], _MockOptimizer):
        raise ValueError(
            f"co2: CO2Strategy trains with exactly one optimizer from configure_optimizers; got "
            f"{kinds if optimizers and not isinstance(optimizers[0], _MockOptimizer) else 'none'}"
        )
    inner = optimizers[0]
    if isinstance(inner, CO2Steps):
        raise ValueError(
            f"co2: configure_optimizers returned a {type(inner).__name__}; return its inner optimizer "
            f"(e.g. torch.optim.AdamW): CO2Strategy builds the CO2Optimizer from its own co2 config"
        )
    if not isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "process_group"):
        raise ValueError(
            f"co2: configure_optimizers returned a {type(inner).__name__}; CO2Strategy needs a plain "
            f"torch.optim.Optimizer of this rank's parameters (not a distributed one)"
        )
    return CO2Optimizer(inner, config, model=module)


class CO2Strategy(CO2Hooks, DDPStrategy):
    """Lightning strategy for CO2: `Trainer(strategy=CO2Strategy(co2={"tau": 32}), ...)`.

    Every rank is its own replica (S = 1). The other arguments are `DDPStrategy`'s launch arguments, as
    there; its DDP options (`ddp_comm_hook`, `find_unused_parameters`, ...) are refused, as no DDP wrapper
    exists to use them.

    Args:
        co2: a `CO2Config`, a dict of its fields, or None for the defaults.
        **ddp_options: refused (ValueError naming them).

    Raises:
        ValueError: (when built) a co2 field is invalid, or a DDP option was given; (when fit starts) the
            module holds a DistributedDataParallel wrapper, or `configure_optimizers` returned no
            optimizer, several, a CO2 optimizer or a distributed one.
        CO2Error: `fit(ckpt_path=...)` names a single file (no CO2 state), or a load or save failed.
    """

    strategy_name = "co2"

    def __init__(
        self,
        co2: Union[CO2Config, Mapping[str, Any], None] = None,
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_options: Any,
    ) -> None:
        if ddp_options:
            raise ValueError(
                f"co2: CO2Strategy does not take {sorted(ddp_options)}: it does not wrap the model in "
                f"DistributedDataParallel, so DDP's options have nothing to act on; accepted: co2 and "
                f"DDPStrategy's launch arguments (accelerator, parallel_devices, cluster_environment, "
                f"checkpoint_io, precision_plugin, process_group_backend, timeout, start_method)"
            )
        self.co2 = CO2Config.coerce(co2)
        check_given(self.co2, driver="lightning")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @property
    def co2_optimizer(self) -> Optional[CO2Optimizer]:
        optimizer = self.optimizers[0] if self.optimizers else None
        return optimizer if isinstance(optimizer, CO2Optimizer) else None

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: CO2 is the only cross-rank traffic."""
        refuse_ddp_wrapper(self.model)

    def setup_optimizers(self, trainer: Any) -> None:
        """The user's `configure_optimizers`, its one optimizer then wrapped in a `CO2Optimizer`."""
        super().setup_optimizers(trainer)
        self.optimizers = [wrap_optimizers(self.optimizers, self.co2, self.lightning_module)]
        self._logged_round = None

    def _save_per_rank(self, directory: Path, lightning_state: dict[str, Any]) -> None:
        framework = checkpoint.framework_state(self.lightning_module, self.co2_optimizer)
        checkpoint.save_checkpoint(directory, framework, extra=lightning_state, tag=TAG)

    def _load_per_rank(self, directory: Path) -> dict[str, Any]:
        framework = checkpoint.framework_state(self.lightning_module, self.co2_optimizer)
        loaded = checkpoint.load_checkpoint(directory, framework, tag=TAG)
        if loaded is None:
            raise CO2Error(f"co2: no complete CO2 checkpoint in {directory}; nothing was loaded")
        return dict(loaded[1])
