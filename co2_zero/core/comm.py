"""The background pipeline (docs/design.md §3 a–g) and the collective strategies (§5).

One daemon thread per CO2 instance runs pipelines in launch order with blocking collectives on the
CO2 groups; the main thread only launches and waits. On CUDA the pipeline runs on its own stream,
ordered against the compute stream by events, never by a device-wide synchronize.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import sparse
from .compress import FORMATS, RecordLayout, dequantize_into, quantize_with_feedback_
from .errors import NonFiniteError
from .outer import OuterHyper, Segment, SegmentIndex, outer_step
from .plan import ResolvedPlan
from .topology import Topology, collective_device
from .worker import BackgroundWorker

if TYPE_CHECKING:
    from .round_schedule import RoundDecision

# torch 2.13 renamed the tensor collectives `*_single` and warns on the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # int8/fp8: `compress.FORMATS`


def wire_bytes(collective: str, nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in `collective` over `ranks` ranks, `nbytes` being the whole buffer (the
    all-reduced tensor, the reduce-scatter input, the all-gather output, the all-to-all send buffer).

    The volume of the bandwidth-optimal algorithms: ring all-reduce 2(G-1)/G of the buffer; ring
    reduce-scatter, ring all-gather and pairwise all-to-all (G-1)/G (a rank keeps its own share).
    Backends may move more for small messages; this is what the exchange needs, whatever the dtype.
    """
    factor = 2 if collective == "all_reduce" else 1
    return factor * (ranks - 1) * nbytes // ranks


class Residuals(NamedTuple):
    """Error-feedback state of a compressed exchange (`comm_dtype` int8/fp8/int4/int2, or `topk` < 1),
    this rank's own.

    displacement: what this rank's displacements could not send yet (partition-sized: every
    sub-shard it sends). gathered: what it could not all-gather yet as the owner of its sub-shard:
    the update of the start point (`reduce_scatter`) or the averaged displacement (`all_reduce`);
    empty with `all_gather` (the sparse exchange), where every rank decodes the same average.
    """

    displacement: torch.Tensor
    gathered: torch.Tensor


class Layout(NamedTuple):
    """Geometry of this rank's partition, identical on every rank of its outer group."""

    length: int  # real elements of the partition
    padded: int  # length rounded up to a multiple of R (the padding is always zero)
    sub_shard: int  # padded // R
    segments: tuple[Segment, ...]  # tensor pieces of the whole partition
    num_tensors: int  # parameter tensors in the whole model (the global tensor-id space)
    vectors: frozenset[int] = frozenset()  # ids of the tensors of at most one dimension (biases, norms)

    def sub_shard_range(self, replica: int) -> tuple[int, int]:
        return replica * self.sub_shard, (replica + 1) * self.sub_shard

    def segments_in(self, start: int, end: int) -> tuple[Segment, ...]:
        """The pieces of [start, end), relative to start."""
        return tuple(
            Segment(s.tensor_id, lo - start, hi - start, s.offset + lo - s.start)
            for s in self.segments
            if (lo := max(s.start, start)) < (hi := min(s.end, end))
        )


def largest_abs(flat: torch.Tensor) -> torch.Tensor:
    """max |flat| as a 0-d tensor on flat's device (0 when empty), NaN if flat holds one."""
    return torch.linalg.vector_norm(flat, float("inf")) if flat.numel() else flat.new_zeros(())


class PipelineJob(NamedTuple):
    """The inputs of one pipeline (docs/design.md §3 a–g)."""

    work: torch.Tensor  # D on entry, the new start point on exit (partition-sized)
    base: torch.Tensor  # the start point the update applies to
    momentum: torch.Tensor  # m on this rank's slice
    g_buffer: Optional[torch.Tensor]  # reduce_scatter: where this rank's sub-shard of g lands
    previous_update_sq_norms: Optional[torch.Tensor]  # the staleness gap's partial norms (None: no gap)
    round_index: int
    decision: RoundDecision  # the round's: its staleness, and every replica's displacement weight


class RoundResult(NamedTuple):
    """What pipeline t hands back to the round state machine."""

    update_sq_norms: torch.Tensor  # this rank's partial per-tensor ‖u‖², the next pipeline's staleness gap
    skipped_replicas: Optional[list[int]]  # None: the outer update was applied; else (`nonfinite:
    # "skip_round"`) the replicas whose displacement held NaN/Inf: the update was skipped on every replica


class OuterExchange:
    """Runs pipeline t: average D over the outer group, outer step, all-gather the new start point."""

    def __init__(self, plan: ResolvedPlan, topology: Topology, layout: Layout, device: torch.device) -> None:
        config = plan.config
        self.config = config
        self.topology = topology
        self.layout = layout
        self.strategy = plan.collective
        self.comm_dtype = _COMM_DTYPES.get(plan.comm_dtype)
        # None: fp32/bf16 travel as plain tensors; with topk < 1 the values' format of `sparse_layout`
        self.wire_format = None if plan.sparse else FORMATS.get(plan.comm_dtype)
        self.sparse_layout = (
            sparse.SparseLayout.for_partition(
                layout.segments, layout.vectors, layout.padded, plan.topk, plan.comm_dtype
            )
            if plan.sparse
            else None
        )
        self.guard = sparse.guard_enabled()  # the senders' mean clips an outlier payload to the median norm
        self.residuals = (
            Residuals(
                torch.zeros(layout.padded, dtype=torch.float32, device=device),
                torch.zeros(0 if plan.sparse else layout.sub_shard, dtype=torch.float32, device=device),
            )
            if plan.compressed
            else None
        )
        self.bytes_sent = 0  # by this rank's pipelines so far (`wire_bytes`); written by the worker only
        r = self.replica = topology.replica_index
        self.senders_per_sent: Optional[torch.Tensor] = None  # sparse: the last average's overlap (0-d)
        start, end = layout.sub_shard_range(r)
        self.sub_shard = slice(start, end)
        sub_shard_segments = layout.segments_in(start, end)
        if self.strategy == "reduce_scatter":
            # This rank computes the outer step on its sub-shard only, then all-gathers.
            self.slice = self.sub_shard
            self.segments = sub_shard_segments
            self.counted = sub_shard_segments
        else:
            # Every rank of the outer group updates the whole partition redundantly; each still
            # counts only its sub-shard in the global norms, so every element is counted once.
            self.slice = slice(0, layout.padded)
            self.segments = layout.segments
            self.counted = tuple(s._replace(start=s.start + start, end=s.end + start) for s in sub_shard_segments)
        self.slice_length = self.slice.stop - self.slice.start
        # Placed here, on the main thread: a new thread's current CUDA device is device 0, not this rank's.
        self.flag_device = collective_device(topology.norm_group)
        # Built once per layout: the outer step's cost then does not grow with the number of tensors.
        self.hyper = OuterHyper.from_config(config)
        self.segment_index = SegmentIndex(self.segments, layout.num_tensors, device)
        self.counted_index = (
            self.segment_index
            if self.counted == self.segments
            else SegmentIndex(self.counted, layout.num_tensors, device)
        )
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.worker = BackgroundWorker(f"co2-outer-rank{topology.rank}")

    def launch(self, job: PipelineJob) -> Future:
        """Start pipeline `job.round_index` in the background; the new start point lands in `job.work`.

        `job.work` must hold D, complete, on the current stream; the caller must not touch `job.base`
        or `job.momentum` until the future is done. The future yields (RoundResult, CUDA event or None).
        """
        if self.stream is None:
            return self.worker.submit(lambda: (self._pipeline(job), None))
        ready = torch.cuda.Event()
        ready.record()

        def on_stream() -> tuple[RoundResult, torch.cuda.Event]:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                result = self._pipeline(job)
                done = torch.cuda.Event()
                done.record(self.stream)
            return result, done

        return self.worker.submit(on_stream)

    def _pipeline(self, job: PipelineJob) -> RoundResult:
        live = job.work[: self.layout.length]  # D, what this rank measured; may be empty
        # Read only when the round turns out non-finite. all_reduce overwrites D, so its largest |D|
        # is taken now (on the device, no sync); reduce_scatter leaves D intact until the all-gather.
        local_max = largest_abs(live) if self.strategy != "reduce_scatter" else None
        # replica_tau: R·w_r, so that the plain mean over R below is the token-weighted average (`pace`);
        # compressed, the scaled D is what is sent and the residual keeps what it could not send of it
        scale = job.decision.weights[self.replica]
        if scale != 1.0:
            job.work.mul_(scale)
        if self.sparse_layout is not None:  # every replica's weight among the senders of a coordinate
            g = self._average_sparse(job.work, job.decision.weights)
        else:
            g = self._average(job.work, job.g_buffer)
        result = outer_step(
            g,
            job.momentum,
            job.base[self.slice],
            segments=self.segment_index,
            counted=self.counted_index,
            previous_update_sq_norms=job.previous_update_sq_norms,
            hyper=self.hyper._replace(staleness=job.decision.staleness),
            sum_across_ranks=self._sum_across_ranks,
        )
        skipped = None
        if not result.finite:  # raises, or skips the round (the new start point is then `base`)
            locally_finite = bool(torch.isfinite(largest_abs(live) if local_max is None else local_max))
            skipped = self._non_finite(locally_finite, job.round_index)
        self._share_new_start(job.work, job.base, g, result.finite)
        return RoundResult(result.update_sq_norms, skipped)

    def _average(self, work: torch.Tensor, g_buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """g = mean of D over the outer group, on this rank's slice (dense; the sparse exchange's is
        `_average_sparse`)."""
        if self.wire_format is not None:
            return self._average_quantized(work, g_buffer)
        group, replicas = self.outer_peers()
        reduce_scatter = self.strategy == "reduce_scatter"
        narrow = self.comm_dtype != torch.float32
        # bf16: divide first, so the narrow sum cannot overflow; fp32 sums in place and divides after
        wire = work.div(replicas).to(self.comm_dtype) if narrow else work
        if reduce_scatter:
            out = torch.empty(self.slice_length, dtype=self.comm_dtype, device=work.device) if narrow else g_buffer
            self._count("reduce_scatter", wire, replicas)
            _reduce_scatter(out, wire, group=group)
            return g_buffer.copy_(out) if narrow else g_buffer.div_(replicas)
        self._count("all_reduce", wire, replicas)
        self._all_reduce(wire, group)
        return work.copy_(wire) if narrow else work.div_(replicas)

    def _all_reduce(self, wire: torch.Tensor, group: Any) -> None:
        """Sum `wire` over `group` in place: the average's collective (the elastic exchange watches
        its quorum's members while it waits)."""
        dist.all_reduce(wire, group=group)

    def agree_final(self, round_index: int) -> None:
        """finalize()'s last word with the peers, after the last exchange arrived: nothing with a fixed
        outer group, where every rank applied that exchange alike. The elastic exchange meets its quorum
        once more here, so that a replica that cut the last round heals (`co2_zero.elastic`)."""

    def steps_next_round(self, tau: int) -> int:
        """The inner steps this replica trains in its next round, asked after each launch: `tau` (this
        replica's). The elastic exchange with `replica_tau: "auto"` returns what its measured speed gives."""
        return tau

    def outer_peers(self) -> tuple[Any, int]:
        """The group this round's displacement is averaged over, and the number of displacements in
        the average: the fixed outer group and R. The seam of elastic membership (`co2_zero.elastic`),
        whose exchange averages over the replicas of each round's quorum instead."""
        return self.topology.outer_group, self.topology.replicas

    def _average_quantized(self, work: torch.Tensor, g_buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """The quantized reduce-scatter (docs/design.md §5): D + residual is quantized per block, each
        sub-shard goes to its owner in one all-to-all, and the owner averages the replicas' dequantized
        pieces in fp32, in replica order. `reduce_scatter`: g lands in `g_buffer`. `all_reduce`: a sum
        of bytes is no byte, so there is no quantized all-reduce; instead each owner all-gathers its
        average quantized (with its own residual) and every rank dequantizes the whole partition, the
        same bytes everywhere, then runs the outer step on all of it as the fp32 `all_reduce` does."""
        replicas, length = self.topology.replicas, self.layout.sub_shard
        record = RecordLayout.for_length(length, bits=self.wire_format.bits)
        rows = work.view(replicas, length)  # row j: sub-shard j, for its owner j
        sent = torch.empty(replicas, record.nbytes, dtype=torch.uint8, device=work.device)
        quantize_with_feedback_(rows, self.residuals.displacement.view(replicas, length), self.wire_format, sent)
        received = torch.empty_like(sent)  # row i: this rank's sub-shard as replica i quantized it
        self._count("all_to_all", sent, replicas)
        dist.all_to_all_single(received, sent, group=self.topology.outer_group)
        g = g_buffer if self.strategy == "reduce_scatter" else work[self.sub_shard]
        dequantize_into(received[:1], self.wire_format, out=g.view(1, length))
        piece = torch.empty(1, length, dtype=torch.float32, device=work.device)
        for i in range(1, replicas):
            g.add_(dequantize_into(received[i : i + 1], self.wire_format, out=piece).view(-1))
        g.div_(replicas)
        if self.strategy == "reduce_scatter":
            return g
        del sent, received, piece  # free the records before the all-gather allocates its own
        self._all_gather_quantized(g, out=rows)
        return work

    def _average_sparse(self, work: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        """The sparse exchange (docs/design.md §5): D + residual, top-k per chunk, travels as one payload
        per replica in an all-gather; every rank decodes the R payloads in replica order into the senders'
        mean (`sparse.average_over_senders_`: each coordinate averaged over the replicas that sent it, with
        `weights` their R·w_r), so
        every replica holds the same bits of g, on the whole partition (the outer step then runs on all of
        it everywhere, as with `all_reduce`, and no new start point travels)."""
        layout, replicas = self.sparse_layout, self.topology.replicas
        mine = torch.empty(layout.nbytes, dtype=torch.uint8, device=work.device)
        sparse.encode_with_feedback_(
            work, self.residuals.displacement, layout, mine, self.config.effective("feedback_decay")
        )
        everyone = torch.empty(replicas, layout.nbytes, dtype=torch.uint8, device=work.device)
        self._count("all_gather", everyone, replicas)
        _all_gather(everyone.view(-1), mine, group=self.topology.outer_group)
        g, self.senders_per_sent = sparse.average_over_senders_(everyone, weights, layout, work, self.guard)
        return g

    @property
    def payload_bytes(self) -> int:
        """Bytes one replica's displacement of this partition takes per round before any collective moves
        it (the field's measure of a format): the top-k payload, the quantized records, or the values."""
        if self.sparse_layout is not None:
            return self.sparse_layout.nbytes
        if self.wire_format is not None:
            record = RecordLayout.for_length(self.layout.sub_shard, bits=self.wire_format.bits)
            return self.topology.replicas * record.nbytes
        return self.layout.padded * self.comm_dtype.itemsize

    def report(self) -> dict[str, Optional[float]]:
        """What a round end reports of the wire besides its bytes (`wire_bytes`): the payload as a fraction of
        fp32's, as `payload_ratio` = fp32 bytes / payload bytes; the sparse exchange's replicas per sent
        coordinate in the last average (1 to R; None when dense or before one arrived)."""
        ratio = 4 * self.layout.padded / self.payload_bytes if self.payload_bytes else None
        overlap = None if self.senders_per_sent is None else float(self.senders_per_sent)
        return {"payload_ratio": ratio, "senders_per_sent": overlap}

    def _share_new_start(self, work: torch.Tensor, base: torch.Tensor, g: torch.Tensor, finite: bool) -> None:
        """Step g: give every rank of the outer group the new start point in `work`.

        `all_reduce` computed it everywhere already. `reduce_scatter`: all-gather each owner's
        sub-shard; quantized, what travels is the owner's update (new start - base, plus its residual)
        and every rank, the owner included, sets `work = base + dequantized update`: the start points
        stay bit-identical across replicas. A skipped non-finite round (every rank knows: the norms are
        global) sends nothing: the start point stays `base`, and the displacement residuals, which may
        hold the NaN, restart from zero (with `all_reduce` the averages' residuals too). `all_gather`
        (sparse): every rank computed the same new start point already.
        """
        if self.residuals is None:
            if self.strategy == "reduce_scatter":
                self._count("all_gather", work, self.topology.replicas)
                _all_gather(work, g, group=self.topology.outer_group)
            return
        if not finite:
            work.copy_(base)
            self.residuals.displacement.zero_()
            if self.strategy == "all_reduce":
                self.residuals.gathered.zero_()
            return
        if self.strategy != "reduce_scatter":
            return
        g.sub_(base[self.sub_shard])
        self._all_gather_quantized(g, out=work.view(self.topology.replicas, self.layout.sub_shard))
        work.add_(base)

    def _all_gather_quantized(self, value: torch.Tensor, out: torch.Tensor) -> None:
        """out (R, sub-shard) <- every owner's `value` (its sub-shard; consumed) quantized with the
        `gathered` residual's feedback and dequantized, in the outer group's order."""
        replicas, length = out.shape
        record = RecordLayout.for_length(length, bits=self.wire_format.bits)
        mine = torch.empty(1, record.nbytes, dtype=torch.uint8, device=value.device)
        quantize_with_feedback_(value.view(1, length), self.residuals.gathered.view(1, length), self.wire_format, mine)
        everyone = torch.empty(replicas, record.nbytes, dtype=torch.uint8, device=value.device)
        self._count("all_gather", everyone, replicas)
        _all_gather(everyone.view(-1), mine.view(-1), group=self.topology.outer_group)
        dequantize_into(everyone, self.wire_format, out=out)

    def _count(self, collective: str, buffer: torch.Tensor, ranks: int) -> None:
        self.bytes_sent += wire_bytes(collective, buffer.numel() * buffer.element_size(), ranks)

    def _sum_across_ranks(self, small: torch.Tensor) -> torch.Tensor:
        self._count("all_reduce", small, self.topology.world_size)
        dist.all_reduce(small, group=self.topology.norm_group)
        return small

    def _non_finite(self, locally_finite: bool, round_index: int) -> list[int]:
        """The replicas whose displacement held NaN/Inf (every rank learns them); raises NonFiniteError
        under `nonfinite: "raise"`, returns them under "skip_round"."""
        bad = self._nonfinite_replicas(locally_finite)
        if self.config.nonfinite == "skip_round":
            return bad
        raise NonFiniteError(
            f"co2: round {round_index}: the displacement of replica(s) {bad} holds NaN or Inf; the outer "
            f"state was not touched. Set nonfinite='skip_round' in the co2 config to skip such rounds."
        )

    @property
    def replica_name(self) -> int:
        """This rank's replica as messages name it: its index in the outer group."""
        return self.topology.replica_index

    def _nonfinite_replicas(self, locally_finite: bool) -> list[int]:
        """The replicas (of the outer group) whose displacement held NaN/Inf: one small all-reduce."""
        flags = torch.zeros(self.topology.replicas, device=self.flag_device)
        flags[self.topology.replica_index] = 0.0 if locally_finite else 1.0
        return [r for r, flag in enumerate(self._sum_across_ranks(flags).tolist()) if flag > 0]

    @property
    def index_bytes(self) -> int:
        """Device bytes of the segment indexes (counted in the CO2 state's footprint)."""
        indexes = {id(i): i for i in (self.segment_index, self.counted_index)}
        return sum(i.nbytes for i in indexes.values())

    def close(self, join_s: float = 1.0) -> bool:
        """Stop the background worker; True if it ended within `join_s` seconds (an idle one's: within
        timeout_s, as it cannot be stuck in a collective)."""
        return self.worker.close(join_s, idle_timeout=self.config.timeout_s)
