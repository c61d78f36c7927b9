"""A replica's stand-in start point (docs/design.md §3, "Stand-ins"): where it starts a round while the
average in flight is not applied yet, made at every round end from its own displacement.

`local` takes an outer step on its own displacement (`outer.local_start`) with the outer momentum as
of the shared start. The tensors are the round state's (`round_state.RoundState`: own_start,
own_momentum); this module is the stand-in's arithmetic and its collectives over the replica's own
shards.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .comm import OuterExchange
from .errors import collective_error
from .outer import local_start, track_momentum
from .plan import ResolvedPlan
from .round_state import RoundState
from .schedule import RoundPlan
from .topology import Topology


class StandIn:
    """The `local` stand-in of one rank (`plan.stand_in`, never "shared")."""

    def __init__(self, plan: ResolvedPlan, topology: Topology, exchange: OuterExchange) -> None:
        self.config, self.topology, self.exchange = plan.config, topology, exchange

    def next_start(self, state: RoundState, plan: RoundPlan, reset_inner: bool) -> None:
        """At a round end, from D in `plan.work` (before the pipeline consumes it): this replica's next own
        start. `reset_inner`: this rank's D is non-finite under "skip_round"."""
        hyper = self.exchange.hyper
        if self._replica_is_nonfinite(reset_inner, state):
            state.own_start.copy_(plan.base)  # the round will be skipped everywhere: its true next start
        else:
            sum_over_replica = lambda partial: self._sum_over_replica(partial, state.rounds)  # noqa: E731
            momentum = self._momentum_for_local(state)
            local_start(
                plan.work, plan.base, momentum, hyper=hyper, out=state.own_start, sum_over_replica=sum_over_replica
            )

    def track_applied_step(self, state: RoundState, before: torch.Tensor, after: torch.Tensor) -> None:
        """The `local` stand-in's copy of the outer momentum follows each outer step applied to the shared
        start (`outer.track_momentum`); before the first round end nothing was applied (before == after), and
        a skipped round (nonfinite: "skip_round") left the momentum as it was."""
        if state.applied_was_skipped:
            return
        if state.own_momentum is not None and state.rounds:
            track_momentum(state.own_momentum, before, after, hyper=self.exchange.hyper)

    def _replica_is_nonfinite(self, mine: bool, state: RoundState) -> bool:
        """Whether any rank of this replica holds a non-finite displacement ("skip_round" only; `mine`: this
        rank's): then its round is skipped everywhere, and every shard of the replica, agreeing, starts the
        next round from the shared start (none takes the stand-in's collectives without the others)."""
        if self.config.nonfinite != "skip_round":
            return False
        flag = torch.tensor([float(mine)], dtype=torch.float64, device=state.start_point.device)
        return bool(self._sum_over_replica(flag, state.rounds).item() > 0)

    def _sum_over_replica(self, partial: torch.Tensor, round_index: int) -> torch.Tensor:
        """`partial` summed over this replica's shards (its inner group), within timeout_s: the local
        stand-in's norm clip over the replica's whole model, and its non-finite flags."""
        if self.topology.shards == 1:
            return partial
        try:
            work = dist.all_reduce(partial, group=self.topology.inner_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.config.timeout_s))
        except Exception as error:
            ranks = list(self.topology.inner_ranks)
            what = f"round {round_index}: the local stand-in's sum over its replica (global ranks {ranks})"
            raise collective_error(what, error, self.config.timeout_s) from error
        return partial

    def _momentum_for_local(self, state: RoundState) -> Optional[torch.Tensor]:
        """The outer momentum as of the shared start, over this rank's whole partition, for the `local`
        stand-in: the momentum itself with all_reduce (so a skipped round or a healed replica needs
        nothing more), else the copy that follows the applied steps; None when β = 0."""
        if not self.config.effective("outer_momentum"):
            return None
        return state.momentum if state.own_momentum is None else state.own_momentum
