"""`CO2DeepSpeedStrategy`: Lightning's `DeepSpeedStrategy` with a `"co2"` section, on GPUs and on CPU.

The engine is built by `co2_zero.deepspeed.initialize`, called directly (no process-wide `patch()`). On a
CPU accelerator (`DS_ACCELERATOR=cpu`) `setup_environment` lets it through and names each rank's device
`cpu:<local rank>`, which answers Lightning's device-index reads (docs/lightning.md). Checkpoints, round
figures and `finalize()` are `common.CO2Hooks`'.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy

from .. import deepspeed as co2_deepspeed
from ..core.errors import CO2Error
from ..core.plan import check_given
from .common import TAG, CO2Hooks


class CO2DeepSpeedStrategy(CO2Hooks, DeepSpeedStrategy):
    """Lightning strategy for CO2 over DeepSpeed ZeRO-1/2: `CO2DeepSpeedStrategy(config={..., "co2": {...}})`.

    Args:
        config: the DeepSpeed config (a dict or a JSON path) with a `co2` section; Lightning fills
            `gradient_accumulation_steps` (from `accumulate_grad_batches`), and the micro-batch and
            `gradient_clipping` when absent.
        **kwargs: Lightning's `DeepSpeedStrategy` arguments.

    Raises:
        ValueError: (when built) no `co2` section, an invalid one (naming the field), or a ZeRO stage other
            than 1 or 2; (on CPU, when fit starts) DeepSpeed's accelerator is not the CPU.
        CO2Error: `fit(ckpt_path=...)` names a single file (no CO2 state), or a load or save failed.
    """

    strategy_name = "co2_deepspeed"

    def __init__(self, config: Union[str, Path, Mapping[str, Any]], **kwargs: Any) -> None:
        super().__init__(config=dict(config) if isinstance(config, Mapping) else config, **kwargs)
        _, self.co2 = co2_deepspeed.split_config(self.config)
        if self.co2 is None:
            raise ValueError(
                f"co2: CO2DeepSpeedStrategy needs a DeepSpeed config with a co2 section; got the keys "
                f'{sorted(self.config)}. Add "co2": {{...}} (docs/configuration.md), or use Lightning\'s '
                f"DeepSpeedStrategy for plain ZeRO"
            )
        check_given(self.co2, driver="lightning")

    @property
    def co2_optimizer(self) -> Optional[co2_deepspeed.CO2ZeroOptimizer]:
        optimizer = getattr(self.model, "optimizer", None)
        return optimizer if isinstance(optimizer, co2_deepspeed.CO2ZeroOptimizer) else None

    def setup_environment(self) -> None:
        """CUDA: Lightning's. CPU: DDPStrategy's (the device, then `setup_distributed`) with each rank's
        device named `cpu:<local rank>`, once DeepSpeed's own accelerator is the CPU too."""
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise ValueError(
                f"co2: Trainer(accelerator='cpu') with DeepSpeed's accelerator {get_accelerator().device_name()!r}; "
                f"set DS_ACCELERATOR=cpu before deepspeed is imported"
            )
        assert self.parallel_devices is not None
        self.parallel_devices = [torch.device("cpu", index) for index in range(len(self.parallel_devices))]
        super(DeepSpeedStrategy, self).setup_environment()

    def _init_deepspeed_distributed(self) -> None:
        """Lightning's, with co2_zero's `init_distributed` for DeepSpeed's."""
        assert self.cluster_environment is not None
        self._set_node_environment_variables()
        self._process_group_backend = self._get_process_group_backend()
        co2_deepspeed.init_distributed(
            dist_backend=self._process_group_backend,
            distributed_port=self.cluster_environment.main_port,
            timeout=self._timeout,
        )

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """`co2_zero.deepspeed.initialize` where Lightning calls `deepspeed.initialize`."""
        engine, zero, _, _ = co2_deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.root_device.index),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        self._logged_round = None
        return engine, zero

    def _save_per_rank(self, directory: Path, lightning_state: dict[str, Any]) -> None:
        co2_deepspeed.save_checkpoint(self.deepspeed_engine, directory, tag=TAG, client_state=lightning_state)

    def _load_per_rank(self, directory: Path) -> dict[str, Any]:
        loaded, client_state = co2_deepspeed.load_checkpoint(self.deepspeed_engine, directory, tag=TAG)
        if loaded is None:
            raise CO2Error(f"co2: no complete CO2 checkpoint in {directory}; nothing was loaded")
        return client_state
