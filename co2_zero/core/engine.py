"""The round engine shared by every integration (docs/design.md §3).

An integration hands the engine its `Partition` (views of the live fp32 master parameters it owns)
and a `refresh` callback that spreads a rewritten partition to the rest of its replica. It then calls
`inner_step_done()` after every applied inner optimizer step; every `tau`-th call ends a round:

1. wait for the pipeline in flight (it produced the next start point),
2. D = start point - live parameters, computed in the retiring buffer; launch the pipeline on it,
3. live parameters <- next start point; refresh; the two partition buffers trade roles.

With a sync delay d < tau the average is applied d steps into the next round instead (the
replica's progress since the round start kept on top of it, `_apply_mid_round`); step 3 and that
apply are the only writes of the live parameters. `sync_delay: "auto"` measures d on the job first
(`sync_delay.DelayMeter`) and switches the schedule once, at a round end. The engine's lifecycle is an explicit `Phase`;
what `overlap` and the sync delay change is decided in one place, `ApplySchedule`. Start-up lives in
`startup`, the module buffers in `buffers`, the state as plain data in `round_state`.
"""

from __future__ import annotations

import enum
import math
import time
import warnings
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from . import round_state, startup
from .buffers import ModuleBuffers
from .comm import OuterExchange, PipelineJob, largest_abs
from .config import CO2Config
from .errors import CO2Error, CO2TimeoutError, collective_error
from .outer import eager_start, local_start, track_momentum
from .parameter_order import StepAnnouncements, steps_mismatch
from .partition import ParameterWatch, Partition
from .plan import resolve
from .schedule import MARGIN, ApplySchedule, DelayMeter, RoundPlan
from .topology import Topology

_WATCH_S = 0.05  # how often a wait for the pipeline looks at the step announcements


class Phase(enum.Enum):
    """Where the engine is in its life. Round ends run from IDLE or IN_FLIGHT; the last two are final."""

    IDLE = "idle"  # no pipeline in flight (before the first round end, in blocking mode between rounds)
    IN_FLIGHT = "in flight"  # a pipeline runs round `pending_index` in the background
    FAILED = "failed"  # a wait, a collective or a check failed: the worker and groups are released
    FINALIZED = "finalized"  # finalize() gave every rank the same model


class RoundEngine:
    """CO2's per-rank state and round ends. See the module docstring.

    `module` (optional): its float buffers are averaged over all ranks at every round end, and its
    parameters are watched (see `ParameterWatch`) together with `params` (the inner optimizer's).
    `membership` (optional, `co2_zero.elastic.Membership`): replicas that come and go; it makes the
    exchange (which averages over each round's quorum) and, via `attach`, joins the job: True means
    this replica joined a running job at a round end and takes part in that round's exchange with a
    zero displacement (docs/design.md §12). `integration`: the adapter's name
    (`co2_zero.integration.Integration`), which the support table reads. The engine resolves its plan
    first (`co2_zero.core.plan`, `self.plan`): a combination the table refuses raises before any collective.
    """

    def __init__(
        self,
        partition: Partition,
        config: CO2Config,
        topology: Topology,
        refresh: Callable[[], None] = lambda: None,
        buffers: Sequence[torch.Tensor] = (),
        module: Optional[torch.nn.Module] = None,
        params: Sequence[torch.Tensor] = (),
        membership: Any = None,
        integration: str = "plain",
    ) -> None:
        partition.check_views()
        module_buffers = [*buffers, *(module.buffers() if module is not None else ())]
        float_buffers = len({id(b) for b in module_buffers if b.is_floating_point()})
        self.plan = resolve(config, topology, integration, membership is not None, float_buffers)
        config = self.plan.config  # with an elastic membership's rewrite
        self.config, self.topology, self.partition, self.refresh = config, topology, partition, refresh
        self.pace = self.plan.pace
        self.tau = self.pace.tau(topology.replica_index)  # this replica's inner steps per round
        self.schedule = ApplySchedule(min(self.plan.steps_before_apply, self.tau), self.tau)
        self.delay_meter = DelayMeter(config.tau) if self.plan.sync_delay == "measured" else None
        self.buffers = ModuleBuffers(module_buffers, topology, config)
        self.watch = ParameterWatch.collect(params, module)
        device = startup.state_device(partition, topology)
        self.layout = startup.layout_of(partition, topology.replicas)
        startup.check_agreement(partition, self.layout, topology, config)
        startup.common_start(partition, topology, refresh, self.watch, config.timeout_s)
        self.buffers.start_common()
        make_exchange = OuterExchange if membership is None else membership.make_exchange
        self.exchange = make_exchange(self.plan, topology, self.layout, device)
        self.announcements = StepAnnouncements(topology.control_group)
        self._at_exit = weakref.finalize(self, _shutdown, self.exchange, topology, self.announcements)
        self._allocate_state(device)
        self.phase = Phase.IDLE
        self._pending: Optional[Future] = None
        self._pending_index = -1  # the round whose pipeline `_pending` runs
        self._announced_round = -1  # the round whose end posted the step announcement in flight
        self._mid_round_s = (0.0, 0.0)  # this round's apply point (sync delay): (blocked, in all)
        self._failure: Optional[CO2Error] = None
        self.last_round: dict[str, Any] = {}
        self._bytes_reported = 0  # of exchange.bytes_sent, already in some last_round
        self.finalize_bytes_sent = 0  # what finalize() sent: the last exchange (it waits for it), the buffers
        if membership is not None and membership.attach(self):
            self._round_end()  # joined a running job at a round end: take part in its exchange

    def _allocate_state(self, device: torch.device) -> None:
        """The two partition buffers that trade roles every round (start point B; D, then Nx), the
        momentum on this rank's slice, and the counters."""
        self.start_point = torch.zeros(self.layout.padded, dtype=torch.float32, device=device)
        self.partition.gather_into(self.start_point)
        self.next_start = self.start_point.clone()
        self.momentum = torch.zeros(self.exchange.slice_length, dtype=torch.float32, device=device)
        reduce_scatter = self.exchange.strategy == "reduce_scatter"
        self.g_buffer = torch.zeros_like(self.momentum) if reduce_scatter else None
        # a stand-in (docs/design.md §3, "Stand-ins"): this replica's own round start, and (with outer
        # momentum) eager's momentum of its own shares, or local's copy of the outer momentum where that is
        # sharded (reduce_scatter; with all_reduce every rank holds it whole: `_momentum_for_local`)
        stand_in = self.config.effective_stand_in
        self.own_start = self.start_point.clone() if stand_in != "shared" else None
        keeps_copy = stand_in == "eager" or (stand_in == "local" and self.exchange.strategy == "reduce_scatter")
        self.own_momentum = torch.zeros_like(self.start_point) if keeps_copy and self.config.outer_momentum else None
        self.previous_update_sq_norms: Optional[torch.Tensor] = None
        self.inner_steps = 0
        self.rounds = 0
        self.skipped_rounds = 0  # rounds whose outer update was skipped (nonfinite: "skip_round")
        self._applied_was_skipped = False  # the last pipeline's update was skipped: nothing to track
        # a sync delay d < tau: the average launched at the last round end is still to be applied, d steps into
        # this round (set at round ends, cleared at the apply point; a state without a next start has none)
        self.average_unapplied = False
        self.run_id: Optional[str] = None  # set by the first checkpoint saved or loaded

    # ---- the lifecycle, as read by integrations and checkpoints -------------------------------------------

    @property
    def pending_round(self) -> Optional[Future]:
        """The pipeline in flight (its future), or None."""
        return self._pending if self.phase is Phase.IN_FLIGHT else None

    @property
    def failed(self) -> Optional[CO2Error]:
        """The error this engine failed with, or None."""
        return self._failure

    @property
    def finalized(self) -> bool:
        return self.phase is Phase.FINALIZED

    def check_usable(self) -> None:
        """Raise CO2Error if this engine failed or was finalized."""
        if self.phase is Phase.FAILED:
            raise CO2Error(f"co2: this optimizer already failed and cannot continue: {self._failure}")
        if self.phase is Phase.FINALIZED:
            raise CO2Error("co2: finalize() ended training; build a new CO2 optimizer to train again")

    def _fail(self, error: CO2Error, cause: Optional[BaseException] = None) -> NoReturn:
        """Enter FAILED: record `error`, release the worker and groups, raise it (from `cause`, else
        from the cause it already carries)."""
        self._failure, self.phase = error, Phase.FAILED
        self.close()
        raise error from (cause if cause is not None else error.__cause__)

    def close(self, join_s: float = 1.0) -> None:
        """Stop the background worker and release the CO2 process groups (not the inner group,
        which the integration's framework keeps using). Also runs at interpreter exit. join_s: how
        long to wait for a busy worker to end; short by default, as a failed engine's worker may be stuck
        in a collective (an idle worker gets timeout_s: it ends as soon as it is scheduled). After
        `finalize()` the groups' last references go too, so their threads end now (docs/design.md §8);
        a failed engine keeps them open, as its peers may still be learning why (a closed connection
        would answer them with a bare "Connection closed by peer")."""
        shutdown = self._at_exit.detach()  # None: closed already
        if shutdown is not None:
            _, function, args, _ = shutdown
            function(*args, join_s=join_s, release=self.phase is Phase.FINALIZED)

    # ---- the round --------------------------------------------------------------------------------

    def inner_step_done(self) -> bool:
        """Count one applied inner step; end the round on every tau-th. Returns True if it did."""
        self.check_usable()
        self.inner_steps += 1
        if self.inner_steps % self.tau:
            if self.delay_meter is not None and self.delay_meter.watching:  # a few steps of rounds 2 and 3 only
                self.delay_meter.saw(self.inner_steps % self.tau, _finished(self._pending))
            if self.average_unapplied and self.schedule.applies_mid_round(self.inner_steps):
                self._apply_mid_round()
            return False
        self._round_end()
        return True

    def _apply_mid_round(self) -> None:
        """Sync delay d < tau, d steps into round t+1: wait for pipeline t and rebase, live x <- x + (x_{t+1}
        - y), y being where this replica's round started (the shared start, or its stand-in), so the d
        steps' progress is kept on top of the new start point; the buffers trade roles. The retiring start
        point is the scratch buffer; with a stand-in, y becomes the new shared start (it is spent)."""
        began = time.perf_counter()
        wait_s = self._wait_pending()
        self._track_applied_step(self.start_point, self.next_start)
        retiring = self.start_point
        self.partition.subtract_from(self.round_start, out=retiring)  # y - x
        torch.sub(self.next_start, retiring, out=retiring)  # x_{t+1} - y + x
        self.start_point, self.next_start = self.next_start, retiring
        self._set_live(retiring)
        if self.own_start is not None:
            self.own_start.copy_(self.start_point)
        self.average_unapplied = False
        self._mid_round_s = (wait_s, time.perf_counter() - began)

    def _round_end(self) -> None:
        """Steps 1-3 of the module docstring, then the module buffers; fills `last_round`."""
        began = time.perf_counter()
        self._check_parameters_unchanged()
        wait_s = self._wait_pending()  # step 1: next_start now holds x_{t+1}
        if self.schedule.steps == self.tau:  # the average in flight is applied at this round end
            self._track_applied_step(self.start_point, self.next_start)
        self._check_steps()  # the last round end's (arrived with its pipeline)
        measured = self.delay_meter.to_post() if self.delay_meter is not None else 0
        self.announcements.post(self.inner_steps, finalizing=False, exchange_steps=measured)
        self._announced_round = self.rounds
        sent = self._exchange_bytes_since_last_report()
        plan = self.schedule.plan(self.start_point, self.next_start, self.previous_update_sq_norms)
        reset_inner = self._launch(plan)  # step 2
        if self.delay_meter is not None:
            self._follow_delay_meter()
        self.average_unapplied = 0 < self.schedule.steps < self.tau  # applied d steps into the next round
        if plan.wait_at_once:
            wait_s += self._wait_pending()
            sent += self._exchange_bytes_since_last_report()
        if plan.swap:  # else the buffers trade roles at the apply point (`_apply_mid_round`)
            self.start_point, self.next_start = self.next_start, self.start_point
        self._set_live(self.round_start)  # step 3: x <- Nx (or this replica's stand-in); refresh
        self.rounds += 1
        if self.buffers:  # a peer that finalized never averages them: learn it first
            self._check_steps()
        buffer_bytes, buffers_restored = self._average_buffers(f"round {self.rounds - 1}")
        if reset_inner:
            self._warn_inner_reset()
        apply_wait_s, apply_s = self._mid_round_s  # with a sync delay, counted with this round end's
        self._mid_round_s = (0.0, 0.0)
        self.last_round = {
            "round": self.rounds - 1,
            "inner_step": self.inner_steps,
            "wait_s": wait_s + apply_wait_s,
            "round_end_s": time.perf_counter() - began + apply_s,
            "skipped_rounds": self.skipped_rounds,
            "inner_state_reset": reset_inner,
            "buffers_restored": buffers_restored,
            "bytes_sent": sent + buffer_bytes,
            "sync_delay": self.schedule.steps,  # where the next average is applied (sync_delay "auto": fixed)
        }

    def _follow_delay_meter(self) -> None:
        """sync_delay "auto", after a launch: note the pipeline; at the deciding round end, switch to the
        fixed delay. The pipeline just launched is then the last applied at a round end; the next launch
        (none in flight: applied mid-round) sets the gap's staleness to the new schedule's."""
        self.delay_meter.launched(self.rounds)
        delay = self.delay_meter.fixed_after_launch(self.rounds)
        if delay is None:
            return
        self.schedule = ApplySchedule(delay, self.config.tau)
        if delay == self.config.tau:
            warnings.warn(
                f"co2: sync_delay 'auto': the exchange took {self.delay_meter.most_steps} of tau={self.config.tau} "
                f"inner steps on the slowest rank (at least that many: the round end waited), so every average "
                f"stays a whole round late, as with sync_delay null. A tau of at least "
                f"{math.ceil(MARGIN * self.delay_meter.most_steps) + 1} would let it apply earlier, and one "
                f"above the exchange's steps keeps the round end from waiting (docs/configuration.md)",
                stacklevel=5,
            )

    def _launch(self, plan: RoundPlan) -> bool:
        """D = (this replica's round start) - x into `plan.work`; a stand-in: the next own start from D,
        before the pipeline consumes it; start the pipeline (IDLE -> IN_FLIGHT). Returns whether this rank's
        own D is non-finite under "skip_round" (its inner state must then be reset)."""
        self.exchange.set_staleness(self.schedule.steps / self.tau)
        self.partition.subtract_from(self.round_start, out=plan.work)
        reset_inner = self.config.nonfinite == "skip_round" and not _all_finite(plan.work[: self.layout.length])
        hyper = self.exchange.hyper
        if self.config.effective_stand_in == "eager":
            replicas = self.topology.replicas
            eager_start(plan.work, plan.base, self.own_momentum, hyper=hyper, replicas=replicas, out=self.own_start)
        elif self.config.effective_stand_in == "local" and self._replica_is_nonfinite(reset_inner):
            self.own_start.copy_(plan.base)  # the round will be skipped everywhere: its true next start
        elif self.config.effective_stand_in == "local":
            local_start(plan.work, plan.base, self._momentum_for_local, hyper=hyper, out=self.own_start,
                        sum_over_replica=self._sum_over_replica)  # fmt: skip
        job = PipelineJob(plan.work, plan.base, self.momentum, self.g_buffer, plan.gap, self.rounds)
        try:
            self._pending, self._pending_index = self.exchange.launch(job), self.rounds
        except CO2Error as error:  # elastic: no quorum, or a rank of this replica is lost
            self._fail(error)
        self.phase = Phase.IN_FLIGHT
        return reset_inner

    def _warn_inner_reset(self) -> None:
        warnings.warn(
            f"co2: round {self.rounds - 1}: this rank's displacement (global rank {self.topology.rank}, "
            f"replica {self.exchange.replica_name}) holds NaN or Inf; its inner optimizer state is reset "
            f"and it restarts from the agreed start point (nonfinite='skip_round')",
            stacklevel=5,
        )

    def _track_applied_step(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """The `local` stand-in's copy of the outer momentum follows each outer step applied to the shared
        start (`outer.track_momentum`); before the first round end nothing was applied (before == after), and
        a skipped round (nonfinite: "skip_round") left the momentum as it was."""
        if self._applied_was_skipped:
            return
        if self.config.effective_stand_in == "local" and self.own_momentum is not None and self.rounds:
            track_momentum(self.own_momentum, before, after, hyper=self.exchange.hyper)

    def _replica_is_nonfinite(self, mine: bool) -> bool:
        """Whether any rank of this replica holds a non-finite displacement ("skip_round" only; `mine`: this
        rank's): then its round is skipped everywhere, and every shard of the replica, agreeing, starts the
        next round from the shared start (none takes the stand-in's collectives without the others)."""
        if self.config.nonfinite != "skip_round":
            return False
        flag = torch.tensor([float(mine)], dtype=torch.float64, device=self.start_point.device)
        return bool(self._sum_over_replica(flag).item() > 0)

    def _sum_over_replica(self, partial: torch.Tensor) -> torch.Tensor:
        """`partial` summed over this replica's shards (its inner group), within timeout_s: the local
        stand-in's norm clip over the replica's whole model, and its non-finite flags."""
        if self.topology.shards == 1:
            return partial
        try:
            work = dist.all_reduce(partial, group=self.topology.inner_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.config.timeout_s))
        except Exception as error:
            ranks = list(self.topology.inner_ranks)
            what = f"round {self.rounds}: the local stand-in's sum over its replica (global ranks {ranks})"
            raise collective_error(what, error, self.config.timeout_s) from error
        return partial

    @property
    def _momentum_for_local(self) -> Optional[torch.Tensor]:
        """The outer momentum as of the shared start, over this rank's whole partition, for the `local`
        stand-in: the momentum itself with all_reduce (so a skipped round or a healed replica needs
        nothing more), else the copy that follows the applied steps; None when β = 0."""
        if not self.config.outer_momentum:
            return None
        return self.momentum if self.own_momentum is None else self.own_momentum

    @property
    def agreed_step(self) -> int:
        """The step the ranks agree on to save (`Pace.agreed_step`): the inner steps, unless replica_tau."""
        return self.pace.agreed_step(self.topology.replica_index, self.inner_steps)

    @property
    def round_start(self) -> torch.Tensor:
        """Where this replica's current round started: the shared start point B, or its stand-in until the
        average in flight is applied (docs/design.md §3)."""
        return self.start_point if self.own_start is None else self.own_start

    def _exchange_bytes_since_last_report(self) -> int:
        """Bytes this rank's finished pipelines sent since the last call (read with none in flight)."""
        sent, self._bytes_reported = self.exchange.bytes_sent - self._bytes_reported, self.exchange.bytes_sent
        return sent

    def finalize(self) -> None:
        """End training with one model on every rank (docs/design.md §3): the last start point produced.

        The ranks first agree that they took the same number of inner steps (a rank that took more
        would wait forever for a round its peers never run); otherwise every rank raises CO2Error
        naming the counts, also a rank that trained on past a round end (`agreement.StepAnnouncements`).
        """
        self.check_usable()
        self._check_steps()
        self.announcements.post(self.inner_steps, finalizing=True)
        self._check_steps(finalizing=True)
        dropped = self.inner_steps % self.tau
        if dropped:
            where = "start point" if self.rounds else f"model it started from: no round ended (tau={self.tau})"
            warnings.warn(
                f"co2 finalize: the {dropped} inner step(s) since the last round end (step "
                f"{self.inner_steps - dropped}) are dropped; every rank returns to the {where}. Train whole rounds: "
                f"a number of steps that tau divides",
                stacklevel=3,
            )
        self._wait_pending()
        try:
            self.exchange.agree_final(self.rounds)
        except CO2Error as error:
            self._fail(error)
        if self.average_unapplied:  # arrived before its apply point
            self.start_point, self.next_start = self.next_start, self.start_point
        self._set_live(self.schedule.last_start(self.start_point, self.next_start))
        buffer_bytes, _ = self._average_buffers("finalize")
        self.finalize_bytes_sent = self._exchange_bytes_since_last_report() + buffer_bytes
        self.phase = Phase.FINALIZED
        self.close(join_s=self.config.timeout_s)

    def _check_steps(self, finalizing: bool = False) -> None:
        """Collect the step announcement in flight (within timeout_s) and fail, naming every rank's
        count, if a peer finalized at another step (or this rank finalizes and a peer did not)."""
        try:
            rows = self.announcements.collect(time.monotonic() + self.config.timeout_s)
        except CO2Error as error:  # the deadline passed, or the control group failed (a peer left)
            where = "co2 finalize" if finalizing else f"co2: round {self._announced_round}"
            here = f"rank {self.topology.rank} at inner step {self.inner_steps}"
            if isinstance(error, CO2TimeoutError):
                what = "called finalize()" if finalizing else "reached this round end"
                failure: CO2Error = CO2TimeoutError(
                    f"{where}: not every rank of the {self.topology.describe_control()} {what} within timeout_s="
                    f"{self.config.timeout_s:g} ({here}); a rank died, is stuck"
                    f"{', or skipped finalize()' if finalizing else ''}"
                )
            else:
                failure = CO2Error(
                    f"{where}: the step announcement on the {self.topology.describe_control()} failed ({here}): "
                    f"{error}; a rank died or left"
                )
            self._fail(failure, error)
        if rows is not None and self.delay_meter is not None:
            self.delay_meter.collected([row[2] for row in rows])
        taus = self.pace.taus_by_rank(self.topology.shards)
        problem = None if rows is None else steps_mismatch(rows, self.topology.rank, self.inner_steps, taus)
        if problem is not None:
            self._fail(CO2Error(problem))

    def _check_parameters_unchanged(self) -> None:
        """A change of requires_grad since construction is refused (see `ParameterWatch`)."""
        changes = self.watch.changes()
        if changes:
            self._fail(
                CO2Error(
                    f"co2: round {self.rounds}: {'; '.join(changes)} since the CO2 optimizer was built. The CO2 "
                    f"partition and the set of frozen parameters cannot change during training: save a "
                    f"checkpoint, change requires_grad, build a new optimizer and load it with reshard=True"
                )
            )

    def _average_buffers(self, where: str) -> tuple[int, bool]:
        """`ModuleBuffers.average`; its failure (a collective, or non-finite buffers under "raise")
        fails the engine."""
        try:
            return self.buffers.average(where)
        except CO2Error as error:
            self._fail(error)

    def _set_live(self, flat: torch.Tensor) -> None:
        """live partition <- flat, then let the integration spread it over its replica."""
        self.partition.write_from(flat)
        self.refresh()

    # ---- waiting with a deadline ---------------------------------------------------------------------

    def _wait_pending(self) -> float:
        """Wait for the pipeline in flight, if any (IN_FLIGHT -> IDLE, or FAILED); returns the
        seconds spent blocked."""
        if self.phase is not Phase.IN_FLIGHT:
            return 0.0
        began = time.perf_counter()
        future, round_index = self._pending, self._pending_index
        self._pending, self.phase = None, Phase.IDLE
        try:
            result, done = self._result_watching_steps(future)
        except CO2Error as error:  # the pipeline's own verdict (NonFiniteError), or a peer's step count
            self._fail(error)
        except Exception as error:  # this wait's deadline, or the collective failed: a peer died or timed out
            what = f"round {round_index}: the background exchange on the {self.topology.describe_outer()}"
            self._fail(collective_error(what, error, self.config.timeout_s), error)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.previous_update_sq_norms = result.update_sq_norms
        self._applied_was_skipped = result.skipped_replicas is not None
        if result.skipped_replicas is not None:
            self.skipped_rounds += 1
            warnings.warn(
                f"co2: round {round_index}: the displacement of replica(s) {result.skipped_replicas} held NaN "
                f"or Inf; the round's outer update was skipped on every replica (skipped_rounds="
                f"{self.skipped_rounds}). Every replica restarts from the agreed start point; a rank whose own "
                f"displacement was non-finite reset its inner optimizer state",
                stacklevel=5,
            )
        return time.perf_counter() - began

    def _result_watching_steps(self, future: Future) -> Any:
        """The pipeline's result within timeout_s; meanwhile, a step announcement that arrives is
        checked: a peer that called finalize() will never run this round, so report the counts now."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            if self.announcements.ready():
                self._check_steps()
            try:
                return future.result(timeout=min(_WATCH_S, max(deadline - time.monotonic(), 0.0)))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    raise

    # ---- state (engine_state: plain containers and tensors) ------------------------------------------

    def geometry(self) -> dict[str, Any]:
        """See `round_state.geometry`."""
        return round_state.geometry(self)

    def identity(self) -> dict[str, Any]:
        """What a state must agree on to be loaded here (`round_state.identity`)."""
        return round_state.identity(self)

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state. Waits for the round in flight so its result is included. Tensors are
        live references (as in `torch.optim.Optimizer.state_dict()`): save or copy them before the next
        step."""
        self.check_usable()
        self._wait_pending()
        return round_state.state_dict(self)

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError naming the first field of `state` that does not fit this engine (same
        config, topology, model and partition); changes nothing."""
        round_state.check_state_dict(self, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved on this same rank of the same topology and config. Checks
        everything first (`check_state_dict`): a refused state changes nothing."""
        self.check_usable()
        self.check_state_dict(state)
        self._wait_pending()
        round_state.load_state_dict(self, state)

    def restart_round(self) -> None:
        """Set the live parameters to where this replica's round starts (`round_start`: its stand-in when
        the loaded state carried one, else the shared start) and refresh the replica: a resharded state
        resumes at the saved run's last round start."""
        self.check_usable()
        self._set_live(self.round_start)

    def restart_from_start_point(self) -> None:
        """Set the live parameters, and a stand-in, to the current shared start point (an elastic replica
        that took the shared state from a peer) and refresh the replica."""
        self.check_usable()
        if self.own_start is not None:  # a stand-in: this replica has trained nothing since
            self.own_start.copy_(self.start_point)
        self._set_live(self.start_point)

    def state_bytes(self) -> int:
        """Bytes of CO2 state this rank holds (docs/design.md §4: 2Ψ/S + 2Ψ/N fp32 words with
        reduce_scatter, 3Ψ/S with all_reduce, plus one float64 norm per tensor), and the outer step's segment
        index (`outer.SegmentIndex`, about 2·√(elements · segments) ids); int8/fp8 add the error-feedback
        residuals, Ψ/S + Ψ/N; a stand-in its own start and momentum, up to 2Ψ/S."""
        tensors = [self.start_point, self.next_start, self.momentum, self.g_buffer, self.previous_update_sq_norms]
        tensors += [self.own_start, self.own_momentum]
        tensors += list(self.exchange.residuals or ())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + self.exchange.index_bytes


def _finished(pending: Optional[Future]) -> bool:
    """Whether a pipeline has finished, on the device too (its CUDA event), without blocking: the
    worker returns once its kernels are queued. None (waited for already) counts as finished; a failed
    one too (its wait reports it)."""
    if pending is None:
        return True
    if not pending.done():
        return False
    if pending.exception() is not None:
        return True
    _, done = pending.result()
    return done is None or done.query()


def _all_finite(flat: torch.Tensor) -> bool:
    return bool(torch.isfinite(largest_abs(flat)))


def _shutdown(
    exchange: OuterExchange,
    topology: Topology,
    announcements: StepAnnouncements,
    join_s: float = 1.0,
    release: bool = False,
) -> None:
    # A worker still blocked in a collective keeps its groups: destroying them under it would crash.
    # So does a step announcement a peer never answered (it is a collective on the control group).
    if exchange.close(join_s) and not (announcements.in_flight and not announcements.ready()):
        if release:
            announcements.release()
        topology.destroy(release=release)
