"""The engine's state as plain containers and tensors (loadable with torch.load(weights_only=True)).

`state_dict`, `check_state_dict` and `load_state_dict` are functions over a `RoundEngine` (its
methods call them): what a state holds, whether it fits this engine, and restoring it. Files,
agreement across ranks and resharding are `co2_zero.checkpoint`'s business (docs/design.md §7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .schedule import ApplySchedule

if TYPE_CHECKING:
    from .engine import RoundEngine

STATE_VERSION = 2


def geometry(engine: RoundEngine) -> dict[str, Any]:
    """Where this rank's state lives in the model: enough to re-cut it per parameter tensor
    (`co2_zero.checkpoint.consolidate`) and to check that a state fits this engine."""
    layout, piece = engine.layout, engine.exchange.slice
    return {
        "length": layout.length,
        "padded": layout.padded,
        "num_tensors": layout.num_tensors,
        "segments": [list(seg) for seg in layout.segments],
        "sub_shard": list(layout.sub_shard_range(engine.topology.replica_index)),
        "momentum_range": [piece.start, piece.stop],
        "strategy": engine.exchange.strategy,
        "overlap": engine.config.overlap,
        "tau": engine.config.tau,
    }


def identity(engine: RoundEngine) -> dict[str, Any]:
    """What a state must agree on to be loaded here."""
    topo = engine.topology
    return {
        "version": STATE_VERSION,
        "config_hash": engine.config.math_hash(),
        "grid": {"replicas": topo.replicas, "shards": topo.shards},
        "rank": topo.rank,
        "signature": engine.partition.signature,
        "geometry": geometry(engine),
    }


def state_dict(engine: RoundEngine) -> dict[str, Any]:
    """The engine's state with no round in flight (the caller waited). Tensors are live references."""
    return {
        **identity(engine),
        "run_id": engine.run_id,
        "inner_steps": engine.inner_steps,
        "rounds": engine.rounds,
        "skipped_rounds": engine.skipped_rounds,
        "start_point": engine.start_point,
        # None when no start point is pending: blocking mode, and a sync delay from its apply point to the
        # round end (the buffer is scratch then); `applies_at` says when a pending one is applied
        "next_start": engine.schedule.carried_next_start(engine.next_start, engine.average_unapplied),
        "applies_at": engine.schedule.steps,  # the inner step of a round: 0 at once, tau the round end, else d
        "momentum": engine.momentum,
        "previous_update_sq_norms": engine.previous_update_sq_norms,
        # comm_dtype int8/fp8: the error-feedback residuals (comm.Residuals), else None
        "residuals": None if engine.exchange.residuals is None else engine.exchange.residuals._asdict(),
        # a stand-in: this replica's own round start and its momentum (eager: of its own shares; local: a
        # copy of the outer momentum where that is sharded; resharding makes it from the momentum), else None
        "stand_in": engine.config.effective_stand_in,
        "own_start": engine.own_start,
        "own_momentum": engine.own_momentum,
        # sync_delay "auto": the delay once fixed (None while it is measured, and for any other sync_delay)
        "fixed_sync_delay": None if engine.delay_meter is None else engine.delay_meter.fixed,
    }


def check_state_dict(engine: RoundEngine, state: Any) -> None:
    """Raise ValueError naming the first field of `state` that does not fit `engine` (same config,
    topology, model and partition); changes nothing."""
    if not isinstance(state, dict):
        raise ValueError(f"co2 checkpoint: the co2 state is a {type(state).__name__}, expected a dict")
    for key, value in identity(engine).items():
        if state.get(key) != value:
            raise ValueError(
                f"co2 checkpoint: {key}={state.get(key)!r} does not match this run's {value!r}; "
                f"resume with the same co2 config, topology and model (or reshard)"
            )
    _check_tensors(engine, state)
    for key in ("inner_steps", "rounds", "skipped_rounds"):
        if not isinstance(state.get(key), int) or state[key] < 0:
            raise ValueError(f"co2 checkpoint: {key}={state.get(key)!r}; expected an integer >= 0")
    if state["rounds"] != state["inner_steps"] // engine.tau:
        raise ValueError(
            f"co2 checkpoint: rounds={state['rounds']} does not fit inner_steps={state['inner_steps']} "
            f"at tau={engine.tau} (this replica's)"
        )
    _check_fixed_sync_delay(engine, state.get("fixed_sync_delay"))


def _check_fixed_sync_delay(engine: RoundEngine, fixed: Any) -> None:
    """A fixed delay only with sync_delay "auto" (the config hash says so too), an integer in [1, tau]."""
    if fixed is None:
        return
    tau = engine.config.tau
    if engine.delay_meter is None:
        raise ValueError(
            f"co2 checkpoint: fixed_sync_delay={fixed!r} but this run's sync_delay is "
            f"{engine.config.sync_delay!r}; accepted: null (only sync_delay 'auto' fixes one)"
        )
    if isinstance(fixed, bool) or not isinstance(fixed, int) or not 1 <= fixed <= tau:
        raise ValueError(f"co2 checkpoint: fixed_sync_delay={fixed!r}; expected null or an integer in [1, tau={tau}]")


def _check_tensors(engine: RoundEngine, state: dict[str, Any]) -> None:
    """Every tensor of `state` has this engine's shape and dtype (and is present iff it has one)."""
    pending = engine.config.overlap and state.get("next_start") is not None  # None: none pending (sync delay)
    expected = {
        "start_point": engine.start_point,
        "next_start": engine.next_start if pending else None,
        "momentum": engine.momentum,
    }
    for key, like in expected.items():
        _check_tensor(key, state.get(key), like)
    norms = state.get("previous_update_sq_norms")
    if norms is not None:
        _check_tensor("previous_update_sq_norms", norms, torch.zeros(engine.layout.num_tensors, dtype=torch.float64))
    for key in ("own_start", "own_momentum"):  # a resharded state has no own_start (and eager's no own_momentum)
        if key == "own_momentum" and engine.own_momentum is None and engine.config.effective_stand_in == "local":
            continue  # local's copy of the momentum, offered by resharding; not kept here (all_reduce, or β = 0)
        if state.get(key) is not None:
            _check_tensor(key, state[key], getattr(engine, key))
    residuals = state.get("residuals")
    if residuals is not None:
        if engine.exchange.residuals is None or not isinstance(residuals, dict):
            raise ValueError(
                f"co2 checkpoint: it holds error-feedback residuals; comm_dtype here is {engine.config.comm_dtype!r}"
            )
        for name, like in engine.exchange.residuals._asdict().items():
            _check_tensor(f"residuals.{name}", residuals.get(name), like)


def _check_tensor(key: str, value: Any, like: Optional[torch.Tensor]) -> None:
    if like is None:
        if value is not None:
            raise ValueError(f"co2 checkpoint: {key} is present but this run has none (overlap differs?)")
        return
    if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"co2 checkpoint: {key} is {got}; expected {like.dtype} {tuple(like.shape)}")


def load_state_dict(engine: RoundEngine, state: dict[str, Any]) -> None:
    """Restore a checked `state` (no round in flight: the caller waited)."""
    engine.inner_steps, engine.rounds = state["inner_steps"], state["rounds"]
    engine.skipped_rounds, engine.run_id = state["skipped_rounds"], state.get("run_id")
    engine.start_point.copy_(state["start_point"])
    if state["next_start"] is not None:
        engine.next_start.copy_(state["next_start"])
    engine.momentum.copy_(state["momentum"])
    _load_sync_delay(engine, state.get("fixed_sync_delay"))
    engine.average_unapplied = _pending_apply(engine, state)
    engine.buffers.take_current_as_agreed()  # checkpoint.load wrote the module first
    norms = state["previous_update_sq_norms"]
    engine.previous_update_sq_norms = None if norms is None else norms.to(engine.momentum.device).clone()
    if engine.own_start is not None:  # a resharded state may carry none: the replica starts from the shared start
        saved = state.get("own_start")
        engine.own_start.copy_(saved if saved is not None else engine.start_point)
        if engine.own_momentum is not None:
            saved = state.get("own_momentum")
            engine.own_momentum.copy_(saved) if saved is not None else engine.own_momentum.zero_()
    if engine.exchange.residuals is not None:  # a resharded state has none: the pending error restarts at 0
        saved = state.get("residuals")
        for name, residual in engine.exchange.residuals._asdict().items():
            residual.copy_(saved[name]) if saved is not None else residual.zero_()


def _pending_apply(engine: RoundEngine, state: dict[str, Any]) -> bool:
    """Whether the state's next start is still to be applied d steps into the round (a sync delay d < tau).
    A state without `applies_at` carries the buffer whatever the phase (scratch after the apply point):
    for it the step counter says whether its apply point has passed."""
    steps, tau = engine.schedule.steps, engine.tau
    pending = state["next_start"] is not None and 0 < steps < tau
    if "applies_at" not in state:
        pending = pending and state["rounds"] > 0 and state["inner_steps"] % tau < steps
    return pending


def _load_sync_delay(engine: RoundEngine, fixed: Optional[int]) -> None:
    """sync_delay "auto": the saved delay and its schedule, or (not fixed when saved) measure anew."""
    if engine.delay_meter is None:
        return
    if fixed is None:  # measured anew, applying at the round end meanwhile (this engine may have fixed one)
        engine.delay_meter.restart(engine.rounds)
        engine.schedule = ApplySchedule(engine.config.steps_before_apply, engine.config.tau)
    else:
        engine.delay_meter.fix(fixed)
        engine.schedule = ApplySchedule(fixed, engine.config.tau)
