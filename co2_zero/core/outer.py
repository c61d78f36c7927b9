"""The outer step on a flat slice of the partition: tensors in, tensors out, no torch.distributed.

A slice covers pieces of several parameter tensors; `Segment`s say which. Per-tensor norms (for the
gap penalty) and the global norm (for norm clipping) span every rank, so each rank computes partial
sums of squares over the pieces it *counts* (its sub-shard; every element is counted by exactly one
rank) and the caller-supplied `sum_across_ranks` adds them up. With `sum_across_ranks = lambda t: t`
this is the whole algorithm on one process.

Cost: a `SegmentIndex`, built once per layout, turns "per tensor" into a fixed number of kernels
(docs/design.md §3), so a round costs the same whether the slice holds 4 tensors or 400.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from .config import CO2Config

EPS = 1e-12

SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]


class Segment(NamedTuple):
    """Elements [start, end) of a flat slice are elements [offset, offset + end - start) of the
    flattened parameter tensor `tensor_id`."""

    tensor_id: int
    start: int
    end: int
    offset: int = 0


class OuterHyper(NamedTuple):
    """The numbers the outer step needs (docs/design.md §3 c–f), read once from a `CO2Config`."""

    outer_lr: float  # α
    outer_momentum: float  # β
    nesterov: bool
    penalty: str  # "none" | "constant" | "adaptive"
    penalty_value: float  # λ of "constant"
    penalty_strength: float  # γ of "adaptive"
    clip: str  # "none" | "value" | "norm"
    clip_threshold: float  # φ
    staleness: float = 1.0  # the share of a round computed before the average in flight is applied: sync delay / τ

    @classmethod
    def from_config(cls, config: CO2Config) -> OuterHyper:
        penalty, clip = config.gap_penalty, config.clip
        return cls(
            outer_lr=float(config.effective("outer_lr")),
            outer_momentum=float(config.effective("outer_momentum")),
            nesterov=bool(config.nesterov),
            penalty=penalty.mode,
            penalty_value=float(penalty.value),
            penalty_strength=float(penalty.strength),
            clip=clip.mode,
            clip_threshold=float(clip.threshold),
            staleness=config.steps_before_apply / config.tau,
        )


class OuterResult(NamedTuple):
    update_sq_norms: torch.Tensor  # this rank's partial per-tensor ‖u‖², the next step's gap
    finite: bool  # False: the pseudo-gradient held NaN/Inf somewhere; the slice was left untouched


class SegmentIndex:
    """Which parameter tensor each element of a flat slice belongs to, stored so that per-tensor
    sums of squares and per-tensor scaling take a fixed number of kernels, however many segments.

    The span [start, stop) from the first segment's start to the last segment's end is cut into
    rows of `block` elements. A row lying inside one segment is reduced or scaled as a whole (one
    `vector_norm` over all rows, one broadcast `mul_`); the elements of the other rows (those a
    segment boundary or a gap crosses, and the tail after the last full row) are listed one by one,
    about `block` per segment. Elements outside every segment (gaps, padding) are left out.

    Memory, on the slice's device: int32 ids per row and per listed element, the listed elements'
    int64 positions and the int32 order of the per-tensor reduction: about 4·(2·rows + 4·listed)
    bytes. `block` ≈ √(span / segments) minimises rows + listed ≈ 2·√(span · segments): for
    GPT-2 small (124 M elements, 148 tensors) 2.6 MiB, 0.56% of one fp32 word per element
    (`nbytes`; counted in `co2_state_bytes()`). A per-element int32 tensor id would cost 100%.

    Reductions are deterministic (no atomics): the row and element sums are gathered in tensor
    order and reduced with one `segment_reduce`.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        num_tensors: int,
        device: Union[torch.device, str] = "cpu",
        block: Optional[int] = None,
    ) -> None:
        pieces = _checked(segments, num_tensors)
        self.num_tensors = num_tensors
        self.start = pieces[0].start if pieces else 0
        self.stop = pieces[-1].end if pieces else 0
        span = self.stop - self.start
        if block is None:  # a power of two near √(span / segments): rows + listed elements is smallest
            block = 2 ** max(0, round(math.log2(max(1.0, math.sqrt(span / max(1, len(pieces)))))))
        if block < 1:
            raise ValueError(f"co2: block={block} is invalid; accepted: an integer >= 1")
        self.block, self.rows = block, span // block
        row_tensor, listed_pos, listed_tensor = self._cut(pieces)

        # The per-tensor reduction reads [row sums, listed sums] in tensor order (stable: by position).
        ids = torch.cat([row_tensor, listed_tensor])
        keep = torch.nonzero(ids != num_tensors).squeeze(1)
        order = keep[torch.argsort(ids[keep], stable=True)]
        self.counts = torch.bincount(ids[keep], minlength=num_tensors).to(device)
        self.order = order.to(device=device, dtype=torch.int32)
        self.row_tensor = row_tensor.to(device=device, dtype=torch.int32)
        self.listed_pos = listed_pos.to(device)
        self.listed_tensor = listed_tensor.to(device=device, dtype=torch.int32)
        self.ones = torch.ones(1, dtype=torch.float32, device=device)  # the factor of rows in no segment

    def _cut(self, pieces: list[Segment]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tensor id per row (num_tensors: not inside one segment); positions and tensor ids of the
        listed elements, in position order."""
        row_tensor = torch.full((self.rows,), self.num_tensors, dtype=torch.int64)
        positions, ids = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
        for s in pieces:
            lo, hi = s.start - self.start, s.end - self.start
            first, last = -(-lo // self.block), hi // self.block  # the whole rows inside [lo, hi)
            if first < last:
                row_tensor[first:last] = s.tensor_id
                listed = [(lo, first * self.block), (last * self.block, hi)]
            else:
                listed = [(lo, hi)]
            for a, b in listed:
                positions.append(torch.arange(a, b, dtype=torch.int64))
                ids.append(torch.full((max(0, b - a),), s.tensor_id, dtype=torch.int64))
        return row_tensor, torch.cat(positions), torch.cat(ids)

    @property
    def nbytes(self) -> int:
        """Device bytes this index holds."""
        held = (self.row_tensor, self.listed_pos, self.listed_tensor, self.order, self.counts, self.ones)
        return sum(t.numel() * t.element_size() for t in held)

    def _span(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flat[start:stop], and its whole rows as a (rows, block) view."""
        if flat.dim() != 1 or flat.numel() < self.stop:
            raise ValueError(
                f"co2: the slice has shape {tuple(flat.shape)}; this segment index needs a 1-D slice of "
                f">= {self.stop} elements"
            )
        span = flat[self.start : self.stop]
        return span, span[: self.rows * self.block].view(self.rows, self.block)

    def sq_norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-tensor sums of squares of `flat` over the segments (length num_tensors).

        In float64: fp32 values above ~1.8e19 have squares beyond fp32's range, and a finite
        displacement must not be taken for a non-finite one. Only these few sums are float64."""
        span, rows = self._span(flat)
        row_sq = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).square()
        listed_sq = span.index_select(0, self.listed_pos).double().square()
        parts = torch.cat([row_sq, listed_sq]).index_select(0, self.order)
        return torch.segment_reduce(parts, "sum", lengths=self.counts, unsafe=True)

    def scale_(self, flat: torch.Tensor, factors: torch.Tensor) -> None:
        """flat[element] *= factors[tensor of element], in place, for every element of a segment."""
        span, rows = self._span(flat)
        rows.mul_(torch.cat([factors, self.ones]).index_select(0, self.row_tensor).unsqueeze(1))
        listed = span.index_select(0, self.listed_pos).mul_(factors.index_select(0, self.listed_tensor))
        span.index_copy_(0, self.listed_pos, listed)


def _checked(segments: Sequence[Segment], num_tensors: int) -> list[Segment]:
    """The non-empty segments sorted by start; overlapping or out-of-range ones are refused."""
    pieces = sorted((s for s in segments if s.end > s.start), key=lambda s: s.start)
    for before, after in zip(pieces, pieces[1:]):
        if after.start < before.end:
            raise ValueError(f"co2: segments {before} and {after} overlap; each element belongs to one tensor")
    for s in pieces:
        if not 0 <= s.tensor_id < num_tensors or s.start < 0:
            raise ValueError(f"co2: segment {s} is invalid; accepted: 0 <= tensor_id < {num_tensors}, start >= 0")
    return pieces


def gap_penalty(hyper: OuterHyper, g_norms: torch.Tensor, gap_norms: torch.Tensor) -> torch.Tensor:
    """Λ per tensor from the global norms of the pseudo-gradient g and of the staleness gap δ."""
    if hyper.penalty == "none":
        return torch.ones_like(g_norms)
    if hyper.penalty == "constant":
        return torch.full_like(g_norms, hyper.penalty_value)
    return 1.0 + hyper.penalty_strength * gap_norms / (g_norms + EPS)


def outer_step(
    g: torch.Tensor,
    momentum: torch.Tensor,
    base: torch.Tensor,
    *,
    segments: SegmentIndex,
    counted: SegmentIndex,
    previous_update_sq_norms: Optional[torch.Tensor],
    hyper: OuterHyper,
    sum_across_ranks: SumAcrossRanks,
) -> OuterResult:
    """One outer step on a slice (docs/design.md §3 b–f), in place.

    g: the averaged displacement on the slice; overwritten with the new start point
       `base - outer_lr * u`. momentum: m on the same slice, updated in place (not written when
       outer_momentum = 0 without Nesterov: m = g/Λ is then never read again). base: the start point
       the update applies to. segments: the tensor pieces of the slice; counted: the pieces this rank
       counts in global norms. previous_update_sq_norms: this rank's partial ‖u‖² of the previous
       step (the staleness gap is δ = -outer_lr * u, its norm scaled by `hyper.staleness`: the share of
       the round its displacement computed before the previous average was applied), or None when there
       is no gap (blocking mode, first step).

    A fixed number of kernels whatever the number of tensors, and one host sync: whether the norms
    are finite, which decides between raising/skipping and updating. The caller runs this on its
    background worker (its own CUDA stream), so that sync never stalls the compute stream; the norm
    clip is applied on the device.
    """
    alpha, beta, num_tensors = hyper.outer_lr, hyper.outer_momentum, counted.num_tensors
    gap_sq = previous_update_sq_norms
    if gap_sq is None:
        gap_sq = torch.zeros(num_tensors, dtype=torch.float64, device=g.device)
    # One small collective carries both per-tensor norm vectors.
    norms_sq = sum_across_ranks(torch.cat([counted.sq_norms(g), gap_sq]))
    if not bool(torch.isfinite(norms_sq).all()):  # the one host sync
        g.copy_(base)
        return OuterResult(torch.zeros(num_tensors, dtype=torch.float64, device=g.device), False)

    if hyper.penalty != "none":  # g <- g / Λ
        g_norms, gap_norms = norms_sq[:num_tensors].sqrt(), alpha * hyper.staleness * norms_sq[num_tensors:].sqrt()
        segments.scale_(g, gap_penalty(hyper, g_norms, gap_norms).reciprocal().to(g.dtype))
    if beta or hyper.nesterov:  # m <- β·m + g/Λ
        m = torch.add(g, momentum, alpha=beta, out=momentum) if beta else momentum.copy_(g)
    else:  # β = 0, heavy ball: m = g/Λ is read by nothing after this step, so it stays in g
        m = g

    clip_momentum_(m, hyper, lambda m: sum_across_ranks(counted.sq_norms(m).sum().reshape(1)))
    update = g.add_(m, alpha=beta) if hyper.nesterov else m  # u
    update_sq_norms = counted.sq_norms(update)
    torch.add(base, update, alpha=-alpha, out=g)  # elementwise: writing over u is safe
    return OuterResult(update_sq_norms, True)


def clip_momentum_(m: torch.Tensor, hyper: OuterHyper, total_sq_norm: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Outer momentum clipping, in place: each element to [-φ, φ] ("value"), or the whole momentum scaled
    to norm φ when above it ("norm"; `total_sq_norm(m)`: ‖m‖² over the model, one element)."""
    if hyper.clip == "value":
        m.clamp_(-hyper.clip_threshold, hyper.clip_threshold)
    elif hyper.clip == "norm":
        norm = total_sq_norm(m).sqrt()
        m.mul_(torch.where(norm > hyper.clip_threshold, hyper.clip_threshold / norm, 1.0).to(m.dtype))


def local_start(
    displacement: torch.Tensor,
    shared_start: torch.Tensor,
    stand_in_momentum: Optional[torch.Tensor],
    *,
    hyper: OuterHyper,
    out: torch.Tensor,
    sum_over_replica: SumAcrossRanks = lambda t: t,
) -> None:
    """This replica's next round start under the `local` stand-in (docs/design.md §3, "Stand-ins"): the
    outer step the average in flight will take from `shared_start`, on the replica's own displacement D
    instead, `shared_start - α·u` with m' = β·m + D, clipped as the step clips m, and u = β·m' + D
    (Nesterov) or m'; m is the outer momentum as of `shared_start` (`stand_in_momentum`,
    `track_momentum`; None when β = 0). Nothing is updated: the true step replaces this one when the
    average arrives. No penalty. Elementwise, but for the norm clip's ‖m'‖² over the replica's model
    (`sum_over_replica` adds up its shards' partial sums)."""
    beta = hyper.outer_momentum
    if beta:  # m' in `out`, clipped there, then the start written over it
        torch.add(displacement, stand_in_momentum, alpha=beta, out=out)
    else:
        out.copy_(displacement)
    clip_momentum_(out, hyper, lambda m: sum_over_replica(torch.linalg.vector_norm(m, dtype=torch.float64).square()))
    if hyper.nesterov:  # u = β·m' + D
        out.mul_(beta).add_(displacement)
    out.mul_(-hyper.outer_lr).add_(shared_start)


def track_momentum(
    stand_in_momentum: torch.Tensor, before: torch.Tensor, after: torch.Tensor, *, hyper: OuterHyper
) -> None:
    """The outer momentum m, on the whole partition, from the shared start's move `before -> after` = -α·u
    (the outer step applied to it): u = m (heavy ball), or u = β·m + g with m = β·m_old + g, so m =
    (u + β·m_old) / (1 + β) (Nesterov). Exact without a clip; the momentum itself may live sharded over
    the outer group (reduce_scatter), while the `local` stand-in needs all of it. In place, elementwise."""
    alpha, beta = hyper.outer_lr, hyper.outer_momentum
    if hyper.nesterov:
        stand_in_momentum.mul_(beta).sub_(after, alpha=1.0 / alpha).add_(before, alpha=1.0 / alpha).div_(1.0 + beta)
    else:
        torch.sub(before, after, out=stand_in_momentum).div_(alpha)
