"""DeepSpeed's view of the CO2 topology: a "model parallel unit" whose data-parallel group is the replica,
so ZeRO shards the inner optimizer over the S ranks of one replica only."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..core.topology import Topology


class ReplicaMPU:
    """DeepSpeed's "model parallel unit" for CO2: data parallelism is this rank's replica (the inner
    group), there is no model parallelism (a group of this rank alone)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._solo: Any = None

    def get_data_parallel_group(self) -> Any:
        return self.topology.inner_group

    def get_data_parallel_rank(self) -> int:
        return self.topology.shard_index

    def get_data_parallel_world_size(self) -> int:
        return self.topology.shards

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.topology.inner_ranks)

    def get_model_parallel_group(self) -> Any:
        # A real one-rank group, not None: deepspeed.comm reads group=None as the world group.
        # Local synchronisation: only this rank takes part in creating it.
        if self._solo is None:
            self._solo = dist.new_group([self.topology.rank], use_local_synchronization=True)
        return self._solo

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1
