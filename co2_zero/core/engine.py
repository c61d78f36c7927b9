"""The round engine shared by every integration (docs/design.md §3).

An integration hands the engine its `Partition` (views of the live fp32 master parameters it owns) and a `refresh`
callback that spreads a rewritten partition to the rest of its replica. It then calls `inner_step_done()` after every
applied inner optimizer step; every `tau`-th call ends a round:

1. wait for the pipeline in flight (it produced the next start point),
2. D = start point - live parameters, computed in the retiring buffer; launch the pipeline on it,
3. live parameters <- next start point; refresh; the two partition buffers trade roles.

With a sync delay d < tau the average is applied d steps into the next round instead (the replica's progress since the
round start kept on top of it, `_apply_mid_round`); step 3 and that apply are the only writes of the live parameters.
`sync_delay: "auto"` measures d on the job first (`schedule.DelayMeter`) and switches the schedule once, at a round end.
What `overlap` and the sync delay change is decided in one place, `ApplySchedule`. The engine holds every tensor and
counter of the round in one `round_state.RoundState` and is its only owner (`state_owner`): others read values through
its properties and hand it whole states to `adopt` (a checkpoint's, or an elastic peer's that the membership hands back
before the launch: `core.membership`, asked, never calling back). Start-up lives in `startup`, the module
buffers in `buffers`, a stand-in's arithmetic in `stand_in`, the pipeline in flight (the lifecycle `Phase`, waits with a
deadline) in `in_flight`.
"""

from __future__ import annotations

import logging
import secrets
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from . import startup
from .buffers import ModuleBuffers
from .comm import OuterExchange, PipelineJob, largest_abs
from .config import CO2Config
from .errors import CO2Error, collective_error, inner_reset_warning, skipped_round_warning
from .in_flight import Phase, finished, result_watching_steps, shutdown
from .membership import AtRoundEnd, Membership, Quorum
from .pace_meter import fixed_message
from .parameter_order import StepAnnouncements, announcement_failure, steps_mismatch
from .partition import ParameterWatch, Partition
from .plan import resolve
from .round_schedule import RoundDecision
from .round_state import RoundState
from .schedule import RoundPlan
from .stand_in import StandIn
from .state_owner import RoundStateOwner
from .step_budget import dropped_steps_warning
from .topology import Topology

logger = logging.getLogger(__name__)


class RoundEngine(RoundStateOwner):
    """CO2's per-rank state and round ends. See the module docstring.

    `module` (optional): its float buffers are averaged over all ranks at every round end, and its parameters are
    watched (see `ParameterWatch`) together with `params` (the inner optimizer's). `membership` (optional,
    `co2_zero.elastic.Membership`, the seam `core.membership.Membership`): replicas that come and go; it makes the
    exchange (which averages over each round's quorum), joins the job (`attach`) and is asked at every round end
    before the launch; it answers with data (`Quorum`) (docs/design.md §12). `integration`: the adapter's
    name (`co2_zero.integration.Integration`), which the support table reads. The engine resolves its plan first
    (`co2_zero.core.plan`, `self.plan`): a combination the table refuses raises before any collective."""

    def __init__(
        self,
        partition: Partition,
        config: CO2Config,
        topology: Topology,
        refresh: Callable[[], None] = lambda: None,
        buffers: Sequence[torch.Tensor] = (),
        module: Optional[torch.nn.Module] = None,
        params: Sequence[torch.Tensor] = (),
        membership: Optional[Membership] = None,
        integration: str = "plain",
    ) -> None:
        partition.check_views()
        module_buffers = [*buffers, *(module.buffers() if module is not None else ())]
        float_buffers = len({id(b) for b in module_buffers if b.is_floating_point()})
        self.plan = resolve(config, topology, integration, membership is not None, float_buffers)
        config = self.plan.config  # with an elastic membership's rewrite
        self.config, self.topology, self.partition, self.refresh = config, topology, partition, refresh
        # the seconds the last round trained (its waits left out), for an exchange that measures speeds
        self.round_train_s, self._round_done_at = None, None
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
        self._at_exit = weakref.finalize(self, shutdown, self.exchange, topology, self.announcements)
        self.state = RoundState.allocate(partition, self.exchange, self.plan, topology.replica_index, device)
        self.stand_in = StandIn(self.plan, topology, self.exchange) if self.plan.stand_in != "shared" else None
        self.phase = Phase.IDLE
        self._pending: Optional[Future] = None
        self._pending_index = -1  # the round whose pipeline `_pending` runs
        self._announced_round = -1  # the round whose end posted the step announcement in flight
        self._mid_round_s = (0.0, 0.0)  # this round's apply point (sync delay): (blocked, in all)
        self._failure: Optional[CO2Error] = None
        self.last_round: dict[str, Any] = {}
        self._bytes_reported = 0  # of exchange.bytes_sent, already in some last_round
        self.finalize_bytes_sent = 0  # what finalize() sent: the last exchange (it waits for it), the buffers
        self.membership = membership
        if membership is not None:
            self._join(membership)

    def _join(self, membership: Membership) -> None:
        """Join the elastic job (`Membership.attach`): adopt the live peer's state it hands back and start from
        its next start point; joined at a running job's round end, take part in that round's exchange now. A
        replica without a run id draws one first: the heals spread the source's, so a job's replicas share one
        (its checkpoints', and the save directory's owner in co2-train)."""
        if self.run_id is None:
            self.name_run(secrets.token_hex(8))
        quorum = self._ask_membership(membership.attach)
        if quorum.adopt is not None:
            self.adopt(quorum.adopt, source="elastic heal")
            self.restart_from_next_start()
        if quorum.joined:
            self._round_end()

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
        """Stop the background worker and release the CO2 process groups (not the inner group, which the
        integration's framework keeps using). Also runs at interpreter exit. join_s: how long to wait for a busy
        worker to end; short by default, as a failed engine's worker may be stuck in a collective (an idle worker
        gets timeout_s: it ends as soon as it is scheduled). After `finalize()` the groups' last references go too,
        so their threads end now (docs/design.md §8); a failed engine keeps them open, as its peers may still be
        learning why (a closed connection would answer them with a bare "Connection closed by peer")."""
        shutdown = self._at_exit.detach()  # None: closed already
        if shutdown is not None:
            _, function, args, _ = shutdown
            function(*args, join_s=join_s, release=self.phase is Phase.FINALIZED)

    # ---- the round --------------------------------------------------------------------------------

    def inner_step_done(self) -> bool:
        """Count one applied inner step; end the round on every tau-th. Returns True if it did. With
        replica_tau "auto", the time until the next call is this rank's next step (`PaceMeter`)."""
        self.check_usable()
        meter = self.schedule.pace_meter
        if meter is not None:
            meter.step_ended()
        ended = self._count_inner_step()
        if meter is not None:
            meter.step_began(self.state.rounds)
        return ended

    def _count_inner_step(self) -> bool:
        state, schedule = self.state, self.schedule
        state.inner_steps += 1
        step_in_round = self.pace.step_in_round(self.topology.replica_index, state.inner_steps)
        if 0 < step_in_round < self.round_steps:
            if schedule.pace_meter is not None and schedule.pace_meter.decides_at(state.inner_steps):
                self._fix_pace(post=True)
            if schedule.delay_meter is not None and schedule.delay_meter.watching:  # some steps of rounds 2, 3 only
                schedule.delay_meter.saw(step_in_round, finished(self._pending))
            if state.average_unapplied and schedule.apply.applies_mid_round(state.inner_steps):
                self._apply_mid_round()
            return False
        if step_in_round:  # an elastic round of fewer steps counts as a whole one on the clock
            state.inner_steps += self.tau - step_in_round
        self._round_end()
        return True

    def _apply_mid_round(self) -> None:
        """Sync delay d < tau, d steps into round t+1: wait for pipeline t, then rebase the live parameters
        on x_{t+1} (`RoundState.apply_mid_round`)."""
        began = time.perf_counter()
        wait_s = self._wait_pending()
        self._track_applied_step()
        self._set_live(self.state.apply_mid_round(self.partition))
        self._mid_round_s = (wait_s, time.perf_counter() - began)

    def _round_end(self) -> None:
        """One round end, straight down: wait for the average in flight (step 1 of the module docstring),
        collect the step announcements, decide the round (its buffers and D; with a membership, its quorum),
        adopt a live peer's state if the membership hands one back, launch the exchange (step 2), apply the
        next start point and begin the next round (step 3), report (`last_round`)."""
        began = self._round_began()
        wait_s = self._wait_pending()  # wait: next_start now holds x_{t+1}
        if self.schedule.apply.steps == self.schedule.apply.tau:  # the average in flight is applied now
            self._track_applied_step()
        step_ns = self._collect_announcements()  # collect
        plan, decision = self.state.plan_round(), self.schedule.decision  # decide
        reset_inner = self._displacement(plan)
        quorum = self._ask_membership(self.membership.before_launch) if self.membership else Quorum()
        if quorum.adopt is not None:  # adopt: this replica was behind its peers
            self.adopt(quorum.adopt, source="elastic heal")
        sent = self._exchange_bytes_since_last_report()
        self._launch(plan, decision)  # launch
        self._schedule_after_launch(step_ns)
        if plan.wait_at_once:  # blocking: applied at once
            wait_s += self._wait_pending()
            sent += self._exchange_bytes_since_last_report()
        buffer_bytes, buffers_restored = self._apply(plan)  # apply
        self._report(began, wait_s, sent + buffer_bytes, reset_inner, buffers_restored)  # report

    def _round_began(self) -> float:
        """The round end's start time; the seconds the round trained (its waits left out); the parameters
        watched are unchanged."""
        began = time.perf_counter()
        self.round_train_s = None if self._round_done_at is None else began - self._round_done_at
        self._check_parameters_unchanged()
        return began

    def _collect_announcements(self) -> int:
        """Collect the last round end's step announcement (it arrived with its pipeline) and post this one's,
        with what the meters measured (the exchange's steps; the step time). Returns the step time posted."""
        self._check_steps()
        schedule = self.schedule
        measured = schedule.delay_meter.to_post() if schedule.delay_meter is not None else 0
        meter = schedule.pace_meter
        step_ns = meter.to_post(self.state.inner_steps) if meter is not None else 0
        self.announcements.post(self.state.inner_steps, False, exchange_steps=measured, step_ns=step_ns)
        self._announced_round = self.state.rounds
        return step_ns

    def _displacement(self, plan: RoundPlan) -> bool:
        """D = (this replica's round start) - x into `plan.work`; a stand-in: the next own start from D,
        before the pipeline consumes it. Returns whether this rank's own D is non-finite under "skip_round"
        (its inner state must then be reset)."""
        self.partition.subtract_from(self.state.round_start, out=plan.work)
        own = plan.work[: self.layout.length]
        reset_inner = self.config.nonfinite == "skip_round" and not bool(torch.isfinite(largest_abs(own)))
        if self.stand_in is not None:
            self.stand_in.next_start(self.state, plan, reset_inner)
        return reset_inner

    def _ask_membership(self, ask: Callable[[AtRoundEnd], Quorum]) -> Quorum:
        """The membership's answer (`core.membership`: attach, before_launch, before_final), asked with this
        replica's values: no quorum, or a lost rank of this replica, fails the engine."""
        state = self.state
        at = AtRoundEnd(state.rounds, state.inner_steps, self.round_steps, self.round_train_s, self.state_for_peer())
        try:
            return ask(at)
        except CO2Error as error:
            self._fail(error)

    def _launch(self, plan: RoundPlan, decision: RoundDecision) -> None:
        """Start the pipeline on D (IDLE -> IN_FLIGHT) under the round's `decision`, with the gap norms as of
        now (a heal brings its peer's)."""
        state = self.state
        gap = state.previous_update_sq_norms if plan.gap is not None else None
        job = PipelineJob(plan.work, plan.base, state.momentum, state.g_buffer, gap, state.rounds, decision)
        try:
            self._pending, self._pending_index = self.exchange.launch(job), state.rounds
        except CO2Error as error:
            self._fail(error)
        self.phase = Phase.IN_FLIGHT

    def _schedule_after_launch(self, step_ns: int) -> None:
        """What the schedule decides once the pipeline runs: sync_delay "auto" fixes its delay at the deciding
        round end; replica_tau "auto" its pace (with the step times just posted), or the ranks align for the
        round its meter times."""
        delay_warning = self.schedule.after_launch(self.state.rounds)
        if delay_warning is not None:  # sync_delay "auto" fixed the delay at tau
            warnings.warn(delay_warning, stacklevel=5)
        meter = self.schedule.pace_meter
        if step_ns:
            self._fix_pace()
        elif meter is not None and meter.aligns_at(self.state.inner_steps):
            self._check_steps()  # every replica starts the round the meter times together

    def _apply(self, plan: RoundPlan) -> tuple[int, bool]:
        """x <- the next start point (or this replica's stand-in; with a sync delay d < tau the average is
        applied d steps into the next round, `_apply_mid_round`), refresh; count the round and decide the
        next one; average the module buffers. Returns their bytes sent and whether they were restored."""
        apply = self.schedule.apply
        self.state.average_unapplied = 0 < apply.steps < apply.tau  # applied d steps into the next round
        if plan.swap:  # else the buffers trade roles at the apply point
            self.state.swap_buffers()
        self._set_live(self.state.round_start)
        self.state.rounds += 1
        self.schedule.start_round(self.state.rounds, self.exchange.steps_next_round)
        if self.buffers:  # a peer that finalized never averages them: learn it first
            self._check_steps()
        return self._average_buffers(f"round {self.state.rounds - 1}")

    def _report(self, began: float, wait_s: float, sent: int, reset_inner: bool, buffers_restored: bool) -> None:
        """`last_round`: what the round end that began at `began` waited, sent and did."""
        if reset_inner:
            where = f"global rank {self.topology.rank}, replica {self.exchange.replica_name}"
            warnings.warn(inner_reset_warning(self.state.rounds - 1, where), stacklevel=5)
        apply_wait_s, apply_s = self._mid_round_s  # with a sync delay, counted with this round end's
        self._mid_round_s = (0.0, 0.0)
        self.last_round = {
            "round": self.state.rounds - 1,
            "inner_step": self.state.inner_steps,
            "wait_s": wait_s + apply_wait_s,
            "round_end_s": time.perf_counter() - began + apply_s,
            "skipped_rounds": self.state.skipped_rounds,
            "inner_state_reset": reset_inner,
            "buffers_restored": buffers_restored,
            "bytes_sent": sent,
            **self.exchange.report(),  # payload_ratio, senders_per_sent
            "sync_delay": self.schedule.apply.steps,  # where the next average is applied (sync_delay "auto": fixed)
        }
        self._round_done_at = time.perf_counter()

    def _fix_pace(self, post: bool = False) -> None:
        """replica_tau "auto" at the deciding step (inside a round, `post`: this rank posts its own announcement):
        every rank's step time, collected within timeout_s, fixes the τ_r from a round (`PaceMeter.decide`)."""
        if post:
            self._check_steps()  # the last round end's: one announcement is in flight at a time
            step_ns = self.schedule.pace_meter.to_post(self.state.inner_steps)
            self.announcements.post(self.state.inner_steps, False, step_ns=step_ns)
            self._announced_round = self.state.rounds
        rows = self._check_steps()
        try:
            pace = self.schedule.pace_meter.decide(rows)
        except ValueError as error:  # a rank posted no time: it was not at the deciding step
            self._fail(CO2Error(f"co2: round {self.state.rounds}: {error}"))
        self.schedule.fix_pace(pace, self.state.rounds)  # inside a round: it ends at this τ_r if the pace has begun
        logger.info(fixed_message(pace, [row.step_ns for row in rows]))

    def _track_applied_step(self) -> None:
        """The average in flight is applied now: the stand-in follows it (`StandIn.track_applied_step`)."""
        if self.stand_in is not None:
            self.stand_in.track_applied_step(self.state, self.state.start_point, self.state.next_start)

    def _exchange_bytes_since_last_report(self) -> int:
        """Bytes this rank's finished pipelines sent since the last call (read with none in flight)."""
        sent, self._bytes_reported = self.exchange.bytes_sent - self._bytes_reported, self.exchange.bytes_sent
        return sent

    def finalize(self) -> None:
        """End training with one model on every rank (docs/design.md §3): the last start point produced.

        The ranks first agree that they took the same number of inner steps (a rank that took more would wait
        forever for a round its peers never run); otherwise every rank raises CO2Error naming the counts, also a
        rank that trained on past a round end (`agreement.StepAnnouncements`)."""
        self.check_usable()
        self._check_steps()
        self.announcements.post(self.state.inner_steps, finalizing=True)
        self._check_steps(finalizing=True)
        dropped = self.pace.step_in_round(self.topology.replica_index, self.state.inner_steps)
        if dropped:
            warnings.warn(dropped_steps_warning(dropped, self.state.inner_steps, self.tau), stacklevel=3)
        self._wait_pending()
        quorum = self._ask_membership(self.membership.before_final) if self.membership else Quorum()
        if quorum.adopt is not None:  # this replica cut its last round while its peers committed it
            self.adopt(quorum.adopt, source="elastic heal")
        try:
            self.exchange.agree_final(self.state.rounds)
        except CO2Error as error:
            self._fail(error)
        if self.state.average_unapplied:  # arrived before its apply point
            self.state.swap_buffers()
        self._set_live(self.schedule.apply.last_start(self.state.start_point, self.state.next_start))
        buffer_bytes, _ = self._average_buffers("finalize")
        self.finalize_bytes_sent = self._exchange_bytes_since_last_report() + buffer_bytes
        self.phase = Phase.FINALIZED
        self.close(join_s=self.config.timeout_s)

    def _check_steps(self, finalizing: bool = False) -> Optional[list[list[int]]]:
        """Collect the step announcement in flight (within timeout_s) and fail, naming every rank's
        count, if a peer finalized at another step (or this rank finalizes and a peer did not). Returns
        the rows collected (None: none was in flight)."""
        try:
            rows = self.announcements.collect(time.monotonic() + self.config.timeout_s)
        except CO2Error as error:  # the deadline passed, or the control group failed (a peer left)
            where = "co2 finalize" if finalizing else f"co2: round {self._announced_round}"
            failure = announcement_failure(error, where, self.topology, self.state.inner_steps, self.config.timeout_s)
            self._fail(failure, error)
        if rows is not None and self.schedule.delay_meter is not None:
            self.schedule.delay_meter.collected([row.exchange_steps for row in rows])
        steps, shards = self.state.inner_steps, self.topology.shards
        problem = None if rows is None else steps_mismatch(rows, self.topology.rank, steps, self.pace, shards)
        if problem is not None:
            self._fail(CO2Error(problem))
        return rows

    def _check_parameters_unchanged(self) -> None:
        """A change of requires_grad since construction is refused (see `ParameterWatch`)."""
        changes = self.watch.changes()
        if changes:
            self._fail(CO2Error(f"co2: round {self.state.rounds}: {self.watch.refusal(changes)}"))

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
            result, done = result_watching_steps(future, self.announcements, self.config.timeout_s, self._check_steps)
        except CO2Error as error:  # the pipeline's own verdict (NonFiniteError), or a peer's step count
            self._fail(error)
        except Exception as error:  # this wait's deadline, or the collective failed: a peer died or timed out
            what = f"round {round_index}: the background exchange on the {self.topology.describe_outer()}"
            self._fail(collective_error(what, error, self.config.timeout_s), error)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        if self.state.take_result(result):
            skipped = skipped_round_warning(round_index, result.skipped_replicas, self.state.skipped_rounds)
            warnings.warn(skipped, stacklevel=5)
        return time.perf_counter() - began
