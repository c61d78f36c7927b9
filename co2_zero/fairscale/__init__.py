"""`CO2OSS`: FairScale's OSS inside each replica, CO2 across replicas (docs/design.md §6.2).

OSS shards the inner optimizer over the **inner group** (the S ranks of one replica) and turns the
trainable parameters each rank owns into views of one flat bucket: that bucket is the rank's CO2
partition. The outer state is split over the outer group like in every integration (docs/design.md §2),
and after a round end the owners' rewritten buckets reach the rest of their replica through OSS's own
parameter broadcast. In a FairScale script, `OSS(...)` becomes `CO2OSS(..., co2=...)` and the
ShardedDataParallel import comes from here (FairScale's drops gradients on a replica group, see there)::

    from co2_zero.fairscale import CO2OSS, ShardedDataParallel

    opt = CO2OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-4, co2={"tau": 32}, model=model)
    model = ShardedDataParallel(model, opt, process_group=opt.group)  # reduce inside the replica only

or, equivalently, ``model, opt = co2_zero.fairscale.wrap(model, co2={"tau": 32}, lr=3e-4)``.
"""

from ..core.errors import missing_extra

try:  # the fairscale extra; without it, an ImportError that names the extra
    import fairscale  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("FairScale", "fairscale", error) from error

from .optimizer import CO2OSS
from .sdp import ShardedDataParallel, wrap

__all__ = ["CO2OSS", "ShardedDataParallel", "wrap"]
