"""The outer step's fused kernels (co2_zero/core/outer.py) against plain per-segment loops written here.

`SegmentIndex` makes per-tensor sums of squares and per-tensor scaling a fixed number of kernels;
these tests compare it with the obvious loop over segments on awkward layouts (offsets, gaps,
padding, empty slices, a tensor split in two, every block size), compare a whole `outer_step` with a
float64 loop version, and count with the profiler that the kernels one outer step launches do not
grow with the number of tensors, with one host sync (the finite check).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from co2_zero.core.config import PUBLISHED, CO2Config
from co2_zero.core.outer import EPS, OuterHyper, Segment, SegmentIndex, outer_step

torch.set_num_threads(1)


# ---- the obvious versions, one segment at a time -----------------------------------------------------


def loop_sq_norms(flat: torch.Tensor, segments: list[Segment], num_tensors: int) -> torch.Tensor:
    out = torch.zeros(num_tensors, dtype=torch.float64)
    for s in segments:
        out[s.tensor_id] += flat[s.start : s.end].double().square().sum()
    return out


def loop_scale_(flat: torch.Tensor, segments: list[Segment], factors: torch.Tensor) -> None:
    for s in segments:
        flat[s.start : s.end].mul_(factors[s.tensor_id])


def loop_outer_step(g, momentum, base, segments, counted, num_tensors, previous, hyper: OuterHyper):
    """docs/design.md §3 b–f on one process, in float64, one segment at a time. Returns (new start,
    momentum, per-tensor ‖u‖² over `counted`)."""
    g, m, base = g.double().clone(), momentum.double().clone(), base.double()
    alpha, beta = hyper.outer_lr, hyper.outer_momentum
    g_norms = loop_sq_norms(g, counted, num_tensors).sqrt()
    gap_norms = alpha * (torch.zeros(num_tensors) if previous is None else previous).double().sqrt()
    for s in segments:
        t = s.tensor_id
        if hyper.penalty == "constant":
            g[s.start : s.end] /= hyper.penalty_value
        elif hyper.penalty == "adaptive":
            g[s.start : s.end] /= 1 + hyper.penalty_strength * gap_norms[t] / (g_norms[t] + EPS)
    m = beta * m + g
    if hyper.clip == "value":
        m = m.clamp(-hyper.clip_threshold, hyper.clip_threshold)
    elif hyper.clip == "norm":
        norm = loop_sq_norms(m, counted, num_tensors).sum().sqrt()
        if norm > hyper.clip_threshold:
            m = m * (hyper.clip_threshold / norm)
    u = beta * m + g if hyper.nesterov else m
    return base - alpha * u, m, loop_sq_norms(u, counted, num_tensors)


# ---- layouts --------------------------------------------------------------------------------------------


def contiguous(sizes: list[int], start: int = 0) -> list[Segment]:
    segments, at = [], start
    for i, n in enumerate(sizes):
        segments.append(Segment(i, at, at + n))
        at += n
    return segments


LAYOUTS = {
    # name: (segments, slice length, num_tensors)
    "contiguous": (contiguous([7, 1, 30, 64, 5]), 107, 5),
    "padding": (contiguous([7, 1, 30, 64, 5]), 112, 5),
    "offset-and-gaps": ([Segment(2, 3, 20, 11), Segment(0, 25, 26), Segment(4, 40, 97, 3)], 100, 6),
    "split-tensor": ([Segment(1, 0, 9), Segment(0, 9, 50), Segment(1, 50, 77, 9)], 80, 2),
    "out-of-order": ([Segment(3, 60, 64), Segment(1, 0, 17), Segment(0, 17, 60)], 64, 4),
    "empty-segments": ([Segment(0, 0, 0), Segment(1, 5, 5), Segment(2, 5, 9)], 12, 3),
    "no-segments": ([], 10, 3),
    "empty-slice": ([], 0, 3),
    "one-element": ([Segment(0, 0, 1)], 1, 1),
}


def random_layout(seed: int) -> tuple[list[Segment], int, int]:
    """Pieces of random tensors with random gaps, some tensors in two pieces, in shuffled order."""
    rng = random.Random(seed)
    num_tensors = rng.randint(1, 30)
    segments, at = [], rng.randint(0, 5)
    for _ in range(rng.randint(1, 40)):
        length = rng.choice([0, 1, 2, rng.randint(1, 20), rng.randint(20, 300)])
        segments.append(Segment(rng.randrange(num_tensors), at, at + length, rng.randint(0, 50)))
        at += length + rng.choice([0, 0, 0, rng.randint(1, 9)])
    rng.shuffle(segments)
    return segments, at + rng.randint(0, 7), num_tensors


CASES = [(name, *layout) for name, layout in LAYOUTS.items()]
CASES += [(f"random-{seed}", *random_layout(seed)) for seed in range(12)]
BLOCKS = [None, 1, 3, 8, 64, 4096]


def data(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(seed))


# ---- SegmentIndex against the loops ---------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name,segments,length,num_tensors", CASES, ids=[c[0] for c in CASES])
def test_sq_norms_match_the_loop(name, segments, length, num_tensors, block):
    flat = data(length)
    index = SegmentIndex(segments, num_tensors, block=block)
    got = index.sq_norms(flat)
    assert got.dtype == torch.float64 and got.shape == (num_tensors,)  # float64: no overflow of squares
    torch.testing.assert_close(got.double(), loop_sq_norms(flat, segments, num_tensors), rtol=1e-9, atol=1e-9)


def test_sq_norms_of_huge_finite_values_do_not_overflow():
    """fp32 values of 1e20 square past fp32's range; their sums of squares stay finite (float64)."""
    flat = torch.full((300,), 1e20)
    index = SegmentIndex([Segment(0, 0, 100), Segment(1, 100, 300)], 2, block=16)
    got = index.sq_norms(flat)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor([100 * 1e40, 200 * 1e40], dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name,segments,length,num_tensors", CASES, ids=[c[0] for c in CASES])
def test_scale_matches_the_loop_exactly(name, segments, length, num_tensors, block):
    factors = torch.rand(num_tensors, generator=torch.Generator().manual_seed(1)) + 0.5
    expected, got = data(length), data(length)
    loop_scale_(expected, segments, factors)
    SegmentIndex(segments, num_tensors, block=block).scale_(got, factors)
    assert torch.equal(got, expected)  # the same multiplications; elements outside every segment untouched


def test_scale_does_not_touch_elements_outside_the_segments():
    flat = torch.full((40,), float("nan"))
    flat[5:12] = 1.0
    flat[30:33] = 1.0
    index = SegmentIndex([Segment(0, 5, 12), Segment(1, 30, 33)], 2, block=4)
    index.scale_(flat, torch.tensor([2.0, 3.0]))
    assert torch.equal(flat[5:12], torch.full((7,), 2.0)) and torch.equal(flat[30:33], torch.full((3,), 3.0))
    outside = torch.cat([flat[:5], flat[12:30], flat[33:]])
    assert outside.isnan().all()
    assert torch.equal(index.sq_norms(flat), torch.tensor([28.0, 27.0]))  # the NaN gaps are not read


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        SegmentIndex([Segment(0, 0, 10), Segment(1, 5, 12)], 2)
    with pytest.raises(ValueError, match="tensor_id"):
        SegmentIndex([Segment(3, 0, 10)], 2)
    with pytest.raises(ValueError, match=">= 12 elements"):
        SegmentIndex([Segment(0, 2, 12)], 1).sq_norms(torch.zeros(11))


def gpt2_small_segments() -> list[Segment]:
    """The 148 parameter tensors of GPT-2 small (124 M elements, tied head), in module order."""
    d, sizes = 768, [50257 * 768, 1024 * 768]
    for _ in range(12):
        sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return contiguous(sizes + [d, d])


def test_index_memory_is_small_for_gpt2_small():
    """docs/design.md §4: the index costs well under 1% of one fp32 word per element."""
    segments = gpt2_small_segments()
    span = segments[-1].end
    assert len(segments) == 148 and span == 124_439_808
    index = SegmentIndex(segments, len(segments))
    listed = index.listed_pos.numel()
    assert listed <= 2 * len(segments) * index.block  # at most two partial rows per segment
    assert index.nbytes == 4 * index.rows + 12 * listed + 4 * index.order.numel() + 8 * len(segments) + 4
    assert index.nbytes < 0.01 * 4 * span, index.nbytes


# ---- the whole outer step -------------------------------------------------------------------------------


def hyper(**fields) -> OuterHyper:
    """The outer step's hyperparameters of a config (the stand-in, which clipping needs shared, aside)."""
    return OuterHyper.from_config(CO2Config(**{"stand_in": "shared", **fields}))


HYPERS = {
    "defaults": hyper(),
    "published": hyper(**PUBLISHED),
    "heavyball-adaptive-clipnorm": hyper(
        outer_lr=0.8,
        outer_momentum=0.5,
        nesterov=False,
        gap_penalty={"mode": "adaptive", "strength": 1.5},
        clip={"mode": "norm", "threshold": 0.5},
    ),
    "nesterov-constant-clipvalue": hyper(
        outer_lr=0.7,
        outer_momentum=0.9,
        nesterov=True,
        gap_penalty={"mode": "constant", "value": 2.0},
        clip={"mode": "value", "threshold": 0.05},
    ),
    "nesterov-none-clipnorm-inactive": hyper(
        outer_lr=0.7, outer_momentum=0.9, nesterov=True, gap_penalty={"mode": "none"}, clip={"mode": "norm"}
    ),
}
STEP_LAYOUTS = ["contiguous", "offset-and-gaps", "split-tensor", "no-segments", "empty-slice"]


@pytest.mark.parametrize("with_gap", [False, True])
@pytest.mark.parametrize("counted_part", ["all", "middle"])
@pytest.mark.parametrize("layout", STEP_LAYOUTS)
@pytest.mark.parametrize("name", list(HYPERS))
def test_outer_step_matches_the_loop(name, layout, counted_part, with_gap):
    segments, length, num_tensors = LAYOUTS[layout]
    counted = segments
    if counted_part == "middle":  # all_reduce: this rank counts only its sub-shard of the slice
        lo, hi = length // 3, 2 * length // 3
        counted = [s._replace(start=max(s.start, lo), end=min(s.end, hi)) for s in segments]
        counted = [s for s in counted if s.start < s.end]
    g, momentum, base = data(length, 1) * 0.1, data(length, 2) * 0.1, data(length, 3)
    m_before = momentum.clone()
    previous = torch.rand(num_tensors, generator=torch.Generator().manual_seed(4)) if with_gap else None
    expected_x, expected_m, expected_u = loop_outer_step(
        g, momentum, base, segments, counted, num_tensors, previous, HYPERS[name]
    )

    result = outer_step(
        g,
        momentum,
        base,
        segments=SegmentIndex(segments, num_tensors),
        counted=SegmentIndex(counted, num_tensors),
        previous_update_sq_norms=previous,
        hyper=HYPERS[name],
        sum_across_ranks=lambda t: t,
    )
    assert result.finite
    torch.testing.assert_close(g.double(), expected_x, rtol=1e-5, atol=1e-6)
    check_momentum(momentum, expected_m, m_before, HYPERS[name])
    torch.testing.assert_close(result.update_sq_norms.double(), expected_u, rtol=1e-5, atol=1e-7)


def check_momentum(momentum, expected, before, step_hyper: OuterHyper) -> None:
    """m as the loop computes it; with β = 0 and heavy ball m is never read, and the buffer is left alone."""
    if step_hyper.outer_momentum == 0 and not step_hyper.nesterov:
        assert torch.equal(momentum.cpu(), before)
    else:
        torch.testing.assert_close(momentum.cpu().double(), expected, rtol=1e-5, atol=1e-6)


def test_norm_clip_rescales_on_the_device():
    """The clip reads the global norm through sum_across_ranks and never returns it to the host."""
    segments = contiguous([10, 20])
    g, momentum, base = torch.full((30,), 2.0), torch.zeros(30), torch.zeros(30)
    seen = []

    def sum_across_ranks(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return t

    outer_step(
        g,
        momentum,
        base,
        segments=SegmentIndex(segments, 2),
        counted=SegmentIndex(segments, 2),
        previous_update_sq_norms=None,
        hyper=hyper(
            outer_lr=1.0, outer_momentum=0.5, nesterov=False, gap_penalty={"mode": "none"}, clip={"mode": "norm"}
        ),
        sum_across_ranks=sum_across_ranks,
    )
    assert [t.numel() for t in seen] == [4, 1]  # the per-tensor norms, then ‖m‖²
    torch.testing.assert_close(seen[1], torch.tensor([120.0], dtype=torch.float64))
    torch.testing.assert_close(torch.linalg.vector_norm(momentum), torch.tensor(1.0))
    torch.testing.assert_close(g, -momentum)


def test_nonfinite_leaves_the_state_untouched():
    segments = contiguous([10, 20])
    g, momentum, base = data(30, 1), data(30, 2), data(30, 3)
    g[17] = float("inf")
    m_before = momentum.clone()
    result = outer_step(
        g,
        momentum,
        base,
        segments=SegmentIndex(segments, 2),
        counted=SegmentIndex(segments, 2),
        previous_update_sq_norms=None,
        hyper=hyper(outer_momentum=0.5),
        sum_across_ranks=lambda t: t,
    )
    assert not result.finite
    assert torch.equal(g, base) and torch.equal(momentum, m_before)
    assert torch.equal(result.update_sq_norms, torch.zeros(2))


# ---- cost: kernels and host syncs do not grow with the number of tensors ----------------------------------

HOST_SYNC = "aten::_local_scalar_dense"  # what .item(), bool(t), float(t) and .tolist() of a scalar run


def profiled_ops(num_tensors: int, elements: int, step_hyper: OuterHyper, counted_fraction: float = 1.0) -> Counter:
    """Ops (aten calls, nested ones included) of one outer_step over `num_tensors` equal tensors."""
    sizes = [elements // num_tensors] * num_tensors
    sizes[-1] += elements - sum(sizes)
    segments = contiguous(sizes)
    length = elements + 3  # padding
    counted = [s for s in segments if s.end <= int(counted_fraction * elements)]
    kwargs = dict(
        segments=SegmentIndex(segments, num_tensors),
        counted=SegmentIndex(counted, num_tensors),
        previous_update_sq_norms=torch.rand(num_tensors),
        hyper=step_hyper,
        sum_across_ranks=lambda t: t,
    )
    g, momentum, base = data(length, 1), data(length, 2), data(length, 3)
    outer_step(g.clone(), momentum.clone(), base, **kwargs)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outer_step(g, momentum, base, **kwargs)
    return Counter(e.name for e in prof.events())


@pytest.mark.parametrize("name", list(HYPERS))
def test_kernel_count_does_not_grow_with_the_number_of_tensors(name):
    few = profiled_ops(4, 40_000, HYPERS[name])
    many = profiled_ops(400, 40_000, HYPERS[name])
    more_elements = profiled_ops(400, 120_000, HYPERS[name], counted_fraction=0.5)
    assert sum(few.values()) < 200, few  # aten calls, views and nested ones included
    assert many == few, (few - many) + (many - few)
    assert more_elements == few, (few - more_elements) + (more_elements - few)
    assert few[HOST_SYNC] == 1, f"expected one host sync (the finite check), saw {few[HOST_SYNC]}: {few}"


def test_profiler_sees_a_per_segment_loop():
    """The counting above can fail: the per-segment loop that the index replaces grows with tensors."""

    def loop_ops(num_tensors: int) -> int:
        flat, segments = data(4000), contiguous([4000 // num_tensors] * num_tensors)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.stack([flat[s.start : s.end].square().sum() for s in segments])
        return len(prof.events())

    assert loop_ops(40) > 5 * loop_ops(4)


# ---- CUDA: the same kernels on the device, and no host sync in them ---------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name,segments,length,num_tensors", CASES, ids=[c[0] for c in CASES])
def test_cuda_index_matches_the_loop_without_host_syncs(name, segments, length, num_tensors):
    flat = data(length)
    factors = torch.rand(num_tensors, generator=torch.Generator().manual_seed(1)) + 0.5
    index = SegmentIndex(segments, num_tensors, device="cuda")
    on_device, factors_on_device = flat.cuda(), factors.cuda()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the kernels below raises
    try:
        norms = index.sq_norms(on_device)
        index.scale_(on_device, factors_on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(norms.cpu().double(), loop_sq_norms(flat, segments, num_tensors), rtol=2e-6, atol=1e-6)
    loop_scale_(flat, segments, factors)
    assert torch.equal(on_device.cpu(), flat)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", list(HYPERS))
def test_cuda_outer_step_matches_the_loop_with_one_host_sync(name):
    segments, length, num_tensors = LAYOUTS["split-tensor"]
    g, momentum, base = data(length, 1) * 0.1, data(length, 2) * 0.1, data(length, 3)
    previous = torch.rand(num_tensors, generator=torch.Generator().manual_seed(4))
    expected_x, expected_m, expected_u = loop_outer_step(
        g, momentum, base, segments, segments, num_tensors, previous, HYPERS[name]
    )
    index = SegmentIndex(segments, num_tensors, device="cuda")
    m_before = momentum.clone()
    g, momentum, base, previous = g.cuda(), momentum.cuda(), base.cuda(), previous.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as syncs:
            result = outer_step(
                g,
                momentum,
                base,
                segments=index,
                counted=index,
                previous_update_sq_norms=previous,
                hyper=HYPERS[name],
                sum_across_ranks=lambda t: t,
            )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in syncs if "synchroniz" in str(w.message)]) == 1  # the finite check
    torch.testing.assert_close(g.cpu().double(), expected_x, rtol=1e-5, atol=1e-6)
    check_momentum(momentum, expected_m, m_before, HYPERS[name])
    torch.testing.assert_close(result.update_sq_norms.cpu().double(), expected_u, rtol=1e-5, atol=1e-7)
