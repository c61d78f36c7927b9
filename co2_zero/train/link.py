"""What one round's exchange costs on a link the tuner is asked about, without a network (`co2-tune-tau
--link_mbit`): the bytes a rank sends in the wire format (design §5's closed forms) and the seconds they take.

A what-if, not a measurement: the link's rate and latency, the format's bytes, the bandwidth-optimal
algorithm's volume and message count; no CPU contention, no codec time, no padding (a few elements).
"""

from __future__ import annotations

from ..core.compress import FORMATS, RecordLayout
from ..core.sparse import SparseLayout

DENSE_BYTES = {"fp32": 4, "bf16": 2}


def round_bytes(numel: int, replicas: int, comm_dtype: str = "fp32", topk: float = 1.0) -> int:
    """Bytes one rank sends in one round's exchange of a partition of `numel` elements over `replicas`:
    dense, a ring all-reduce (or reduce-scatter + all-gather: the same volume), 2(R-1)/R of the buffer;
    quantized, an all-to-all and an all-gather of R records of a sub-shard; top-k, R-1 sparse payloads."""
    if replicas < 2:
        return 0
    share = (replicas - 1) / replicas
    if topk < 1.0:
        return (replicas - 1) * SparseLayout.for_length(numel, topk, comm_dtype).nbytes
    if comm_dtype in FORMATS:
        record = RecordLayout.for_length(numel // replicas, bits=FORMATS[comm_dtype].bits).nbytes
        return int(2 * share * replicas * record)
    return int(2 * share * numel * DENSE_BYTES[comm_dtype])


def round_messages(replicas: int, topk: float = 1.0) -> int:
    """Messages one rank sends one after another in a round: 2(R-1) (two ring passes, or all-to-all then
    all-gather); R-1 for top-k (one all-gather ring)."""
    return (replicas - 1) * (1 if topk < 1.0 else 2)


def link_seconds(nbytes: int, messages: int, link_mbit: float, latency_ms: float = 0.0) -> float:
    """Seconds to send `nbytes` in `messages` sequential messages on a link of `link_mbit` Mbit/s whose
    messages each wait `latency_ms`."""
    return nbytes * 8 / (link_mbit * 1e6) + messages * latency_ms / 1e3
