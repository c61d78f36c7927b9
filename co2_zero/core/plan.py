"""The resolved plan: every `auto` and every derived choice of a job, decided once, when the optimizer is built.

`resolve(config, topology, ...)` turns the settings as given (`CO2Config`) and where they run (the
integration, an elastic membership, the backend and R) into one immutable `ResolvedPlan`, which the
engine, the exchange and the training job's header read; `repr()` prints it whole. The same call checks
it against the support table (`co2_zero.core.support`), first on the settings as given (before any
collective), then on the resolved choices. `check_given` is that first check for the callers that
refuse before they build an engine (FairScale's OSS, Lightning's strategy, co2-train).

The choices that depend on the config alone (the stand-in `auto` picks, the apply point) are
`CO2Config` properties, because the checkpoint identity needs them without a job; the plan reads them
from there and adds what needs the job (docs/design.md §3, "How a round flows").
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from . import support
from .config import CO2Config
from .pace import Pace
from .topology import Topology

# The sync delay modes (docs/design.md §3, "The sync delay"): the average applied at once (blocking), at the
# round end, a fixed number of steps into the next round, or measured on the job ("auto").
SYNC_DELAYS = ("at once", "round end", "fixed", "measured")
# Every replica's inner steps per round (docs/design.md §3, "Replicas of different speeds"): all tau, each its own
# as given, measured on the job in its first steps and then fixed (`replica_tau: "auto"`), or, with an elastic
# membership, measured every round over its quorum (`co2_zero.elastic.speeds`).
REPLICA_TAUS = ("uniform", "given", "measured", "every round")


@dataclass(frozen=True)
class ResolvedPlan:
    """Every choice fixed for the whole run; built by `resolve`, read by every part, never changed. What a
    run decides while it runs is the round schedule's (`round_schedule.RoundSchedule`, one `RoundDecision`
    per round): this replica's steps per round (`replica_tau`, here only how they are decided) and where
    the average applies (`sync_delay`, likewise); the plan holds the modes, never a starting value."""

    config: CO2Config  # the settings the rounds run: as given, with an elastic membership's rewrite
    integration: str  # `co2_zero.integration.Integration`: plain, fsdp2, fairscale, deepspeed
    elastic: bool  # replicas come and go (an elastic membership)
    backend: str  # of the outer group
    replicas: int  # R
    shards: int  # S
    stand_in: str  # shared or local (docs/design.md §3, "Stand-ins")
    sync_delay: str  # one of SYNC_DELAYS
    collective: str  # reduce_scatter, all_reduce or all_gather (docs/design.md §5)
    comm_dtype: str  # the wire type of the exchange's values
    topk: float  # the fraction sent (1.0: dense)
    replica_tau: str  # one of REPLICA_TAUS
    float_buffers: int  # module buffers averaged at round ends

    @property
    def sparse(self) -> bool:
        return self.topk < 1.0

    @property
    def compressed(self) -> bool:
        """The exchange keeps error-feedback residuals (a quantized wire type, or a sparse exchange)."""
        return self.sparse or self.comm_dtype not in ("fp32", "bf16")

    def facts(self) -> dict[str, Any]:
        """What the support table reads: the config's fields, the resolved choices as `plan.<field>`."""
        resolved = {f"plan.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        where = {k: getattr(self, k) for k in ("integration", "elastic", "replicas", "float_buffers")}
        return {**self.config.leaves(), **resolved, **where}


def choose_collective(config: CO2Config, backend: str) -> str:
    """`collective: auto` for a backend.

    gloo: `all_reduce`. Measured here (torch 2.13, 2 ranks, 5e7 fp32): all_reduce 94 ms against
    reduce_scatter 269 ms + all_gather 214 ms; gloo's reduce-scatter and all-gather are far from
    bandwidth-optimal, so one all-reduce plus a redundant update of the partition wins.
    nccl (and others): `reduce_scatter`: ring reduce-scatter + all-gather move the same bytes as a
    ring all-reduce, and the outer momentum then needs only Ψ/N elements per rank instead of Ψ/S;
    `all_reduce` where the local stand-in runs with a clip, which needs the whole clipped momentum
    (the support table refuses `reduce_scatter` there).
    A sparse exchange (`topk` < 1): `all_gather` on every backend (docs/design.md §5).
    """
    if config.sparse:
        return "all_gather"
    if config.collective != "auto":
        return config.collective
    clipped_local = config.clip.mode != "none" and config.effective_stand_in == "local"
    return "all_reduce" if backend == "gloo" or clipped_local else "reduce_scatter"


def _sync_delay(config: CO2Config) -> str:
    if not config.overlap:
        return "at once"
    if config.measures_sync_delay:
        return "measured"
    return "round end" if config.steps_before_apply == config.tau else "fixed"


def _for_membership(config: CO2Config) -> CO2Config:
    """What an elastic membership runs: `sync_delay: "auto"` is the round end there (a quorum forms and
    heals at round ends; docs/elastic.md). Every other field is kept, and refused there if unsupported."""
    return dataclasses.replace(config, sync_delay=None) if config.sync_delay == "auto" else config


def _replica_tau(config: CO2Config, elastic: bool) -> str:
    if config.replica_tau is None:
        return "uniform"
    if config.replica_tau != "auto":
        return "given"
    return "every round" if elastic else "measured"


def sparse_costs(config: CO2Config) -> list[str]:
    """What the settings asked for explicitly cost the sparse exchange (`topk` < 1), as the quality study
    measured it (docs/configuration.md, "Choosing a wire format"): allowed, and said once."""
    if not config.sparse:
        return []
    costs = []
    if config.effective("outer_momentum") > 0:
        costs.append(
            f"outer_momentum={config.outer_momentum} on top of the error feedback amplifies what each round "
            "could not send (diverged in the study's short runs); 'auto' sets 0 with topk < 1"
        )
    if config.effective("outer_lr") != 1.0 and config.effective_stand_in == "local":
        costs.append(
            f"outer_lr={config.outer_lr} with the local stand-in steps alpha x the replica's own dense "
            "displacement where the shared step is sparse; 'auto' sets 1.0 with topk < 1"
        )
    return costs


def check_given(config: CO2Config, **where: Any) -> None:
    """Refuse what the support table refuses of `config` where it runs (`integration`, `driver`,
    `elastic`), before anything is built."""
    support.check({**config.leaves(), **where})


def resolve(
    config: CO2Config,
    topology: Topology,
    integration: str = "plain",
    elastic: bool = False,
    float_buffers: int = 0,
    backend: Optional[str] = None,
) -> ResolvedPlan:
    """The plan of `config` on `topology` (its outer group's backend unless `backend` is given), or
    `support.Unsupported` naming what the support table refuses; `Pace.of`'s ValueError for a
    `replica_tau` of another length than R."""
    check_given(config, integration=integration, elastic=elastic)
    Pace.of(config, topology.replicas)  # a replica_tau of another length than R: its ValueError, before any collective
    for cost in sparse_costs(config):
        warnings.warn(f"co2 config: topk={config.topk}: {cost}", stacklevel=3)
    if elastic:
        config = _for_membership(config)
    backend = backend or str(dist.get_backend(topology.outer_group))
    plan = ResolvedPlan(
        config=config,
        integration=integration,
        elastic=elastic,
        backend=backend,
        replicas=topology.replicas,
        shards=topology.shards,
        stand_in=config.effective_stand_in,
        sync_delay=_sync_delay(config),
        collective=choose_collective(config, backend),
        comm_dtype=config.comm_dtype,
        topk=config.topk,
        replica_tau=_replica_tau(config, elastic),
        float_buffers=float_buffers,
    )
    support.check(plan.facts())
    return plan
