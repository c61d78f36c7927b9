"""Where everything sits in a sparse payload (docs/design.md §5): which elements form a chunk, how many each
chunk sends, the bytes of its values, where the indices start. Known from the partition alone, so every replica
of a shard (same length, same segments) builds the same layout and every payload has its fixed size.

Flat chunks (the exchange's layout, `for_length`): the padded partition is cut into chunks of `CHUNK`
consecutive elements whatever the tensors (the last one may be shorter); chunk c of n elements sends its k(n)
largest elements. Tensor chunks (`for_tensors`, the study's switch `CO2_SPARSE_CHUNKS=tensor`, measured
against flat chunks in docs/design-communication.md §5: no gain in loss, more bytes and codec time): the
partition is cut into spans, one per segment (a tensor's piece on this rank) and one per gap between them or
after the last (padding); a span of a tensor with at most one dimension (a bias, a norm's weight; `vectors`
lists their ids) goes dense: every element, quantized in blocks of `compress.BLOCK` (fp32/bf16: raw), no
indices; any other span is chunked as above from its own first element.

The payload: the value records of every group in layout order, then the packed indices of the sparse groups.
"""

from __future__ import annotations

import math
import os
from typing import AbstractSet, NamedTuple, Sequence

from .compress import BLOCK, FORMATS, RecordLayout
from .outer import Segment

CHUNK = 4096  # elements per chunk
INDEX_BITS = 12  # a chunk-local index: 0 .. CHUNK - 1
CHUNKS_ENV = "CO2_SPARSE_CHUNKS"  # the study's switch (docs/design-communication.md §5): "flat" or "tensor"
RAW_BYTES = {"fp32": 4, "bf16": 2}  # values sent as they are


def chunk_k(topk: float, n: int) -> int:
    """Elements a chunk of `n` sends: round(topk · n), half up, at least one (no chunk is left out for
    good: a chunk that sent nothing would never move the shared start)."""
    return max(1, min(n, math.floor(topk * n + 0.5))) if n else 0


class Group(NamedTuple):
    """Chunks of one size: `chunks` of `n` elements from `start` on, `k` sent from each, records of `record`
    bytes; `dense`: all n sent, in blocks of `compress.BLOCK`, without indices (then k = n)."""

    start: int  # first element
    chunks: int
    n: int
    k: int
    record: int  # bytes of one chunk's values
    dense: bool = False

    @property
    def block(self) -> int:
        """Elements per scale of a record: the whole chunk's k when sparse, `compress.BLOCK` when dense."""
        return BLOCK if self.dense else self.k


class Span(NamedTuple):
    """Elements [start, end) of the partition, chunked on their own; `dense`: sent whole."""

    start: int
    end: int
    dense: bool = False


def value_record_bytes(value_format: str, k: int, block: int) -> int:
    """Bytes of one record of `k` values, one scale per `block` of them (raw formats: no scale)."""
    if value_format in RAW_BYTES:
        return k * RAW_BYTES[value_format]
    return RecordLayout.for_length(k, block=block, bits=FORMATS[value_format].bits).nbytes


def spans_of(segments: Sequence[Segment], vectors: AbstractSet[int], length: int) -> list[Span]:
    """The spans covering [0, length): each segment (dense when its tensor id is in `vectors`), and each gap
    before, between or after them (never dense: padding, or elements no tensor claims)."""
    spans, at = [], 0
    for seg in sorted(segments, key=lambda s: s.start):
        if seg.start > at:
            spans.append(Span(at, seg.start))
        spans.append(Span(seg.start, seg.end, seg.tensor_id in vectors))
        at = seg.end
    if at < length:
        spans.append(Span(at, length))
    return [span for span in spans if span.end > span.start]


def _span_groups(span: Span, topk: float, value_format: str, chunk: int) -> list[Group]:
    n = span.end - span.start
    if span.dense:
        return [Group(span.start, 1, n, n, value_record_bytes(value_format, n, BLOCK), dense=True)]
    full, last = divmod(n, chunk)
    sizes = [(span.start, full, chunk)] if full else []
    if last:
        sizes.append((span.start + full * chunk, 1, last))
    out = []
    for start, chunks, size in sizes:
        k = chunk_k(topk, size)
        out.append(Group(start, chunks, size, k, value_record_bytes(value_format, k, k)))
    return out


def _merged(groups: list[Group]) -> list[Group]:
    """Adjacent sparse groups of one chunk size whose chunks follow each other become one group (a tensor of a
    multiple of `CHUNK` elements then costs no group of its own): fewer kernels, the same bytes."""
    out: list[Group] = []
    for group in groups:
        prev = out[-1] if out else None
        if prev and not (prev.dense or group.dense) and (prev.n, prev.k) == (group.n, group.k):
            if prev.start + prev.chunks * prev.n == group.start:
                out[-1] = prev._replace(chunks=prev.chunks + group.chunks)
                continue
        out.append(group)
    return out


class SparseLayout(NamedTuple):
    """The payload of a vector of `length` elements: the groups of chunks, their value bytes, the indices."""

    length: int
    value_format: str
    groups: tuple[Group, ...]
    index_offset: int  # where the packed indices start (the value records before them)
    nbytes: int

    @classmethod
    def for_spans(cls, spans: Sequence[Span], topk: float, value_format: str, chunk: int = CHUNK) -> SparseLayout:
        """The layout of the spans (covering [0, length) in order), each chunked on its own."""
        groups = _merged([g for span in spans for g in _span_groups(span, topk, value_format, chunk)])
        offset = sum(g.chunks * g.record for g in groups)
        indices = sum(g.chunks * g.k for g in groups if not g.dense)
        nbytes = 4 * math.ceil((offset + math.ceil(indices * INDEX_BITS / 8)) / 4)
        return cls(spans[-1].end if spans else 0, value_format, tuple(groups), offset, nbytes)

    @classmethod
    def for_length(cls, length: int, topk: float, value_format: str, chunk: int = CHUNK) -> SparseLayout:
        """Flat chunks: the whole vector as one span, cut into chunks of `chunk` whatever the tensors."""
        return cls.for_spans([Span(0, length)] if length else [], topk, value_format, chunk)

    @classmethod
    def for_tensors(
        cls, segments: Sequence[Segment], vectors: AbstractSet[int], length: int, topk: float, value_format: str
    ) -> SparseLayout:
        """Tensor chunks: chunks restart at each segment, tensors in `vectors` go dense."""
        return cls.for_spans(spans_of(segments, vectors, length), topk, value_format)

    @classmethod
    def for_partition(
        cls, segments: Sequence[Segment], vectors: AbstractSet[int], length: int, topk: float, value_format: str
    ) -> SparseLayout:
        """The exchange's layout of a partition of `length` (padded) elements: flat chunks, or tensor chunks
        where the study's switch `CO2_SPARSE_CHUNKS=tensor` asks for them."""
        chunks = os.environ.get(CHUNKS_ENV, "flat")
        if chunks not in ("flat", "tensor"):
            raise ValueError(f"co2: {CHUNKS_ENV}={chunks!r}; it takes 'flat' (the default) or 'tensor'")
        if chunks == "tensor":
            return cls.for_tensors(segments, vectors, length, topk, value_format)
        return cls.for_length(length, topk, value_format)

    @property
    def indexed(self) -> int:
        """Elements sent with an index per payload (the sparse groups')."""
        return sum(g.chunks * g.k for g in self.groups if not g.dense)

    @property
    def sent(self) -> int:
        """Elements sent per payload, the dense groups' included."""
        return sum(g.chunks * g.k for g in self.groups)
