"""The round engine's read methods of its round state (`round_state.RoundState`): the engine is the state's only
owner, and integrations, checkpoints and elastic membership read its values through these."""

from __future__ import annotations

from typing import Optional

import torch

from .pace import Pace
from .round_state import RoundState
from .topology import Topology


class StateReads:
    """The round engine's read methods of its `RoundState` (`RoundEngine` is the state's only owner; others
    read values through these)."""

    state: RoundState
    topology: Topology

    @property
    def pace(self) -> Pace:
        """Every replica's inner steps per round (`RoundState.pace`; replica_tau "auto": fixed after its first
        inner steps)."""
        return self.state.pace

    @property
    def tau(self) -> int:
        """This replica's inner steps in the current round."""
        return self.state.pace.tau(self.topology.replica_index, self.state.rounds)

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
        return 0 if self.state.delay_meter is None else self.state.delay_meter.most_steps
