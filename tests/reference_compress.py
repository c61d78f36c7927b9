"""Independent reference of the compressed exchange (comm_dtype int8/fp8/int4/int2, topk < 1), for
`reference.simulate`.

Plain per-replica, per-block code, written from the specification in docs/design.md §5 and the README,
not from the library (nothing here imports co2_zero):

- every rank's partition (a list of parameter pieces, in order) is flattened, padded with zeros to a
  multiple of R and cut into R sub-shards; a sub-shard is quantized in blocks of 256 elements, each
  with scale absmax / qmax (int8: qmax 127, int4: 7, int2: 1, round half to even; fp8 e4m3: qmax 448),
  dequantized as value * scale;
- averaging: replica r's displacement D_r is measured from its own round start (the shared start
  point, or its stand-in); it sends D_r + e_r quantized and keeps e_r <- (D_r + e_r) - dequantized; the
  owner of a sub-shard adds the replicas' dequantized pieces in replica order and divides by R;
- `reduce_scatter`: the owner's update (new start - base) + e_u travels quantized (e_u keeps the rest)
  and the new start is base + dequantized update, for every replica;
- `all_reduce`: the owner's average + e_g travels quantized (e_g keeps the rest); the outer step then
  runs on the dequantized average.
- `all_gather` (topk < 1): replica r sends D_r + e_r sparsified over its whole partition: every chunk of
  4096 elements (the last may be shorter) sends the k = max(1, round half up(topk * n)) elements largest
  in magnitude (NaN largest, ties to the lower index), their values quantized as one block of k (or kept
  fp32 / rounded to bf16); e_r keeps the rest. With the study's tensor chunks (`chunks="tensor"`) it goes
  piece by piece instead: a piece of a parameter with at most one dimension goes whole, quantized in
  blocks of 256 (or kept fp32 / rounded to bf16); any other piece, and the padding after the last piece,
  is chunked as above from its own first element. Every replica then
  scales each arrival whose norm over its weight (1, or R·w_r below) exceeds the median of those R
  figures (the mean of the middle two when R is even; a non-finite one is neither scaled nor counted)
  down to that median, and averages the R arrivals in replica order over the senders: coordinate i of
  the average is the sum of the values sent for i over the number of replicas whose payload carries i
  (0 where none does; a value that quantized to 0 was still sent), and runs the outer step on the whole
  partition; the new start is its result, for every replica.
  With `feedback_decay` β < 1 replica r sends D_r + β·e_r instead (what was not sent fades).
- replicas of different speeds (`replica_tau`, `reference.simulate_paced`): replica r's displacement
  counts with its share of the round's tokens w_r = τ_r / Στ. It sends R·w_r·D_r + e_r (top-k:
  R·w_r·D_r + β·e_r), e_r keeps what was not sent of that scaled value, and the owners' plain mean
  over R is then Σ_r w_r·D_r, as the exact exchange's weighted average. Top-k: coordinate i is the sum of
  the sent values over the sum of R·w_r of its senders, the w-weighted mean of D_r over the senders.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Params = dict[str, Tensor]
Piece = tuple[str, int, int]  # parameter name, first and last+1 element of its flattened tensor

BLOCK = 256
CHUNK = 4096
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "int2": 1.0}
RAW = {"fp32": torch.float32, "bf16": torch.bfloat16}


def roundtrip(x: Tensor, fmt: str, block: int = BLOCK) -> Tensor:
    """What arrives when the 1-D fp32 vector `x` (one sub-shard) is sent: quantized, dequantized."""
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        part = x[lo : lo + block]
        scale = part.abs().max() / QMAX[fmt]
        if scale == 0:
            out[lo : lo + block] = 0.0
            continue
        scaled = part / scale
        if fmt == "fp8":
            values = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        else:
            values = scaled.round().clamp(-QMAX[fmt], QMAX[fmt])
        out[lo : lo + block] = values * scale
    return out


Span = tuple[int, int, bool]  # first and last+1 element of a vector, sent whole (True) or top-k per chunk


def sparse_roundtrip(x: Tensor, fmt: str, topk: float, spans: list[Span] | None = None) -> tuple[Tensor, Tensor]:
    """(what arrives, which elements were sent) when the 1-D fp32 vector `x` is sent with `fmt` values, span
    by span (None: the whole vector, top-k per chunk)."""
    out, sent = torch.zeros_like(x), torch.zeros(x.numel(), dtype=torch.bool)
    for first, end, whole in [(0, x.numel(), False)] if spans is None else spans:
        if whole:
            part = x[first:end]
            out[first:end] = part.to(RAW[fmt]).float() if fmt in RAW else roundtrip(part, fmt)
            sent[first:end] = True
            continue
        for lo in range(first, end, CHUNK):
            chunk = x[lo : min(lo + CHUNK, end)]
            k = max(1, math.floor(topk * chunk.numel() + 0.5))
            key = torch.where(chunk.isnan(), torch.tensor(math.inf), chunk.abs())
            chosen = torch.sort(-key, stable=True).indices[:k].sort().values
            values = chunk[chosen]
            out[lo + chosen] = values.to(RAW[fmt]).float() if fmt in RAW else roundtrip(values, fmt, block=k)
            sent[lo + chosen] = True
    return out, sent


def median_clip(arrived: list[Tensor], weights: list[float]) -> list[Tensor]:
    """The arrivals, each scaled down where its norm over its weight exceeds the median of those figures."""
    figures = [float(torch.linalg.vector_norm(a.double())) / w for a, w in zip(arrived, weights)]
    finite = sorted(f for f in figures if math.isfinite(f))
    if not finite:
        return arrived
    half = len(finite) // 2
    median = finite[half] if len(finite) % 2 else (finite[half - 1] + finite[half]) / 2
    return [a * (median / f) if math.isfinite(f) and f > median else a for a, f in zip(arrived, figures)]


def feedback_decay(config: dict) -> float:
    """The sparse exchange's residual decay β of `config`: as given, else 0.95 with topk < 1 (1.0 dense)."""
    value = config.get("feedback_decay", "auto")
    return (0.95 if config.get("topk", 1.0) < 1.0 else 1.0) if value == "auto" else value


class CompressedExchange:
    """The exchange of `reference.simulate(..., exchange=...)` for one run: error-feedback residuals
    of every replica and owner, kept across rounds.

    partitions: one list of pieces per shard index s (what ranks (r, s) own, identical for every r);
    None: one partition holding every parameter whole, in order (S = 1).
    """

    def __init__(
        self,
        fmt: str,
        strategy: str,
        replicas: int,
        partitions: list[list[Piece]] | None = None,
        topk: float = 1.0,
        decay: float = 1.0,
        guard: bool = True,
        chunks: str = "flat",
    ):
        assert strategy in ("reduce_scatter", "all_reduce", "all_gather") and (strategy == "all_gather") == (topk < 1)
        assert fmt in QMAX or (topk < 1 and fmt in RAW)
        assert decay == 1.0 or topk < 1
        self.fmt, self.strategy, self.replicas, self.topk, self.decay = fmt, strategy, replicas, topk, decay
        # the top-k exchange's median clip, and its chunks: "flat" (the whole vector) or "tensor" (span by span)
        self.partitions, self.guard, self.chunks = partitions, guard, chunks
        self.sent: dict[tuple[int, int], Tensor] = {}  # (replica, shard) -> displacement residual
        self.owned: dict[int, Tensor] = {}  # shard -> residual of what the owners gather (all R of them)

    # ---- layout ----------------------------------------------------------------------------------

    def _pieces(self, params: Params) -> list[list[Piece]]:
        if self.partitions is None:
            return [[(name, 0, value.numel()) for name, value in params.items()]]
        return self.partitions

    def _flatten(self, params: Params, pieces: list[Piece]) -> Tensor:
        flat = [params[name].reshape(-1)[lo:hi] for name, lo, hi in pieces]
        length = sum(hi - lo for _, lo, hi in pieces)
        padded = max(self.replicas, math.ceil(length / self.replicas) * self.replicas)
        return torch.cat(flat + [torch.zeros(padded - length)])

    def _unflatten(self, flats: list[Tensor], like: Params) -> Params:
        out = {name: value.clone().reshape(-1) for name, value in like.items()}
        for pieces, flat in zip(self._pieces(like), flats):
            offset = 0
            for name, lo, hi in pieces:
                out[name][lo:hi] = flat[offset : offset + hi - lo]
                offset += hi - lo
        return {name: out[name].reshape(like[name].shape) for name in like}

    def _spans(self, params: Params, pieces: list[Piece]) -> list[Span] | None:
        """The top-k exchange's spans of a flattened partition: each piece (whole where its parameter has at
        most one dimension), then the padding; flat chunks: None, the whole vector."""
        if self.chunks == "flat":
            return None
        spans, at = [], 0
        for name, lo, hi in pieces:
            spans.append((at, at + hi - lo, params[name].dim() <= 1))
            at += hi - lo
        padded = self._flatten(params, pieces).numel()
        return spans + ([(at, padded, False)] if padded > at else [])

    def _send(self, vector: Tensor, residual: Tensor, spans: list[Span] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(what arrives, the new residual, which elements were sent) for sending `vector` + `residual`
        (top-k: + decay · `residual`, span by span), sub-shard by sub-shard."""
        if self.strategy == "all_gather":  # the whole partition, top-k per chunk of each span
            total = vector + self.decay * residual
            arrived, sent = sparse_roundtrip(total, self.fmt, self.topk, spans)
        else:
            total = vector + residual
            arrived = torch.cat([roundtrip(part, self.fmt) for part in total.chunk(self.replicas)])
            sent = torch.ones(total.numel(), dtype=torch.bool)
        return arrived, total - arrived, sent

    # ---- the two hooks of reference.simulate -------------------------------------------------------

    def average(self, starts: list[Params], xs: list[Params], weights: list[float] | None = None) -> Params:
        """The replicas' mean displacement, replica r's from its own round start `starts[r]` to `xs[r]`, as
        the owners compute it from the quantized pieces; with `weights` (w_r, summing to 1) the weighted
        mean Σ w_r·D_r, replica r sending R·w_r·D_r."""
        means = []
        for s, pieces in enumerate(self._pieces(starts[0])):
            spans = self._spans(starts[0], pieces)
            arrivals, scales, senders = [], [], None
            for r, (own, x) in enumerate(zip(starts, xs)):
                displacement = self._flatten(own, pieces) - self._flatten(x, pieces)
                scale = 1.0 if weights is None else self.replicas * weights[r]
                residual = self.sent.get((r, s), torch.zeros_like(displacement))
                top_k = (spans,) if self.strategy == "all_gather" else ()  # the dense formats' _send takes no spans
                piece, self.sent[(r, s)], sent = self._send(displacement * scale, residual, *top_k)
                arrivals.append(piece)
                scales.append(scale)
                senders = sent * scale if senders is None else senders + sent * scale
            if self.strategy == "all_gather" and self.guard:
                arrivals = median_clip(arrivals, scales)
            total = arrivals[0]
            for piece in arrivals[1:]:
                total = total + piece
            if self.strategy == "all_gather":  # top-k: the mean over the senders of each element
                mean = torch.where(senders > 0, total / torch.where(senders > 0, senders, 1.0), 0.0)
            else:
                mean = total / self.replicas
            if self.strategy == "all_reduce":
                owned = self.owned.get(s, torch.zeros_like(mean))
                mean, self.owned[s], _ = self._send(mean, owned)
            means.append(mean)
        return self._unflatten(means, starts[0])

    def publish(self, base: Params, result: Params) -> Params:
        """The next start point every replica ends up with, given the owners' exact `result`."""
        if self.strategy != "reduce_scatter":
            return result
        starts = []
        for s, pieces in enumerate(self._pieces(base)):
            flat_base = self._flatten(base, pieces)
            update = self._flatten(result, pieces) - flat_base
            arrived, self.owned[s], _ = self._send(update, self.owned.get(s, torch.zeros_like(update)))
            starts.append(flat_base + arrived)
        return self._unflatten(starts, base)
