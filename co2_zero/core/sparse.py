"""The sparse exchange's codec: top-k of each chunk, chunk-local indices, quantized values, error
feedback (docs/design.md §5). Pure tensor functions, no torch.distributed.

A vector of `length` elements is cut into chunks of `CHUNK` consecutive elements (the last one may be
shorter). Chunk c of n elements sends its k(n) = max(1, round(topk · n)) elements largest in magnitude;
a tie at the k-th magnitude goes to the lower index, and NaN counts as larger than any number (so a
non-finite chunk always sends a non-finite element). The payload is one byte string of fixed size,
whatever the values:

- the values: per chunk, a record of `compress` (one block of k elements, its scale first) in an
  int8/fp8/int4/int2 `comm_dtype`, or the k raw fp32/bf16 values; full chunks first, then the short one;
- the indices: every chunk's k chunk-local indices in ascending order, `INDEX_BITS` bits each, packed
  little-endian over the whole payload (`bit_pack`).

A quantized chunk holding NaN/Inf has a non-finite scale, so every value it sends decodes non-finite.
Error feedback (`encode_with_feedback_`): the residual keeps everything not sent and the quantization
error of what was, exactly as `compress.quantize_with_feedback_`; with `feedback_decay` β < 1 it is
scaled by β before it is added (SparseLoCo's decaying accumulator).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .compress import FORMATS, RecordLayout, dequantize_into, quantize_into

CHUNK = 4096  # elements per chunk
INDEX_BITS = 12  # a chunk-local index: 0 .. CHUNK - 1
RAW = {"fp32": torch.float32, "bf16": torch.bfloat16}  # values sent as they are


def chunk_k(topk: float, n: int) -> int:
    """Elements a chunk of `n` sends: round(topk · n), half up, at least one (no chunk is left out for
    good: a chunk that sent nothing would never move the shared start)."""
    return max(1, min(n, math.floor(topk * n + 0.5))) if n else 0


class Group(NamedTuple):
    """Chunks of one size: `chunks` of `n` elements, `k` sent from each, records of `record` bytes."""

    start: int  # first element
    chunks: int
    n: int
    k: int
    record: int  # bytes of one chunk's values


class SparseLayout(NamedTuple):
    """The payload of a vector of `length` elements: the groups of chunks, their value bytes, the indices."""

    length: int
    value_format: str
    groups: tuple[Group, ...]
    index_offset: int  # where the packed indices start (the value records before them)
    nbytes: int

    @classmethod
    def for_length(cls, length: int, topk: float, value_format: str, chunk: int = CHUNK) -> SparseLayout:
        full, last = divmod(length, chunk)
        sizes = [(0, full, chunk)] if full else []
        if last:
            sizes.append((full * chunk, 1, last))
        groups, offset = [], 0
        for start, chunks, n in sizes:
            k = chunk_k(topk, n)
            record = _value_bytes(value_format, k)
            groups.append(Group(start, chunks, n, k, record))
            offset += chunks * record
        indices = sum(g.chunks * g.k for g in groups)
        nbytes = 4 * math.ceil((offset + math.ceil(indices * INDEX_BITS / 8)) / 4)
        return cls(length, value_format, tuple(groups), offset, nbytes)

    @property
    def sent(self) -> int:
        """Elements sent per payload."""
        return sum(g.chunks * g.k for g in self.groups)


def _value_bytes(value_format: str, k: int) -> int:
    if value_format in RAW:
        return k * RAW[value_format].itemsize
    return RecordLayout.for_length(k, block=k, bits=FORMATS[value_format].bits).nbytes


def select(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (chunks, k; ascending) of each row's k elements largest in magnitude, ties to the lower
    index, NaN largest of all."""
    magnitude = rows.abs().nan_to_num_(nan=math.inf)
    kth = magnitude.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = magnitude > kth
    ties = magnitude == kth
    room = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(dim=-1) <= room))
    return chosen.nonzero()[:, 1].view(rows.shape[0], k)


def _encode_values(values: torch.Tensor, value_format: str, records: torch.Tensor) -> torch.Tensor:
    """records (chunks, record bytes) <- `values` (chunks, k); returns what the receiver decodes."""
    if value_format in RAW:
        sent = values.to(RAW[value_format])
        records.copy_(sent.view(torch.uint8).view(records.shape))
        return sent.float()
    fmt, k = FORMATS[value_format], values.shape[-1]
    quantize_into(values, fmt, records, scratch=torch.empty_like(values), block=k)
    return dequantize_into(records, fmt, out=torch.empty_like(values), block=k)


def _decode_values(records: torch.Tensor, value_format: str, k: int) -> torch.Tensor:
    if value_format in RAW:
        return records.contiguous().view(RAW[value_format]).view(records.shape[0], k).float()
    out = torch.empty(records.shape[0], k, dtype=torch.float32, device=records.device)
    return dequantize_into(records, FORMATS[value_format], out=out, block=k)


def _sections(payload: torch.Tensor, layout: SparseLayout):
    """(group, its rows' records (chunks, record bytes)) for every group of `layout` in `payload`."""
    offset = 0
    for group in layout.groups:
        size = group.chunks * group.record
        yield group, payload[offset : offset + size].view(group.chunks, group.record)
        offset += size


def _rows(vector: torch.Tensor, group: Group) -> torch.Tensor:
    return vector[group.start : group.start + group.chunks * group.n].view(group.chunks, group.n)


def encode_with_feedback_(
    vector: torch.Tensor, residual: torch.Tensor, layout: SparseLayout, payload: torch.Tensor, decay: float = 1.0
) -> None:
    """One error-feedback step: vector <- vector + decay · residual; payload (uint8, `layout.nbytes`) <- its
    top-k encoding; residual <- vector - what the payload decodes to (fp32 vectors of `layout.length`)."""
    if decay != 1.0:
        residual.mul_(decay)  # then added: the rounding of D + (β·e), as specified
    vector.add_(residual)
    residual.copy_(vector)
    payload.zero_()  # the records' padding too: the same bytes for the same input
    indices = []
    for group, records in _sections(payload, layout):
        rows, idx = _rows(vector, group), select(_rows(vector, group), group.k)
        picked = rows.gather(-1, idx)
        arrived = _encode_values(picked, layout.value_format, records)
        _rows(residual, group).scatter_(-1, idx, picked - arrived)
        indices.append(idx.flatten())
    bit_pack(torch.cat(indices), INDEX_BITS, payload[layout.index_offset :])


def _carried(payload: torch.Tensor, layout: SparseLayout):
    """(group, its rows' records, their chunk-local indices (chunks, k)) for every group of `payload`."""
    indices = bit_unpack(payload[layout.index_offset :], INDEX_BITS, layout.sent)
    used = 0
    for group, records in _sections(payload, layout):
        count = group.chunks * group.k
        yield group, records, indices[used : used + count].view(group.chunks, group.k)
        used += count


def add_decoded_(payload: torch.Tensor, layout: SparseLayout, out: torch.Tensor) -> torch.Tensor:
    """out (fp32, `layout.length`) += what `payload` carries (zero off the sent indices). Returns `out`."""
    for group, records, idx in _carried(payload, layout):
        _rows(out, group).scatter_add_(-1, idx, _decode_values(records, layout.value_format, group.k))
    return out


class SenderMean(NamedTuple):
    """The average of `average_over_senders_` and how much the payloads overlapped."""

    average: torch.Tensor
    senders_per_sent: torch.Tensor  # 0-d: payloads carrying a carried coordinate, on average (1 to R)


def average_over_senders_(
    payloads: torch.Tensor, scales: Sequence[float], layout: SparseLayout, out: torch.Tensor
) -> SenderMean:
    """out <- the senders' mean of `payloads` (R, `layout.nbytes`), replica r's values scaled by `scales[r]`.

    Coordinate i of the average is  g_i = (sum of v_r,i over the senders r of i) / (sum of s_r over them),
    0 where no payload carries i. With s_r = 1 that is the plain mean over the replicas that sent i; with
    s_r = R·w_r (`replica_tau`: v_r = R·w_r·D_r) the w-weighted mean of D_r over them. The mean over all R
    would cut every coordinate that only some replicas sent (docs/design.md §5). Payloads are added in
    replica order, so every rank decoding the same payloads holds the same bits.
    """
    out.zero_()
    weight, count = torch.zeros_like(out), torch.zeros_like(out)
    for payload, scale in zip(payloads, scales):
        for group, records, idx in _carried(payload, layout):
            _rows(out, group).scatter_add_(-1, idx, _decode_values(records, layout.value_format, group.k))
            ones = torch.ones(idx.shape, dtype=out.dtype, device=out.device)
            _rows(weight, group).scatter_add_(-1, idx, ones * scale)
            _rows(count, group).scatter_add_(-1, idx, ones)
    overlap = count.sum() / (count > 0).sum().clamp_min(1)
    return SenderMean(out.div_(weight.masked_fill_(count == 0, 1.0)), overlap)


def bit_pack(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out (uint8, at least ceil(len·bits/8)) <- the non-negative `values` (< 2**bits), `bits` each,
    little-endian: bit j of value i is bit (i·bits + j) of the string."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.long().unsqueeze(-1) >> shifts) & 1).flatten()
    if stream.numel() % 8:
        stream = torch.cat([stream, stream.new_zeros(8 - stream.numel() % 8)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=values.device)
    packed = (stream.view(-1, 8) * weights).sum(dim=-1)
    out[: packed.numel()].copy_(packed)


def bit_unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` values (int64) that `bit_pack` wrote into `packed`."""
    shifts = torch.arange(8, device=packed.device)
    stream = ((packed.long().unsqueeze(-1) >> shifts) & 1).flatten()[: count * bits]
    weights = torch.ones(bits, dtype=torch.long, device=packed.device) << torch.arange(bits, device=packed.device)
    return (stream.view(count, bits) * weights).sum(dim=-1)
