"""Replicas x shards (docs/design.md §2) and the process groups CO2 talks on.

World of N ranks = R replicas x S shards; replica r holds ranks [r*S, (r+1)*S). The inner group is a
replica (ZeRO/OSS shard the inner optimizer over it); the outer group of shard index s is
{r*S + s : r in range(R)}, the ranks owning the same partition in every replica.

All CO2 traffic runs on groups created here, never on the default group (users all-reduce their loss
on it), and the background worker and the main thread never share a group: a group must only ever
see one collective at a time, in the same order on every rank.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .config import CHOICES, CO2Config
from .errors import CO2Error, CO2TimeoutError


def collective_device(group: Any = None) -> torch.device:
    """The device a tensor must be on for a collective on `group` (docs/design.md §5).

    NCCL takes only tensors on the rank's current CUDA device; gloo (and a default group that pairs
    gloo for CPU with NCCL for CUDA) takes CPU tensors. Every small tensor the library sends (flags,
    norms, fingerprints) is placed by this one function, so the rule holds by construction.
    """
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fingerprint(value: Any) -> int:
    """One int64 identifying `value` exactly: numbers by their float64 bits (decodable), booleans as
    0/1, anything else by a hash of its repr."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True)


def _describe(code: int, like: Any, choices: Sequence[Any] = ()) -> str:
    """What another rank's fingerprint `code` stands for, given this rank's value `like`."""
    if isinstance(like, bool):
        return repr(bool(code))
    if isinstance(like, (int, float)):
        number = struct.unpack("<d", struct.pack("<q", code))[0]
        return repr(int(number) if isinstance(like, int) and number.is_integer() else number)
    for choice in choices:
        if fingerprint(choice) == code:
            return repr(choice)
    return "a different value"


def text_words(text: str, words: int) -> list[int]:
    """UTF-8 text as `words` int64 (truncated on a character boundary, zero-padded): text that travels
    inside a fingerprint vector, so every rank can print what another rank said."""
    data = text.encode()[: 8 * words].decode(errors="ignore").encode()
    return list(struct.unpack(f"<{words}q", data.ljust(8 * words, b"\0")))


def words_text(values: Sequence[int]) -> str:
    """The text `text_words` encoded."""
    return struct.pack(f"<{len(values)}q", *values).rstrip(b"\0").decode(errors="replace")


def gather_fingerprints(values: Sequence[int], group: Any, timeout_s: float, what: str) -> list[list[int]]:
    """All-gather a fixed-size vector of int64 fingerprints over `group`, within `timeout_s`.

    One tensor collective, no pickling (no numpy needed), valid on every backend. Returns one list per
    rank of the group, in group rank order. A rank that never arrives raises CO2TimeoutError naming
    `what` and the group's ranks, instead of a bare backend timeout.
    """
    device = collective_device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(everyone, mine, group=group, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    except Exception as error:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise CO2TimeoutError(
            f"co2: {what}: not every rank of the group of global ranks {ranks} took part within "
            f"timeout_s={timeout_s:g} ({type(error).__name__}: {error}); every rank must build the CO2 "
            f"optimizer, in the same order"
        ) from error
    return [t.tolist() for t in everyone]


def check_shards(shards: int, world: int) -> int:
    """R, the number of replicas; a ValueError naming the field when S does not divide the world."""
    if shards < 1 or world % shards != 0:
        raise ValueError(
            f"co2 config: shards_per_replica={shards!r} does not divide the world size {world}; "
            f"accepted: a divisor of {world} (ranks per replica)"
        )
    return world // shards


def warn_single_replica(config: CO2Config, shards: int, world: int) -> None:
    """Warn, on global rank 0 only, when several ranks form one replica (R = 1).

    CO2 then has no other replica to average with: every round's outer step sees only this replica's
    own displacement. It is what `shards_per_replica: "node"` (the default) gives on one machine, where
    the node is the whole world; one process (world size 1) is left alone.
    """
    if world == 1 or shards != world or dist.get_rank() != 0:
        return
    given = '"node" (LOCAL_WORLD_SIZE)' if config.shards_per_replica == "node" else str(shards)
    divisors = [d for d in range(1, world) if world % d == 0]
    warnings.warn(
        f"co2: shards_per_replica={given} makes S = {shards} with world size {world}: R = 1 replica, so CO2 "
        f"has nothing to average (the outer step sees one replica's displacement). To run CO2 on one machine set "
        f"shards_per_replica to a divisor of {world} below it ({', '.join(map(str, divisors))}; 1 makes every "
        f'rank a replica); "node" is meant for several nodes (one replica per node)',
        stacklevel=3,
    )


def replica_ranks(shards: int, world: int) -> list[list[int]]:
    """The global ranks of every replica: replica r is ranks [r*S, (r+1)*S)."""
    return [list(range(r * shards, (r + 1) * shards)) for r in range(check_shards(shards, world))]


def new_groups(rank_lists: Sequence[Sequence[int]], config: CO2Config) -> list[Any]:
    """One process group per rank list, with the config's timeout. Collective over the default group:
    every rank creates every group, in this order, and keeps the ones it belongs to."""
    timeout = timedelta(seconds=float(config.timeout_s))
    return [dist.new_group(ranks=list(ranks), timeout=timeout) for ranks in rank_lists]


def agree_on_config(config: CO2Config, shards: int) -> None:
    """Fail fast, naming the field, when the ranks were started with different co2 configs or would
    split the world differently (`shards_per_replica: "node"` on nodes of different sizes).

    Runs on the default group before any CO2 group exists: with different grids the ranks would
    otherwise build different groups and hang in `new_group`.
    """
    leaves = config.leaves()
    leaves.pop("timeout_s")  # may differ harmlessly
    leaves["shards_per_replica"] = shards
    names = sorted(leaves)
    table = gather_fingerprints([fingerprint(leaves[n]) for n in names], None, config.timeout_s, "start-up check")
    rank, mine = dist.get_rank(), table[dist.get_rank()]
    for other, theirs in enumerate(table):
        differ = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        if differ:
            here = [(names[i], leaves[names[i]], theirs[i]) for i in differ]
            diff = ", ".join(f"{n}={v!r} here vs {_describe(code, v, CHOICES.get(n, ()))}" for n, v, code in here)
            raise CO2Error(f"co2: rank {rank} and rank {other} have different co2 configs: {diff}")


@dataclass
class Topology:
    """This rank's place in the R x S grid and the groups it uses."""

    world_size: int
    rank: int
    replicas: int
    shards: int
    inner_group: Any  # the ranks of this rank's replica (used by ZeRO/OSS, main thread)
    outer_group: Any  # this shard index across replicas (background worker)
    norm_group: Any  # every rank: per-tensor norms of the outer step (background worker)
    control_group: Any  # every rank, the main thread's: module buffers, step announcements, checkpoint agreement
    outer_ranks: tuple[int, ...]
    inner_ranks: tuple[int, ...]
    owns_inner_group: bool

    @property
    def replica_index(self) -> int:
        return self.rank // self.shards

    @property
    def shard_index(self) -> int:
        return self.rank % self.shards

    def describe_outer(self) -> str:
        return f"outer group of shard {self.shard_index} (global ranks {list(self.outer_ranks)})"

    def describe_control(self) -> str:
        return f"control group (global ranks {list(range(self.world_size))})"

    @classmethod
    def build(cls, config: CO2Config, shards: Optional[int] = None, inner_group: Any = None) -> Topology:
        """Create the CO2 groups. Collective: every rank must call it, in the same order.

        `shards` overrides `config.shards_per_replica` (the plain-PyTorch optimizer passes 1).
        `inner_group`, when a caller already has one (e.g. the group given to OSS), must be exactly
        this rank's replica; it is then used instead of a new one.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "co2_zero needs torch.distributed initialised first: call "
                "torch.distributed.init_process_group(...) (gloo on CPU, nccl on GPU) before building "
                "a CO2 optimizer"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        shards = config.resolve_shards(world) if shards is None else shards
        agree_on_config(config, shards)
        replicas = check_shards(shards, world)
        warn_single_replica(config, shards, world)
        rank_lists_of_replicas = replica_ranks(shards, world)
        shard_ranks = [list(range(s, world, shards)) for s in range(shards)]
        # every rank creates every group, in this fixed order (dist.new_group is collective)
        inner_groups = new_groups(rank_lists_of_replicas, config) if inner_group is None else None
        outer_groups = new_groups(shard_ranks, config)
        norm_group, control_group = new_groups([list(range(world))] * 2, config)

        r, s = rank // shards, rank % shards
        owns_inner_group = inner_group is None
        if inner_group is None:
            inner_group = inner_groups[r]
        else:
            given = sorted(dist.get_process_group_ranks(inner_group))
            if given != rank_lists_of_replicas[r]:
                raise ValueError(
                    f"co2: the process group given for the replica holds global ranks {given}, but "
                    f"shards_per_replica={shards} puts rank {rank} in replica {r} = ranks "
                    f"{rank_lists_of_replicas[r]}; pass group=None or a group of exactly those ranks"
                )
        return cls(
            world_size=world,
            rank=rank,
            replicas=replicas,
            shards=shards,
            inner_group=inner_group,
            outer_group=outer_groups[s],
            norm_group=norm_group,
            control_group=control_group,
            outer_ranks=tuple(shard_ranks[s]),
            inner_ranks=tuple(rank_lists_of_replicas[r]),
            owns_inner_group=owns_inner_group,
        )

    def destroy(self, inner: bool = False, release: bool = False) -> None:
        """Destroy the CO2 groups; also the inner group when `inner` and this topology created it
        (a group the caller passed in is the caller's). `release`: each field is then None, the
        group's last reference here: a destroyed group's threads run, and its connections stay open,
        until that goes, which must not be left to interpreter shutdown (docs/design.md §8)."""
        names = ["outer_group", "norm_group", "control_group"]
        if inner and self.owns_inner_group:
            names.append("inner_group")
        for name in names:
            group = getattr(self, name)
            if group is None:  # released before
                continue
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # destroyed before
                pass
            if release:
                setattr(self, name, None)
