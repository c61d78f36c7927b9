"""Chunks like the field and the outlier guard of the sparse exchange (docs/design-communication.md §5), against
the span-by-span code and the median clip of tests/reference_compress.py: chunks restart at each tensor, a tensor
of one dimension goes whole, the payload's size follows from the segments alone; each payload's norm clipped to
the median of the R payloads' norms (R·w_r-weighted with `replica_tau`), a non-finite one left as it is."""

from __future__ import annotations

import math

import pytest
import torch

from co2_zero.core.compress import BLOCK, FORMATS, RecordLayout
from co2_zero.core.outer import Segment
from co2_zero.core.sparse import (
    CHUNK,
    INDEX_BITS,
    SparseLayout,
    add_decoded_,
    average_over_senders_,
    chunk_k,
    encode_with_feedback_,
    guard_enabled,
    median_clip,
)
from tests.reference_compress import median_clip as reference_clip
from tests.reference_compress import sparse_roundtrip

VALUE_FORMATS = ("fp32", "bf16", "int8", "fp8", "int4", "int2")
# a matrix of 5000 elements, a bias of 300 (tensor 1, one dimension), a matrix of 2·CHUNK, one of 77, padding
SEGMENTS = (Segment(0, 0, 5000), Segment(1, 5000, 5300), Segment(2, 5300, 5300 + 2 * CHUNK), Segment(3, 13492, 13569))
VECTORS = frozenset({1})
PADDED = 13572
SPANS = [(0, 5000, False), (5000, 5300, True), (5300, 13492, False), (13492, 13569, False), (13569, 13572, False)]


def _layout(fmt: str, topk: float) -> SparseLayout:
    return SparseLayout.for_tensors(SEGMENTS, VECTORS, PADDED, topk, fmt)


def _encode(vector: torch.Tensor, layout: SparseLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(the payload, the residual) of sending `vector` once."""
    payload, residual = torch.empty(layout.nbytes, dtype=torch.uint8), torch.zeros_like(vector)
    encode_with_feedback_(vector.clone(), residual, layout, payload)
    return payload, residual


def _vector(seed: int, length: int = PADDED) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, generator=gen) * torch.logspace(-3, 1, length)


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
@pytest.mark.parametrize("topk", [0.009, 0.015, 0.2])
def test_tensor_chunks_match_the_reference_bit_for_bit(fmt, topk):
    vector = _vector(7)
    layout = _layout(fmt, topk)
    payload, residual = _encode(vector, layout)
    arrived = add_decoded_(payload, layout, torch.zeros_like(vector))
    expected, sent = sparse_roundtrip(vector, fmt, topk, SPANS)
    assert torch.equal(arrived, expected)
    assert torch.equal(residual, vector - expected)
    assert layout.sent == int(sent.sum())


def test_chunks_restart_at_each_tensor_and_a_vector_goes_whole():
    layout = _layout("int2", 0.015)
    starts = [(g.start, g.chunks, g.n, g.k, g.dense) for g in layout.groups]
    assert starts == [
        (0, 1, CHUNK, 61, False),
        (CHUNK, 1, 5000 - CHUNK, 14, False),  # the matrix's short chunk: not shared with the bias
        (5000, 1, 300, 300, True),  # the bias: every element
        (5300, 2, CHUNK, 61, False),  # the next matrix from its own first element
        (13492, 1, 77, 1, False),
        (13569, 1, 3, 1, False),  # the padding
    ]


def test_full_chunks_of_adjacent_tensors_share_one_group():
    """Tensors of a multiple of CHUNK elements cost no group each: the same payload, fewer kernels."""
    segments = [Segment(i, i * 2 * CHUNK, (i + 1) * 2 * CHUNK) for i in range(3)]
    layout = SparseLayout.for_tensors(segments, frozenset(), 6 * CHUNK, 0.015, "int2")
    assert [(g.start, g.chunks) for g in layout.groups] == [(0, 6)]
    assert layout == SparseLayout.for_length(6 * CHUNK, 0.015, "int2")


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_the_payload_size_follows_from_the_segments(fmt):
    """Sparse chunks: a record of k values (one scale) and k 12-bit indices each; the bias: its 300 values in
    blocks of 256, no index; the whole padded to 4 bytes."""
    topk, layout = 0.015, _layout(fmt, 0.015)
    sizes = [CHUNK, 5000 - CHUNK, CHUNK, CHUNK, 77, 3]
    ks = [chunk_k(topk, n) for n in sizes]
    if fmt in ("fp32", "bf16"):
        values = (sum(ks) + 300) * (4 if fmt == "fp32" else 2)
    else:
        bits = FORMATS[fmt].bits
        values = sum(RecordLayout.for_length(k, block=k, bits=bits).nbytes for k in ks)
        values += RecordLayout.for_length(300, block=BLOCK, bits=bits).nbytes
    assert layout.nbytes == 4 * math.ceil((values + math.ceil(sum(ks) * INDEX_BITS / 8)) / 4)
    assert _encode(_vector(3), layout)[0].numel() == layout.nbytes


def test_a_vector_arrives_whole_and_keeps_only_its_rounding():
    vector = _vector(5)
    payload, residual = _encode(vector, _layout("fp32", 0.015))
    arrived = add_decoded_(payload, _layout("fp32", 0.015), torch.zeros_like(vector))
    assert torch.equal(arrived[5000:5300], vector[5000:5300]) and not residual[5000:5300].any()


def test_the_exchange_takes_flat_chunks_unless_the_study_switch_asks_for_tensor_chunks(monkeypatch):
    def exchange_layout() -> SparseLayout:
        return SparseLayout.for_partition(SEGMENTS, VECTORS, PADDED, 0.015, "int2")

    monkeypatch.delenv("CO2_SPARSE_CHUNKS", raising=False)
    assert exchange_layout() == SparseLayout.for_length(PADDED, 0.015, "int2")
    monkeypatch.setenv("CO2_SPARSE_CHUNKS", "tensor")
    assert exchange_layout() == _layout("int2", 0.015) != SparseLayout.for_length(PADDED, 0.015, "int2")
    monkeypatch.setenv("CO2_SPARSE_CHUNKS", "tensors")
    with pytest.raises(ValueError, match=r"CO2_SPARSE_CHUNKS='tensors'.*'flat'.*'tensor'"):
        exchange_layout()


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two():
    factors = median_clip(torch.tensor([1.0, 2.0, 3.0, 10.0]), torch.ones(4))
    assert torch.allclose(factors, torch.tensor([1.0, 1.0, 2.5 / 3.0, 0.25]))
    assert torch.equal(median_clip(torch.tensor([4.0, 1.0, 2.0]), torch.ones(3)), torch.tensor([0.5, 1.0, 1.0]))


def test_the_guard_compares_displacements_not_their_weights():
    """With `replica_tau` a fast replica sends R·w_r·D_r: a large payload for a large weight is no outlier."""
    norms, scales = torch.tensor([3.0, 1.0, 1.0]), torch.tensor([3.0, 1.0, 1.0])
    assert torch.equal(median_clip(norms, scales), torch.ones(3))
    assert torch.equal(median_clip(norms, torch.ones(3)), torch.tensor([1.0 / 3.0, 1.0, 1.0]))


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Close to the float tolerance of the norms (fp32 here, float64 in the reference), where the senders'
    sum of values of both signs may cancel."""
    scale = float(expected[expected.isfinite()].abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)


def _payloads(vectors: list[torch.Tensor], layout: SparseLayout) -> torch.Tensor:
    return torch.stack([_encode(v, layout)[0] for v in vectors])


def _reference_average(vectors, fmt, topk, scales, spans=SPANS):
    arrivals, weight = [], torch.zeros_like(vectors[0])
    for vector, scale in zip(vectors, scales):
        arrived, sent = sparse_roundtrip(vector, fmt, topk, spans)
        arrivals.append(arrived)
        weight = weight + sent * scale
    total = sum(reference_clip(arrivals, scales)[1:], reference_clip(arrivals, scales)[0])
    return torch.where(weight > 0, total / torch.where(weight > 0, weight, 1.0), 0.0)


@pytest.mark.parametrize("fmt", ["fp32", "int4", "int2"])
@pytest.mark.parametrize("scales", [[1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.4, 1.6], [0.5, 1.5, 1.0, 1.0]])
def test_the_guarded_average_matches_the_reference(fmt, scales):
    vectors = [_vector(10 + r) * (1 + 3 * r) for r in range(len(scales))]  # the norms differ
    layout = _layout(fmt, 0.015)
    got = average_over_senders_(_payloads(vectors, layout), scales, layout, torch.empty(PADDED))
    expected = _reference_average(vectors, fmt, 0.015, scales)
    _assert_close(got.average, expected)
    unguarded = average_over_senders_(_payloads(vectors, layout), scales, layout, torch.empty(PADDED), guard=False)
    assert not torch.allclose(unguarded.average, expected, rtol=1e-3, atol=0)  # the test can tell


def test_one_replica_outlier_moves_the_average_no_more_than_a_typical_one():
    typical = [_vector(20 + r) for r in range(3)]
    outlier = _vector(30) * 1000
    layout = _layout("fp32", 0.015)
    guarded = average_over_senders_(_payloads(typical + [outlier], layout), [1.0] * 4, layout, torch.empty(PADDED))
    plain = average_over_senders_(
        _payloads(typical + [outlier], layout), [1.0] * 4, layout, torch.empty(PADDED), guard=False
    )
    largest_typical = max(
        float(add_decoded_(p, layout, torch.zeros(PADDED)).norm()) for p in _payloads(typical, layout)
    )
    assert float(guarded.average.norm()) <= 4 * largest_typical  # each clipped payload's norm: the median
    assert float(plain.average.norm()) > 100 * largest_typical


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_payload_stays_nonfinite_and_is_not_counted_in_the_median(bad):
    vectors = [_vector(40 + r) for r in range(3)]
    vectors[1][5100] = bad  # in the bias: sent by every replica
    layout = _layout("int8", 0.015)
    got = average_over_senders_(_payloads(vectors, layout), [1.0] * 3, layout, torch.empty(PADDED)).average
    assert not got[5000:5256].isfinite().any()  # the bias's first int8 block shares the bad value's scale
    assert got[:5000].isfinite().all() and got[5256:].isfinite().all()
    expected = _reference_average([v.clone() for v in vectors], "int8", 0.015, [1.0] * 3)
    _assert_close(got[:5000], expected[:5000])


def test_a_huge_but_finite_payload_is_clipped_too():
    """1e20 squared overflows fp32: the norms are float64, so the guard still sees a finite outlier."""
    vectors = [_vector(60 + r) for r in range(3)]
    vectors[2][7] = 1e20
    layout = SparseLayout.for_length(PADDED, 0.015, "fp32")
    got = average_over_senders_(_payloads(vectors, layout), [1.0] * 3, layout, torch.empty(PADDED)).average
    assert got.isfinite().all() and float(got.abs().max()) < 1e3


def test_every_replica_decoding_the_same_payloads_holds_the_same_bits():
    vectors = [_vector(50 + r) * (r + 1) for r in range(4)]
    layout = SparseLayout.for_length(PADDED, 0.009, "fp32")  # fp32 values are decoded as views of the bytes
    payloads = _payloads(vectors, layout)
    sent = payloads.clone()
    first = average_over_senders_(payloads, [1.0] * 4, layout, torch.empty(PADDED)).average
    assert torch.equal(payloads, sent)  # decoding leaves the received bytes as they were
    again = average_over_senders_(payloads, [1.0] * 4, layout, torch.empty(PADDED)).average
    assert torch.equal(first, again)


def test_the_guard_switch_is_on_unless_the_study_turns_it_off(monkeypatch):
    monkeypatch.delenv("CO2_SPARSE_GUARD", raising=False)
    assert guard_enabled()
    monkeypatch.setenv("CO2_SPARSE_GUARD", "off")
    assert not guard_enabled()
    monkeypatch.setenv("CO2_SPARSE_GUARD", "no")
    with pytest.raises(ValueError, match=r"CO2_SPARSE_GUARD='no'.*'on'.*'off'"):
        guard_enabled()
