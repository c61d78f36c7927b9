"""Elastic training: replicas that come and go while training goes on (docs/design.md §12).

Membership is torchft's: a Lighthouse keeps the quorum of replica groups, and one `torchft.Manager`
per replica heartbeats to it, forms a quorum at every round end, reconfigures a process group over
that quorum and heals a replica that is behind from a live peer. co2_zero runs no protocol of its
own. This module is the narrow seam between the two:

- `Membership.make_exchange` gives the engine an `ElasticExchange`, which averages each round's
  displacement over the replicas of that round's quorum (not a fixed outer group) and applies the
  result only if the Manager's commit vote says this replica's average is complete; otherwise the
  round is skipped exactly like `nonfinite: "skip_round"` (next start point = base).
- `Membership.attach` joins the job when the engine is built: at start-up every replica takes the
  start point of one peer; a replica that (re)joins a running job receives the start point and the
  outer state from a live peer and takes part in that round's exchange with a zero displacement.

Each replica group is its own launch: its ranks form the engine's world (R = 1 as far as the engine
knows), and the replicas meet only through the quorum's process group. The outer state is the
`all_reduce` strategy's: every replica keeps the whole partition's, so a lost replica takes nothing
with it and nothing needs re-cutting when R changes.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from .comm import Layout, OuterExchange, PipelineJob, RoundResult, choose_collective
from .config import CO2Config
from .errors import CO2Error, missing_extra
from .partition import local_values
from .topology import Topology, collective_device

if TYPE_CHECKING:  # pragma: no cover
    from .engine import RoundEngine


def _torchft() -> Any:
    """torchft, imported on first use: it is the optional extra `elastic`."""
    try:
        import torchft
        import torchft.process_group  # noqa: F401  (ProcessGroupGloo lives there)
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise missing_extra("torchft", "elastic", error) from error
    return torchft


class Peers(NamedTuple):
    """One round's quorum as this replica sees it."""

    group: Any  # the quorum's process group (torchft's, reconfigured by the Manager)
    replicas: tuple[int, ...]  # the replica ids of the quorum, in the group's rank order
    rank: int  # this replica's rank in the quorum
    contributes: bool  # False: joined at this round end; its displacement is not in the average


@dataclass
class RoundRecord:
    """What this replica saw of one round's exchange (`Membership.history`)."""

    round: int
    replicas: tuple[int, ...]  # the quorum
    contributors: Optional[tuple[int, ...]]  # replicas whose displacement was averaged (None: unknown, cut early)
    committed: bool  # False: the exchange was cut and every survivor skipped the round


class _CutExchange(Exception):
    """The round's average is incomplete on some rank of this replica: skip the round."""


class Membership:
    """This replica's membership in an elastic job (docs/design.md §12): pass it to `CO2Optimizer`.

    lighthouse: the Lighthouse's address (`http://host:port`, torchft's `torchft_lighthouse`).
    replica_id: this replica group's number (an integer, unique in the job; a restarted replica keeps
    its number). min_replicas: rounds with fewer replicas in the quorum are not committed.
    start_replicas: a job that starts (no replica has trained yet) waits, up to timeout_s, until this
    many replicas are in the quorum, so that they all start from round 0 together.
    store_addr/store_port: this launch's TCPStore (default: MASTER_ADDR/MASTER_PORT, as torchrun sets).
    """

    def __init__(
        self,
        lighthouse: str,
        replica_id: int,
        *,
        min_replicas: int = 1,
        start_replicas: int = 1,
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
        self.store_addr = store_addr
        self.store_port = store_port
        self.history: list[RoundRecord] = []
        self.changes: list[str] = []  # "replicas 3 -> 2 at round 17", one per change of the quorum
        self.quorum: tuple[int, ...] = ()  # the replica ids of the latest quorum (the job's R now)
        self.manager: Any = None
        self.exchange: Optional[ElasticExchange] = None
        self.engine: Optional[RoundEngine] = None
        self.timeout_s = 0.0
        self._received: Optional[int] = None  # inner_steps of the state a peer sent this replica

    # ---- the engine's seam ---------------------------------------------------------------------------

    def make_exchange(
        self, config: CO2Config, topology: Topology, layout: Layout, device: torch.device
    ) -> ElasticExchange:
        """The exchange of an elastic engine; starts this replica's torchft Manager."""
        _check_supported(config, topology)
        self.timeout_s = float(config.timeout_s)
        self.exchange = ElasticExchange(self, config, topology, layout, device)
        self.manager = self._start_manager(topology)
        return self.exchange

    def attach(self, engine: RoundEngine) -> bool:
        """Join the job (the first quorum). True: this replica joined a running job at a round end
        and must take part in that round's exchange now, with a zero displacement.

        At a job's start (no replica has trained) every replica takes the start point of one peer
        (torchft's init_sync), and the quorum is formed again until `start_replicas` are in it."""
        if engine.buffers:
            raise CO2Error(
                f"co2 elastic: the model has {len(engine.buffers)} float buffer(s) (e.g. BatchNorm statistics); "
                f"elastic mode does not average buffers across replicas yet: pass a model without float "
                f"buffers, or train without a membership"
            )
        self.engine = engine
        deadline = time.monotonic() + self.timeout_s
        while True:
            peers = self._quorum(round_index=0, joining=True)
            received, self._received = self._received, None
            if received is not None:  # live = the peer's start point (for a joiner: a zero displacement)
                engine.start_point.copy_(engine.next_start)
                engine.restart_from_start_point()
            if received:  # the job is running: take part in the exchange of the round that just ended
                self.exchange.joined = peers._replace(contributes=False)
                return True
            # The vote ends the serving of this quorum's heals: meet the others first (after their heal).
            if self._vote(error=_meet(peers)) and len(peers.replicas) >= self.start_replicas:
                return False
            if time.monotonic() > deadline:
                raise CO2Error(
                    f"co2 elastic: replica {self.replica_id}: only replicas {list(peers.replicas)} joined within "
                    f"timeout_s={self.timeout_s:g}; start_replicas={self.start_replicas} are needed to start"
                )
            time.sleep(0.05)

    # ---- membership, through torchft ------------------------------------------------------------------

    def _start_manager(self, topology: Topology) -> Any:
        torchft = _torchft()
        timeout = timedelta(seconds=self.timeout_s)
        try:
            return torchft.Manager(
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

    def open_round(self, round_index: int) -> Peers:
        """The quorum for round `round_index`'s exchange (main thread, at the round end). A replica that
        is behind (its last exchange was cut while its peers committed theirs) heals here."""
        self._check_replica_whole(round_index)
        return self._quorum(round_index, joining=False)

    def final_quorum(self, round_index: int) -> Peers:
        """finalize()'s last quorum. A replica that cut the last round while its peers committed it is a
        step behind them: it heals from a live peer here, as it would at the next round end if there
        were one, so that every replica ends with one model."""
        peers = self._quorum(round_index, joining=False)  # finalize() checked every rank of the replica is here
        self._received = None
        if self.manager.errored():
            raise CO2Error(
                f"co2 elastic: finalize: replica {self.replica_id} could not take the final model from its peers "
                f"{list(peers.replicas)} ({self.manager.errored()}); its parameters may differ from theirs: load "
                f"the newest checkpoint, or take the parameters of a replica that finalized"
            )
        return peers

    def end(self, peers: Peers, error: Optional[Exception]) -> None:
        """The vote on finalize()'s last meeting. This replica's model is final either way (it was not
        behind, or it healed in the quorum); a failed meeting only cost a peer that trains on its round."""
        if not self._vote(error):
            warnings.warn(
                f"co2 elastic: finalize: the last meeting with replicas {list(peers.replicas)} failed ({error}); "
                f"replica {self.replica_id} ends with its own model (it was not behind them, or healed in the quorum)",
                stacklevel=2,
            )

    def _check_replica_whole(self, round_index: int) -> None:
        """Every rank of this replica (S > 1) reached the round end, within timeout_s: one tiny all-reduce
        on the replica's control group. The replica is the unit that fails: a lost rank takes it out
        here (the engine fails and stops the Manager), so the other replicas go on after the Lighthouse's
        heartbeat timeout instead of waiting for a replica that will never ask for the quorum."""
        topology = self.engine.topology
        if topology.world_size == 1:
            return
        probe = torch.zeros(1, device=collective_device(topology.control_group))
        try:
            work = dist.all_reduce(probe, group=topology.control_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as error:
            raise CO2Error(
                f"co2 elastic: round {round_index}: not every rank of replica {self.replica_id} "
                f"({topology.world_size} ranks) reached the round end within timeout_s={self.timeout_s:g} "
                f"({type(error).__name__}: {error}); a rank of this replica died or is stuck, so the replica "
                f"leaves the job and the others go on: restart every rank of it to rejoin"
            ) from error

    def _quorum(self, round_index: int, joining: bool) -> Peers:
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.timeout_s))
        except Exception as error:
            raise CO2Error(
                f"co2 elastic: round {round_index}: replica {self.replica_id} got no quorum from the Lighthouse "
                f"{self.lighthouse} within timeout_s={self.timeout_s:g} ({type(error).__name__}: {error}); the "
                f"Lighthouse is down or unreachable, or fewer than min_replicas replicas are alive"
            ) from error
        if joining and self.manager.errored():
            raise CO2Error(f"co2 elastic: replica {self.replica_id} could not join the job: {self.manager.errored()}")
        group = self.manager._pg
        shards = self.engine.topology.world_size
        replicas = tuple(rank // shards for rank in (group._global_ranks or [self.replica_id * shards]))
        self.quorum = replicas
        return Peers(group, replicas, replicas.index(self.replica_id), contributes=True)

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
        self._record(RoundRecord(round_index, peers.replicas, contributors, committed))
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
        """The engine's state between two rounds (called on the sender's quorum thread while its main
        thread waits for the quorum and no exchange runs). Copies: the transport serves them later."""
        engine = self.engine
        norms = engine.previous_update_sq_norms
        return {
            "identity": _portable(engine.identity()),
            "next_start": engine.next_start.clone(),
            "momentum": engine.momentum.clone(),
            "previous_update_sq_norms": None if norms is None else norms.clone(),
            "rounds": engine.rounds,
            "inner_steps": engine.inner_steps,
            "skipped_rounds": engine.skipped_rounds,
            "frozen": [local_values(p).clone() for _, p in engine.watch.frozen],
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a live peer's state (main thread, inside start_quorum)."""
        engine = self.engine
        mine = _portable(engine.identity())
        for key, value in mine.items():
            if state["identity"].get(key) != value:
                raise CO2Error(
                    f"co2 elastic: replica {self.replica_id} cannot heal from its peer: {key}="
                    f"{state['identity'].get(key)!r} there, {value!r} here; every replica must run the same "
                    f"co2 config, model and number of ranks"
                )
        with torch.no_grad():
            engine.next_start.copy_(state["next_start"])
            engine.momentum.copy_(state["momentum"])
            for (_, p), value in zip(engine.watch.frozen, state["frozen"]):
                local_values(p).copy_(value)
        norms = state["previous_update_sq_norms"]
        engine.previous_update_sq_norms = None if norms is None else norms.to(engine.momentum.device)
        engine.rounds, engine.inner_steps = state["rounds"], state["inner_steps"]
        engine.skipped_rounds = state["skipped_rounds"]
        self._received = state["inner_steps"]

    def close(self) -> None:
        """Leave the job: stop the Manager (its heartbeats end; the others go on without us)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


class ElasticExchange(OuterExchange):
    """The outer exchange over each round's quorum (docs/design.md §12).

    Per round: the quorum (main thread, in `launch`); in the background, one small all-reduce of who
    contributes, the average of the contributors' displacements, the commit vote, then the outer
    step. A cut exchange leaves the base as the next start point and the outer state untouched.
    """

    def __init__(
        self, membership: Membership, config: CO2Config, topology: Topology, layout: Layout, device: torch.device
    ) -> None:
        super().__init__(config, topology, layout, device)
        self.membership = membership
        self.joined: Optional[Peers] = None  # the quorum `attach` joined, for the first round end
        self.peers: Optional[Peers] = None  # this round's; set before launch, read by the worker
        self.round_index = -1
        self.contributors: tuple[int, ...] = ()

    def launch(self, job: PipelineJob):
        peers, self.joined = self.joined or self.membership.open_round(job.round_index), None
        # A replica that healed in the quorum holds its peer's gap norms now.
        job = job._replace(previous_update_sq_norms=self.membership.engine.previous_update_sq_norms)
        self.peers, self.round_index = peers, job.round_index
        return super().launch(job)

    def outer_peers(self) -> tuple[Any, int]:
        return self.peers.group, len(self.contributors)

    def _pipeline(self, job: PipelineJob) -> RoundResult:
        try:
            return super()._pipeline(job)
        except _CutExchange:
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
            g = super()._average(work, g_buffer)
        except Exception as failure:  # a peer died or the group broke: the average is incomplete
            error = _collective_error(failure)
            _drop_group(peers.group)
        if not self.membership.settle(peers, self.round_index, self.contributors or None, error):
            raise _CutExchange()
        return g

    def _who_contributes(self, peers: Peers) -> tuple[int, ...]:
        """One small all-reduce over the quorum: which replicas' displacements are in the average."""
        flags = torch.zeros(len(peers.replicas), dtype=torch.float32)
        flags[peers.rank] = 1.0 if peers.contributes else 0.0
        dist.all_reduce(flags, group=peers.group)
        return tuple(r for r, flag in zip(peers.replicas, flags.tolist()) if flag > 0)

    def agree_final(self, round_index: int) -> None:
        """finalize(): the last quorum, met as a round end at which this replica contributes nothing. A
        peer that trains on (it stops later) runs its round's exchange in this quorum: this replica takes
        part in the average with a zero displacement, then keeps its own model."""
        peers = self.membership.final_quorum(round_index)._replace(contributes=False)
        error = None
        try:
            self.peers, self.contributors = peers, self._who_contributes(peers)
            if self.contributors:
                device = self.membership.engine.start_point.device
                super()._average(torch.zeros(self.layout.padded, device=device), None)
        except Exception as failure:
            error = _collective_error(failure)
            _drop_group(peers.group)
        self.membership.end(peers, error)

    def close(self) -> bool:
        closed = super().close()
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


def _drop_group(group: Any) -> None:
    """Close this replica's connections of a quorum group whose collective failed, at once: a peer
    still inside that collective then fails too (gloo: 'Connection closed by peer') instead of
    waiting out the group's timeout for data this replica will never send, while the Lighthouse
    waits for it (design §12). The failed commit makes the next quorum reconfigure the group."""
    try:
        group.abort()
    except Exception as error:  # pragma: no cover - torchft's abort only drops its reference
        warnings.warn(f"co2 elastic: could not abort the quorum's process group: {error}", stacklevel=2)


def _meet(peers: Peers) -> Optional[Exception]:
    """One tiny all-reduce over the quorum (every member arrives after its heal); the error, if any."""
    try:
        dist.all_reduce(torch.zeros(1), group=peers.group)
    except Exception as error:
        return error
    return None


def _check_supported(config: CO2Config, topology: Topology) -> None:
    """Elastic mode's limits, refused at construction with what is supported."""
    if topology.replicas != 1:
        raise CO2Error(
            f"co2 elastic: this launch holds {topology.replicas} replicas ({topology.world_size} ranks); in elastic "
            f"mode each replica group is its own launch (one torchrun per replica, its ranks the replica's shards): "
            f"plain CO2Optimizer needs one rank per launch, FSDP2 a mesh of every rank of the launch"
        )
    strategy = choose_collective(config, dist.get_backend(topology.outer_group))
    if strategy != "all_reduce" or config.comm_dtype not in ("fp32", "bf16"):
        raise CO2Error(
            f"co2 elastic: collective={config.collective!r} (resolved to {strategy!r}) with comm_dtype="
            f"{config.comm_dtype!r} is not supported; elastic mode needs collective='all_reduce' (every replica "
            f"keeps the whole partition's outer state, so a lost replica takes nothing with it) and comm_dtype "
            f"'fp32' or 'bf16'"
        )
    if not config.overlap:
        raise CO2Error("co2 elastic: overlap=False is not supported; elastic mode runs CO2's overlapped rounds")
    if config.eager:
        raise CO2Error(
            "co2 elastic: eager=True is not supported; accepted: eager=False (an eager replica's share is 1/R "
            "of an average whose contributors are only known inside each round's quorum, and a healing "
            "replica would need its own correction)"
        )


def _portable(identity: dict[str, Any]) -> dict[str, Any]:
    """The parts of an engine's identity a peer must share (the rank inside the replica included)."""
    return {key: identity[key] for key in ("version", "config_hash", "grid", "rank", "signature", "geometry")}
