"""FairScale's `ShardedDataParallel`, fixed for a replica's group, and `wrap()`: the usual FairScale pair
with CO2 across replicas."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Type, Union

import torch
from fairscale.nn.data_parallel import ShardedDataParallel as _FairScaleSDP

from ..core.config import CO2Config
from .optimizer import CO2OSS


class ShardedDataParallel(_FairScaleSDP):
    """`fairscale.nn.ShardedDataParallel`, fixed for a `process_group` that is not the whole world.

    After reducing a gradient that is not in a reduce bucket, FairScale keeps it only where
    `dst_rank == self._global_rank`: the owner's rank *in the group* against this rank's *global* rank.
    On every replica but the first the owner then drops its reduced gradient and OSS skips the
    parameter, silently: every parameter larger than `reduce_buffer_size` (an embedding, say), and all
    of them when S = 1 (a group of one has no buckets). The attribute serves nothing else, so it is
    set to the rank in the group. Same constructor as FairScale's.

    Args:
        *args: FairScale's arguments: the module and the `CO2OSS` (or OSS) optimizer(s).
        **kwargs: FairScale's keywords; pass `process_group=opt.group`, the replica.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._global_rank = self._rank  # compared with group ranks only (FairScale 0.4.13)


def wrap(
    module: torch.nn.Module,
    co2: Union[CO2Config, Mapping[str, Any], None] = None,
    optim: Type[torch.optim.Optimizer] = torch.optim.AdamW,
    sdp_kwargs: Optional[Mapping[str, Any]] = None,
    **defaults: Any,
) -> tuple[ShardedDataParallel, CO2OSS]:
    """Build `CO2OSS` over `module`'s parameters and wrap `module` in ShardedDataParallel on the
    replica's group: the usual FairScale pair, CO2 across replicas. Call it on all ranks.

    Args:
        module: the model (fp32, on one device).
        co2: a `CO2Config`, a dict of its fields, or None for the defaults.
        optim: the inner optimizer class.
        sdp_kwargs: keywords for ShardedDataParallel.
        **defaults: the inner optimizer's arguments (e.g. lr, weight_decay).

    Returns:
        `(model, optimizer)`: the `ShardedDataParallel` module and its `CO2OSS`."""
    opt = CO2OSS(module.parameters(), optim=optim, co2=co2, model=module, **defaults)
    return ShardedDataParallel(module, opt, process_group=opt.group, **dict(sdp_kwargs or {})), opt
