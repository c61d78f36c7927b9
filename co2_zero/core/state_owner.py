"""The round state's owner (`RoundEngine`'s base): whole states saved, checked and adopted, and its values read.

The engine is the only owner of its `round_state.RoundState`: integrations, checkpoints and the elastic membership
read values through the properties here, and hand whole states to `adopt` (a checkpoint's, or a live peer's that
the membership returned at a round end). The round itself (its end, the pipeline in flight) is `engine.py`'s.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import round_state
from .buffers import ModuleBuffers
from .comm import Layout, OuterExchange
from .config import CO2Config
from .pace import Pace
from .partition import ParameterWatch, Partition
from .round_schedule import RoundSchedule
from .round_state import RoundState
from .topology import Topology


class RoundStateOwner:
    """The round engine's whole-state interface (save, check, adopt, serve to a peer) and the reads of its
    `RoundState`. The engine fills in the fields below and the lifecycle methods (`check_usable`, ...)."""

    state: RoundState
    topology: Topology
    config: CO2Config
    layout: Layout
    exchange: OuterExchange
    partition: Partition
    buffers: ModuleBuffers
    watch: ParameterWatch

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

    @property
    def agreed_step(self) -> int:
        """The step the ranks agree on to save (`Pace.agreed_step`): the inner steps, unless replica_tau."""
        return self.pace.agreed_step(self.topology.replica_index, self.state.inner_steps)

    # ---- whole states: saved, checked, adopted, served to a peer --------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a state must agree on to be adopted here (`round_state.identity`, with its `geometry`)."""
        where = round_state.geometry(self.layout, self.exchange, self.topology, self.config)
        return round_state.identity(self.config, self.topology, self.partition.signature, where)

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state. Waits for the round in flight so its result is included. Tensors are
        live references (as in `torch.optim.Optimizer.state_dict()`): save or copy them before the next
        step."""
        self.check_usable()
        self._wait_pending()
        return self.state.to_dict(self.identity())

    def check_state_dict(self, state: Any, source: round_state.Source = "checkpoint") -> None:
        """Raise ValueError naming the first field of `state` that does not fit this engine (same
        config, topology, model and partition); changes nothing."""
        round_state.check(self.state, state, self.identity(), source)
        if source == "elastic heal":
            self.watch.check_frozen(state.get("frozen"), source)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved on this same rank of the same topology and config (`adopt`)."""
        self.adopt(state, source="checkpoint")

    def adopt(self, state: dict[str, Any], source: round_state.Source) -> None:
        """Check `state` (`check_state_dict`: a refused state changes nothing), then adopt it. source
        "checkpoint": what `state_dict` saved (no round in flight: this waits). "elastic heal": what a
        live peer's `state_for_peer` served, at a round end (the peer's next start point and outer state,
        and its frozen parameters), which the membership handed back before the launch (`Quorum.adopt`)."""
        self.check_usable()
        self.check_state_dict(state, source)
        if source == "checkpoint":
            self._wait_pending()
            self.state.load(state)
            self.buffers.take_current_as_agreed()  # checkpoint.load wrote the module first
            return
        with torch.no_grad():
            self.state.take_from_peer(state)
            self.watch.write_frozen(state["frozen"])

    def state_for_peer(self) -> dict[str, Any]:
        """What a peer that heals from this replica adopts (`adopt(..., "elastic heal")`), as of now, between
        two rounds: references (the caller copies them when it serves them), and its frozen parameters."""
        return {**self.identity(), **self.state.for_peer(), "frozen": self.watch.frozen_values()}

    def restart_round(self) -> None:
        """Set the live parameters to where this replica's round starts (`round_start`: its stand-in when
        the loaded state carried one, else the shared start) and refresh the replica: a resharded state
        resumes at the saved run's last round start."""
        self.check_usable()
        self._set_live(self.state.round_start)

    def restart_from_next_start(self) -> None:
        """Take the next start point as the shared start, and set the live parameters and a stand-in to it
        (an elastic replica that joined from a peer's state) and refresh the replica."""
        self.check_usable()
        self._set_live(self.state.take_next_as_start())

    def state_bytes(self) -> int:
        """Bytes of CO2 state this rank holds (docs/design.md §4: 2Ψ/S + 2Ψ/N fp32 words with reduce_scatter, 3Ψ/S
        with all_reduce, plus one float64 norm per tensor), and the outer step's segment index (`outer.SegmentIndex`,
        about 2·√(elements · segments) ids); int8/fp8 add the error-feedback residuals, Ψ/S + Ψ/N; a stand-in its
        own start and momentum, up to 2Ψ/S."""
        return sum(t.numel() * t.element_size() for t in self.state.tensors()) + self.exchange.index_bytes
