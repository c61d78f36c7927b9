"""The round schedule: the one owner of what the job decides while it runs (docs/design.md §3).

The pace (every replica's inner steps per round; `replica_tau: "auto"` and its `PaceMeter`), the apply
point (`sync_delay: "auto"` and its `DelayMeter`) and the elastic round length are decided here only.
At the start of every round the schedule makes one frozen `RoundDecision`, which the engine, the
exchange and the checkpoint read; `ApplySchedule` is built here only (`_set_apply`). The resolved plan
(`co2_zero.core.plan`) says which of these the schedule decides; this module turns its "auto"s into
numbers. Plain bookkeeping: no collectives (the engine collects the step announcements and hands them in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .pace import Pace
from .pace_meter import DECISIONS, PaceMeter
from .plan import ResolvedPlan
from .schedule import ApplySchedule, DelayMeter, late_average_warning


@dataclass(frozen=True)
class RoundDecision:
    """What one round of this replica runs with, decided when it starts (or when the pace is fixed inside it)."""

    round_index: int
    tau: int  # this replica's τ_r: the round's length on the clock
    steps: int  # the inner steps it trains (fewer than tau where the elastic exchange measured them)
    applies_at: int  # where the average launched at its end is applied: 0 at once, tau the round end, else d
    staleness: float  # the share of a round before that average is applied (the gap penalty's)
    weights: tuple[float, ...]  # every replica's displacement scale R·w_r in its exchange (`Pace.displacement_scale`)


class RoundSchedule:
    """The pace, the apply point and the round length of one replica (`replica`) under `plan`, and the meters
    that fix the "auto" ones. `decision` is the round in progress's; `apply` where the average in flight is
    applied."""

    def __init__(self, plan: ResolvedPlan, replica: int) -> None:
        self.plan, self.replica = plan, replica
        self.pace = Pace.of(plan.config, plan.replicas)  # replica_tau "auto": tau until fixed
        self.delay_meter = DelayMeter(plan.config.tau) if plan.sync_delay == "measured" else None
        self.pace_meter = PaceMeter(plan.config.tau, plan.shards, replica) if plan.replica_tau == "measured" else None
        self._set_apply(0)
        self.start_round(0)

    def _set_apply(self, round_index: int, delay: Optional[int] = None) -> None:
        """The one place an `ApplySchedule` is built: `delay` steps into the next round, else the plan's apply
        point within this replica's τ_r of round `round_index`."""
        tau = self.pace.tau(self.replica, round_index)
        self.apply = ApplySchedule(min(self.plan.config.steps_before_apply, tau) if delay is None else delay, tau)

    def start_round(self, round_index: int, steps_for: Callable[[int], int] = lambda tau: tau) -> RoundDecision:
        """Decide round `round_index`; `steps_for(tau)`: the steps the exchange chose for this replica (the elastic
        one with `replica_tau: "auto"`; else tau)."""
        tau = self.pace.tau(self.replica, round_index)
        weights = self.pace.displacement_scales(round_index)
        staleness = self.apply.steps / self.apply.tau
        self.decision = RoundDecision(round_index, tau, steps_for(tau), self.apply.steps, staleness, weights)
        return self.decision

    def fix_pace(self, pace: Pace, round_index: int) -> None:
        """Run `pace` from its `from_round` on (fixed inside round `round_index`, or at its end): the round end the
        apply point waits for moves with this replica's τ (none is in flight mid-round: replica_tau runs with
        the round end, or blocking)."""
        self.pace = pace
        self._set_apply(pace.from_round)
        self.start_round(round_index)

    def after_launch(self, round_index: int) -> Optional[str]:
        """sync_delay "auto", after round `round_index`'s launch: note the pipeline; at the deciding round end,
        switch to the fixed delay. Returns the warning to give when the delay fixed is a whole round."""
        if self.delay_meter is None:
            return None
        self.delay_meter.launched(round_index)
        delay = self.delay_meter.fixed_after_launch(round_index)
        if delay is None:
            return None
        self._set_apply(round_index, delay)
        tau = self.plan.config.tau
        return late_average_warning(self.delay_meter.most_steps, tau) if delay == tau else None

    @property
    def fixed_replica_tau(self) -> Optional[list[dict[str, Any]]]:
        """replica_tau "auto": the paces fixed so far, in the order they start, as plain data; else None."""
        fixed = None if self.pace_meter is None else self.pace_meter.fixed
        return None if fixed is None else [{"taus": list(t), "from_round": r} for r, t in fixed.segments]

    @property
    def fixed_sync_delay(self) -> Optional[int]:
        """sync_delay "auto": the delay once fixed; else None."""
        return None if self.delay_meter is None else self.delay_meter.fixed

    def load(
        self,
        fixed_replica_tau: Optional[list[Any]],
        fixed_delay: Optional[int],
        inner_steps: int,
        rounds: int,
        round_steps: Optional[int] = None,
    ) -> None:
        """A checked checkpoint's decisions, at `inner_steps` in round `rounds`: the round in progress trains the
        `round_steps` it was deciding (None, a state that has none: tau), at most its τ_r."""
        self._load_pace(fixed_replica_tau, inner_steps, rounds)
        self.take_fixed_delay(fixed_delay, rounds)
        self.start_round(rounds, lambda tau: tau if round_steps is None else min(round_steps, tau))

    def _load_pace(self, fixed: Optional[list[dict[str, Any]]], inner_steps: int, rounds: int) -> None:
        """replica_tau "auto": the saved pace (its correction still to come: timed from the loaded step), or (not
        fixed when saved) run at tau and measure anew from the loaded step (`PaceMeter.restart`)."""
        if self.pace_meter is None:
            return
        if fixed is None:
            self.pace_meter.restart(inner_steps)
            self.pace = Pace((self.plan.config.tau,) * len(self.pace.taus))
        else:
            self.pace = saved_pace(fixed)
            self.pace_meter.fix(self.pace, inner_steps, resumed=True)
        self._set_apply(rounds)

    def take_fixed_delay(self, fixed: Optional[int], rounds: int) -> None:
        """sync_delay "auto": a saved (or a peer's) fixed delay, or (none fixed there) measure anew from round
        `rounds`, applying at the round end meanwhile (this schedule may have fixed one)."""
        if self.delay_meter is None:
            return
        if fixed is None:
            self.delay_meter.restart(rounds)
            self._set_apply(rounds)
        else:
            self.delay_meter.fix(fixed)
            self._set_apply(rounds, fixed)

    def saved_pace_of(self, saved: dict[str, Any], source: str) -> Pace:
        """The pace `saved` ran: its fixed replica_tau "auto" (checked: 1 or 2 paces, each R integers in [1, tau]
        whose largest is tau, from rounds in increasing order up to the round in progress or the next), tau
        while it measured, else this run's."""
        fixed, config = saved.get("fixed_replica_tau"), self.plan.config
        if self.pace_meter is None:
            if fixed is not None:
                raise ValueError(
                    f"co2 {source}: fixed_replica_tau={fixed!r} but this run's replica_tau is "
                    f"{config.replica_tau!r}; accepted: null (only replica_tau 'auto' fixes one)"
                )
            return self.pace
        replicas = len(self.pace.taus)
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

    def check_round_steps(self, steps: Any, source: str) -> None:
        """A state's `round_steps` (the inner steps its round in progress trains): null or an integer in [1, tau]."""
        tau = self.plan.config.tau
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= tau):
            raise ValueError(f"co2 {source}: round_steps={steps!r}; expected null or an integer in [1, tau={tau}]")

    def check_fixed_delay(self, fixed: Any, source: str) -> None:
        """A fixed delay only with sync_delay "auto" (the config hash says so too), an integer in [1, tau]."""
        if fixed is None:
            return
        config = self.plan.config
        if self.delay_meter is None:
            raise ValueError(
                f"co2 {source}: fixed_sync_delay={fixed!r} but this run's sync_delay is "
                f"{config.sync_delay!r}; accepted: null (only sync_delay 'auto' fixes one)"
            )
        if isinstance(fixed, bool) or not isinstance(fixed, int) or not 1 <= fixed <= config.tau:
            raise ValueError(
                f"co2 {source}: fixed_sync_delay={fixed!r}; expected null or an integer in [1, tau={config.tau}]"
            )


def saved_pace(fixed: list[dict[str, Any]]) -> Pace:
    """The pace a state's checked `fixed_replica_tau` holds."""
    return Pace.of_segments([(segment["from_round"], segment["taus"]) for segment in fixed])


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
