"""FSDP2 inside each replica, CO2 across replicas (docs/design.md §6.4).

PyTorch's `fully_shard` over `replica_mesh(config)` (a 1-D mesh = this rank's replica) shards every
parameter by rows over the replica's S ranks and keeps each rank's rows as the local tensor of a
DTensor parameter. Those local tensors are this rank's partition: CO2 reads and writes them in place
and FSDP2 all-gathers them for every forward and backward, so nothing needs spreading after a round
end (the refresh callback only checks that the shards did not move). This module only builds the
mesh and finds the partition; `CO2Optimizer` dispatches here when the inner optimizer holds DTensor
parameters.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .core.config import CO2Config
from .core.errors import CO2Error
from .core.outer import Segment
from .core.parameter_order import identify
from .core.partition import Partition, parameter_signature
from .core.topology import new_groups, replica_ranks
from .integration import TensorRows, check_fp32_parameters

_USE_REPLICA_MESH = "shard the model with fully_shard(module, mesh=co2_zero.fsdp.replica_mesh(config))"


def replica_mesh(config: Union[CO2Config, dict, None] = None, device_type: Optional[str] = None) -> DeviceMesh:
    """This rank's replica (ranks [r*S, (r+1)*S)) as a 1-D DeviceMesh for `fully_shard`.

    Collective over the default group: every rank calls it once, in the same order relative to its
    other group creations. S is `config.shards_per_replica` ("node": the ranks per node). The device
    type is "cuda" when the default backend drives CUDA (nccl) and CUDA is available, else "cpu";
    pass `device_type` to override. On CUDA, set the rank's device before calling it.

    Args:
        config: a `CO2Config`, a dict of its fields, or None for the defaults (S = ranks per node).
        device_type: the mesh's device type, to override the default.

    Returns:
        A 1-D `DeviceMesh` over this rank's replica, for `fully_shard(..., mesh=...)`.

    Raises:
        ValueError: `shards_per_replica` does not divide the world size, or a config field is invalid.
        RuntimeError: `torch.distributed` is not initialised.
    """
    config = CO2Config.coerce(config)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("co2: replica_mesh needs torch.distributed initialised first (init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = config.resolve_shards(world)
    groups = new_groups(replica_ranks(shards, world), config)  # every replica's, on every rank
    return DeviceMesh.from_group(groups[rank // shards], device_type or default_device_type())


def default_device_type() -> str:
    """`"cuda"` when the default process group's backend runs on CUDA (nccl) and CUDA is available."""
    backend = str(dist.get_backend())
    return "cuda" if torch.cuda.is_available() and ("nccl" in backend or "cuda" in backend) else "cpu"


def find_partition(
    params: Sequence[torch.nn.Parameter], config: CO2Config, module: Optional[torch.nn.Module] = None
) -> tuple[Partition, Any, Callable[[], None]]:
    """The partition of fully_shard'ed `params` (the inner optimizer's trainable parameters, in
    order), the replica's process group (for `Topology.build(..., inner_group=...)`) and the
    engine's `refresh` callback. `module` (optional) names the parameters for the start-up check.

    Chunks are the local shards (views of FSDP2's sharded storage, without its padding rows);
    segments map them to the parameters' flattened global elements. Nothing needs spreading after a
    round end (FSDP2 all-gathers the shards for every forward), so `refresh` only checks that the
    shards are still the tensors FSDP2 reads.
    """
    mesh = _replica_mesh_of(params, config)
    check_fp32_parameters(
        params,
        "CO2 needs fp32 sharded parameters. Keep the model fp32 and compute in low precision with "
        "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))",
    )
    chunks, segments, offset = [], [], 0
    for i, p in enumerate(params):
        first, local = _local_shard(i, p, mesh)
        chunks.append(local.view(-1))
        if local.numel():
            segments.append(Segment(i, offset, offset + local.numel(), first * math.prod(p.shape[1:])))
            offset += local.numel()
    partition = Partition(
        chunks=chunks,
        segments=segments,
        num_tensors=len(params),
        signature=parameter_signature([p.shape for p in params]),
        tensors=identify(params, module),
    )
    return partition, mesh.get_group(), _check_shards_unmoved(params, chunks)


def shard_rows(length: int, shards: int, shard: int) -> tuple[int, int]:
    """(first row, rows) of dim 0 (`length` rows) that shard `shard` of `shards` holds: `torch.chunk`'s
    split, which `fully_shard` uses (chunks of ceil(length / shards) rows; the last shards may be short or
    empty, FSDP2 pads them in its own storage)."""
    rows = math.ceil(length / shards)
    first = min(shard * rows, length)
    return first, min(rows, length - first)


def local_rows(value: Any, what: str = "a DTensor") -> Optional[tuple[int, torch.Tensor]]:
    """(first global row, this rank's rows) of a `fully_shard`'ed DTensor: its local tensor itself, so
    writing into it writes the parameter FSDP2 all-gathers. None for any other value (a plain tensor is
    all of itself). Checkpoint files hold these rows, never the DTensor (docs/design.md §7)."""
    if not isinstance(value, DTensor):
        return None
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        raise ValueError(
            f"co2: {what} (shape {tuple(value.shape)}) has placements {tuple(value.placements)} on a "
            f"{mesh.ndim}-D mesh; accepted: (Shard(dim=0),) on a 1-D mesh, fully_shard's default"
        )
    first, rows = shard_rows(value.shape[0], mesh.size(), mesh.get_local_rank())
    with torch.no_grad():
        local = value.to_local()  # without autograd: the DTensor's own local tensor, not a view of it
    if local.shape[0] != rows:
        raise ValueError(
            f"co2: {what} (shape {tuple(value.shape)}) has {local.shape[0]} local rows on shard "
            f"{mesh.get_local_rank()}; fully_shard's dim-0 sharding gives {rows}. Custom shard placements "
            f"are not supported"
        )
    return first, local


def sharded_like(local: torch.Tensor, param: DTensor) -> DTensor:
    """`local` (this rank's rows of a tensor shaped like `param`, e.g. an optimizer moment read from a
    checkpoint) as a DTensor sharded like `param`, on the device of its shard."""
    with torch.no_grad():
        device = param.to_local().device
    return DTensor.from_local(
        local.to(device), param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class DTensorRows(TensorRows):
    """How FSDP2 holds tensors, for checkpoints (`co2_zero.integration.TensorRows`): module entries and
    optimizer moments of `fully_shard`'ed parameters are DTensors; a file holds this rank's rows of
    each (`local_rows`), made a DTensor like its parameter again on load (`sharded_like`)."""

    def local_rows(self, value: Any) -> Optional[tuple[int, torch.Tensor]]:
        return local_rows(value)

    def like(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return sharded_like(local, param)


DTENSOR_ROWS = DTensorRows()


def _check_shards_unmoved(params: Sequence[DTensor], chunks: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A check that each parameter's local shard is still the storage the partition views. FSDP2
    re-allocates it only when the parameter is replaced under it (e.g. `_apply` with tensor swapping,
    `to_empty`); CO2 would then silently train a copy, so fail instead."""

    def check() -> None:
        with torch.no_grad():
            for i, (p, chunk) in enumerate(zip(params, chunks)):
                if chunk.numel() and p.to_local().data_ptr() != chunk.data_ptr():
                    raise CO2Error(
                        f"co2: the local shard of parameter {i} (shape {tuple(p.shape)}) moved after "
                        f"CO2Optimizer was built; build the optimizer after the model's storage is final "
                        f"(after to_empty(), init, load_state_dict(assign=True))"
                    )

    return check


def _replica_mesh_of(params: Sequence[torch.nn.Parameter], config: CO2Config) -> DeviceMesh:
    """The one 1-D mesh every parameter is sharded over, checked to be exactly this rank's replica."""
    plain = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"co2: parameters {plain} are plain tensors while others are DTensors; every trainable "
            f"parameter must be sharded by fully_shard over the replica mesh ({_USE_REPLICA_MESH})"
        )
    meshes = {p.device_mesh for p in params}
    if len(meshes) != 1:
        raise ValueError(f"co2: the parameters are sharded over {len(meshes)} different meshes; {_USE_REPLICA_MESH}")
    mesh = meshes.pop()
    if mesh.ndim != 1:
        raise ValueError(
            f"co2: the model is sharded over a {mesh.ndim}-D mesh {mesh.mesh.tolist()} (HSDP); CO2 replaces "
            f"HSDP's replicate dimension: {_USE_REPLICA_MESH}, a 1-D mesh of this rank's replica"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = config.resolve_shards(world)
    replica = rank // shards
    expected = replica_ranks(shards, world)[replica]
    ranks = mesh.mesh.tolist()
    if ranks != expected:
        raise ValueError(
            f"co2: the model is sharded over the mesh of global ranks {ranks}, but shards_per_replica="
            f"{config.shards_per_replica!r} (S = {shards}) puts rank {rank} in replica {replica} = ranks "
            f"{expected}; {_USE_REPLICA_MESH} with the same config"
        )
    return mesh


def _local_shard(i: int, p: DTensor, mesh: DeviceMesh) -> tuple[int, torch.Tensor]:
    """(first row, the DTensor's local tensor: the object FSDP2 all-gathers from), checked usable as a
    chunk (its dtype was checked by the caller)."""
    first, local = local_rows(p, f"parameter {i}")
    if local.device.type != mesh.device_type:
        raise ValueError(
            f"co2: parameter {i} lives on {local.device} while its mesh is on {mesh.device_type} "
            f"(CPUOffloadPolicy); CPU offload is not supported with CO2: its collectives run on the "
            f"mesh's device. Drop offload_policy"
        )
    if not local.is_contiguous():
        raise ValueError(f"co2: the local shard of parameter {i} (shape {tuple(p.shape)}) is not contiguous")
    return first, local
