"""A tiny LightningModule over tests.models and a Trainer launched inside tests.dist_utils ranks, shared
by the Lightning suites (tests/integrations/test_lightning.py, tests/integrations/test_lightning_deepspeed.py).

`as_torchrun(rank, world)` makes a spawned rank look like a torchrun worker (Lightning then joins the
rank's existing process group instead of launching processes). `Recorder` keeps the parameters after
every optimizer step, keyed by the global step, as the next step starts from them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import lightning.pytorch as L
import torch

from tests import models


def as_torchrun(rank: int, world: int) -> None:
    """The environment torchrun gives a worker (Lightning's TorchElasticEnvironment reads it)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29400")  # unused: the process group exists already


class Lit(L.LightningModule):
    """tests.models' model and loss; `optimizer` as tests.models builds it; `schedule`: a per-step LR
    schedule (LambdaLR on the inner optimizer, interval "step"); `build`: replaces configure_optimizers;
    `by_step`: each step trains on `by_step(rank, global step)` whatever the loader gave, so the data follow
    the step across a resume (Lightning restarts a plain DataLoader at its epoch's first batch)."""

    def __init__(
        self,
        kind: str = "mlp",
        optimizer: str = "sgd",
        schedule: bool = False,
        build: Optional[Callable] = None,
        by_step: Optional[Callable[[int, int], Any]] = None,
    ) -> None:
        super().__init__()
        self.net = models.make_model(kind)
        self.optimizer_kind, self.schedule, self.build, self.by_step = optimizer, schedule, build, by_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch if self.by_step is None else self.by_step(self.global_rank, self.trainer.global_step)
        return models.loss_fn(self.net(x.to(next(self.parameters()).dtype)).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", models.loss_fn(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.build is not None:
            return self.build(self)
        opt = models.make_optimizer(self.optimizer_kind, self.parameters())
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(L.Callback):
    """The module's parameters (names without the LightningModule's `net.`) after every optimizer step."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps[trainer.global_step] = params(pl_module)


def params(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n.removeprefix("net."): p.detach().float().clone() for n, p in module.named_parameters()}


def loader(batch: Callable[[int], Any], count: int) -> torch.utils.data.DataLoader:
    """This rank's own `count` batches, in order (`batch(i)` makes batch i; no sampler)."""
    return torch.utils.data.DataLoader([batch(i) for i in range(count)], batch_size=None)


def trainer(world: int, strategy: Any, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer over `world` ranks with this rank's own data (no distributed sampler), writing
    nothing unless told (no logger, no checkpoints)."""
    settings = dict(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, **settings)
