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

from __future__ import annotations

import math
import warnings
from itertools import chain
from typing import Any, Callable, Mapping, Optional, Type, Union

import torch
import torch.distributed as dist

from .core.errors import CO2Error, missing_extra

try:
    from fairscale.internal.params import calc_grad_norm
    from fairscale.nn.data_parallel import ShardedDataParallel as _FairScaleSDP
    from fairscale.optim import OSS
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("FairScale", "fairscale", error) from error

from . import integration as contract  # the checks every adapter shares
from .checkpoint.record import load_record, optimizer_record, refused
from .core.config import CO2Config
from .core.engine import RoundEngine
from .core.outer import Segment
from .core.parameter_order import identify
from .core.partition import Partition, parameter_signature
from .core.plan import check_given
from .core.topology import Topology, collective_device
from .integration import CO2Steps, InnerOptimizerState, Integration

__all__ = ["CO2OSS", "ShardedDataParallel", "wrap"]


def _cpu_copy(obj: Any) -> Any:
    """Detached CPU copies of the tensors in a (nested) state dict; a snapshot, never a live view."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    return {k: _cpu_copy(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


class CO2OSS(CO2Steps, OSS):
    """`fairscale.optim.OSS` whose replicas train with CO2; `step()` = the OSS step + CO2 bookkeeping.

    Same constructor as OSS plus `co2` (a `CO2Config` or a dict of its fields) and `model` (optional:
    its float buffers, e.g. BatchNorm statistics, are averaged across all ranks at every round end).
    `group` is built from `co2.shards_per_replica` when None; a group passed in must hold exactly this
    rank's replica. After construction `self.group` is that inner group: give it to
    `co2_zero.fairscale.ShardedDataParallel(..., process_group=opt.group)` (FairScale's own drops
    gradients on such a group, see there) or to DDP, so gradients are reduced inside the replica only.
    Every rank must construct it (it creates process groups). The default inner optimizer is AdamW
    (OSS's is SGD). `state_dict()` carries the CO2 state in both of its forms: OSS's consolidated one
    (one file per replica) and, where nothing was consolidated, this rank's own share (per-rank files,
    `co2_zero.checkpoint`).

    Args:
        params: the parameters (or parameter groups), as for `fairscale.optim.OSS`; fp32, on one device.
        optim: the inner optimizer class.
        group: this rank's replica as a process group; built from `co2.shards_per_replica` when None.
        broadcast_buffer_size: as for OSS.
        broadcast_fp16: as for OSS (at its usual precision cost).
        force_broadcast_object: as for OSS.
        co2: a `CO2Config`, a dict of its fields, or None for the defaults.
        model: optional; its float buffers are averaged across all ranks at every round end.
        **defaults: the inner optimizer's arguments (lr, weight_decay, ...).

    Raises:
        ValueError: a `co2` field is invalid, or `group` is not exactly this rank's replica.
        CO2Error: the ranks disagree on the config, the grid or the model.
    """

    integration = Integration.FAIRSCALE

    def __init__(
        self,
        params: Any,
        optim: Type[torch.optim.Optimizer] = torch.optim.AdamW,
        group: Optional[Any] = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        co2: Union[CO2Config, Mapping[str, Any], None] = None,
        model: Optional[torch.nn.Module] = None,
        **defaults: Any,
    ) -> None:
        contract.refuse_membership(Integration.FAIRSCALE, defaults)
        config = CO2Config.coerce(co2)
        check_given(config, integration=Integration.FAIRSCALE)
        # OSS talks on its group inside __init__: refusals first, then the replica's group.
        topology = Topology.build(config, inner_group=group)
        super().__init__(
            params,
            optim=optim,
            group=topology.inner_group,
            broadcast_buffer_size=broadcast_buffer_size,
            broadcast_fp16=broadcast_fp16,
            force_broadcast_object=force_broadcast_object,
            **defaults,
        )
        self.config, self.topology, self._model = config, topology, model
        self._partition = self.find_partition()
        self.engine = self._new_engine()
        self._co2_states: list[Optional[dict[str, Any]]] = []

    # ---- the partition: OSS's flat bucket of this rank ----------------------------------------------

    def find_partition(self) -> Partition:
        """This rank's OSS bucket, and which global parameter tensor each piece of it is.

        Tensor ids count the trainable parameters of all param groups in order (OSS lays out its buckets
        in that order, so it cannot be changed here: the engine refuses ranks whose orders name different
        parameters, `agreement.agree_on_parameters`; pass `model` so that it compares names). The
        pieces' places are read from the parameters' own storage offsets, not assumed from OSS's order.
        """
        params = contract.trainable_parameters(g["params"] for g in self.param_groups)
        device = contract.one_device(p for g in self.param_groups for p in g["params"])
        contract.check_fp32_parameters(
            params, "CO2OSS needs fp32 parameters (OSS keeps no fp32 master copy: use autocast with fp32 parameters)"
        )
        index = {id(p): i for i, p in enumerate(params)}
        signature = parameter_signature([p.shape for p in params])
        tensors = identify(params, self._model)
        bucket = self.buckets.get(device, {}).get(self.rank)
        if bucket is None:
            # This rank owns no trainable parameter: one private zero that never moves keeps the
            # engine's buffers on the parameters' device.
            return Partition([torch.zeros(1, device=device)], [], len(params), signature, tensors)
        buffer = bucket.buffer
        owned = [p for g in self.partition_parameters()[self.rank] for p in g["params"] if p.requires_grad]
        segments = []
        for p in owned:
            if p.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                raise CO2Error(f"co2: trainable parameter {index[id(p)]} is not a view of this rank's OSS bucket")
            start = p.storage_offset() - buffer.storage_offset()
            segments.append(Segment(index[id(p)], start, start + p.numel()))  # OSS never splits a tensor
        segments.sort(key=lambda seg: seg.start)
        if [seg.start for seg in segments] != [0] + [seg.end for seg in segments[:-1]] or (
            segments[-1].end != buffer.numel()
        ):
            raise CO2Error("co2: the OSS bucket is not exactly this rank's trainable parameters, back to back")
        return Partition([buffer], segments, len(params), signature, tensors)

    def _follow_bucket(self) -> None:
        """Keep the engine's partition on OSS's current bucket (same layout, new storage).

        OSS replaces its bucket tensors in `refresh_trainable()` (ShardedDataParallel calls it on the
        first forward and on every train/eval switch) and, with `broadcast_fp16`, in every parameter
        broadcast. Called after each of those, so the engine never touches a stale bucket.
        """
        live = self._partition.chunks[0]
        bucket = self.buckets.get(live.device, {}).get(self.rank)
        if not self._partition.segments:  # the placeholder of a rank that owns nothing
            unchanged = bucket is None
        else:
            unchanged = bucket is not None and bucket.buffer is live
        if unchanged:
            return
        current = self.find_partition()
        if tuple(current.segments) != tuple(self._partition.segments):
            raise CO2Error(
                "co2: the parameters this rank trains changed after CO2OSS was built (frozen or unfrozen "
                "parameters?); the CO2 partition cannot change during training"
            )
        self._partition.chunks[:] = current.chunks

    def refresh_replica(self) -> None:
        """After a round end rewrote this rank's bucket: OSS's broadcast inside the replica."""
        self._broadcast_params()
        self._follow_bucket()

    def refresh_trainable(self) -> None:
        """OSS's (it rebuilds the buckets), then re-point the CO2 partition at the new bucket."""
        super().refresh_trainable()
        if hasattr(self, "engine"):
            self._follow_bucket()

    def _new_engine(self) -> RoundEngine:
        """Collective over every rank (the engine checks that all ranks agree on the layout)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return RoundEngine(
            self._partition,
            self.config,
            self.topology,
            refresh=self.refresh_replica,
            module=self._model,
            params=params,
            integration=self.integration,
        )

    # ---- training -----------------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """The OSS step (own shard, then broadcast inside the replica), then count it for CO2.

        A round end rewrites this rank's bucket and broadcasts again, so the other ranks of the replica
        start the round from the new start point too (one extra inner broadcast every tau steps).
        """
        loss = super().step(closure, **kwargs)
        self._all_states, self._co2_states = [], []  # a consolidated state is stale once the optimizer stepped
        self._follow_bucket()  # broadcast_fp16 replaced the bucket
        self._count_step()
        return loss

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place by default (OSS inherits torch 2.x's `set_to_none=True`).

        ShardedDataParallel reduces small gradients through views of its flat gradient buckets. Setting
        `.grad` to None cuts those views: from step 2 on, backward writes fresh tensors, the stale bucket
        is what gets reduced, and the owner steps with its own unreduced gradient, silently.
        """
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm(
        self,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        filter_params_fn: Optional[Callable[[Any], Any]] = None,
    ) -> torch.Tensor:
        """OSS's gradient clipping, with the norm taken over the replica (call it on all its ranks).

        OSS all-reduces the norm over the whole world: under CO2 that would mix the replicas'
        gradients (a norm about sqrt(R) too large) and add a cross-replica collective to every step.
        With ShardedDataParallel each rank holds only its own reduced gradients, so
        `torch.nn.utils.clip_grad_norm_` is wrong too; this is the one to use.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = self._local_params if filter_params_fn is None else filter_params_fn(self._local_params)
        norm = calc_grad_norm(params, norm_type).to(collective_device(self.group))
        if norm_type == math.inf:
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.group)
        else:
            norm = norm**norm_type
            dist.all_reduce(norm, group=self.group)
            norm = norm ** (1.0 / norm_type)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1:
            for per_rank in self._per_device_params.values():
                for p in per_rank[self.rank]:
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)
        return norm

    # ---- state -------------------------------------------------------------------------------------

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """OSS's local optimizer: the inner state of this rank's shard."""
        return self.optim

    def checkpoint_state(self, model: torch.nn.Module) -> InnerOptimizerState:
        """This optimizer's part of a `co2_zero.checkpoint` file: OSS's local optimizer state (this
        rank's shard; the model comes from `model`)."""

        def groups_from_inner() -> None:
            OSS._sync_param_groups(self.optim.param_groups, self.param_groups)

        def groups_to_inner() -> None:  # a scheduler writes OSS's groups; the inner copy lags until step()
            OSS._sync_param_groups(self.param_groups, self.optim.param_groups)

        return InnerOptimizerState(
            self.integration,
            self.engine,
            model,
            self.optim,
            after_load=groups_from_inner,
            before_capture=groups_to_inner,
        )

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """OSS's consolidation of the inner optimizer state, plus the CO2 state of every rank of the
        replica, onto `recipient_rank` of the replica (-1: every rank). Call it on all ranks.

        The inner optimizer state differs between replicas, so this checkpoint is one file per replica
        (saved by its recipient); it then holds everything the replica's ranks need to resume.
        """
        super().consolidate_state_dict(recipient_rank)
        mine = None if self.engine.finalized else _cpu_copy(self.engine.state_dict())
        states: list[Optional[dict[str, Any]]] = [None] * self.world_size
        if recipient_rank == -1:
            dist.all_gather_object(states, mine, group=self.group)
        else:
            receive = states if self.rank == recipient_rank else None
            dist.gather_object(mine, receive, dst=self._local_to_global_rank[recipient_rank], group=self.group)
        self._co2_states = states if recipient_rank in (-1, self.rank) else []

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """Where OSS has a consolidated state (the recipient after `consolidate_state_dict()`, or
        `all_ranks`): OSS's PyTorch-compatible dict, plus `"co2"` (this rank's CO2 state) and
        `"co2_replica"` (that of every rank of the replica, for one file per replica).

        Elsewhere (where OSS would raise): this rank's own share, `{"oss_shard": ..., "co2": ...}`, what
        per-rank checkpoint files hold (`co2_zero.checkpoint.save`). Tensors are live references, as
        in `torch.optim.Optimizer.state_dict()`: save them before the next step.
        """
        if all_ranks or self._all_states:
            state = super().state_dict(all_ranks=all_ranks)
            state["co2"] = self._co2_states[self.rank]
            state["co2_replica"] = {
                "replica": self.topology.replica_index,
                "ranks": list(self.topology.inner_ranks),
                "states": self._co2_states,
            }
            return state
        framework = self.checkpoint_state(self._model)  # its capture brings the inner groups up to date
        record = optimizer_record(framework, finalized_ok=True)
        return {
            "oss_shard": {
                "rank": self.rank,
                "world_size": self.world_size,
                "state": framework.torch_state(record["framework"]),
            },
            "co2": record["co2"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore either form of `state_dict()`, saved by the same rank (own share) or the same
        replica (consolidated) of a run with the same topology and co2 config. Call it on all ranks,
        after loading the model weights. Either form is read as this rank's record (its CO2 state and
        its share of the inner state) and loaded as `checkpoint.load` loads one: every check first, so
        a refused state changes nothing (ValueError naming the field).

        A state without CO2 state (a plain OSS checkpoint, or one saved after `finalize()`) loads the
        inner optimizer and restarts CO2 from the current parameters, with a warning.
        """
        what = "CO2OSS.load_state_dict"
        if not isinstance(state_dict, dict):
            raise refused(what, f"the state dict is a {type(state_dict).__name__}; expected a state_dict()")
        (mine, co2_field), (inner, inner_field) = self._saved_co2(state_dict), self._saved_inner(state_dict)
        framework = self.checkpoint_state(self._model)
        record = {"co2": mine, "framework": framework.framework_of(inner)}
        fields = {"framework": inner_field} if mine is None else {"co2": co2_field, "framework": inner_field}
        load_record(framework, record, what, fields)
        if mine is None:
            warnings.warn(
                "co2: the optimizer state carries no CO2 state (a plain OSS checkpoint, or one saved after "
                "finalize()); CO2 restarts from the current parameters",
                stacklevel=2,
            )
            self.engine.close()  # its worker and CO2 groups; OSS keeps the replica's group
            self.topology = Topology.build(self.config, inner_group=self.group)
            self.engine = self._new_engine()

    def _saved_co2(self, state_dict: dict[str, Any]) -> tuple[Any, str]:
        """This rank's CO2 state in either form of `state_dict()` (None: it has none), and its field."""
        replica = state_dict.get("co2_replica")
        if replica is None:
            return state_dict.get("co2"), "state_dict['co2']"
        if replica["replica"] != self.topology.replica_index or len(replica["states"]) != self.world_size:
            raise ValueError(
                f"co2 checkpoint: it holds the state of replica {replica['replica']} (global ranks "
                f"{replica['ranks']}) but this rank is in replica {self.topology.replica_index} (global "
                f"ranks {list(self.topology.inner_ranks)}); each replica loads the file its own recipient saved"
            )
        return replica["states"][self.rank], f"state_dict['co2_replica']['states'][{self.rank}]"

    def _saved_inner(self, state_dict: dict[str, Any]) -> tuple[Any, str]:
        """This rank's share of the inner optimizer state in either form of `state_dict()`, as its local
        optimizer's state dict, and its field."""
        shard = state_dict.get("oss_shard")
        if shard is None:
            return self._own_share_of(state_dict), "state_dict (OSS's consolidated state)"
        if (shard["rank"], shard["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"co2 checkpoint: this optimizer shard was saved by rank {shard['rank']} of a replica of "
                f"{shard['world_size']}; this is rank {self.rank} of {self.world_size}: load each rank's own file"
            )
        return shard["state"], "state_dict['oss_shard']['state']"

    def _own_share_of(self, consolidated: dict[str, Any]) -> dict[str, Any]:
        """The part of OSS's consolidated state dict (global parameter ids) that this rank owns, as its
        local optimizer's state dict: what its own share holds. Checks only what the mapping needs (the
        groups' sizes, the ids); `InnerOptimizerState.check` checks the rest."""
        groups, state = consolidated.get("param_groups"), consolidated.get("state", {})
        sizes = [len(g["params"]) for g in self.param_groups]
        saved = [len(g.get("params", ())) for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
        if saved != sizes or not isinstance(state, dict):
            raise refused(
                "CO2OSS.load_state_dict",
                f"state_dict['param_groups'] has groups of sizes {saved} and state_dict['state'] is a "
                f"{type(state).__name__}; this optimizer has groups of sizes {sizes} (a different model?)",
            )
        owner = dict(zip(chain(*(g["params"] for g in groups)), chain(*(g["params"] for g in self.param_groups))))
        local = {id(p): i for i, p in enumerate(chain(*(g["params"] for g in self.optim.param_groups)))}
        unknown = sorted(map(str, set(state) - set(owner)))
        if unknown:
            raise refused(
                "CO2OSS.load_state_dict", f"state_dict['state'] names parameters {unknown[:5]}, not in its groups"
            )
        mine = {local[id(owner[key])]: entry for key, entry in state.items() if id(owner[key]) in local}
        here = [[local[id(p)] for p in g["params"]] for g in self.optim.param_groups]
        return {"state": mine, "param_groups": [{**g, "params": ids} for g, ids in zip(groups, here)]}


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
