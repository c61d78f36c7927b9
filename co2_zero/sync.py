"""The round state machine shared by every integration (docs/design.md §3).

An integration hands the engine its `Partition` (views of the live fp32 master parameters it owns)
and a `refresh` callback that spreads a rewritten partition to the rest of its replica. It then calls
`inner_step_done()` after every applied inner optimizer step; every `tau`-th call ends a round:

1. wait for the pipeline in flight (it produced the next start point),
2. D = start point - live parameters, computed in the retiring buffer; launch the pipeline on it,
3. live parameters <- next start point; refresh; the two partition buffers trade roles.

Only step 3 ever writes the live parameters. The engine's state (`state_dict()`) is plain containers
and tensors; files, agreement and resharding are `co2_zero.checkpoint`'s business.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .agreement import StepAnnouncements, TensorIdentity, agree_on_parameters, steps_mismatch
from .comm import Layout, OuterExchange, PipelineJob, largest_abs, wire_bytes
from .config import CO2Config
from .errors import CO2Error, CO2TimeoutError, NonFiniteError, collective_error
from .outer import Segment
from .topology import Topology, collective_device, fingerprint, gather_fingerprints

STATE_VERSION = 2
_WATCH_S = 0.05  # how often a wait for the pipeline looks at the step announcements


@dataclass
class Partition:
    """This rank's share of the live fp32 master parameters, as the integration found it.

    chunks: 1-D fp32 views of the live parameters, in partition order (one per ZeRO param group, or
    one flat buffer). segments: which global parameter tensor each piece of the concatenated chunks
    belongs to. num_tensors: parameter tensors in the whole model. tensors: the identity (name, shape)
    of each tensor id, which every rank must share (`agreement.agree_on_parameters`); empty: unnamed.
    """

    chunks: list[torch.Tensor]
    segments: Sequence[Segment]
    num_tensors: int
    signature: str  # parameter_signature() of the whole model (checkpoints carry it)
    tensors: Sequence[TensorIdentity] = ()

    @property
    def length(self) -> int:
        return sum(c.numel() for c in self.chunks)


def _state_device(partition: Partition, topology: Topology) -> torch.device:
    """Where the CO2 state lives: with the partition, whose collectives run on the outer group.

    An empty partition takes the outer group's collective device. NCCL takes tensors on this rank's
    CUDA device only, so a partition elsewhere (e.g. DeepSpeed's optimizer CPU offload) is refused
    here, naming the devices, instead of failing in the first collective.
    """
    wanted = collective_device(topology.outer_group)
    if not partition.chunks:
        return wanted
    device = partition.chunks[0].device
    if wanted.type == "cuda" and device != wanted:
        raise CO2Error(
            f"co2: the fp32 master partition is on {device}, but the CO2 process groups use the "
            f"{dist.get_backend(topology.outer_group)} backend, whose collectives need tensors on {wanted}; "
            f"keep the master parameters on this rank's GPU (no optimizer CPU offload) and call "
            f"torch.cuda.set_device(local_rank) before building the optimizer"
        )
    return device


class ParameterWatch:
    """The model's parameters as they were when the CO2 optimizer was built.

    Frozen parameters (requires_grad=False) are outside every partition, so CO2 never averages them:
    the engine broadcasts them from rank 0 at start-up and they stay identical as long as nobody
    writes them. Freezing or unfreezing a parameter later would change the partition (or train a
    tensor no replica averages), so a change of requires_grad is refused at the next round end.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.named = list(named)
        self.flags = [p.requires_grad for _, p in self.named]

    @classmethod
    def collect(cls, params: Sequence[torch.Tensor], module: Optional[torch.nn.Module]) -> ParameterWatch:
        """The module's named parameters, then those of `params` the module does not hold (deduplicated)."""
        named: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for name, p in module.named_parameters() if module is not None else ():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        for i, p in enumerate(params):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((f"inner optimizer parameter {i}", p))
        return cls(named)

    @property
    def frozen(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for (name, p), trainable in zip(self.named, self.flags) if not trainable]

    def changes(self) -> list[str]:
        """One phrase per parameter whose requires_grad differs from construction time."""
        return [
            f"{name} (shape {tuple(p.shape)}) was {'trainable' if was else 'frozen'} and is now "
            f"{'trainable' if p.requires_grad else 'frozen'}"
            for (name, p), was in zip(self.named, self.flags)
            if p.requires_grad != was
        ]


class RoundEngine:
    """CO2's per-rank state and round ends. See the module docstring.

    `module` (optional): its float buffers are averaged over all ranks at every round end, and its
    parameters are watched (see `ParameterWatch`) together with `params` (the inner optimizer's).
    `membership` (optional, `co2_zero.elastic.Membership`): replicas that come and go; it makes the
    exchange (which averages over each round's quorum) and, via `attach`, joins the job: True means
    this replica joined a running job at a round end and takes part in that round's exchange with a
    zero displacement (docs/design.md §12).
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
    ) -> None:
        for i, chunk in enumerate(partition.chunks):
            if chunk.dtype != torch.float32 or chunk.dim() != 1:
                raise ValueError(
                    f"co2: partition chunk {i} is {chunk.dtype} with shape {tuple(chunk.shape)}; the "
                    f"live master parameters must be 1-D float32 views"
                )
        self.config = config
        self.topology = topology
        self.partition = partition
        self.refresh = refresh
        module_buffers = list(module.buffers()) if module is not None else []
        unique = {id(b): b for b in [*buffers, *module_buffers]}
        self.buffers = [b for b in unique.values() if b.is_floating_point()]
        self.watch = ParameterWatch.collect(params, module)
        device = _state_device(partition, topology)

        replicas = topology.replicas
        padded = max(replicas, math.ceil(partition.length / replicas) * replicas)
        self.layout = Layout(
            length=partition.length,
            padded=padded,
            sub_shard=padded // replicas,
            segments=tuple(partition.segments),
            num_tensors=partition.num_tensors,
        )
        self._check_agreement()
        self._common_start()
        # One fp32 copy of the float buffers: what a round end with non-finite buffers falls back to.
        self.agreed_buffers = self._common_buffers()
        make_exchange = OuterExchange if membership is None else membership.make_exchange
        self.exchange = make_exchange(config, topology, self.layout, device)
        self.announcements = StepAnnouncements(topology.buffer_group)
        self._at_exit = weakref.finalize(self, _shutdown, self.exchange, topology, self.announcements)

        # The two partition buffers that trade roles every round (start point B; D, then Nx).
        self.start_point = torch.zeros(padded, dtype=torch.float32, device=device)
        self._gather_live(self.start_point)
        self.next_start = self.start_point.clone()
        self.momentum = torch.zeros(self.exchange.slice_length, dtype=torch.float32, device=device)
        reduce_scatter = self.exchange.strategy == "reduce_scatter"
        self.g_buffer = torch.zeros_like(self.momentum) if reduce_scatter else None
        self.previous_update_sq_norms: Optional[torch.Tensor] = None

        self.inner_steps = 0
        self.rounds = 0
        self.skipped_rounds = 0  # rounds whose outer update was skipped (nonfinite: "skip_round")
        self.run_id: Optional[str] = None  # set by the first checkpoint saved or loaded
        self.pending_round: Optional[Future] = None
        self.pending_index = -1  # the round whose pipeline `pending_round` runs
        self.finalized = False
        self.failed: Optional[BaseException] = None
        self.last_round: dict[str, Any] = {}
        self._bytes_reported = 0  # of exchange.bytes_sent, already in some last_round
        if membership is not None and membership.attach(self):
            self._round_end()  # joined a running job at a round end: take part in its exchange

    # ---- the round --------------------------------------------------------------------------------

    def inner_step_done(self) -> bool:
        """Count one applied inner step; end the round on every tau-th. Returns True if it did."""
        self.check_usable()
        self.inner_steps += 1
        if self.inner_steps % self.config.tau:
            return False
        self._round_end()
        return True

    def _round_end(self) -> None:
        began = time.perf_counter()
        self._check_parameters_unchanged()
        wait_s = self._wait_pending()  # step 1: next_start now holds x_{t+1}
        self._check_steps()  # the last round end's (arrived with its pipeline)
        self.announcements.post(self.inner_steps, finalizing=False)
        sent = self._exchange_bytes_since_last_report()
        overlap = self.config.overlap
        if overlap:  # D overwrites the retiring start point; the update applies to x_{t+1}
            base, work = self.next_start, self.start_point
        else:  # blocking: D goes to the spare buffer; the update applies to x_t, right now
            base, work = self.start_point, self.next_start
        self._subtract_live(self.start_point, out=work)  # step 2: D = B - x
        reset_inner = self.config.nonfinite == "skip_round" and not _all_finite(work[: self.layout.length])
        gap = self.previous_update_sq_norms if overlap else None
        self.pending_round = self.exchange.launch(
            PipelineJob(work, base, self.momentum, self.g_buffer, gap, self.rounds)
        )
        self.pending_index = self.rounds
        if not overlap:
            wait_s += self._wait_pending()
            sent += self._exchange_bytes_since_last_report()
        new_start, spare = (base, work) if overlap else (work, base)
        self._set_live(new_start)  # step 3: x <- Nx; refresh
        self.start_point, self.next_start = new_start, spare
        self.rounds += 1
        if self.buffers:  # a peer that finalized never averages them: learn it first
            self._check_steps()
        buffer_bytes, buffers_restored = self._average_buffers(f"round {self.rounds - 1}")
        sent += buffer_bytes
        if reset_inner:
            warnings.warn(
                f"co2: round {self.rounds - 1}: this rank's displacement (global rank {self.topology.rank}, "
                f"replica {self.topology.replica_index}) holds NaN or Inf; its inner optimizer state is reset "
                f"and it restarts from the agreed start point (nonfinite='skip_round')",
                stacklevel=4,
            )
        self.last_round = {
            "round": self.rounds - 1,
            "inner_step": self.inner_steps,
            "wait_s": wait_s,
            "round_end_s": time.perf_counter() - began,
            "skipped_rounds": self.skipped_rounds,
            "inner_state_reset": reset_inner,
            "buffers_restored": buffers_restored,
            "bytes_sent": sent,
        }

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
        dropped = self.inner_steps % self.config.tau
        if dropped:
            warnings.warn(
                f"co2 finalize: the {dropped} inner step(s) since the last round end (step "
                f"{self.inner_steps - dropped}) are dropped; every rank returns to the start point",
                stacklevel=3,
            )
        self._wait_pending()
        self._set_live(self.next_start if self.config.overlap else self.start_point)
        self._average_buffers("finalize")
        self.finalized = True
        self.close()

    def _check_steps(self, finalizing: bool = False) -> None:
        """Collect the step announcement in flight (within timeout_s) and fail, naming every rank's
        count, if a peer finalized at another step (or this rank finalizes and a peer did not)."""
        try:
            rows = self.announcements.collect(time.monotonic() + self.config.timeout_s)
        except CO2TimeoutError as error:
            ranks = list(range(self.topology.world_size))
            where, what = ("co2 finalize", "called finalize()") if finalizing else ("co2", "reached this round end")
            self._fail(
                CO2TimeoutError(
                    f"{where}: not every rank of global ranks {ranks} {what} within timeout_s="
                    f"{self.config.timeout_s:g} (rank {self.topology.rank} at inner step {self.inner_steps}); a "
                    f"rank died, is stuck{', or skipped finalize()' if finalizing else ''}"
                ),
                error,
            )
        problem = None if rows is None else steps_mismatch(rows, self.topology.rank, self.inner_steps)
        if problem is not None:
            self._fail(CO2Error(problem))

    def _fail(self, error: CO2Error, cause: Optional[BaseException] = None) -> None:
        """Mark the engine failed, release its worker and groups, raise `error`."""
        self.failed = error
        self.close()
        raise error from cause

    def close(self) -> None:
        """Stop the background worker and release the CO2 process groups (not the inner group,
        which the integration's framework keeps using). Also runs at interpreter exit."""
        self._at_exit()

    # ---- waiting with a deadline ---------------------------------------------------------------------

    def _wait_pending(self) -> float:
        """Wait for the pipeline in flight (if any); returns the seconds spent blocked."""
        if self.pending_round is None:
            return 0.0
        began = time.perf_counter()
        future, self.pending_round = self.pending_round, None
        round_index = self.pending_index
        where = self.topology.describe_outer()
        try:
            result, done = self._result_watching_steps(future)
        except CO2Error as error:  # the pipeline's own verdict (NonFiniteError), or a peer's step count
            self.failed = error
        except Exception as error:  # this wait's deadline, or the collective failed: a peer died or timed out
            what = f"round {round_index}: the background exchange on the {where}"
            self.failed = collective_error(what, error, self.config.timeout_s)
            self.failed.__cause__ = error
        if self.failed is not None:
            self.close()
            raise self.failed
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.previous_update_sq_norms = result.update_sq_norms
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

    def check_usable(self) -> None:
        """Raise CO2Error if this engine failed or was finalized."""
        if self.failed is not None:
            raise CO2Error(f"co2: this optimizer already failed and cannot continue: {self.failed}")
        if self.finalized:
            raise CO2Error("co2: finalize() ended training; build a new CO2 optimizer to train again")

    # ---- the live partition ----------------------------------------------------------------------------

    def _chunk_slices(self):
        offset = 0
        for chunk in self.partition.chunks:
            yield chunk, slice(offset, offset + chunk.numel())
            offset += chunk.numel()

    @torch.no_grad()
    def _gather_live(self, out: torch.Tensor) -> None:
        """out <- live partition."""
        for chunk, where in self._chunk_slices():
            out[where].copy_(chunk)

    @torch.no_grad()
    def _subtract_live(self, start_point: torch.Tensor, out: torch.Tensor) -> None:
        """out <- start_point - live partition (the padding stays zero)."""
        for chunk, where in self._chunk_slices():
            torch.sub(start_point[where], chunk, out=out[where])

    @torch.no_grad()
    def _common_start(self) -> None:
        """Every replica starts from replica 0's parameters (a framework broadcasts its model only
        within its data-parallel group, here a replica), and every rank holds rank 0's frozen
        parameters (CO2 never averages them). Before the worker exists: the outer group is free, and
        `_check_agreement` made sure the partitions have the same layout."""
        if self.topology.replicas > 1:
            for chunk in self.partition.chunks:
                dist.broadcast(chunk, src=self.topology.outer_ranks[0], group=self.topology.outer_group)
            self.refresh()
        self._broadcast_frozen()

    @torch.no_grad()
    def _broadcast_frozen(self) -> None:
        """Frozen parameters from replica 0 to every replica (over the outer group, like the partition:
        inside a replica the framework already made them equal; an FSDP2-sharded one is its local
        shard), one flat tensor per dtype. The ranks first agree on the frozen set."""
        topo, timeout = self.topology, self.config.timeout_s
        frozen = [(name, _local(p)) for name, p in self.watch.frozen]
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.watch.frozen]
        mine = [len(frozen), fingerprint(shapes)]
        table = gather_fingerprints(mine, topo.buffer_group, timeout, "start-up check of the frozen parameters")
        for rank, theirs in enumerate(table):
            if theirs != mine:
                raise CO2Error(
                    f"co2: rank {topo.rank} and rank {rank} disagree on the frozen parameters (requires_grad="
                    f"False): {len(frozen)} here {[name for name, _ in frozen][:8]}, {theirs[0]} there; every "
                    f"rank must freeze the same parameters before building the CO2 optimizer"
                )
        if topo.replicas == 1:
            return
        device = collective_device(topo.outer_group)
        for dtype in sorted({p.dtype for _, p in frozen}, key=str):
            params = [p for _, p in frozen if p.dtype == dtype]
            flat = torch.cat([p.reshape(-1).to(device) for p in params])
            try:
                work = dist.broadcast(flat, src=topo.outer_ranks[0], group=topo.outer_group, async_op=True)
                work.wait(timeout=timedelta(seconds=timeout))
            except Exception as error:
                what = f"start-up broadcast of the frozen parameters on the {topo.describe_outer()}"
                raise collective_error(what, error, timeout) from error
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

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

    def _set_live(self, flat: torch.Tensor) -> None:
        """live partition <- flat, then let the integration spread it over its replica."""
        with torch.no_grad():
            for chunk, where in self._chunk_slices():
                chunk.copy_(flat[where])
        self.refresh()

    # ---- module buffers ------------------------------------------------------------------------------

    def _describe_buffer_group(self) -> str:
        return f"buffer group (global ranks {list(range(self.topology.world_size))})"

    def _flat_buffers(self) -> torch.Tensor:
        """This rank's float module buffers, concatenated as fp32 on the buffer group's device."""
        device = collective_device(self.topology.buffer_group)
        return torch.cat([b.detach().reshape(-1).float().to(device) for b in self.buffers])

    @torch.no_grad()
    def _write_buffers(self, flat: torch.Tensor) -> None:
        offset = 0
        for b in self.buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    @torch.no_grad()
    def _common_buffers(self) -> Optional[torch.Tensor]:
        """Every rank starts from rank 0's float module buffers (as it starts from replica 0's
        parameters): the first agreed buffers, which a non-finite first round end falls back to.
        Returns them flat (None without buffers)."""
        if not self.buffers:
            return None
        flat = self._flat_buffers()
        try:
            work = dist.broadcast(flat, src=0, group=self.topology.buffer_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.config.timeout_s))
        except Exception as error:
            what = f"start-up broadcast of the module buffers on the {self._describe_buffer_group()}"
            raise collective_error(what, error, self.config.timeout_s) from error
        self._write_buffers(flat)
        return flat

    def _average_buffers(self, where: str) -> tuple[int, bool]:
        """Average the float module buffers over every rank (main thread, its own group). Returns the
        bytes this rank sent (`comm.wire_bytes`) and whether the last agreed buffers were kept instead.

        One all-reduce carries the buffers followed by one non-finite flag per rank (the sum is
        element-wise: a NaN buffer cannot reach the flags), so every rank learns before writing anything
        whether some rank's buffers hold NaN/Inf. Then `nonfinite: "raise"` raises NonFiniteError with
        every rank's buffers untouched and "skip_round" restores the last agreed ones (docs/design.md §3).
        """
        if not self.buffers:
            return 0, False
        world = self.topology.world_size
        values = self._flat_buffers()
        flags = values.new_zeros(world)
        flags[self.topology.rank] = (~torch.isfinite(values)).any()
        flat = torch.cat([values, flags])
        try:
            dist.all_reduce(flat, group=self.topology.buffer_group)
        except Exception as error:
            what = f"{where}: averaging the module buffers on the {self._describe_buffer_group()}"
            self._fail(collective_error(what, error, self.config.timeout_s), error)
        sent = wire_bytes("all_reduce", flat.numel() * flat.element_size(), world)
        bad = [rank for rank, flag in enumerate(flat[-world:].tolist()) if flag > 0]
        if bad:
            self._keep_agreed_buffers(bad, where)
            return sent, True
        self.agreed_buffers = flat[:-world].div_(world)
        self._write_buffers(self.agreed_buffers)
        return sent, False

    def _keep_agreed_buffers(self, bad: list[int], where: str) -> None:
        """Some ranks' buffers hold NaN/Inf: raise (`nonfinite: "raise"`), or restore the last agreed
        buffers on this rank and say so ("skip_round")."""
        replicas = sorted({rank // self.topology.shards for rank in bad})
        holders = f"the float module buffers (e.g. BatchNorm statistics) of rank(s) {bad} (replica(s) {replicas})"
        if self.config.nonfinite == "raise":
            self._fail(
                NonFiniteError(
                    f"co2: {where}: {holders} hold NaN or Inf; no rank's buffers were changed. Set "
                    f"nonfinite='skip_round' in the co2 config to keep the last agreed buffers instead."
                )
            )
        self._write_buffers(self.agreed_buffers)
        warnings.warn(
            f"co2: {where}: {holders} held NaN or Inf; every rank keeps the last agreed buffers (those of "
            f"the last round end that averaged them) instead of averaging (nonfinite='skip_round')",
            stacklevel=5,
        )

    # ---- agreement ---------------------------------------------------------------------------------

    def _check_agreement(self) -> None:
        """Fail fast, naming the difference, when ranks hold different models or partition layouts
        (a fingerprint exchange at start-up instead of a hang later; the configs and the grid were
        compared when the topology was built)."""
        topo, layout = self.topology, self.layout
        tensors = self.partition.tensors or [
            TensorIdentity(f"optimizer parameter {i}", (), False) for i in range(self.partition.num_tensors)
        ]
        agree_on_parameters(tensors, topo.norm_group, self.config.timeout_s)
        mine = [topo.shard_index, layout.length, fingerprint(tuple(tuple(seg) for seg in layout.segments))]
        table = gather_fingerprints(mine, topo.norm_group, self.config.timeout_s, "start-up model check")
        for rank, theirs in enumerate(table):
            if theirs[0] == topo.shard_index and theirs[1:] != mine[1:]:
                raise CO2Error(
                    f"co2: rank {topo.rank} and rank {rank} own shard {topo.shard_index} but their "
                    f"partitions differ ({layout.length} elements here vs {theirs[1]}, or a different split "
                    f"into tensors); every replica must partition the model the same way"
                )

    # ---- state (plain containers and tensors: loadable with torch.load(weights_only=True)) ----------

    def geometry(self) -> dict[str, Any]:
        """Where this rank's state lives in the model: enough to re-cut it per parameter tensor
        (`co2_zero.checkpoint.consolidate`) and to check that a state fits this engine."""
        layout, piece = self.layout, self.exchange.slice
        return {
            "length": layout.length,
            "padded": layout.padded,
            "num_tensors": layout.num_tensors,
            "segments": [list(seg) for seg in layout.segments],
            "sub_shard": list(layout.sub_shard_range(self.topology.replica_index)),
            "momentum_range": [piece.start, piece.stop],
            "strategy": self.exchange.strategy,
            "overlap": self.config.overlap,
            "tau": self.config.tau,
        }

    def identity(self) -> dict[str, Any]:
        """What a state must agree on to be loaded here."""
        topo = self.topology
        return {
            "version": STATE_VERSION,
            "config_hash": self.config.math_hash(),
            "grid": {"replicas": topo.replicas, "shards": topo.shards},
            "rank": topo.rank,
            "signature": self.partition.signature,
            "geometry": self.geometry(),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state. Waits for the round in flight so its result is included. Tensors are
        live references (as in `torch.optim.Optimizer.state_dict()`): save or copy them before the next
        step."""
        self.check_usable()
        self._wait_pending()
        return {
            **self.identity(),
            "run_id": self.run_id,
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "skipped_rounds": self.skipped_rounds,
            "start_point": self.start_point,
            "next_start": self.next_start if self.config.overlap else None,
            "momentum": self.momentum,
            "previous_update_sq_norms": self.previous_update_sq_norms,
            # comm_dtype int8/fp8: the error-feedback residuals (comm.Residuals), else None
            "residuals": None if self.exchange.residuals is None else self.exchange.residuals._asdict(),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError naming the first field of `state` that does not fit this engine (same
        config, topology, model and partition); changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"co2 checkpoint: the co2 state is a {type(state).__name__}, expected a dict")
        for key, value in self.identity().items():
            if state.get(key) != value:
                raise ValueError(
                    f"co2 checkpoint: {key}={state.get(key)!r} does not match this run's {value!r}; "
                    f"resume with the same co2 config, topology and model (or reshard)"
                )
        expected = {
            "start_point": self.start_point,
            "next_start": self.next_start if self.config.overlap else None,
            "momentum": self.momentum,
        }
        for key, like in expected.items():
            _check_tensor(key, state.get(key), like)
        norms = state.get("previous_update_sq_norms")
        if norms is not None:
            _check_tensor("previous_update_sq_norms", norms, torch.zeros(self.layout.num_tensors, dtype=torch.float64))
        residuals = state.get("residuals")
        if residuals is not None:
            if self.exchange.residuals is None or not isinstance(residuals, dict):
                raise ValueError(
                    f"co2 checkpoint: it holds error-feedback residuals; comm_dtype here is {self.config.comm_dtype!r}"
                )
            for name, like in self.exchange.residuals._asdict().items():
                _check_tensor(f"residuals.{name}", residuals.get(name), like)
        for key in ("inner_steps", "rounds", "skipped_rounds"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"co2 checkpoint: {key}={state.get(key)!r}; expected an integer >= 0")
        if state["rounds"] != state["inner_steps"] // self.config.tau:
            raise ValueError(
                f"co2 checkpoint: rounds={state['rounds']} does not fit inner_steps={state['inner_steps']} "
                f"at tau={self.config.tau}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved on this same rank of the same topology and config. Checks
        everything first (`check_state_dict`): a refused state changes nothing."""
        self.check_usable()
        self.check_state_dict(state)
        self._wait_pending()
        self.inner_steps, self.rounds = state["inner_steps"], state["rounds"]
        self.skipped_rounds, self.run_id = state["skipped_rounds"], state.get("run_id")
        self.start_point.copy_(state["start_point"])
        if state["next_start"] is not None:
            self.next_start.copy_(state["next_start"])
        self.momentum.copy_(state["momentum"])
        if self.buffers:  # checkpoint.load wrote the module first: its buffers are now the agreed ones
            self.agreed_buffers = self._flat_buffers()
        norms = state["previous_update_sq_norms"]
        self.previous_update_sq_norms = None if norms is None else norms.to(self.momentum.device).clone()
        if self.exchange.residuals is not None:  # a resharded state has none: the pending error restarts at 0
            saved = state.get("residuals")
            for name, residual in self.exchange.residuals._asdict().items():
                residual.copy_(saved[name]) if saved is not None else residual.zero_()

    def restart_from_start_point(self) -> None:
        """Set the live parameters to the current start point (a resharded state resumes at the
        saved run's last round start) and refresh the replica."""
        self.check_usable()
        self._set_live(self.start_point)

    def state_bytes(self) -> int:
        """Bytes of CO2 state this rank holds (docs/design.md §4: 2Ψ/S + 2Ψ/N fp32 words with
        reduce_scatter, 3Ψ/S with all_reduce, plus one float64 norm per tensor), and the outer step's segment
        index (`outer.SegmentIndex`, about 2·√(elements · segments) ids); int8/fp8 add the error-feedback
        residuals, Ψ/S + Ψ/N."""
        tensors = [self.start_point, self.next_start, self.momentum, self.g_buffer, self.previous_update_sq_norms]
        tensors += list(self.exchange.residuals or ())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + self.exchange.index_bytes


def _check_tensor(key: str, value: Any, like: Optional[torch.Tensor]) -> None:
    if like is None:
        if value is not None:
            raise ValueError(f"co2 checkpoint: {key} is present but this run has none (overlap differs?)")
        return
    if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"co2 checkpoint: {key} is {got}; expected {like.dtype} {tuple(like.shape)}")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local values: its shard for an FSDP2 DTensor, else itself (detached)."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()


def _all_finite(flat: torch.Tensor) -> bool:
    return bool(torch.isfinite(largest_abs(flat)))


class CO2Steps:
    """What every integration's optimizer adds to its framework's optimizer, around `self.engine`."""

    engine: RoundEngine
    round_ended: bool = False  # did the last step() end a round

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding this rank's inner state (its moments)."""
        return self.optimizer  # type: ignore[attr-defined]

    def _count_step(self, applied: bool = True) -> None:
        """After the framework's step: count it for CO2 if it was applied (not skipped on overflow)."""
        self.round_ended = applied and self.engine.inner_step_done()
        if self.round_ended and self.engine.last_round["inner_state_reset"]:
            self.inner_optimizer.state.clear()  # nonfinite="skip_round": this partition's moments were NaN/Inf

    @property
    def last_round(self) -> dict[str, Any]:
        """The last round end: round, inner_step, wait_s, round_end_s, bytes_sent (what this rank sent
        since the previous report), skipped_rounds (rounds whose outer update was skipped so far),
        inner_state_reset (this rank reset its inner state), buffers_restored (some rank's float module
        buffers held NaN/Inf, so every rank kept the last agreed buffers instead of averaging)."""
        return self.engine.last_round

    def finalize(self) -> None:
        """Wait for the round in flight and give every rank the same model (docs/design.md §3)."""
        self.engine.finalize()

    def co2_state_bytes(self) -> int:
        """Bytes of CO2 state on this rank (docs/design.md §4)."""
        return self.engine.state_bytes()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "engine"):
            raise RuntimeError("co2: parameters cannot be added after the CO2 partition was built")
        super().add_param_group(param_group)  # type: ignore[misc]


def parameter_signature(shapes: Sequence[Sequence[int]]) -> str:
    """A short hash of the model's parameter shapes, in order."""
    return hashlib.sha256(repr([tuple(s) for s in shapes]).encode()).hexdigest()[:16]


def _shutdown(exchange: OuterExchange, topology: Topology, announcements: StepAnnouncements) -> None:
    # A worker still blocked in a collective keeps its groups: destroying them under it would crash.
    # So does a step announcement a peer never answered (it is a collective on the buffer group).
    if exchange.close() and not (announcements.in_flight and not announcements.ready()):
        topology.destroy()
