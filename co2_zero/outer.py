"""The outer step on a flat slice of the partition: tensors in, tensors out, no torch.distributed.

A slice covers pieces of several parameter tensors; `Segment`s say which. Per-tensor norms (for the
gap penalty) and the global norm (for norm clipping) span every rank, so each rank computes partial
sums of squares over the pieces it *counts* (its sub-shard; every element is counted by exactly one
rank) and the caller-supplied `sum_across_ranks` adds them up. With `sum_across_ranks = lambda t: t`
this is the whole algorithm on one process.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

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


class OuterResult(NamedTuple):
    update_sq_norms: torch.Tensor  # this rank's partial per-tensor ‖u‖², the next step's gap
    finite: bool  # False: the pseudo-gradient held NaN/Inf somewhere; the slice was left untouched


def partial_sq_norms(flat: torch.Tensor, segments: Sequence[Segment], num_tensors: int) -> torch.Tensor:
    """Per-tensor sums of squares of `flat` over `segments` (fp32, length num_tensors)."""
    out = torch.zeros(num_tensors, dtype=torch.float32, device=flat.device)
    if segments:
        ids = torch.tensor([s.tensor_id for s in segments], device=flat.device)
        sums = torch.stack([flat[s.start : s.end].float().square().sum() for s in segments])
        out.index_add_(0, ids, sums)
    return out


def gap_penalty(config: CO2Config, g_norms: torch.Tensor, gap_norms: torch.Tensor) -> torch.Tensor:
    """Λ per tensor from the global norms of the pseudo-gradient g and of the staleness gap δ."""
    penalty = config.gap_penalty
    if penalty.mode == "none":
        return torch.ones_like(g_norms)
    if penalty.mode == "constant":
        return torch.full_like(g_norms, float(penalty.value))
    return 1.0 + float(penalty.strength) * gap_norms / (g_norms + EPS)


def scale_segments_(flat: torch.Tensor, segments: Sequence[Segment], factors: torch.Tensor) -> None:
    """flat[segment] *= factors[segment.tensor_id], in place."""
    if not segments:
        return
    for s, factor in zip(segments, factors[[s.tensor_id for s in segments]].tolist()):
        if factor != 1.0:
            flat[s.start : s.end].mul_(factor)


def outer_step(
    g: torch.Tensor,
    momentum: torch.Tensor,
    base: torch.Tensor,
    *,
    segments: Sequence[Segment],
    counted: Sequence[Segment],
    num_tensors: int,
    previous_update_sq_norms: Optional[torch.Tensor],
    config: CO2Config,
    sum_across_ranks: SumAcrossRanks,
) -> OuterResult:
    """One outer step on a slice (DESIGN.md §3 b–f), in place.

    g: the averaged displacement on the slice; overwritten with the new start point
       `base - outer_lr * u`. momentum: m on the same slice, updated in place. base: the start point
       the update applies to. segments: the tensor pieces of the slice; counted: the pieces this rank
       counts in global norms. previous_update_sq_norms: this rank's partial ‖u‖² of the previous
       step (the staleness gap is δ = -outer_lr * u), or None when there is no gap (blocking mode,
       first step).
    """
    alpha, beta = float(config.outer_lr), float(config.outer_momentum)
    gap_sq = previous_update_sq_norms
    if gap_sq is None:
        gap_sq = torch.zeros(num_tensors, dtype=torch.float32, device=g.device)
    # One small collective carries both per-tensor norm vectors.
    norms_sq = sum_across_ranks(torch.cat([partial_sq_norms(g, counted, num_tensors), gap_sq]))
    if not bool(torch.isfinite(norms_sq).all()):
        g.copy_(base)
        return OuterResult(torch.zeros(num_tensors, dtype=torch.float32, device=g.device), False)
    g_norms, gap_norms = norms_sq[:num_tensors].sqrt(), alpha * norms_sq[num_tensors:].sqrt()

    scale_segments_(g, segments, 1.0 / gap_penalty(config, g_norms, gap_norms))  # g <- g / Λ
    momentum.mul_(beta).add_(g)

    clip = config.clip
    if clip.mode == "value":
        momentum.clamp_(-clip.threshold, clip.threshold)
    elif clip.mode == "norm":
        counted_sq = partial_sq_norms(momentum, counted, num_tensors).sum().reshape(1)
        norm = float(sum_across_ranks(counted_sq).sqrt())
        if norm > clip.threshold:
            momentum.mul_(clip.threshold / norm)

    update = g.add_(momentum, alpha=beta) if config.nesterov else g.copy_(momentum)
    update_sq_norms = partial_sq_norms(update, counted, num_tensors)
    torch.add(base, update, alpha=-alpha, out=update)  # elementwise: writing over u is safe
    return OuterResult(update_sq_norms, True)
