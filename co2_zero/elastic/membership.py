"""This replica's membership in an elastic job, through torchft's Manager (docs/design.md §12).

The quorum of each round, the commit vote on its exchange, and healing: the state a live peer sends
a replica that is behind (a joiner, or a replica that cut a round its peers committed).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.comm import Layout
from ..core.errors import CO2Error, missing_extra
from ..core.membership import AtRoundEnd, Quorum
from ..core.plan import ResolvedPlan
from ..core.round_state import IDENTITY_FIELDS
from ..core.topology import Topology, collective_device
from .agreement import ReplicaRefused
from .exchange import ElasticExchange, Peers, drop_group
from .job_end import check_lost, record_end
from .lighthouse import QuorumIds, check_unique, replica_number
from .quiet import quiet_torchft


def _torchft() -> Any:
    """torchft, imported on first use: it is the optional extra `elastic`."""
    try:
        import torchft
        import torchft.process_group  # noqa: F401  (ProcessGroupGloo lives there)
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise missing_extra("torchft", "elastic", error) from error
    return torchft


@dataclass
class RoundRecord:
    """What this replica saw of one round's exchange (`Membership.history`)."""

    round: int
    replicas: tuple[int, ...]  # the quorum
    contributors: Optional[tuple[int, ...]]  # replicas whose displacement was averaged (None: unknown, cut early)
    committed: bool  # False: the exchange was cut and every survivor skipped the round
    weights: Optional[tuple[int, ...]] = None  # the inner steps each contributor trained (its weight), in order


class Membership:
    """This replica's membership in an elastic job (docs/design.md §12): pass it to `CO2Optimizer`. The engine
    asks it for each round's quorum (`co2_zero.core.membership.Membership`, the seam): it answers with data
    and never calls the engine.

    lighthouse: the Lighthouse's address (`http://host:port`, torchft's `torchft_lighthouse`).
    replica_id: this replica group's number (an integer, unique in the job; a restarted replica keeps
    its number). min_replicas: rounds with fewer replicas in the quorum are not committed.
    start_replicas: a job that starts (no replica has trained yet) waits, up to timeout_s, until this
    many replicas are in the quorum, so that they all start from round 0 together.
    agree: the job's own settings every replica must share ({"dtype": "bf16", "seed": 0}): with the co2
    config and the model, checked at every meeting of the quorum; a difference is named on every replica.
    store_addr/store_port: this launch's TCPStore (default: MASTER_ADDR/MASTER_PORT, as torchrun sets).
    """

    def __init__(
        self,
        lighthouse: str,
        replica_id: int,
        *,
        min_replicas: int = 1,
        start_replicas: int = 1,
        agree: Optional[dict[str, Any]] = None,
        store_addr: Optional[str] = None,
        store_port: Optional[int] = None,
    ) -> None:
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise ValueError(f"co2 elastic: replica_id={replica_id!r} is invalid; accepted: an integer >= 0")
        for name, value in (("min_replicas", min_replicas), ("start_replicas", start_replicas)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"co2 elastic: {name}={value!r} is invalid; accepted: an integer >= 1")
        self.lighthouse = lighthouse
        self.replica_id = replica_id
        self.min_replicas = min_replicas
        self.start_replicas = start_replicas
        self.agree = dict(agree or {})
        self.store_addr = store_addr
        self.store_port = store_port
        self.history: list[RoundRecord] = []
        self.changes: list[str] = []  # "replicas 3 -> 2 at round 17", one per change of the quorum
        self.quorum: tuple[int, ...] = ()  # the replica ids of the latest quorum (the job's R now)
        self._members: tuple[str, ...] = ()  # the latest quorum's launches ("<replica_id>:<uuid>", torchft's)
        self.manager: Any = None
        self.exchange: Optional[ElasticExchange] = None
        self.topology: Optional[Topology] = None  # this launch's ranks (the replica's shards)
        self.timeout_s = 0.0
        self._at: Optional[AtRoundEnd] = None  # this replica as of the round end the engine asks at
        self._end_rounds = 0  # the rounds this replica ended the job at (its final model's, `before_final`)
        self._received: Optional[dict[str, Any]] = None  # the state a live peer sent, until handed to the engine
        self._served: Optional[dict[str, Any]] = None  # what a healing peer gets now (`RoundEngine.state_for_peer`)
        self._background_round: Optional[int] = None  # the round whose quorum runs on the exchange's worker
        self._round_in_place: Optional[int] = None  # the round whose quorum runs on the main thread, mid-job
        self._whole_at: Optional[int] = None  # the last round end every rank of this replica was seen to reach

    # ---- the engine's seam ---------------------------------------------------------------------------

    def make_exchange(
        self, plan: ResolvedPlan, topology: Topology, layout: Layout, device: torch.device
    ) -> ElasticExchange:
        """The exchange of an elastic engine (the plan was checked against the support table); starts this
        replica's torchft Manager."""
        self.timeout_s, self.topology = float(plan.config.timeout_s), topology
        self.exchange = ElasticExchange(self, plan, topology, layout, device)
        self.manager = self._start_manager(topology)
        return self.exchange

    def attach(self, at: AtRoundEnd) -> Quorum:
        """Join the job (the first quorum). The answer's `adopt`: a live peer's state, which the engine adopts
        and starts from; its `joined`: this replica joined a running job at a round end and must take part in
        that round's exchange now, with a zero displacement.

        At a job's start (no replica has trained) every replica takes the start point of one peer
        (torchft's init_sync), and the quorum is formed again until `start_replicas` are in it."""
        self._at, self._served = at, dict(at.served)
        self.exchange.at = at
        try:
            return self._join()
        except CO2Error:
            self.close()  # the others go on without this replica after the heartbeat timeout
            raise

    def _join(self) -> Quorum:
        """attach's quorums, until this replica joined a running job or `start_replicas` started one."""
        deadline, adopt = time.monotonic() + self.timeout_s, None
        while True:
            peers = self._quorum(round_index=0, joining=True, serve_now=False)
            received, self._received = self._received, None
            if received is not None:  # live = the peer's start point (for a joiner: a zero displacement)
                adopt = self._served = received  # a later quorum's healing peer gets what this replica holds then
            if received is not None and received["inner_steps"]:  # the job is running: take part in its exchange
                self.exchange.joined = peers._replace(contributes=False)
                return Quorum(adopt=adopt, joined=True)
            # The vote ends the serving of this quorum's heals: meet the others first (after their heal).
            start = self._served["next_start"]
            if self._vote(error=self.exchange.meet(peers, start)) and len(peers.replicas) >= self.start_replicas:
                return Quorum(adopt=adopt)
            if time.monotonic() > deadline:
                raise CO2Error(
                    f"co2 elastic: replica {self.replica_id}: only replicas {list(peers.replicas)} joined within "
                    f"timeout_s={self.timeout_s:g}; start_replicas={self.start_replicas} are needed to start"
                )
            time.sleep(0.05)

    def before_launch(self, at: AtRoundEnd) -> Quorum:
        """At round end `at.rounds`, before the launch (main thread, no pipeline in flight): this round's quorum.
        After a joined round end, the quorum `attach` met; after a cut exchange (this replica may be behind),
        the quorum now, where a live peer's state may arrive (the answer's `adopt`); else the checks and the
        state to serve for the quorum the exchange's worker asks for (`background_quorum`)."""
        self._at, self._served = at, dict(at.served)
        exchange = self.exchange
        exchange.take_round_end(at)
        if exchange.joined is not None:  # attach met this round end's quorum
            exchange.peers, exchange.joined = exchange.joined, None
            return Quorum()
        if exchange.cut:  # this replica may be behind: heal before the next round starts from the start point
            exchange.peers = self.open_round(at.rounds)
            received, self._received = self._received, None
            return Quorum(adopt=received)
        self.prepare_background_round(at.rounds)
        exchange.peers = None
        return Quorum()

    def before_final(self, at: AtRoundEnd) -> Quorum:
        """finalize()'s last quorum (`final_quorum`), before the exchange's last meeting in it: a live peer's
        state to adopt if this replica is behind (its final model is then the peer's)."""
        self._at, self._served = at, dict(at.served)
        self.exchange.at = at
        peers = self.final_quorum(at.rounds)
        received, self._received = self._received, None
        final = received if received is not None else at.served
        self.exchange.final = (peers._replace(contributes=False), final["next_start"])
        self._end_rounds = final["rounds"]
        return Quorum(adopt=received)

    # ---- membership, through torchft ------------------------------------------------------------------

    def _start_manager(self, topology: Topology) -> Any:
        torchft = _torchft()
        timeout = timedelta(seconds=self.timeout_s)
        try:
            manager = torchft.Manager(
                pg=torchft.process_group.ProcessGroupGloo(timeout=timeout),
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=self.min_replicas,
                use_async_quorum=False,  # heal before the round's exchange, never during it
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=topology.rank,
                world_size=topology.world_size,
                store_addr=self.store_addr or os.environ.get("MASTER_ADDR", "localhost"),
                store_port=self.store_port or int(os.environ["MASTER_PORT"]),
                lighthouse_addr=self.lighthouse,
                replica_id=str(self.replica_id),
                init_sync=True,  # at step 0 every replica takes the start point of one peer
            )
        except Exception as error:
            store = (
                f"{self.store_addr or os.environ.get('MASTER_ADDR')}:{self.store_port or os.environ.get('MASTER_PORT')}"
            )
            raise CO2Error(
                f"co2 elastic: replica {self.replica_id} could not start its torchft Manager within timeout_s="
                f"{self.timeout_s:g} (Lighthouse {self.lighthouse}, store {store}): {type(error).__name__}: {error}"
            ) from error
        manager._client = QuorumIds(manager._client)  # the quorum's replica group ids, kept for each round
        return quiet_torchft(manager)  # torchft's noise on CPU (quiet.py)

    def open_round(self, round_index: int) -> Peers:
        """The quorum for round `round_index`'s exchange, on the main thread at the round end. A replica
        that is behind (its last exchange was cut while its peers committed theirs) heals here."""
        self._check_replica_whole(round_index)
        self._round_in_place = round_index
        try:
            return self._quorum(round_index, joining=False)
        except CO2Error:  # the peers of this quorum must not wait for this replica in its average
            drop_group(self.manager._pg)
            raise
        finally:
            self._round_in_place = None

    def prepare_background_round(self, round_index: int) -> None:
        """At the round end, on the main thread: the checks and the state to serve for a quorum that
        `background_quorum` then asks for on the exchange's worker."""
        self._check_replica_whole(round_index)
        self._served = dict(self._at.served)

    def background_quorum(self, round_index: int) -> Peers:
        """The quorum for round `round_index`'s exchange, asked for by its pipeline while the next round
        computes: a lost peer's heartbeat timeout and a joiner's wait overlap training (design §12). Only
        after a committed round, when this replica is not behind; it still serves healing peers."""
        self._background_round = round_index
        try:
            return self._quorum(round_index, joining=False, serve_now=False)
        except CO2Error:  # the peers of this quorum must not wait for this replica in its average
            drop_group(self.manager._pg)
            raise
        finally:
            self._background_round = None

    def final_quorum(self, round_index: int) -> Peers:
        """finalize()'s last quorum. A replica that cut the last round while its peers committed it is a
        step behind them: it heals from a live peer here, as it would at the next round end if there
        were one, so that every replica ends with one model."""
        peers = self._quorum(round_index, joining=False, ending=True)  # finalize() checked every rank is here
        healed = self._received is not None  # handed to the engine by `before_final`
        if self.manager.errored():
            raise CO2Error(
                f"co2 elastic: finalize: replica {self.replica_id} could not take the final model from its peers "
                f"{list(peers.replicas)} ({self.manager.errored()}); its parameters may differ from theirs: load "
                f"the newest checkpoint, or take the parameters of a replica that finalized"
            )
        if not healed:
            self._check_not_left_behind(peers)
        return peers

    def _check_not_left_behind(self, peers: Peers) -> None:
        """A replica that cut its last exchange and meets no peer at the end cannot know the model the
        others of that round's quorum ended with (they may have committed it): refuse to end as if it
        held theirs. With a peer in the final quorum, torchft heals it when the peer committed more."""
        last = self.history[-1] if self.history else None
        others = [r for r in (last.replicas if last else ()) if r != self.replica_id]
        if last is None or last.committed or len(peers.replicas) > 1 or not others:
            return
        raise CO2Error(
            f"co2 elastic: finalize: replica {self.replica_id} cut its last exchange (round {last.round}) while "
            f"replicas {others} of that round's quorum may have committed it, and none of them was left in its "
            f"final quorum to heal it from: its model may differ from theirs. Take the final model of a replica "
            f"that finalized without an error, or load the newest checkpoint"
        )

    def end(self, peers: Peers, error: Optional[Exception]) -> None:
        """The vote on finalize()'s last meeting. This replica's model is final either way (it was not
        behind, or it healed in the quorum); a failed meeting only cost a peer that trains on its round.
        The job's end is then recorded on the Lighthouse, where a replica that comes back later reads it."""
        if not isinstance(error, ReplicaRefused):
            self._record_end(peers)
        if not self._vote(error):
            warnings.warn(
                f"co2 elastic: finalize: the last meeting with replicas {list(peers.replicas)} failed ({error}); "
                f"replica {self.replica_id} ends with its own model (it was not behind them, or healed in the quorum)",
                stacklevel=2,
            )

    def _record_end(self, peers: Peers) -> None:
        """Rank 0 of this replica records on the Lighthouse that its launch ended the job at this round end."""
        member = next((m for m in peers.members if replica_number(m) == str(self.replica_id)), None)
        if self.topology.rank == 0 and member is not None:
            record_end(self.lighthouse, member, self._end_rounds, self.timeout_s)

    def _check_replica_whole(self, round_index: int) -> None:
        """Every rank of this replica (S > 1) reached the round end, within timeout_s. The replica is the
        unit that fails: a lost rank takes it out here (the engine fails and stops the Manager), so the
        other replicas go on after the Lighthouse's heartbeat timeout instead of waiting for a replica
        that will never ask for the quorum. An agreement at this round end already (`replica_max`, the
        exchange's step counts with `replica_tau: "auto"`) is that check: one all-reduce, not two."""
        if self._whole_at != round_index:
            self.replica_max([0], round_index)

    def replica_max(self, values: Sequence[int], round_index: int) -> list[int]:
        """Each of `values` at its largest over every rank of this replica, on the main thread at round
        end `round_index`: one tiny all-reduce on the replica's control group, within timeout_s (a lost
        or stuck rank of the replica is a CO2Error naming the replica, `_check_replica_whole`)."""
        topology = self.topology
        if topology.world_size == 1:
            return list(values)
        probe = torch.tensor(values, dtype=torch.int64, device=collective_device(topology.control_group))
        try:
            work = dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=topology.control_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as error:
            raise CO2Error(
                f"co2 elastic: round {round_index}: not every rank of replica {self.replica_id} "
                f"({topology.world_size} ranks) reached the round end within timeout_s={self.timeout_s:g} "
                f"({type(error).__name__}: {error}); a rank of this replica died or is stuck, so the replica "
                f"leaves the job and the others go on: restart every rank of it to rejoin"
            ) from error
        self._whole_at = round_index
        return probe.tolist()

    def _quorum(self, round_index: int, joining: bool, serve_now: bool = True, ending: bool = False) -> Peers:
        """serve_now: a peer that heals from this replica gets its state as of now (main thread, between
        rounds); False: as `prepare_background_round` fixed it. ending: finalize()'s, where peers that
        ended are no loss."""
        if serve_now:
            self._served = dict(self._at.served)
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.timeout_s))
        except CO2Error:
            raise
        except Exception as error:
            raise CO2Error(
                f"co2 elastic: round {round_index}: replica {self.replica_id} got no quorum from the Lighthouse "
                f"{self.lighthouse} within timeout_s={self.timeout_s:g} ({type(error).__name__}: {error}); the "
                f"Lighthouse is down or unreachable, or fewer than min_replicas replicas are alive"
            ) from error
        if joining and self.manager.errored():
            raise CO2Error(f"co2 elastic: replica {self.replica_id} could not join the job: {self.manager.errored()}")
        group = self.manager._pg
        members = self.manager._client.last
        try:
            check_unique(members, round_index, self.replica_id)
        except CO2Error:
            drop_group(group)
            raise
        shards = self.topology.world_size
        replicas = tuple(rank // shards for rank in (group._global_ranks or [self.replica_id * shards]))
        if not joining and not ending:
            try:
                check_lost(self, round_index, lost=[m for m in self._members if m not in members], replicas=replicas)
            except CO2Error:
                drop_group(group)
                raise
        self.quorum, self._members = replicas, members
        return Peers(group, replicas, replicas.index(self.replica_id), contributes=True, members=members)

    def _vote(self, error: Optional[BaseException]) -> bool:
        """torchft's commit vote over this replica's ranks: True iff none of them failed."""
        if error is not None:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))
        return bool(self.manager.should_commit(timeout=timedelta(seconds=self.timeout_s)))

    def _record(self, record: RoundRecord) -> None:
        """Append a round to `history` and, when its quorum has another size than the previous round's, a
        line to `changes`: both from the same records (the background worker appends them in round order)."""
        previous = self.history[-1].replicas if self.history else None
        self.history.append(record)
        if previous is not None and len(previous) != len(record.replicas):
            self.changes.append(f"replicas {len(previous)} -> {len(record.replicas)} at round {record.round}")

    def settle(self, peers: Peers, round_index: int, contributors: Optional[tuple[int, ...]], error: Any) -> bool:
        """After the average (background worker): commit it, or cut the round on this replica."""
        committed = self._vote(error)
        weights = self.exchange.weights if contributors else None
        self._record(RoundRecord(round_index, peers.replicas, contributors, committed, weights))
        if not committed:
            warnings.warn(
                f"co2 elastic: round {round_index}: the exchange over replicas {list(peers.replicas)} was cut "
                f"({error or 'another rank of this replica failed'}); replica {self.replica_id} skips the round "
                f"(next start point = base, outer momentum unchanged)",
                stacklevel=2,
            )
        return committed

    # ---- healing: what a live peer sends a replica that is behind ------------------------------------

    def _state_dict(self) -> dict[str, Any]:
        """What a healing peer receives (torchft's quorum thread, inside this replica's quorum): the state
        fixed when the quorum was asked for (`AtRoundEnd.served`, or a peer's since). Copies: served later."""
        return {key: _copied(value) for key, value in self._served.items()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a live peer's state (main thread, inside start_quorum): the quorum's answer hands it to the
        engine, which adopts it (`RoundEngine.adopt`)."""
        if self._background_round is not None:
            raise CO2Error(
                f"co2 elastic: round {self._background_round}: replica {self.replica_id} is behind its peers (they "
                f"committed round(s) it did not take part in: it was left out of a quorum, e.g. it reached its "
                f"round end later than the Lighthouse's join timeout after them) while its next round was "
                f"already computing from its own start point; it leaves the job: restart it to rejoin from a "
                f"live peer"
            )
        if any(state.get(key) != self._served[key] for key in IDENTITY_FIELDS):
            return  # another config or model: the quorum's meeting names the fields on every replica
        self._check_in_step(state)
        self._received = state

    def _check_in_step(self, state: dict[str, Any]) -> None:
        """A heal at a round end on the main thread (its last exchange was cut) takes the peer's start
        point and outer state only when the peer is at the same round end: a peer whose counters are
        ahead committed rounds this replica never trained (it was frozen or stalled longer than
        timeout_s), and taking them would move the job's step, LR schedule and data position under its
        training loop."""
        at, round_index = self._at, self._round_in_place
        if round_index is None or (state["rounds"], state["inner_steps"]) == (at.rounds, at.inner_steps):
            return
        raise CO2Error(
            f"co2 elastic: round {round_index}: replica {self.replica_id} is behind its peers: they are at inner "
            f"step {state['inner_steps']} (round {state['rounds']}), it is at inner step {at.inner_steps} "
            f"(round {at.rounds}); they committed rounds it did not take part in (its exchange was cut, e.g. "
            f"it was frozen or stalled longer than timeout_s={self.timeout_s:g}). Taking their state would move "
            f"its step, learning-rate schedule and data position under its training loop, so it leaves the job: "
            f"restart it to rejoin from a live peer at the job's step"
        )

    def close(self) -> None:
        """Leave the job: stop the Manager (its heartbeats end; the others go on without us)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


def _copied(value: Any) -> Any:
    """`value` with its tensors (also in a list) cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return [_copied(v) for v in value] if isinstance(value, list) else value
