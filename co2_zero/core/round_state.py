"""The round state: every tensor and counter a round needs, in one `RoundState` the engine holds.

The engine is its only owner: integrations, checkpoints and elastic membership read values through the
engine's read methods and hand it whole states to adopt (`RoundEngine.adopt`), which checks a state
here (`check`: nothing is applied unless everything fits) and applies it (`RoundState.load` for a
checkpoint, `RoundState.take_from_peer` for an elastic heal or join). As plain data (`to_dict`) the state
loads with torch.load(weights_only=True). Files, agreement across ranks and resharding are
`co2_zero.checkpoint`'s business (docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from .comm import Layout, OuterExchange, Residuals, RoundResult
from .config import CO2Config
from .partition import Partition
from .plan import ResolvedPlan
from .round_schedule import RoundSchedule
from .schedule import RoundPlan
from .topology import Topology

STATE_VERSION = 2
COUNTERS = ("inner_steps", "rounds", "skipped_rounds")
SOURCES = ("checkpoint", "elastic heal")  # where a state to adopt comes from (`RoundEngine.adopt`)
Source = Literal["checkpoint", "elastic heal"]
IDENTITY_FIELDS = ("version", "config_hash", "grid", "rank", "signature", "geometry")  # `identity`'s
PEER_FIELDS = ("next_start", "momentum", "previous_update_sq_norms", *COUNTERS, "own_momentum")


@dataclass
class RoundState:
    """One rank's round state. The two partition buffers trade roles every round (start point B; D, then
    Nx); the momentum lives on this rank's slice. A stand-in (docs/design.md §3, "Stand-ins") adds this
    replica's own round start and (with outer momentum) its copy of the outer momentum where that is
    sharded (with all_reduce every rank holds it whole)."""

    start_point: torch.Tensor
    next_start: torch.Tensor
    momentum: torch.Tensor
    g_buffer: Optional[torch.Tensor]  # reduce_scatter: g on this rank's sub-shard
    own_start: Optional[torch.Tensor]
    own_momentum: Optional[torch.Tensor]
    residuals: Optional[Residuals]  # comm_dtype int8/fp8/..., topk < 1: the exchange's error feedback
    schedule: RoundSchedule  # the run-time decisions: pace, apply point, round length (and their meters)
    previous_update_sq_norms: Optional[torch.Tensor] = None  # the gap penalty's, per tensor
    inner_steps: int = 0
    rounds: int = 0
    skipped_rounds: int = 0  # rounds whose outer update was skipped (nonfinite: "skip_round")
    # a sync delay d < tau: the average launched at the last round end is still to be applied, d steps into
    # this round (set at round ends, cleared at the apply point; a state without a next start has none)
    average_unapplied: bool = False
    applied_was_skipped: bool = False  # the last pipeline's update was skipped: nothing to track
    run_id: Optional[str] = None  # set by the first checkpoint saved or loaded

    @classmethod
    def allocate(
        cls, partition: Partition, exchange: OuterExchange, plan: ResolvedPlan, replica: int, device: torch.device
    ) -> RoundState:
        """A fresh state of `replica` starting at the partition's live values, shaped by the plan (stand-in,
        apply point, pace)."""
        start_point = torch.zeros(exchange.layout.padded, dtype=torch.float32, device=device)
        partition.gather_into(start_point)
        momentum = torch.zeros(exchange.slice_length, dtype=torch.float32, device=device)
        reduce_scatter = exchange.strategy == "reduce_scatter"
        stand_in = plan.stand_in
        keeps_copy = stand_in == "local" and reduce_scatter
        return cls(
            start_point=start_point,
            next_start=start_point.clone(),
            momentum=momentum,
            g_buffer=torch.zeros_like(momentum) if reduce_scatter else None,
            own_start=start_point.clone() if stand_in != "shared" else None,
            own_momentum=torch.zeros_like(start_point)
            if keeps_copy and plan.config.effective("outer_momentum")
            else None,
            residuals=exchange.residuals,
            schedule=RoundSchedule(plan, replica),
        )

    def swap_buffers(self) -> None:
        """The two partition buffers trade roles."""
        self.start_point, self.next_start = self.next_start, self.start_point

    @property
    def round_start(self) -> torch.Tensor:
        """Where this replica's current round started: the shared start point B, or its stand-in until the
        average in flight is applied (docs/design.md §3)."""
        return self.start_point if self.own_start is None else self.own_start

    def take_next_as_start(self) -> torch.Tensor:
        """The next start point becomes the shared start, and a stand-in's (this replica has trained nothing
        since: an elastic joiner). Returns the start point."""
        self.start_point.copy_(self.next_start)
        if self.own_start is not None:
            self.own_start.copy_(self.start_point)
        return self.start_point

    def apply_mid_round(self, partition: Partition) -> torch.Tensor:
        """Sync delay d < tau, d steps into round t+1, pipeline t done: rebase, x_{t+1} - y + x (y the round
        start: shared, or the stand-in), so the d steps' progress is kept on top of the new start point;
        the buffers trade roles (the retiring start point is the scratch buffer). With a stand-in, y becomes
        the new shared start (it is spent). Returns the buffer holding the new live values."""
        retiring = self.start_point
        partition.subtract_from(self.round_start, out=retiring)  # y - x
        torch.sub(self.next_start, retiring, out=retiring)  # x_{t+1} - y + x
        self.swap_buffers()  # the retiring start point is the next start's buffer now
        if self.own_start is not None:
            self.own_start.copy_(self.start_point)
        self.average_unapplied = False
        return retiring

    def take_result(self, result: RoundResult) -> bool:
        """A finished pipeline's outcome: its update norms (the next gap penalty's), and whether its outer
        update was skipped (nonfinite "skip_round"; counted). Returns whether it was."""
        self.previous_update_sq_norms = result.update_sq_norms
        self.applied_was_skipped = result.skipped_replicas is not None
        self.skipped_rounds += self.applied_was_skipped
        return self.applied_was_skipped

    def plan_round(self) -> RoundPlan:
        """This round end's buffers and gap norms (`ApplySchedule.plan`)."""
        return self.schedule.apply.plan(self.start_point, self.next_start, self.previous_update_sq_norms)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for its bytes)."""
        held = [self.start_point, self.next_start, self.momentum, self.g_buffer, self.previous_update_sq_norms]
        held += [self.own_start, self.own_momentum, *(self.residuals or ())]
        return [t for t in held if t is not None]

    def to_dict(self, identity: dict[str, Any]) -> dict[str, Any]:
        """The state as plain data, with no round in flight (the caller waited). Tensors are live references."""
        return {
            **identity,
            "run_id": self.run_id,
            **{key: getattr(self, key) for key in COUNTERS},
            "start_point": self.start_point,
            # None when no start point is pending: blocking mode, and a sync delay from its apply point to the
            # round end (the buffer is scratch then); `applies_at` says when a pending one is applied
            "next_start": self.schedule.apply.carried_next_start(self.next_start, self.average_unapplied),
            "applies_at": self.schedule.apply.steps,  # the inner step of a round: 0 at once, tau the round end, else d
            # the inner steps this replica trains in the round in progress (fewer than its tau where the elastic
            # exchange chose them from its speed, `replica_tau: "auto"`)
            "round_steps": self.schedule.decision.steps,
            "momentum": self.momentum,
            "previous_update_sq_norms": self.previous_update_sq_norms,
            # comm_dtype int8/fp8, topk < 1: the error-feedback residuals (comm.Residuals), else None
            "residuals": None if self.residuals is None else self.residuals._asdict(),
            # a stand-in: this replica's own round start and its copy of the outer momentum where that is
            # sharded (resharding makes it from the momentum), else None
            "stand_in": self.schedule.plan.stand_in,
            "own_start": self.own_start,
            "own_momentum": self.own_momentum,
            # sync_delay "auto": the delay once fixed (None while it is measured, and for any other sync_delay)
            "fixed_sync_delay": self.schedule.fixed_sync_delay,
            # replica_tau "auto": the τ_r fixed so far, each with the round they run from (None while measured,
            # and for any other replica_tau)
            "fixed_replica_tau": self.schedule.fixed_replica_tau,
        }

    def for_peer(self) -> dict[str, Any]:
        """What a peer that heals from this replica adopts, between two rounds (references: the caller
        copies them when it serves them), with the job's run id."""
        peer = {key: getattr(self, key) for key in PEER_FIELDS}
        return {**peer, "fixed_sync_delay": self.schedule.fixed_sync_delay, "run_id": self.run_id}

    def load(self, saved: dict[str, Any]) -> None:
        """Restore a checked checkpoint state `saved` (no round in flight)."""
        self.inner_steps, self.rounds = saved["inner_steps"], saved["rounds"]
        self.skipped_rounds, self.run_id = saved["skipped_rounds"], saved.get("run_id")
        self.start_point.copy_(saved["start_point"])
        if saved["next_start"] is not None:
            self.next_start.copy_(saved["next_start"])
        self.momentum.copy_(saved["momentum"])
        fixed_replica_tau, fixed_sync_delay = saved.get("fixed_replica_tau"), saved.get("fixed_sync_delay")
        self.schedule.load(fixed_replica_tau, fixed_sync_delay, self.inner_steps, self.rounds, saved.get("round_steps"))
        self.average_unapplied = self._pending_apply(saved, self.schedule.apply.tau)
        self._take_norms(saved["previous_update_sq_norms"])
        if self.own_start is not None:  # a resharded state may carry none: the replica starts from the shared start
            saved_start = saved.get("own_start")
            self.own_start.copy_(saved_start if saved_start is not None else self.start_point)
        self._take_own_momentum(saved.get("own_momentum"))
        self._take_residuals(saved.get("residuals"))

    def take_from_peer(self, served: dict[str, Any]) -> None:
        """Adopt a live peer's checked state (`for_peer`) at a round end: its next start point (the base of
        the round's exchange; this replica's stand-in starts there too), outer state (with local's copy of
        the momentum), counters and fixed delay. The start point is the round's work buffer then: left
        alone. Error-feedback residuals are a rank's own unsent error: they restart at 0. The peer's run id
        is the job's: every replica that heals takes it, so the job's checkpoints name one run."""
        self.next_start.copy_(served["next_start"])
        self.momentum.copy_(served["momentum"])
        if self.own_start is not None:  # its stand-in was made from the state it was behind on
            self.own_start.copy_(served["next_start"])
        self._take_own_momentum(served.get("own_momentum"))
        self._take_residuals(None)
        self._take_norms(served["previous_update_sq_norms"])
        self.inner_steps, self.rounds = served["inner_steps"], served["rounds"]
        self.skipped_rounds = served["skipped_rounds"]
        self.run_id = served.get("run_id") or self.run_id
        self.schedule.take_fixed_delay(served.get("fixed_sync_delay"), self.rounds)
        self.schedule.start_round(self.rounds)

    def _take_norms(self, norms: Optional[torch.Tensor]) -> None:
        self.previous_update_sq_norms = None if norms is None else norms.to(self.momentum.device).clone()

    def _take_own_momentum(self, saved: Optional[torch.Tensor]) -> None:
        if self.own_momentum is not None:
            self.own_momentum.copy_(saved) if saved is not None else self.own_momentum.zero_()

    def _take_residuals(self, saved: Optional[dict[str, torch.Tensor]]) -> None:
        """A state without residuals (resharded) restarts the pending error at 0."""
        if self.residuals is not None:
            for name, residual in self.residuals._asdict().items():
                residual.copy_(saved[name]) if saved is not None else residual.zero_()

    def _pending_apply(self, saved: dict[str, Any], tau: int) -> bool:
        """Whether the saved next start is still to be applied d steps into the round (a sync delay d < tau).
        A state without `applies_at` carries the buffer whatever the phase (scratch after the apply point):
        for it the step counter says whether its apply point has passed."""
        steps = self.schedule.apply.steps
        pending = saved["next_start"] is not None and 0 < steps < tau
        if "applies_at" not in saved:
            pending = pending and saved["rounds"] > 0 and saved["inner_steps"] % tau < steps
        return pending


def geometry(layout: Layout, exchange: OuterExchange, topology: Topology, config: CO2Config) -> dict[str, Any]:
    """Where this rank's state lives in the model: enough to re-cut it per parameter tensor
    (`co2_zero.checkpoint.consolidate`) and to check that a state fits this engine."""
    piece = exchange.slice
    return {
        "length": layout.length,
        "padded": layout.padded,
        "num_tensors": layout.num_tensors,
        "segments": [list(seg) for seg in layout.segments],
        "sub_shard": list(layout.sub_shard_range(topology.replica_index)),
        "momentum_range": [piece.start, piece.stop],
        "strategy": exchange.strategy,
        "overlap": config.overlap,
        "tau": config.tau,
    }


def identity(config: CO2Config, topology: Topology, signature: Any, where: dict[str, Any]) -> dict[str, Any]:
    """What a state must agree on to be adopted here (`where`: the `geometry`)."""
    grid = {"replicas": topology.replicas, "shards": topology.shards}
    return dict(zip(IDENTITY_FIELDS, (STATE_VERSION, config.math_hash(), grid, topology.rank, signature, where)))


def check(state: RoundState, saved: Any, expected: dict[str, Any], source: Source) -> None:
    """Raise ValueError naming the first field of `saved` (a checkpoint's state, or a peer's: `source`)
    that does not fit `state` under `expected` (the identity); changes nothing."""
    if source not in SOURCES:
        raise ValueError(f"co2: source={source!r} is not a source of state; accepted: {', '.join(SOURCES)}")
    if not isinstance(saved, dict):
        raise ValueError(f"co2 {source}: the co2 state is a {type(saved).__name__}, expected a dict")
    for key, value in expected.items():
        if saved.get(key) != value:
            raise ValueError(
                f"co2 {source}: {key}={saved.get(key)!r} does not match this run's {value!r}; "
                f"resume with the same co2 config, topology and model (or reshard)"
            )
    _check_tensors(state, saved, source, expected["geometry"]["num_tensors"])
    for key in COUNTERS:
        if not isinstance(saved.get(key), int) or saved[key] < 0:
            raise ValueError(f"co2 {source}: {key}={saved.get(key)!r}; expected an integer >= 0")
    # a peer serves its state inside a round end, before it counts that round (at finalize, after)
    behind = (0, 1) if source == "elastic heal" else (0,)
    replica = state.schedule.replica
    pace = state.schedule.saved_pace_of(saved, source)
    if pace.rounds_at(replica, saved["inner_steps"]) - saved["rounds"] not in behind:
        paces = ", then ".join(f"{list(taus)} from round {first}" for first, taus in pace.segments)
        taus = f"tau={pace.tau(replica)}" if pace.uniform else f"replica_tau={paces}"
        raise ValueError(
            f"co2 {source}: rounds={saved['rounds']} does not fit inner_steps={saved['inner_steps']} "
            f"at {taus} (replica {replica})"
        )
    state.schedule.check_fixed_delay(saved.get("fixed_sync_delay"), source)
    state.schedule.check_round_steps(saved.get("round_steps"), source)


def _check_tensors(state: RoundState, saved: dict[str, Any], source: str, num_tensors: int) -> None:
    """Every tensor of `saved` has this state's shape and dtype (and is present iff it has one). A peer's
    state holds no start point (the round's work buffer at a heal)."""
    plan = state.schedule.plan
    pending = plan.config.overlap and saved.get("next_start") is not None  # None: none pending (sync delay)
    expected = {"next_start": state.next_start if pending else None, "momentum": state.momentum}
    if source == "checkpoint":
        expected["start_point"] = state.start_point
    for key, like in expected.items():
        _check_tensor(source, key, saved.get(key), like)
    norms = saved.get("previous_update_sq_norms")
    if norms is not None:
        like = torch.zeros(num_tensors, dtype=torch.float64)
        _check_tensor(source, "previous_update_sq_norms", norms, like)
    for key in ("own_start", "own_momentum"):  # a resharded state has no own_start
        if key == "own_momentum" and state.own_momentum is None and plan.stand_in == "local":
            continue  # local's copy of the momentum, offered by resharding; not kept here (all_reduce, or β = 0)
        if saved.get(key) is not None:
            _check_tensor(source, key, saved[key], getattr(state, key))
    residuals = saved.get("residuals")
    if residuals is not None:
        if state.residuals is None or not isinstance(residuals, dict):
            raise ValueError(f"co2 {source}: it holds error-feedback residuals; comm_dtype here is {plan.comm_dtype!r}")
        for name, like in state.residuals._asdict().items():
            _check_tensor(source, f"residuals.{name}", residuals.get(name), like)


def _check_tensor(source: str, key: str, value: Any, like: Optional[torch.Tensor]) -> None:
    if like is None:
        if value is not None:
            raise ValueError(f"co2 {source}: {key} is present but this run has none (overlap differs?)")
        return
    if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"co2 {source}: {key} is {got}; expected {like.dtype} {tuple(like.shape)}")
