"""What the replicas of a quorum must agree on, checked at every meeting (docs/design.md §12).

Each replica sends one fixed-size int64 row in the small all-reduce that starts every exchange (and
the start-up meeting): its weight in the average (the inner steps it trained this round; 0: it does not
contribute), whether it has trained, its step time (`speeds.py`), then two words per field: the
co2 config's fields, its ranks, its model (tensor count, trainable parameters, names and shapes), the
state version, what the job asks to agree on (`Membership(agree=...)`: e.g. its dtype and seed), and
a digest of the shared start point the exchange applies to (at `finalize()`: the final model), so
replicas that drifted apart are named instead of averaged. Numbers and short text travel exactly, so
a difference names the field and both values on every replica, not only a hash.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..core.comm import Layout
from ..core.config import CO2Config
from ..core.errors import CO2Error
from ..core.topology import _describe, fingerprint, text_words, words_text

WORDS = 2  # per field: a number's float64 bits, up to 16 bytes of text, or a hash marked HASHED
HASHED = -1  # second word of a value too long to travel as text
FIELDS = 64  # fields per row (padded): the row has a fixed size whatever the config holds
HEAD = 3  # the row's first words: weight (0: not contributing), has trained, step time in microseconds


def identity_fields(
    config: CO2Config, layout: Layout, ranks: int, identity: Mapping[str, Any], agree: Mapping[str, Any]
) -> dict[str, Any]:
    """This replica's identity, field by field (timeouts may differ harmlessly): its config, its `ranks`, its
    partition's `layout`, and its state's `identity` (`RoundEngine.identity`: the model's signature, the
    state version)."""
    fields = {k: v for k, v in config.leaves().items() if k != "timeout_s"}
    fields.update(
        {
            "ranks per replica": ranks,
            "model parameter tensors": layout.num_tensors,
            "model trainable parameters (this rank's partition)": layout.length,
            "model parameter names and shapes": identity["signature"],
            "state version": identity["version"],
        }
    )
    fields.update({f"job {name}": value for name, value in agree.items()})
    if len(fields) > FIELDS:
        raise CO2Error(f"co2 elastic: {len(fields)} fields to agree on; at most {FIELDS}")
    return fields


def start_digest(start: torch.Tensor) -> int:
    """A digest of a shared start point's bits (exact in a float64: below 2**52): replicas that hold
    different ones differ in it, whatever the values."""
    return int(torch.sum(start.detach().view(torch.int32), dtype=torch.int64)) % (1 << 52)


def encode(value: Any) -> list[int]:
    """Two words for one field's value: exact for numbers, booleans and text up to 16 bytes."""
    if isinstance(value, (bool, int, float)):
        return [fingerprint(value), 0]
    text = str(value)
    if len(text.encode()) <= 8 * WORDS and text:
        return text_words(text, WORDS)
    return [fingerprint(text), HASHED]


def decode(words: list[int], like: Any) -> str:
    """What another replica's two words stand for, given this replica's value `like`."""
    if words[1] == HASHED:
        return f"a different value (digest {words[0] & (2**64 - 1):016x})"
    if isinstance(like, (bool, int, float)) and words[1] == 0:
        return _describe(words[0], like)
    return repr(words_text(words))


def row(weight: int, trained: bool, step_us: int, fields: Mapping[str, Any]) -> list[int]:
    """This replica's row of the meeting's all-reduce: `weight` the inner steps its displacement holds (0:
    it does not contribute), `step_us` its last round's step time (0: not measured)."""
    words = [w for value in fields.values() for w in encode(value)]
    return [weight, int(trained), step_us, *words, *[0] * (WORDS * FIELDS - len(words))]


def mismatch(fields: Mapping[str, Any], mine: list[int], theirs: list[int]) -> Optional[str]:
    """'tau=4 here, 8 there, ...' for every field in which row `theirs` differs from `mine`; None if none."""
    names = list(fields)
    differ = []
    for i, name in enumerate(names):
        a, b = mine[HEAD + WORDS * i : HEAD + WORDS * (i + 1)], theirs[HEAD + WORDS * i : HEAD + WORDS * (i + 1)]
        if a != b:
            differ.append(f"{name}={fields[name]!r} here, {decode(b, fields[name])} there")
    if mine[HEAD + WORDS * len(names) :] != theirs[HEAD + WORDS * len(names) :]:
        differ.append("the number of fields (another co2_zero version)")
    return ", ".join(differ) or None


class ReplicaRefused(CO2Error):
    """This replica's identity is not the quorum's: it leaves the job."""


def verdict(
    rows: list[list[int]], replicas: tuple[int, ...], me: int, fields: Mapping[str, Any], round_index: int
) -> Optional[CO2Error]:
    """None if every row agrees. Else the identity that stays is the one held by every replica that has
    trained, or (none has) by a strict majority: a replica without it gets ReplicaRefused (it leaves);
    one with it a CO2Error naming the others (its round is cut: they leave). No such identity: every
    replica is refused. Each message names the fields and both values."""
    identity = [tuple(r[HEAD:]) for r in rows]
    if len(set(identity)) == 1:
        return None
    trained = {identity[i] for i, r in enumerate(rows) if r[1]}
    counts = {key: identity.count(key) for key in set(identity)}
    if trained:
        staying = next(iter(trained)) if len(trained) == 1 else None
    else:
        best = max(counts.values())
        leaders = [key for key, n in counts.items() if n == best]
        staying = leaders[0] if len(leaders) == 1 and 2 * best > len(rows) else None
    others = [i for i in range(len(rows)) if identity[i] != identity[me]]
    detail = "; ".join(f"replica {replicas[i]}: {mismatch(fields, rows[me], rows[i])}" for i in others[:1])
    differ = [replicas[i] for i in others]
    if staying is not None and identity[me] == staying:
        return CO2Error(
            f"co2 elastic: round {round_index}: replica(s) {differ} hold another co2 config, model, job "
            f"setting or shared start point than this replica ({detail}); they leave the job, and this round "
            f"is cut"
        )
    return ReplicaRefused(
        f"co2 elastic: round {round_index}: replica {replicas[me]} holds another co2 config, model, job "
        f"setting or shared start point than replica(s) {differ} of its quorum ({detail}); every replica "
        f"must run the same config, model, ranks, dtype and seed and hold the same shared start: it leaves "
        f"the job"
    )
