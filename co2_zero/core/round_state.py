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
from .pace import Pace
from .pace_meter import DECISIONS, PaceMeter
from .partition import Partition
from .plan import ResolvedPlan
from .schedule import ApplySchedule, DelayMeter, RoundPlan, late_average_warning
from .topology import Topology

STATE_VERSION = 2
COUNTERS = ("inner_steps", "rounds", "skipped_rounds")
SOURCES = ("checkpoint", "elastic heal")  # where a state to adopt comes from (`RoundEngine.adopt`)
Source = Literal["checkpoint", "elastic heal"]
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
    schedule: ApplySchedule  # where the average in flight is applied (sync_delay "auto": once fixed)
    delay_meter: Optional[DelayMeter]  # sync_delay "auto": measures, then fixes, the delay
    pace: Pace  # every replica's inner steps per round (replica_tau "auto": once fixed)
    pace_meter: Optional[PaceMeter]  # replica_tau "auto": measures, then fixes, the pace
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
        tau = plan.pace.tau(replica, 0)
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
            own_momentum=torch.zeros_like(start_point) if keeps_copy and plan.config.outer_momentum else None,
            residuals=exchange.residuals,
            schedule=ApplySchedule(min(plan.steps_before_apply, tau), tau),
            delay_meter=DelayMeter(plan.config.tau) if plan.sync_delay == "measured" else None,
            pace=plan.pace,
            pace_meter=PaceMeter(plan.config.tau, plan.shards, replica) if plan.replica_tau == "measured" else None,
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
        return self.schedule.plan(self.start_point, self.next_start, self.previous_update_sq_norms)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for its bytes)."""
        held = [self.start_point, self.next_start, self.momentum, self.g_buffer, self.previous_update_sq_norms]
        held += [self.own_start, self.own_momentum, *(self.residuals or ())]
        return [t for t in held if t is not None]

    def to_dict(self, identity: dict[str, Any], stand_in: str) -> dict[str, Any]:
        """The state as plain data, with no round in flight (the caller waited). Tensors are live references."""
        return {
            **identity,
            "run_id": self.run_id,
            **{key: getattr(self, key) for key in COUNTERS},
            "start_point": self.start_point,
            # None when no start point is pending: blocking mode, and a sync delay from its apply point to the
            # round end (the buffer is scratch then); `applies_at` says when a pending one is applied
            "next_start": self.schedule.carried_next_start(self.next_start, self.average_unapplied),
            "applies_at": self.schedule.steps,  # the inner step of a round: 0 at once, tau the round end, else d
            "momentum": self.momentum,
            "previous_update_sq_norms": self.previous_update_sq_norms,
            # comm_dtype int8/fp8, topk < 1: the error-feedback residuals (comm.Residuals), else None
            "residuals": None if self.residuals is None else self.residuals._asdict(),
            # a stand-in: this replica's own round start and its copy of the outer momentum where that is
            # sharded (resharding makes it from the momentum), else None
            "stand_in": stand_in,
            "own_start": self.own_start,
            "own_momentum": self.own_momentum,
            # sync_delay "auto": the delay once fixed (None while it is measured, and for any other sync_delay)
            "fixed_sync_delay": self.fixed_sync_delay,
            # replica_tau "auto": the τ_r fixed so far, each with the round they run from (None while measured,
            # and for any other replica_tau)
            "fixed_replica_tau": self.fixed_replica_tau,
        }

    @property
    def fixed_replica_tau(self) -> Optional[list[dict[str, Any]]]:
        """replica_tau "auto": the paces fixed so far, in the order they start, as plain data; else None."""
        fixed = None if self.pace_meter is None else self.pace_meter.fixed
        return None if fixed is None else [{"taus": list(t), "from_round": r} for r, t in fixed.segments]

    def fix_pace(self, pace: Pace, config: CO2Config, replica: int) -> None:
        """Run `pace` from its `from_round` on: the round end the schedule waits for moves with this replica's
        τ (none is in flight at a sync delay d < tau: replica_tau runs with the round end, or blocking)."""
        self.pace = pace
        tau = pace.tau(replica, pace.from_round)
        self.schedule = ApplySchedule(min(config.steps_before_apply, tau), tau)

    @property
    def fixed_sync_delay(self) -> Optional[int]:
        """sync_delay "auto": the delay once fixed; else None."""
        return None if self.delay_meter is None else self.delay_meter.fixed

    def follow_delay_meter(self, tau: int) -> Optional[str]:
        """sync_delay "auto", after a launch: note the pipeline; at the deciding round end, switch to the
        fixed delay. The pipeline just launched is then the last applied at a round end; the next launch
        (none in flight: applied mid-round) sets the gap's staleness to the new schedule's. Returns the
        warning to give when the delay fixed is a whole round (`schedule.late_average_warning`)."""
        self.delay_meter.launched(self.rounds)
        delay = self.delay_meter.fixed_after_launch(self.rounds)
        if delay is None:
            return None
        self.schedule = ApplySchedule(delay, tau)
        return late_average_warning(self.delay_meter.most_steps, tau) if delay == tau else None

    def for_peer(self) -> dict[str, Any]:
        """What a peer that heals from this replica adopts, between two rounds (references: the caller
        copies them when it serves them)."""
        return {**{key: getattr(self, key) for key in PEER_FIELDS}, "fixed_sync_delay": self.fixed_sync_delay}

    def load(self, saved: dict[str, Any], config: CO2Config, replica: int) -> None:
        """Restore a checked checkpoint state `saved` of `replica` (no round in flight)."""
        self.inner_steps, self.rounds = saved["inner_steps"], saved["rounds"]
        self.skipped_rounds, self.run_id = saved["skipped_rounds"], saved.get("run_id")
        self.start_point.copy_(saved["start_point"])
        if saved["next_start"] is not None:
            self.next_start.copy_(saved["next_start"])
        self.momentum.copy_(saved["momentum"])
        self._load_pace(saved.get("fixed_replica_tau"), config, replica)
        self._load_sync_delay(saved.get("fixed_sync_delay"), config)
        self.average_unapplied = self._pending_apply(saved, self.schedule.tau)
        self._take_norms(saved["previous_update_sq_norms"])
        if self.own_start is not None:  # a resharded state may carry none: the replica starts from the shared start
            saved_start = saved.get("own_start")
            self.own_start.copy_(saved_start if saved_start is not None else self.start_point)
        self._take_own_momentum(saved.get("own_momentum"))
        self._take_residuals(saved.get("residuals"))

    def take_from_peer(self, served: dict[str, Any], config: CO2Config) -> None:
        """Adopt a live peer's checked state (`for_peer`) at a round end: its next start point (the base of
        the round's exchange; this replica's stand-in starts there too), outer state (with local's copy of
        the momentum), counters and fixed delay. The start point is the round's work buffer then: left
        alone. Error-feedback residuals are a rank's own unsent error: they restart at 0."""
        self.next_start.copy_(served["next_start"])
        self.momentum.copy_(served["momentum"])
        if self.own_start is not None:  # its stand-in was made from the state it was behind on
            self.own_start.copy_(served["next_start"])
        self._take_own_momentum(served.get("own_momentum"))
        self._take_residuals(None)
        self._take_norms(served["previous_update_sq_norms"])
        self.inner_steps, self.rounds = served["inner_steps"], served["rounds"]
        self.skipped_rounds = served["skipped_rounds"]
        self._load_sync_delay(served.get("fixed_sync_delay"), config)

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
        steps = self.schedule.steps
        pending = saved["next_start"] is not None and 0 < steps < tau
        if "applies_at" not in saved:
            pending = pending and saved["rounds"] > 0 and saved["inner_steps"] % tau < steps
        return pending

    def _load_pace(self, fixed: Optional[list[dict[str, Any]]], config: CO2Config, replica: int) -> None:
        """replica_tau "auto": the saved pace (its correction still to come: timed from the loaded step), or (not
        fixed when saved) run at tau and measure anew from the loaded step (`PaceMeter.restart`)."""
        if self.pace_meter is None:
            return
        if fixed is None:
            self.pace_meter.restart(self.inner_steps)
            self.pace = Pace((config.tau,) * len(self.pace.taus))
        else:
            self.pace = saved_pace(fixed)
            self.pace_meter.fix(self.pace, self.inner_steps, resumed=True)
        tau = self.pace.tau(replica, self.rounds)
        self.schedule = ApplySchedule(min(config.steps_before_apply, tau), tau)

    def _load_sync_delay(self, fixed: Optional[int], config: CO2Config) -> None:
        """sync_delay "auto": the saved delay and its schedule, or (not fixed when saved) measure anew."""
        if self.delay_meter is None:
            return
        if fixed is None:  # measured anew, applying at the round end meanwhile (this engine may have fixed one)
            self.delay_meter.restart(self.rounds)
            self.schedule = ApplySchedule(config.steps_before_apply, config.tau)
        else:
            self.delay_meter.fix(fixed)
            self.schedule = ApplySchedule(fixed, config.tau)


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
    return {
        "version": STATE_VERSION,
        "config_hash": config.math_hash(),
        "grid": {"replicas": topology.replicas, "shards": topology.shards},
        "rank": topology.rank,
        "signature": signature,
        "geometry": where,
    }


def check(
    state: RoundState, saved: Any, expected: dict[str, Any], config: CO2Config, replica: int, source: Source
) -> None:
    """Raise ValueError naming the first field of `saved` (a checkpoint's state, or a peer's: `source`)
    that does not fit `state` of `replica` under `expected` (the identity) and `config`; changes nothing."""
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
    _check_tensors(state, saved, config, source, expected["geometry"]["num_tensors"])
    for key in COUNTERS:
        if not isinstance(saved.get(key), int) or saved[key] < 0:
            raise ValueError(f"co2 {source}: {key}={saved.get(key)!r}; expected an integer >= 0")
    # a peer serves its state inside a round end, before it counts that round (at finalize, after)
    behind = (0, 1) if source == "elastic heal" else (0,)
    pace = _pace_of(state, saved, config, source)
    if pace.rounds_at(replica, saved["inner_steps"]) - saved["rounds"] not in behind:
        paces = ", then ".join(f"{list(taus)} from round {first}" for first, taus in pace.segments)
        taus = f"tau={pace.tau(replica)}" if pace.uniform else f"replica_tau={paces}"
        raise ValueError(
            f"co2 {source}: rounds={saved['rounds']} does not fit inner_steps={saved['inner_steps']} "
            f"at {taus} (replica {replica})"
        )
    _check_fixed_sync_delay(state, saved.get("fixed_sync_delay"), config, source)


def saved_pace(fixed: list[dict[str, Any]]) -> Pace:
    """The pace a state's checked `fixed_replica_tau` holds."""
    return Pace.of_segments([(segment["from_round"], segment["taus"]) for segment in fixed])


def _pace_of(state: RoundState, saved: dict[str, Any], config: CO2Config, source: str) -> Pace:
    """The pace `saved` ran: its fixed replica_tau "auto" (checked: 1 or 2 paces, each R integers in [1, tau]
    whose largest is tau, from rounds in increasing order up to the round in progress or the next), tau
    while it measured, else this run's."""
    fixed = saved.get("fixed_replica_tau")
    if state.pace_meter is None:
        if fixed is not None:
            raise ValueError(
                f"co2 {source}: fixed_replica_tau={fixed!r} but this run's replica_tau is "
                f"{config.replica_tau!r}; accepted: null (only replica_tau 'auto' fixes one)"
            )
        return state.pace
    replicas = len(state.pace.taus)
    if fixed is None:
        return Pace((config.tau,) * replicas)
    if not _good_paces(fixed, replicas, config.tau, saved["rounds"] + 1):
        raise ValueError(
            f"co2 {source}: fixed_replica_tau={fixed!r}; expected null or a list of 1 to {DECISIONS} "
            f"{{'taus': a list of R={replicas} integers in [1, tau={config.tau}], the largest tau, 'from_round': "
            f"a round}}, the rounds increasing from 0 to at most {saved['rounds'] + 1} (the saved rounds="
            f"{saved['rounds']}, plus 1)"
        )
    return saved_pace(fixed)


def _good_paces(fixed: Any, replicas: int, tau: int, last_round: int) -> bool:
    """1 to DECISIONS paces of good τ_r whose rounds increase from 0 to at most `last_round` (a pace is fixed in
    the round in progress or at its start, or for the next)."""
    if not isinstance(fixed, list) or not 1 <= len(fixed) <= DECISIONS or not all(isinstance(p, dict) for p in fixed):
        return False
    rounds = [p.get("from_round") for p in fixed]
    if not all(_is_int(r) for r in rounds) or rounds != sorted(set(rounds)):
        return False
    return 0 <= rounds[0] and rounds[-1] <= last_round and all(_good_taus(p.get("taus"), replicas, tau) for p in fixed)


def _good_taus(taus: Any, replicas: int, tau: int) -> bool:
    return (
        isinstance(taus, list)
        and len(taus) == replicas
        and all(_is_int(t) and 1 <= t <= tau for t in taus)
        and max(taus) == tau
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fixed_sync_delay(state: RoundState, fixed: Any, config: CO2Config, source: str) -> None:
    """A fixed delay only with sync_delay "auto" (the config hash says so too), an integer in [1, tau]."""
    if fixed is None:
        return
    if state.delay_meter is None:
        raise ValueError(
            f"co2 {source}: fixed_sync_delay={fixed!r} but this run's sync_delay is "
            f"{config.sync_delay!r}; accepted: null (only sync_delay 'auto' fixes one)"
        )
    if isinstance(fixed, bool) or not isinstance(fixed, int) or not 1 <= fixed <= config.tau:
        raise ValueError(
            f"co2 {source}: fixed_sync_delay={fixed!r}; expected null or an integer in [1, tau={config.tau}]"
        )


def _check_tensors(state: RoundState, saved: dict[str, Any], config: CO2Config, source: str, num_tensors: int) -> None:
    """Every tensor of `saved` has this state's shape and dtype (and is present iff it has one). A peer's
    state holds no start point (the round's work buffer at a heal)."""
    pending = config.overlap and saved.get("next_start") is not None  # None: none pending (sync delay)
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
        if key == "own_momentum" and state.own_momentum is None and config.effective_stand_in == "local":
            continue  # local's copy of the momentum, offered by resharding; not kept here (all_reduce, or β = 0)
        if saved.get(key) is not None:
            _check_tensor(source, key, saved[key], getattr(state, key))
    residuals = saved.get("residuals")
    if residuals is not None:
        if state.residuals is None or not isinstance(residuals, dict):
            raise ValueError(
                f"co2 {source}: it holds error-feedback residuals; comm_dtype here is {config.comm_dtype!r}"
            )
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
