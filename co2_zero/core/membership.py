"""The seam between the round engine and a membership of replicas that come and go (docs/design-elastic.md).

The engine asks its membership at a round end, before the launch, for that round's quorum: the membership
answers with data (`Quorum`: a live peer's state to adopt, if this replica is behind) and the engine adopts
it itself. What the membership needs of the engine it gets as plain values (`AtRoundEnd`), never by holding
the engine: one direction, as torchft's Manager is asked before DiLoCo's step. `co2_zero.elastic.Membership`
is the one implementation; the core imports only this Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

import torch

from .comm import Layout, OuterExchange
from .plan import ResolvedPlan
from .topology import Topology


@dataclass(frozen=True)
class AtRoundEnd:
    """What a membership reads of this replica at a round end (or at start-up, or at finalize), as values."""

    rounds: int  # the rounds ended so far (the round that just ended is rounds - 1 until the engine counts it)
    inner_steps: int
    round_steps: int  # the inner steps this replica trained in the round that ended (its weight)
    round_train_s: Optional[float]  # the seconds it trained them, its waits left out (None: not measured)
    # what a peer that heals from this replica adopts (`RoundEngine.state_for_peer`: its identity, its next start
    # point, outer state and counters), references read only
    served: Mapping[str, Any]


@dataclass(frozen=True)
class Quorum:
    """A membership's answer: the state of a live peer this replica must adopt ("elastic heal"), if any, and
    (at start-up) whether it joined a running job at a round end, to take part in that round's exchange."""

    adopt: Optional[dict[str, Any]] = None
    joined: bool = False


class Membership(Protocol):
    """What the engine asks of a membership: its exchange (which averages over each round's quorum), then, at
    start-up, every round end before the launch, and finalize, the quorum (`Quorum`)."""

    def make_exchange(
        self, plan: ResolvedPlan, topology: Topology, layout: Layout, device: torch.device
    ) -> OuterExchange: ...

    def attach(self, at: AtRoundEnd) -> Quorum: ...

    def before_launch(self, at: AtRoundEnd) -> Quorum: ...

    def before_final(self, at: AtRoundEnd) -> Quorum: ...
