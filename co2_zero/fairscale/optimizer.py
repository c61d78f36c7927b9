"""`CO2OSS`: FairScale's OSS inside each replica (its flat bucket is the rank's CO2 partition), CO2 across
replicas; its state dict forms are state_dicts.py's."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Type, Union

import torch
import torch.distributed as dist
from fairscale.internal.params import calc_grad_norm
from fairscale.optim import OSS

from .. import integration as contract  # the checks every adapter shares
from ..core.config import CO2Config
from ..core.engine import RoundEngine
from ..core.errors import CO2Error
from ..core.outer import Segment
from ..core.parameter_order import identify
from ..core.partition import Partition, parameter_signature
from ..core.plan import check_given
from ..core.topology import Topology, collective_device
from ..integration import CO2Steps, InnerOptimizerState, Integration
from .state_dicts import StateDictForms


class CO2OSS(StateDictForms, CO2Steps, OSS):
    """`fairscale.optim.OSS` whose replicas train with CO2; `step()` = the OSS step + CO2 bookkeeping.

    Every rank must construct it (it creates process groups). `self.group` is then the replica's inner
    group: give it to `co2_zero.fairscale.ShardedDataParallel(..., process_group=opt.group)` (FairScale's
    own drops gradients on such a group) or to DDP, so gradients are reduced inside the replica only. The
    default inner optimizer is AdamW (OSS's is SGD). `state_dict()`: docs/fairscale.md, state_dicts.py.

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
        self._forget_consolidated()

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
        self._forget_consolidated()
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
