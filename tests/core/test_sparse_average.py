"""The sparse exchange's average (`sparse.average_over_senders_`, docs/design.md §5): each coordinate is the
mean over the replicas whose payload carries it, weighted by their R·w_r with `replica_tau`, 0 where none
does, against the per-chunk code of tests/reference_compress.py; the edge cases: a coordinate sent by one
replica, by every replica, by none, ties at the k-th value, NaN in one payload; and the overlap figure."""

from __future__ import annotations

import pytest
import torch

from co2_zero.core.sparse import CHUNK, SparseLayout, average_over_senders_, encode_with_feedback_
from tests.reference_compress import sparse_roundtrip


def _payloads(vectors: list[torch.Tensor], fmt: str, topk: float) -> tuple[torch.Tensor, SparseLayout]:
    layout = SparseLayout.for_length(vectors[0].numel(), topk, fmt)
    payloads = torch.empty(len(vectors), layout.nbytes, dtype=torch.uint8)
    for vector, payload in zip(vectors, payloads):
        encode_with_feedback_(vector.clone(), torch.zeros_like(vector), layout, payload)
    return payloads, layout


def _average(vectors: list[torch.Tensor], fmt: str, topk: float, scales=None):
    payloads, layout = _payloads(vectors, fmt, topk)
    scales = [1.0] * len(vectors) if scales is None else scales
    # the senders' mean alone: the outlier guard scaling the payloads first is tested in test_sparse_chunks.py
    return average_over_senders_(payloads, scales, layout, torch.empty_like(vectors[0]), guard=False)


def _expected(vectors: list[torch.Tensor], fmt: str, topk: float, scales=None) -> torch.Tensor:
    """The reference: the sum of what arrived over the sum of the senders' scales, per coordinate."""
    scales = [1.0] * len(vectors) if scales is None else scales
    total, weight = torch.zeros_like(vectors[0]), torch.zeros_like(vectors[0])
    for vector, scale in zip(vectors, scales):
        arrived, sent = sparse_roundtrip(vector, fmt, topk)
        total, weight = total + arrived, weight + sent * scale
    return torch.where(weight > 0, total / torch.where(weight > 0, weight, 1.0), 0.0)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_average_matches_the_reference_bit_for_bit(fmt, replicas):
    gen = torch.Generator().manual_seed(replicas)
    vectors = [torch.randn(2 * CHUNK + 700, generator=gen) for _ in range(replicas)]
    got = _average(vectors, fmt, 0.03)
    assert torch.equal(got.average, _expected(vectors, fmt, 0.03))


def test_a_coordinate_one_replica_sent_arrives_whole():
    """The mean over all R would cut it R times: the defect the senders' mean removes."""
    a, b = torch.zeros(CHUNK), torch.zeros(CHUNK)
    a[10], b[20] = 3.0, -2.0
    got = _average([a, b], "fp32", 1 / CHUNK).average
    assert got[10] == 3.0 and got[20] == -2.0
    assert int((got != 0).sum()) == 2


def test_a_coordinate_every_replica_sent_is_their_plain_mean_and_one_none_sent_is_zero():
    vectors = [torch.zeros(CHUNK) for _ in range(4)]
    for r, vector in enumerate(vectors):
        vector[5] = float(r + 1)
    got = _average(vectors, "fp32", 1 / CHUNK)
    assert got.average[5] == 2.5 and not got.average[6:].any() and not got.average[:5].any()
    assert float(got.senders_per_sent) == 4.0


def test_a_value_that_quantized_to_zero_was_still_sent():
    """int2 sends the elements below half a block's largest as 0: their replica still counts as a sender."""
    a, b = torch.zeros(CHUNK), torch.zeros(CHUNK)
    a[0], a[1], b[1] = 1.0, 0.1, 0.8  # a sends 0.1 as 0 (k = 2: elements 0 and 1)
    b[2] = 0.9
    got = _average([a, b], "int2", 2 / CHUNK).average
    assert torch.equal(got, _expected([a, b], "int2", 2 / CHUNK))
    assert got[1] == pytest.approx(0.9 / 2)  # (0 from a + 0.9 = b's block scale from b) over two senders


def test_ties_at_the_kth_value_go_to_the_lower_index_on_every_replica():
    vectors = [torch.ones(CHUNK), 2 * torch.ones(CHUNK)]
    got = _average(vectors, "fp32", 3 / CHUNK).average
    assert got[:3].tolist() == [1.5, 1.5, 1.5] and not got[3:].any()


@pytest.mark.parametrize("fmt", ["fp32", "int2"])
def test_nan_in_one_payload_stays_nan_where_it_was_sent(fmt):
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(2 * CHUNK, generator=gen) for _ in range(3)]
    vectors[1][CHUNK + 5] = float("nan")
    got = _average(vectors, fmt, 0.03).average
    assert got[CHUNK + 5].isnan() and got[:CHUNK].isfinite().all()  # the other chunk is untouched
    assert torch.equal(got.isnan(), _expected(vectors, fmt, 0.03).isnan())


def test_replica_weights_give_the_weighted_mean_over_the_senders():
    """replica_tau: replica r sends v_r = R·w_r·D_r; the average is Σ v_r / Σ R·w_r over the senders of each
    coordinate, the w-weighted mean of D_r over them (Σ w_r·D_r where every replica sent it)."""
    weights = [0.75, 0.25]
    scales = [2 * w for w in weights]
    d0, d1 = torch.zeros(CHUNK), torch.zeros(CHUNK)
    d0[0], d0[2], d1[0], d1[1] = 4.0, 1.0, 8.0, 6.0  # each replica sends two coordinates
    sent = [d0 * scales[0], d1 * scales[1]]
    got = _average(sent, "fp32", 2 / CHUNK, scales).average
    assert got[0] == pytest.approx(0.75 * 4.0 + 0.25 * 8.0) and got[1] == 6.0 and got[2] == 1.0
    assert torch.equal(got, _expected(sent, "fp32", 2 / CHUNK, scales))


def test_the_overlap_counts_senders_per_sent_coordinate():
    a, b = torch.zeros(CHUNK), torch.zeros(CHUNK)
    a[0], a[1], b[1], b[2] = 1.0, 1.0, 1.0, 1.0
    assert float(_average([a, b], "fp32", 2 / CHUNK).senders_per_sent) == pytest.approx(4 / 3)
