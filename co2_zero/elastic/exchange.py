"""The outer exchange of an elastic job: each round's average over that round's quorum (design §12).

Only the averaging differs from the fixed-group `OuterExchange`: who takes part is the quorum's
(`Peers`), whether the average is applied is the commit vote's (`Membership.settle`), and a cut
average leaves the base as the next start point. The membership itself lives in `membership.py`.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..core.comm import Layout, OuterExchange, PipelineJob, RoundResult
from ..core.errors import CO2Error
from ..core.membership import AtRoundEnd
from ..core.plan import ResolvedPlan
from ..core.topology import Topology
from .agreement import FIELDS, HEAD, WORDS, ReplicaRefused, identity_fields, row, start_digest, verdict
from .lighthouse import AbandonedCollective, wait_watched
from .speeds import displacement_scale, steps_for


class Peers(NamedTuple):
    """One round's quorum as this replica sees it."""

    group: Any  # the quorum's process group (torchft's, reconfigured by the Manager)
    replicas: tuple[int, ...]  # the replica ids of the quorum, in the group's rank order
    rank: int  # this replica's rank in the quorum
    contributes: bool  # False: joined at this round end; its displacement is not in the average
    members: tuple[str, ...] = ()  # torchft's replica group ids of the quorum ("<replica_id>:<uuid>")


class Quorums(Protocol):
    """What the exchange asks of this replica's membership (`membership.Membership`): each round's commit
    vote, the agreement of the replica's ranks, and the settings the quorum agrees on."""

    agree: dict[str, Any]
    lighthouse: str
    replica_id: int

    def background_quorum(self, round_index: int) -> Peers: ...
    def settle(self, peers: Peers, round_index: int, contributors: Optional[tuple[int, ...]], error: Any) -> bool: ...
    def replica_max(self, values: Sequence[int], round_index: int) -> list[int]: ...
    def end(self, peers: Peers, error: Optional[Exception]) -> None: ...
    def close(self) -> None: ...


class _CutExchange(Exception):
    """The round's average is incomplete on some rank of this replica: skip the round."""


class ElasticExchange(OuterExchange):
    """The outer exchange over each round's quorum (docs/design.md §12).

    Per round, in the background: the quorum, one small all-reduce of who contributes (with the inner
    steps each trained, its weight, and its step time: `speeds.py`), the average of the contributors'
    displacements weighted by their steps, the commit vote, then the outer step. The quorum is asked for
    on the main thread instead (`Membership.before_launch`, which hands the engine a live peer's state
    to adopt) after an exchange this replica cut: it may be behind its peers. A cut exchange leaves the
    base as the next start point and the outer state untouched.
    """

    def __init__(
        self, membership: Quorums, plan: ResolvedPlan, topology: Topology, layout: Layout, device: torch.device
    ) -> None:
        super().__init__(plan, topology, layout, device)
        self.membership = membership
        self.device = device
        self.joined: Optional[Peers] = None  # the quorum `attach` joined, for the first round end
        self.peers: Optional[Peers] = None  # this round's (None until the background quorum); the worker's
        self.round_index = -1
        self.contributors: tuple[int, ...] = ()
        self.weights: tuple[int, ...] = ()  # the inner steps each contributor trained in this round (the worker's)
        self.measures_speed = plan.config.replica_tau == "auto"  # each round's steps from the quorum's speeds
        self._weight, self._step_us = 0, 0  # this replica's for the round in flight: its steps, its step time
        self._chosen: Optional[int] = None  # the steps the last exchange's speeds give (written by the worker)
        self._next_steps: Optional[int] = None  # ... agreed by the replica's ranks at the last launch: the next round's
        self.cut = False  # the last exchange was cut on this replica (set by the worker)
        self._abandoned: list[tuple[Any, Any]] = []  # (group, collective) given up on, until it ends
        self._fields: Optional[dict[str, Any]] = None  # what the quorum agrees on (agreement.py), made once
        self._start = 0  # start_digest of the shared start point this replica's exchange applies to
        self.ranks = topology.world_size
        self.at: Optional[AtRoundEnd] = None  # what the exchange reads of this replica, as of the last round end
        self.final: Optional[tuple[Peers, torch.Tensor]] = None  # finalize()'s quorum and the final model

    def take_round_end(self, at: AtRoundEnd) -> None:
        """At a round end (main thread, no pipeline in flight), before the membership asks for the quorum: what
        the exchange reads of this replica (as values, `AtRoundEnd`), and its steps (`_take_round_steps`)."""
        self.at, self.round_index = at, at.rounds
        self._take_round_steps(at)  # before the quorum: no peer counts on this replica yet

    def _take_round_steps(self, at: AtRoundEnd) -> None:
        """The steps this replica trained in the round that ended (its weight), its step time over them, and
        the steps the last exchange chose for it. Its ranks (S > 1) agree on both in one all-reduce: the
        replica's step time is its slowest rank's, its steps the fewest any rank's exchange chose. So every
        shard's outer group gets the same row for this replica, and its ranks, whose collectives run
        together, train the same steps."""
        self._weight, trained_s = at.round_steps, at.round_train_s
        if not self.measures_speed:
            return
        measured = trained_s is not None and self._weight > 0
        step_us = max(1, round(1e6 * trained_s / self._weight)) if measured else 0
        chosen = self.config.tau if self._chosen is None else self._chosen
        self._step_us, fewest = self.membership.replica_max([step_us, -chosen], self.round_index)
        self._next_steps = -fewest

    def steps_next_round(self, tau: int) -> int:
        """`replica_tau: "auto"`: what this replica's speed against the quorum's fastest gives (`speeds.py`), from
        the exchange before the one just launched; `tau` until measured, and without "auto"."""
        return tau if self._next_steps is None else self._next_steps

    def outer_peers(self) -> tuple[Any, int]:
        return self.peers.group, len(self.contributors)

    def _pipeline(self, job: PipelineJob) -> RoundResult:
        if self.peers is None:
            self.peers = self.membership.background_quorum(job.round_index)
        self._start = start_digest(job.base)  # the shared start this exchange applies to (after any heal)
        try:
            result, self.cut = super()._pipeline(job), False
            return result
        except _CutExchange:
            self.cut = True
            job.work.copy_(job.base)  # the skip path: the next start point is the base
            zeros = torch.zeros(self.layout.num_tensors, dtype=torch.float64, device=job.work.device)
            return RoundResult(zeros, None)

    def _average(self, work: torch.Tensor, g_buffer: Optional[torch.Tensor]) -> torch.Tensor:
        peers, error, g = self.peers, None, work
        self.contributors = ()
        try:
            self.contributors = self._who_contributes(peers)
            if not self.contributors:
                raise CO2Error(f"co2 elastic: no replica of the quorum {list(peers.replicas)} contributes")
            scale = displacement_scale(self._weight, self.weights) if peers.contributes else 1.0
            if scale != 1.0:  # the weighted average over the plain mean's collective (`speeds.py`)
                work.mul_(scale)
            g = super()._average(work, g_buffer)
        except Exception as failure:  # a peer died or the group broke: the average is incomplete
            error = _collective_error(failure)
            drop_group(peers.group)
        if not self.membership.settle(peers, self.round_index, self.contributors or None, error):
            if isinstance(error, ReplicaRefused):
                raise error
            raise _CutExchange()
        return g

    def _who_contributes(self, peers: Peers) -> tuple[int, ...]:
        """One small all-reduce over the quorum: which replicas' displacements are in the average and with
        how many inner steps each (`weights`), and whether every replica runs the same config, model and
        job settings (`agreement.py`). With `replica_tau: "auto"`, the steps the speeds give (`_chosen`)."""
        if self._fields is None:
            identity = self.at.served
            self._fields = identity_fields(self.config, self.layout, self.ranks, identity, self.membership.agree)
        rows = torch.zeros((len(peers.replicas), HEAD + WORDS * FIELDS), dtype=torch.int64)
        fields = {**self._fields, "shared start point (digest)": self._start}
        weight = self._weight if peers.contributes else 0
        rows[peers.rank] = torch.tensor(row(weight, self.at.rounds > 0, self._step_us, fields))
        self._all_reduce(rows, peers.group)
        table = rows.tolist()
        refused = verdict(table, peers.replicas, peers.rank, fields, self.round_index)
        if refused is not None:
            raise refused
        contributing = [(r, line[0]) for r, line in zip(peers.replicas, table) if line[0] > 0]
        self.weights = tuple(w for _, w in contributing)
        chosen = steps_for(self.config.tau, [line[2] for line in table], peers.rank) if peers.contributes else None
        self._chosen = chosen if self.measures_speed and chosen is not None else self._chosen
        return tuple(r for r, _ in contributing)

    def meet(self, peers: Peers, start: torch.Tensor) -> Optional[Exception]:
        """A start-up meeting of the quorum (`Membership.attach`) on the shared start point `start`: the
        agreement, nobody contributing. Returns the error of a failed meeting; raises ReplicaRefused if this
        replica must leave."""
        self.peers, self.round_index = peers, 0
        self._start = start_digest(start)
        try:
            self._who_contributes(peers._replace(contributes=False))
        except ReplicaRefused:
            drop_group(peers.group)
            raise
        except Exception as error:
            return _collective_error(error)
        return None

    def _all_reduce(self, wire: torch.Tensor, group: Any) -> None:
        """The quorum's all-reduce, waited for while the Lighthouse still holds every member's heartbeat
        (a frozen or lost peer ends the wait after the heartbeat timeout, not timeout_s). It sums a copy:
        a collective given up on may still complete later, and must not write into the round's buffers."""
        self._abandoned = [(pg, work) for pg, work in self._abandoned if not work.is_completed()]
        scratch = wire.clone()
        work = dist.all_reduce(scratch, group=group, async_op=True)
        try:
            wait_watched(work, self.peers.members, self.membership.lighthouse, self.config.timeout_s)
        except AbandonedCollective:
            # gloo cannot cancel it, and the group's destructor (or abort) waits for it: keep the group
            # until it ends (gloo's own timeout), out of torchft's wrapper, whose next quorum builds anew
            self._abandoned.append((group._pg, work))
            group._pg = None
            raise
        wire.copy_(scratch)

    @property
    def replica_name(self) -> int:
        """This replica as messages name it: its replica_id (each launch is replica 0 of its own world)."""
        return self.membership.replica_id

    def _nonfinite_replicas(self, locally_finite: bool) -> list[int]:
        """The replica ids of this round's quorum whose displacement held NaN/Inf: whether any rank of
        this replica's did (over its own ranks), then one small all-reduce over the quorum."""
        mine = super()._nonfinite_replicas(locally_finite)  # [0] or []: this launch is one replica
        peers = self.peers
        flags = torch.zeros(len(peers.replicas), dtype=torch.float32)
        flags[peers.rank] = 1.0 if mine else 0.0
        self._all_reduce(flags, peers.group)
        return [r for r, flag in zip(peers.replicas, flags.tolist()) if flag > 0]

    def agree_final(self, round_index: int) -> None:
        """finalize(): the last quorum (`final`, which `Membership.before_final` met), as a round end at which
        this replica contributes nothing. A peer that trains on (it stops later) runs its round's exchange in
        this quorum: this replica takes part in the average with a zero displacement, then keeps its own
        model."""
        (peers, final_model), self.final = self.final, None
        self._start, error = start_digest(final_model), None
        try:
            self.peers, self.contributors = peers, self._who_contributes(peers)
            if self.contributors:
                super()._average(torch.zeros(self.layout.padded, device=self.device), None)
        except Exception as failure:
            error = _collective_error(failure)
            drop_group(peers.group)
        self.membership.end(peers, error)
        if isinstance(error, ReplicaRefused):
            raise error

    def close(self, join_s: float = 1.0) -> bool:
        closed = super().close(join_s)
        self.membership.close()
        return closed


def _collective_error(failure: Exception) -> Exception:
    """The collective's own error, without its traceback. c10d's exception logger (torch 2.13) replaces
    the error of a collective on a group it does not know (torchft's) by a ValueError from
    `get_backend` ("... not initialized in the world group map"): the real one is its context. The
    traceback goes: its frames hold the collective's work, which keeps the group's connections open."""
    if isinstance(failure, ValueError) and "world group map" in str(failure) and failure.__context__ is not None:
        failure = failure.__context__
    chained: Optional[BaseException] = failure
    while chained is not None:
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return failure


def drop_group(group: Any) -> None:
    """Close this replica's connections of a quorum group whose collective failed, at once: a peer
    still inside that collective then fails too (gloo: 'Connection closed by peer') instead of
    waiting out the group's timeout for data this replica will never send, while the Lighthouse
    waits for it (design §12). The failed commit makes the next quorum reconfigure the group."""
    try:
        group.abort()
    except Exception as error:  # pragma: no cover - torchft's abort only drops its reference
        warnings.warn(f"co2 elastic: could not abort the quorum's process group: {error}", stacklevel=2)
