"""The sparse exchange's codec (`co2_zero.core.sparse`, docs/design.md §5) against the plain per-chunk code of
tests/reference_compress.py, bit for bit, and its edge cases: a chunk of zeros, ties at the k-th value,
a chunk shorter than the rest, NaN/Inf, k rounding to 0; the payload's size against its formula."""

from __future__ import annotations

import math

import pytest
import torch

from co2_zero.core.compress import FORMATS, RecordLayout
from co2_zero.core.sparse import (
    CHUNK,
    INDEX_BITS,
    SparseLayout,
    add_decoded_,
    bit_pack,
    bit_unpack,
    chunk_k,
    encode_with_feedback_,
)
from tests.reference_compress import sparse_roundtrip

VALUE_FORMATS = ("fp32", "bf16", "int8", "fp8", "int4", "int2")


def _send(vector: torch.Tensor, fmt: str, topk: float, residual=None, decay: float = 1.0):
    """(what arrives, the new residual, the payload) when `vector` + decay · `residual` is sent."""
    layout = SparseLayout.for_length(vector.numel(), topk, fmt)
    residual = torch.zeros_like(vector) if residual is None else residual.clone()
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    encode_with_feedback_(vector.clone(), residual, layout, payload, decay)
    return add_decoded_(payload, layout, torch.zeros_like(vector)), residual, payload


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
@pytest.mark.parametrize("length", [1, 7, CHUNK, CHUNK + 1, 2 * CHUNK + 1808])
@pytest.mark.parametrize("topk", [0.015, 0.03, 0.5])
def test_codec_matches_reference_bit_for_bit(fmt, length, topk):
    gen = torch.Generator().manual_seed(length)
    vector = torch.randn(length, generator=gen) * torch.logspace(-3, 1, length)
    arrived, residual, _ = _send(vector, fmt, topk)
    expected, _ = sparse_roundtrip(vector, fmt, topk)
    assert torch.equal(arrived, expected)
    assert torch.equal(residual, vector - expected)  # error feedback keeps exactly what did not arrive
    sent = sum(chunk_k(topk, min(CHUNK, length - lo)) for lo in range(0, length, CHUNK))
    assert int((arrived != 0).sum()) <= sent and int((expected != 0).sum()) > 0


def test_error_feedback_residual_is_added_before_selection():
    vector = torch.zeros(CHUNK)
    residual = torch.zeros(CHUNK)
    residual[7] = 5.0  # what an earlier round could not send
    arrived, new_residual, _ = _send(vector, "fp32", 1 / CHUNK, residual)
    assert arrived[7] == 5.0 and int((arrived != 0).sum()) == 1 and not new_residual.any()


def test_a_decaying_residual_fades_before_selection():
    """feedback_decay β: the top-k of D + β·e is sent, and the residual keeps the rest of D + β·e."""
    vector, residual = torch.zeros(CHUNK), torch.zeros(CHUNK)
    vector[3], residual[7], residual[9] = 3.0, 4.0, -1.0
    arrived, new_residual, _ = _send(vector, "fp32", 1 / CHUNK, residual, decay=0.5)
    assert arrived[3] == 3.0 and int((arrived != 0).sum()) == 1  # 3 beats 4·0.5: the faded residual lost
    assert new_residual[7] == 2.0 and new_residual[9] == -0.5 and int((new_residual != 0).sum()) == 2


@pytest.mark.parametrize("fmt", ("int2", "int4", "fp32"))
@pytest.mark.parametrize("decay", [0.95, 0.5])
def test_decaying_feedback_matches_the_reference(fmt, decay):
    gen = torch.Generator().manual_seed(7)
    vector, residual = torch.randn(CHUNK + 100, generator=gen), torch.randn(CHUNK + 100, generator=gen)
    arrived, new_residual, _ = _send(vector, fmt, 0.03, residual, decay=decay)
    total = vector + decay * residual
    expected, _ = sparse_roundtrip(total, fmt, 0.03)
    assert torch.equal(arrived, expected)
    assert torch.equal(new_residual, total - expected)


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_a_chunk_of_zeros_sends_zeros(fmt):
    vector = torch.randn(3 * CHUNK)
    vector[CHUNK : 2 * CHUNK] = 0.0
    arrived, residual, _ = _send(vector, fmt, 0.03)
    assert not arrived[CHUNK : 2 * CHUNK].any() and not residual[CHUNK : 2 * CHUNK].any()
    assert arrived[:CHUNK].any() and arrived[2 * CHUNK :].any()


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_ties_at_the_kth_value_go_to_the_lower_indices(fmt):
    vector = torch.ones(CHUNK + 100)
    vector[CHUNK + 50] = -1.5  # the short chunk's largest (k = 2 of 100): taken, then the lowest tie
    arrived, _, payload = _send(vector, fmt, 0.015)
    k = chunk_k(0.015, CHUNK)
    assert torch.equal((arrived[:CHUNK] != 0).nonzero().flatten(), torch.arange(k))
    assert torch.equal((arrived[CHUNK:] != 0).nonzero().flatten(), torch.tensor([0, 50]))
    assert torch.equal(payload, _send(vector, fmt, 0.015)[2])  # the same bytes every time


def test_a_short_chunk_and_k_rounding_to_zero_still_send_one_element():
    assert chunk_k(0.015, CHUNK) == 61 and chunk_k(0.015, 10) == 1 and chunk_k(1e-9, CHUNK) == 1
    assert chunk_k(0.5, 3) == 2 and chunk_k(1.0, 5) == 5 and chunk_k(0.015, 0) == 0
    vector = torch.randn(2 * CHUNK + 10)
    layout = SparseLayout.for_length(vector.numel(), 1e-9, "int2")
    assert layout.sent == 3 and [(g.chunks, g.n, g.k) for g in layout.groups] == [(2, CHUNK, 1), (1, 10, 1)]
    arrived, _, _ = _send(vector, "fp32", 1e-9)
    for lo in (0, CHUNK, 2 * CHUNK):
        chunk = vector[lo : lo + CHUNK]
        assert int((arrived[lo : lo + CHUNK] != 0).sum()) == 1
        assert arrived[lo : lo + CHUNK].abs().max() == chunk.abs().max()


@pytest.mark.parametrize("fmt", ("int2", "fp32"))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_residual_is_still_sent_nonfinite_when_it_decays(fmt, bad):
    """β·NaN is NaN and β·Inf is Inf: a poisoned residual still reaches the peers as non-finite."""
    vector, residual = torch.randn(CHUNK), torch.zeros(CHUNK)
    residual[11] = bad
    arrived, _, _ = _send(vector, fmt, 0.015, residual, decay=0.95)
    assert not bool(arrived.isfinite().all())


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_chunks_stay_nonfinite(fmt, bad):
    vector = torch.randn(3 * CHUNK)
    vector[CHUNK + 123] = bad
    arrived, _, _ = _send(vector, fmt, 0.015)
    assert not arrived[CHUNK : 2 * CHUNK].isfinite().all()  # still seen as non-finite after the exchange
    assert arrived[:CHUNK].isfinite().all() and arrived[2 * CHUNK :].isfinite().all()


@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_payload_bytes_match_the_formula(fmt):
    """Per chunk: k values (fp32/bf16 raw; else a record: a 4-byte scale and k packed values, padded to 4
    bytes), plus k 12-bit indices; the whole payload padded to 4 bytes."""
    length, topk = 5 * CHUNK + 1000, 0.015
    layout = SparseLayout.for_length(length, topk, fmt)
    ks = [chunk_k(topk, CHUNK)] * 5 + [chunk_k(topk, 1000)]
    if fmt in ("fp32", "bf16"):
        values = sum(k * (4 if fmt == "fp32" else 2) for k in ks)
    else:
        values = sum(RecordLayout.for_length(k, block=k, bits=FORMATS[fmt].bits).nbytes for k in ks)
    assert layout.nbytes == 4 * math.ceil((values + math.ceil(sum(ks) * INDEX_BITS / 8)) / 4)
    _, _, payload = _send(torch.randn(length), fmt, topk)
    assert payload.numel() == layout.nbytes
    if fmt == "int2":  # the 1.5% int2 format: more than 140x fewer bytes than the fp32 vector
        assert 4 * length / layout.nbytes > 140


def test_bit_pack_roundtrips():
    values = torch.randint(0, 2**INDEX_BITS, (1001,), generator=torch.Generator().manual_seed(0))
    packed = torch.zeros(math.ceil(1001 * INDEX_BITS / 8), dtype=torch.uint8)
    bit_pack(values, INDEX_BITS, packed)
    assert torch.equal(bit_unpack(packed, INDEX_BITS, 1001), values)
    assert packed[0] == values[0] & 0xFF  # little-endian: the first value's low byte first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", VALUE_FORMATS)
def test_codec_on_cuda_matches_cpu_bit_for_bit(fmt):
    """The same payload and residual on both devices: replicas on different devices would still agree."""
    vector = torch.randn(2 * CHUNK + 333, generator=torch.Generator().manual_seed(0))
    vector[:CHUNK] = vector[:CHUNK].round()  # ties at the k-th value
    got = {}
    for device in ("cpu", "cuda"):
        layout = SparseLayout.for_length(vector.numel(), 0.015, fmt)
        residual = torch.full_like(vector, 0.01, device=device)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        encode_with_feedback_(vector.to(device), residual, layout, payload)
        got[device] = (payload.cpu(), residual.cpu())
    assert torch.equal(got["cpu"][0], got["cuda"][0]) and torch.equal(got["cpu"][1], got["cuda"][1])
