"""The round engine's read methods of its round state (`round_state.RoundState`): the engine is the state's only
owner, and integrations, checkpoints and elastic membership read its values through these."""

from __future__ import annotations

from typing import Optional

import torch

from .pace import Pace
from .round_schedule import RoundSchedule
from .round_state import RoundState
from .topology import Topology


class StateReads:
    """The round engine's read methods of its `RoundState` (`RoundEngine` is the state's only owner; others
    read values through these)."""

    state: RoundState
    topology: Topology

    @property
    def schedule(self) -> RoundSchedule:
        """The run-time decisions (`RoundState.schedule`): pace, apply point, round length."""
        return self.state.schedule

    @property
    def pace(self) -> Pace:
        """Every replica's inner steps per round (`RoundSchedule.pace`; replica_tau "auto": fixed after its first
        inner steps)."""
        return self.state.schedule.pace

    @property
    def tau(self) -> int:
        """This replica's τ_r in the current round: its length on the clock (`RoundDecision.tau`)."""
        return self.state.schedule.decision.tau

    @property
    def round_steps(self) -> int:
        """The inner steps this replica trains in the current round (`RoundDecision.steps`): tau, fewer where the
        elastic exchange measures them."""
        return self.state.schedule.decision.steps

    @property
    def inner_steps(self) -> int:
        return self.state.inner_steps

    @property
    def rounds(self) -> int:
        return self.state.rounds

    @property
    def skipped_rounds(self) -> int:
        return self.state.skipped_rounds

    @property
    def run_id(self) -> Optional[str]:
        """The run's id, agreed by the first checkpoint saved (`co2_zero.checkpoint`), or loaded."""
        return self.state.run_id

    def name_run(self, run_id: str) -> None:
        self.state.run_id = run_id

    @property
    def keeps_own_momentum(self) -> bool:
        """Whether this rank keeps the local stand-in's copy of the outer momentum (where that is sharded)."""
        return self.state.own_momentum is not None

    @property
    def previous_update_sq_norms(self) -> Optional[torch.Tensor]:
        """The last applied outer update's squared norms per tensor (the next gap penalty's); read only."""
        return self.state.previous_update_sq_norms

    @property
    def next_start(self) -> torch.Tensor:
        """The next start point (between rounds: the base of the exchange in flight); read only."""
        return self.state.next_start

    @property
    def exchange_steps(self) -> int:
        """sync_delay "auto": the most inner steps an exchange took (`DelayMeter.most_steps`), else 0."""
        meter = self.state.schedule.delay_meter
        return 0 if meter is None else meter.most_steps
