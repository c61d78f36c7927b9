"""What the engine does once, when it is built (docs/design.md §3, §5): agree, then start together.

- `state_device`: where the CO2 state lives (refusing a partition NCCL cannot reach);
- `layout_of`: the padded flat layout the outer step works on;
- `check_agreement`: every rank holds the same model and, per shard, the same partition layout, or
  every rank fails naming the difference (instead of a hang later);
- `common_start`: every replica starts from replica 0's parameters, frozen ones included.

All run before the background worker exists, so the outer group is still free for the broadcasts.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from .comm import Layout
from .config import CO2Config
from .deadline import wait_within
from .errors import CO2Error
from .parameter_order import TensorIdentity, agree_on_parameters
from .partition import ParameterWatch, Partition, local_values
from .topology import Topology, collective_device, fingerprint, gather_fingerprints


def state_device(partition: Partition, topology: Topology) -> torch.device:
    """Where the CO2 state lives: with the partition, whose collectives run on the outer group.

    An empty partition takes the outer group's collective device. NCCL takes tensors on this rank's
    CUDA device only, so a partition elsewhere (e.g. DeepSpeed's optimizer CPU offload) is refused
    here, naming the devices, instead of failing in the first collective.
    """
    wanted = collective_device(topology.outer_group)
    if not partition.chunks:
        return wanted
    device = partition.chunks[0].device
    if wanted.type == "cuda" and device != wanted:
        raise CO2Error(
            f"co2: the fp32 master partition is on {device}, but the CO2 process groups use the "
            f"{dist.get_backend(topology.outer_group)} backend, whose collectives need tensors on {wanted}; "
            f"keep the master parameters on this rank's GPU (no optimizer CPU offload) and call "
            f"torch.cuda.set_device(local_rank) before building the optimizer"
        )
    return device


def layout_of(partition: Partition, replicas: int) -> Layout:
    """The partition padded to a multiple of R, so that every replica owns an equal sub-shard."""
    padded = max(replicas, math.ceil(partition.length / replicas) * replicas)
    return Layout(
        length=partition.length,
        padded=padded,
        sub_shard=padded // replicas,
        segments=tuple(partition.segments),
        num_tensors=partition.num_tensors,
        vectors=frozenset(i for i, tensor in enumerate(partition.tensors) if len(tensor.shape) <= 1),
    )


def check_agreement(partition: Partition, layout: Layout, topology: Topology, config: CO2Config) -> None:
    """Fail fast, naming the difference, when ranks hold different models or partition layouts
    (a fingerprint exchange at start-up instead of a hang later; the configs and the grid were
    compared when the topology was built)."""
    tensors = partition.tensors or [
        TensorIdentity(f"optimizer parameter {i}", (), False) for i in range(partition.num_tensors)
    ]
    agree_on_parameters(tensors, topology.norm_group, config.timeout_s)
    mine = [topology.shard_index, layout.length, fingerprint(tuple(tuple(seg) for seg in layout.segments))]
    table = gather_fingerprints(mine, topology.norm_group, config.timeout_s, "start-up model check")
    for rank, theirs in enumerate(table):
        if theirs[0] == topology.shard_index and theirs[1:] != mine[1:]:
            raise CO2Error(
                f"co2: rank {topology.rank} and rank {rank} own shard {topology.shard_index} but their "
                f"partitions differ ({layout.length} elements here vs {theirs[1]}, or a different split "
                f"into tensors); every replica must partition the model the same way"
            )


@torch.no_grad()
def common_start(
    partition: Partition, topology: Topology, refresh: Callable[[], None], watch: ParameterWatch, timeout_s: float
) -> None:
    """Every replica starts from replica 0's parameters (a framework broadcasts its model only
    within its data-parallel group, here a replica), and every rank holds rank 0's frozen
    parameters (CO2 never averages them). `check_agreement` made sure the partitions have the same
    layout."""
    if topology.replicas > 1:
        for chunk in partition.chunks:
            dist.broadcast(chunk, src=topology.outer_ranks[0], group=topology.outer_group)
        refresh()
    _broadcast_frozen(watch, topology, timeout_s)


@torch.no_grad()
def _broadcast_frozen(watch: ParameterWatch, topology: Topology, timeout_s: float) -> None:
    """Frozen parameters from replica 0 to every replica (over the outer group, like the partition:
    inside a replica the framework already made them equal; an FSDP2-sharded one is its local
    shard), one flat tensor per dtype. The ranks first agree on the frozen set."""
    _agree_on_frozen(watch.frozen, topology, timeout_s)
    frozen = [(name, local_values(p)) for name, p in watch.frozen]
    if topology.replicas == 1:
        return
    device = collective_device(topology.outer_group)
    for dtype in sorted({p.dtype for _, p in frozen}, key=str):
        params = [p for _, p in frozen if p.dtype == dtype]
        flat = torch.cat([p.reshape(-1).to(device) for p in params])
        what = f"start-up broadcast of the frozen parameters on the {topology.describe_outer()}"
        source, group = topology.outer_ranks[0], topology.outer_group
        broadcast = partial(dist.broadcast, flat, src=source, group=group, async_op=True)
        wait_within(broadcast, what, timeout_s)
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _agree_on_frozen(frozen: list[tuple[str, torch.Tensor]], topology: Topology, timeout_s: float) -> None:
    """Every rank must freeze the same parameters (name, global shape, dtype), or each raises naming them."""
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in frozen]
    mine = [len(frozen), fingerprint(shapes)]
    table = gather_fingerprints(mine, topology.control_group, timeout_s, "start-up check of the frozen parameters")
    for rank, theirs in enumerate(table):
        if theirs != mine:
            raise CO2Error(
                f"co2: rank {topology.rank} and rank {rank} disagree on the frozen parameters (requires_grad="
                f"False): {len(frozen)} here {[name for name, _ in frozen][:8]}, {theirs[0]} there; every "
                f"rank must freeze the same parameters before building the CO2 optimizer"
            )
