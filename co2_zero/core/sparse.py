"""The sparse exchange's codec: top-k of each chunk, chunk-local indices, quantized values, error
feedback, and the senders' mean with its outlier guard (docs/design.md §5). Pure tensor functions, no
torch.distributed.

Which elements form a chunk is the layout's (`sparse_layout`: chunks of 4096 consecutive elements of the
partition; the study's tensor chunks restart at each tensor and send tensors of one dimension whole).
Chunk c of n elements sends its k(n) = max(1, round(topk · n)) elements largest in magnitude; a tie at
the k-th magnitude goes to the lower index, and NaN counts as larger than any number (so a non-finite
chunk always sends a non-finite element). The payload is one byte string of
fixed size, whatever the values:

- the values: per chunk, a record of `compress` (one block of k elements, its scale first; a dense
  span: blocks of `compress.BLOCK`) in an int8/fp8/int4/int2 `comm_dtype`, or the raw fp32/bf16 values;
- the indices: every sparse chunk's k chunk-local indices in ascending order, `INDEX_BITS` bits each,
  packed little-endian over the whole payload (`bit_pack`).

A quantized chunk holding NaN/Inf has a non-finite scale, so every value it sends decodes non-finite.
Error feedback (`encode_with_feedback_`): the residual keeps everything not sent and the quantization
error of what was, exactly as `compress.quantize_with_feedback_`; with `feedback_decay` β < 1 it is
scaled by β before it is added (SparseLoCo's decaying accumulator).
The guard (`median_clip`): before the senders' mean, each replica's decoded payload is scaled so that
its norm is at most the median of the R payloads' norms.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Sequence

import torch

from .compress import FORMATS, dequantize_into, quantize_into
from .sparse_layout import CHUNK, INDEX_BITS, Group, SparseLayout, chunk_k  # noqa: F401 (CHUNK, chunk_k: re-exported)

RAW = {"fp32": torch.float32, "bf16": torch.bfloat16}  # values sent as they are
GUARD_ENV = "CO2_SPARSE_GUARD"  # the study's switch (docs/design-communication.md §5): "on" or "off"


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


def _encode_values(values: torch.Tensor, value_format: str, records: torch.Tensor, block: int) -> torch.Tensor:
    """records (chunks, record bytes) <- `values` (chunks, k), one scale per `block`; returns what the
    receiver decodes."""
    if value_format in RAW:
        sent = values.to(RAW[value_format])
        records.copy_(sent.view(torch.uint8).view(records.shape))
        return sent.float()
    fmt = FORMATS[value_format]
    quantize_into(values, fmt, records, scratch=torch.empty_like(values), block=block)
    return dequantize_into(records, fmt, out=torch.empty_like(values), block=block)


def _decode_values(records: torch.Tensor, value_format: str, group: Group) -> torch.Tensor:
    if value_format in RAW:
        return records.contiguous().view(RAW[value_format]).view(records.shape[0], group.k).float()
    out = torch.empty(records.shape[0], group.k, dtype=torch.float32, device=records.device)
    return dequantize_into(records, FORMATS[value_format], out=out, block=group.block)


def _sections(payload: torch.Tensor, layout: SparseLayout):
    """(group, its rows' records (chunks, record bytes)) for every group of `layout` in `payload`."""
    offset = 0
    for group in layout.groups:
        size = group.chunks * group.record
        yield group, payload[offset : offset + size].view(group.chunks, group.record)
        offset += size


def _rows(vector: torch.Tensor, group: Group) -> torch.Tensor:
    return vector[group.start : group.start + group.chunks * group.n].view(group.chunks, group.n)


def _every(rows: torch.Tensor) -> torch.Tensor:
    """The indices of a dense group: every element of every row."""
    return torch.arange(rows.shape[-1], device=rows.device).expand(rows.shape)


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
        rows = _rows(vector, group)
        idx = _every(rows) if group.dense else select(rows, group.k)
        picked = rows.gather(-1, idx)
        arrived = _encode_values(picked, layout.value_format, records, group.block)
        _rows(residual, group).scatter_(-1, idx, picked - arrived)
        if not group.dense:
            indices.append(idx.flatten())
    if indices:
        bit_pack(torch.cat(indices), INDEX_BITS, payload[layout.index_offset :])


def _carried(payload: torch.Tensor, layout: SparseLayout):
    """(group, its chunk-local indices (chunks, k), their decoded values (chunks, k)) for every group of
    `payload`."""
    indices = bit_unpack(payload[layout.index_offset :], INDEX_BITS, layout.indexed)
    used = 0
    for group, records in _sections(payload, layout):
        values = _decode_values(records, layout.value_format, group)
        if group.dense:
            yield group, _every(values), values
            continue
        count = group.chunks * group.k
        yield group, indices[used : used + count].view(group.chunks, group.k), values
        used += count


def add_decoded_(payload: torch.Tensor, layout: SparseLayout, out: torch.Tensor) -> torch.Tensor:
    """out (fp32, `layout.length`) += what `payload` carries (zero off the sent indices). Returns `out`."""
    for group, idx, values in _carried(payload, layout):
        _rows(out, group).scatter_add_(-1, idx, values)
    return out


def guard_enabled() -> bool:
    """Whether the exchange clips outlier payloads (`median_clip`): on, unless the study's switch
    `CO2_SPARSE_GUARD=off` asks otherwise."""
    value = os.environ.get(GUARD_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"co2: {GUARD_ENV}={value!r}; it takes 'on' (the default) or 'off'")
    return value == "on"


def median_clip(norms: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The factor (R,) that scales each replica's payload so that the displacement it carries, norm / scale,
    is at most the median of the replicas' (the mean of the two middle ones when R is even).

    One replica's outlier payload (a loss spike, a bad batch) then moves the shared start no more than a
    typical one would. A payload whose norm is not finite keeps factor 1 (it stays non-finite; the round is
    skipped or refused) and does not count in the median. Same inputs, same bits, on every rank."""
    measured = norms / scales.clamp_min(torch.finfo(scales.dtype).tiny)
    finite = measured.isfinite()
    kept = measured[finite].sort().values
    if not kept.numel():
        return torch.ones_like(norms)
    middle = kept.numel() // 2
    median = kept[middle] if kept.numel() % 2 else (kept[middle - 1] + kept[middle]) / 2
    over = finite & (measured > median)
    return torch.where(over, median / measured.where(over, 1.0), 1.0)


class SenderMean(NamedTuple):
    """The average of `average_over_senders_` and how much the payloads overlapped."""

    average: torch.Tensor
    senders_per_sent: torch.Tensor  # 0-d: payloads carrying a carried coordinate, on average (1 to R)


def average_over_senders_(
    payloads: torch.Tensor, scales: Sequence[float], layout: SparseLayout, out: torch.Tensor, guard: bool = True
) -> SenderMean:
    """out <- the senders' mean of `payloads` (R, `layout.nbytes`), replica r's values scaled by `scales[r]`.

    Coordinate i of the average is  g_i = (sum of c_r·v_r,i over the senders r of i) / (sum of s_r over them),
    0 where no payload carries i. With s_r = 1 that is the plain mean over the replicas that sent i; with
    s_r = R·w_r (`replica_tau`: v_r = R·w_r·D_r) the w-weighted mean of D_r over them. The mean over all R
    would cut every coordinate that only some replicas sent (docs/design.md §5). c_r: 1, or with `guard` the
    outlier clip `median_clip` of the decoded payloads' norms. Payloads are added in replica order, so every
    rank decoding the same payloads holds the same bits.
    """
    factors = torch.ones(len(payloads), dtype=out.dtype, device=out.device)
    if guard:
        norms = torch.stack([payload_norm(payload, layout) for payload in payloads])
        weights = torch.tensor(list(scales), dtype=torch.float64, device=out.device)
        factors = median_clip(norms, weights).to(out.dtype)
    out.zero_()
    weight, count = torch.zeros_like(out), torch.zeros_like(out)
    for payload, scale, factor in zip(payloads, scales, factors):  # one payload's indices decoded at a time
        for group, idx, values in _carried(payload, layout):
            _rows(out, group).scatter_add_(-1, idx, values * factor if guard else values)
            ones = torch.ones(idx.shape, dtype=out.dtype, device=out.device)
            _rows(weight, group).scatter_add_(-1, idx, ones * scale)
            _rows(count, group).scatter_add_(-1, idx, ones)
    overlap = count.sum() / (count > 0).sum().clamp_min(1)
    return SenderMean(out.div_(weight.masked_fill_(count == 0, 1.0)), overlap)


def payload_norm(payload: torch.Tensor, layout: SparseLayout) -> torch.Tensor:
    """‖what `payload` carries‖ (0-d float64, so that a huge but finite payload's norm stays finite): its
    values alone, decoded group by group, without the indices."""
    total = torch.zeros((), dtype=torch.float64, device=payload.device)
    for group, records in _sections(payload, layout):
        total += _decode_values(records, layout.value_format, group).double().square().sum()
    return total.sqrt()


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
