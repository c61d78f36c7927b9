"""One schema for CO2: `CO2Config` and the `"co2"` section of a DeepSpeed JSON config.

Every field is validated on construction; a bad value raises `ValueError` naming the field, the value
and what would be accepted. Combinations of fields are refused by the support table
(`co2_zero.core.support`): those of fields alone here, the rest when the optimizer is built.
`CO2Config.from_dict` rejects unknown keys (DeepSpeed silently ignores unknown top-level keys, so this
is the only check a typo in a JSON config gets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from . import support
from .field_checks import (
    as_floats,
    build_section,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_number_or_auto,
    fail,
    is_int_at_least,
)

PENALTY_MODES = ("none", "constant", "adaptive")
CLIP_MODES = ("none", "value", "norm")
COLLECTIVES = ("auto", "reduce_scatter", "all_reduce", "all_gather")
# int8/fp8/int4/int2: block-quantized with error feedback (compress.py)
COMM_DTYPES = ("fp32", "bf16", "int8", "fp8", "int4", "int2")
NONFINITE_POLICIES = ("raise", "skip_round")
STAND_INS = ("auto", "shared", "local")  # where a replica starts a round while the last average is in flight
# The accepted values of every choice field, by dotted name (for messages that name another rank's value).
CHOICES = {
    "gap_penalty.mode": PENALTY_MODES,
    "clip.mode": CLIP_MODES,
    "collective": COLLECTIVES,
    "comm_dtype": COMM_DTYPES,
    "nonfinite": NONFINITE_POLICIES,
}
# What `auto` resolves to for the outer step's settings, (dense, sparse): the quality study's best of each
# exchange. A sparse exchange (`topk` < 1) sends only what its error feedback has gathered, and an outer
# momentum on top of that feedback costs loss (docs/configuration.md, "Choosing a wire format").
AUTO_OUTER: dict[str, tuple[float, float]] = {
    "outer_lr": (0.5, 1.0),
    "outer_momentum": (0.9, 0.0),
    "feedback_decay": (1.0, 0.95),
}
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; process-group timeouts are kept in milliseconds by the backends

# CO2 as published (Sun et al., ICLR 2024): `CO2Config(**PUBLISHED)`, or these keys in a "co2" section.
# Checkpoints saved under this setting load under it (the config hash is the same). The defaults are the
# setting that won the quality study (docs/configuration.md, "Defaults and presets").
PUBLISHED: dict[str, Any] = {
    "tau": 12,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "nesterov": False,
    "stand_in": "shared",
    "sync_delay": None,
    "gap_penalty": {"mode": "adaptive", "value": 1.0, "strength": 2.0},
}


def _neutral(name: str) -> Any:
    """The `"neutral"` value of CO2Config's field `name` (a sentinel where it declares none)."""
    metadata = next(f.metadata for f in dataclasses.fields(CO2Config) if f.name == name)
    return metadata.get("neutral", _neutral)


def _identity_fields(section: Any) -> dict[str, Any]:
    """`dataclasses.asdict(section)` without the fields at their metadata's `"neutral"` value."""
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "neutral" in f.metadata and value == f.metadata["neutral"]:
            continue
        out[f.name] = _identity_fields(value) if dataclasses.is_dataclass(value) else value
    return out


def dotted(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A (nested) config section as `{dotted name: value}` (`gap_penalty.mode`, ...), each name after `prefix`."""
    flat: dict[str, Any] = {}
    for key, value in section.items():
        name = f"{prefix}.{key}" if prefix else key
        flat.update(dotted(value, name) if isinstance(value, Mapping) else {name: value})
    return flat


@dataclass(frozen=True)
class GapPenalty:
    """How much a stale pseudo-gradient is trusted (docs/design.md §3c).

    `none`: Λ = 1. `constant`: Λ = `value` (the authors' code). `adaptive`: per parameter tensor,
    Λ = 1 + `strength` · ‖δ‖ / (‖g‖ + ε), with δ the distance the model moved since g was measured.
    """

    mode: str = field(
        default="none",
        metadata={
            "doc": "Staleness gap penalty Λ per parameter tensor: `none` (Λ = 1), `constant` or `adaptive` (as "
            "published; it lost to `none` with Nesterov momentum in the quality study)."
        },
    )
    value: float = field(default=1.0, metadata={"doc": "λ for `constant`: Λ = λ (the authors' public code)."})
    strength: float = field(default=2.0, metadata={"doc": "γ for `adaptive`: Λ = 1 + γ·‖δ‖/(‖g‖ + 1e-12)."})

    def __post_init__(self) -> None:
        check_choice("gap_penalty.mode", self.mode, PENALTY_MODES)
        check_number("gap_penalty.value", self.value, "a number >= 1", lambda v: v >= 1.0)
        check_number("gap_penalty.strength", self.strength, "a number >= 0", lambda v: v >= 0.0)
        as_floats(self, "value", "strength")


@dataclass(frozen=True)
class Clip:
    """Outer momentum clipping: `value` clamps m element-wise to ±threshold; `norm` rescales m so
    its global L2 norm is at most threshold."""

    mode: str = field(
        default="none",
        metadata={
            "doc": "Outer momentum clipping: `value` clamps m element-wise to ±φ; `norm` rescales m to a "
            "global L2 norm of at most φ. Off by default: φ is an absolute norm, which grows with the model."
        },
    )
    threshold: float = field(default=1.0, metadata={"doc": "φ, the clipping threshold."})

    def __post_init__(self) -> None:
        check_choice("clip.mode", self.mode, CLIP_MODES)
        check_number("clip.threshold", self.threshold, "a number > 0", lambda v: v > 0.0)
        as_floats(self, "threshold")


@dataclass(frozen=True)
class CO2Config:
    """Hyperparameters and plumbing of CO2, validated on construction.

    One schema for `CO2Config(...)`, `CO2Config.from_dict(d)` and the `"co2"` section of a DeepSpeed
    JSON config. Each field's `metadata["doc"]` is its description in the generated configuration
    reference (docs/configuration.md); the algorithm behind them is docs/design.md §3.

    Raises:
        ValueError: a field has a wrong type or an out-of-range value, or a nested section has an
            unknown key; the message names the field, the value and what would be accepted.
        support.Unsupported (a ValueError): the support table refuses a combination of fields.
    """

    tau: int = field(
        default=32,
        metadata={"doc": "Inner optimizer steps per round (steps that were applied, not micro-batches)."},
    )
    outer_lr: Union[float, str] = field(
        default="auto",
        metadata={
            "doc": "α, the outer learning rate. `auto` (the default): 0.5, or 1.0 with `topk` < 1. Its best dense "
            "value rises with tau (the quality study's best per tau: docs/benchmarks.md).",
            "accepted": "a number > 0, or 'auto'",
        },
    )
    outer_momentum: Union[float, str] = field(
        default="auto",
        metadata={
            "doc": "β, the outer momentum. `auto` (the default): 0.9, or 0 with `topk` < 1 (the decaying "
            "residual stands in for it; an outer momentum on top of error feedback costs loss).",
            "accepted": "a number in [0, 1), or 'auto'",
        },
    )
    nesterov: bool = field(
        default=True, metadata={"doc": "Nesterov outer momentum: `u = β·m + g/Λ` instead of `u = m`."}
    )
    overlap: bool = field(
        default=True,
        metadata={
            "doc": "`true`: CO2, the exchange overlaps the next round and its average is applied `sync_delay` "
            "steps into it (by default as soon as the exchange is hidden; `null`: a round late). `false`: "
            "blocking outer steps (Local SGD, SlowMo, DiLoCo), on the same code path."
        },
    )
    stand_in: str = field(
        default="auto",
        metadata={
            "doc": "Where each replica starts a round while the last average is in flight; the true average "
            'replaces the stand-in when it arrives (docs/design.md §3, "Stand-ins"). `auto` (the default): '
            "`local` (`shared` with `overlap: false`). `shared`: the shared start point, as published. "
            "`local`: the outer step the average will take, on the replica's own displacement "
            "instead (with the outer momentum; with a clip, `collective: all_reduce`, which `auto` picks). "
            "`local` set explicitly needs `overlap: true`; it costs up to 2Ψ/S fp32 words per rank.",
        },
    )
    sync_delay: Optional[Union[int, str]] = field(
        default="auto",
        metadata={
            "doc": "Inner steps of the next round the exchange has to finish in: the average in flight is "
            "applied after that many steps of the round after it, each replica's progress in those steps "
            "kept on top of it (a rebase). `null`: tau, the round end (CO2 as published). A "
            "smaller value hides any exchange shorter than that many steps and brings the loss towards "
            "blocking DiLoCo's; set it to the exchange's time over the step time, rounded up "
            '(docs/design.md §3, "The sync delay"). `"auto"` (the default): measured on the job '
            "itself: the first rounds apply at the round end while every rank counts the steps each exchange "
            "took; from round 5 on the delay is 1.5 times the most any rank counted (at most tau), the same "
            "on every rank, saved in checkpoints; with an elastic membership, the round end. A number needs "
            "`overlap: true`; with `overlap: false` null and `auto` both mean at once.",
            "accepted": "null, 'auto', or an integer in [1, tau]",
        },
    )
    gap_penalty: Union[GapPenalty, Mapping[str, Any]] = field(
        default_factory=GapPenalty, metadata={"doc": "The staleness gap penalty (a `GapPenalty` or a dict)."}
    )
    clip: Union[Clip, Mapping[str, Any]] = field(
        default_factory=Clip, metadata={"doc": "Outer momentum clipping (a `Clip` or a dict)."}
    )
    shards_per_replica: Union[int, str] = field(
        default="node",
        metadata={
            "doc": 'S, ranks per replica (ZeRO, OSS or FSDP2 shard over them). `"node"`: the ranks per node '
            "as the launcher says (`LOCAL_WORLD_SIZE`, `LOCAL_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`). Must "
            "divide the world size. A plain `CO2Optimizer` (no FSDP2) uses 1.",
        },
    )
    collective: str = field(
        default="auto",
        metadata={
            "doc": "How the displacement is averaged over the replicas. `auto`: `all_reduce` on gloo, "
            "`reduce_scatter` on NCCL (docs/design.md §5)."
        },
    )
    comm_dtype: str = field(
        default="fp32",
        metadata={
            "doc": "Wire type of the exchange's values. `bf16` halves the displacement's bytes (the new start "
            "point travels in fp32). `int8`, `fp8` (e4m3), `int4` and `int2` quantize the displacement and the "
            "new start point in blocks of 256 elements with error feedback, bit-packed: 0.254×, 0.129× and "
            "0.066× the fp32 bytes per round (int8/fp8, int4, int2), for Ψ/S + Ψ/N fp32 words of residuals "
            "per rank. With `topk` < 1 it is the type of the values sent (docs/configuration.md, "
            '"Choosing a wire format").'
        },
    )
    topk: float = field(
        default=1.0,
        metadata={
            "doc": "The fraction of the displacement each replica sends per round: in every chunk of 4096 "
            "elements of its partition, the largest in magnitude (at least one per chunk), as chunk-local "
            "12-bit indices and `comm_dtype` values; what is not sent stays in an error-feedback residual "
            "(Ψ/S fp32 words per rank). The payloads are all-gathered (`collective: all_gather`, what `auto` "
            "resolves to) and every replica applies the same outer step to their average. `1.0` (the "
            "default): dense. 0.015 with `int2`: 1/147 of the fp32 bytes per rank at R = 2, 1/73 at R = 4 (the "
            'all-gather grows with R: docs/wire-formats.md, "Choosing a wire format").',
            "accepted": "a number in (0, 1]",
            "neutral": 1.0,
        },
    )
    feedback_decay: Union[float, str] = field(
        default="auto",
        metadata={
            "doc": "The sparse exchange's error feedback: each round a replica sends the top-k of "
            "`D + feedback_decay · residual`, so what was not sent fades by this factor per round "
            "(SparseLoCo, arXiv 2508.15706: 0.95, with `outer_momentum: 0` and `outer_lr: 1`, the decaying "
            "residual standing in for the outer momentum). `1.0`: nothing fades, every element of D is sent in "
            "some round. `auto` (the default): 0.95 with `topk` < 1, else 1.0; another value needs `topk` < 1.",
            "accepted": "a number in (0, 1], or 'auto'",
            "neutral": 1.0,
        },
    )
    timeout_s: float = field(
        default=600.0,
        metadata={"doc": "Deadline of every wait on the exchange, and timeout of the CO2 process groups."},
    )
    replica_tau: Union[tuple[int, ...], str, None] = field(
        default=None,
        metadata={
            "doc": "Replicas of different speeds: per replica, its own inner steps per round (replica r, the "
            "ranks [r·S, (r+1)·S), runs `replica_tau[r]`), so that a slow replica ends its rounds when the "
            "others do instead of making them wait; the exchange weighs each replica's displacement by its "
            'share of the tokens, τ_r / Στ (docs/design.md §3, "Replicas of different speeds"). `null` (the '
            "default): every replica runs `tau`. A list of R integers in [1, tau] whose largest is `tau`, or "
            "`auto`: every replica starts at `tau` and times its inner steps; after 4 timed steps each "
            "replica's τ_r is fixed at the whole steps it completes in the fastest's round of `tau` "
            "(`taus_for_speeds`), from the round in progress (from the next where a replica has passed its "
            "τ_r), then corrected once from the times of the first whole round at them, for the rest of the "
            "run, and saved in checkpoints; with an elastic membership "
            "`auto` measures every round instead, over each "
            'round\'s quorum (docs/elastic.md, "Replicas of different speeds"), and a list is refused. It needs '
            "`sync_delay` null or `auto` (both: the round end) and a `comm_dtype` other than `bf16`.",
            "accepted": "null, 'auto', or a list of one integer in [1, tau] per replica, the largest equal to tau",
            "neutral": None,
        },
    )
    nonfinite: str = field(
        default="raise",
        metadata={
            "doc": "A NaN/Inf in some replica's displacement: `raise` a `NonFiniteError` naming the round and "
            "replica, or `skip_round`: skip that round's outer update on every replica (a rank whose own "
            "displacement was non-finite also resets its inner optimizer state; "
            '`last_round["skipped_rounds"]` counts them). The same for NaN/Inf in some rank\'s float module '
            "buffers: raise, or keep the last agreed buffers on every rank "
            '(`last_round["buffers_restored"]`).'
        },
    )

    def __post_init__(self) -> None:
        check_int("tau", self.tau, 1)
        check_number_or_auto("outer_lr", self.outer_lr, "a number > 0, or 'auto'", lambda v: v > 0.0)
        check_number_or_auto(
            "outer_momentum", self.outer_momentum, "a number in [0, 1), or 'auto'", lambda v: 0 <= v < 1
        )
        check_bool("nesterov", self.nesterov)
        check_bool("overlap", self.overlap)
        object.__setattr__(self, "gap_penalty", build_section(GapPenalty, "gap_penalty", self.gap_penalty))
        object.__setattr__(self, "clip", build_section(Clip, "clip", self.clip))
        if self.shards_per_replica != "node" and not is_int_at_least(self.shards_per_replica, 1):
            fail("shards_per_replica", self.shards_per_replica, "an integer >= 1, or 'node'")
        check_choice("collective", self.collective, COLLECTIVES)
        check_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        check_number("topk", self.topk, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0)
        check_number_or_auto(
            "feedback_decay", self.feedback_decay, "a number in (0, 1], or 'auto'", lambda v: 0 < v <= 1
        )
        seconds = f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
        check_number("timeout_s", self.timeout_s, seconds, lambda v: 0 < v <= MAX_TIMEOUT_S)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("stand_in", self.stand_in, STAND_INS)
        if self.sync_delay is not None:
            self._check_sync_delay()
        if self.replica_tau is not None:
            self._check_replica_tau()
        as_floats(self, "timeout_s", "topk", *(name for name in AUTO_OUTER if getattr(self, name) != "auto"))
        support.check(self.leaves())  # the combinations that need no more than these fields

    @property
    def steps_before_apply(self) -> int:
        """Inner steps into a round at which the average of the round before it is applied, at the start:
        0 in blocking mode (at once), else `sync_delay` (tau when unset, and while "auto" measures: the
        round end; `co2_zero.core.schedule` fixes the measured one)."""
        if not self.overlap:
            return 0
        return self.tau if self.sync_delay in (None, "auto") else self.sync_delay

    @property
    def measures_sync_delay(self) -> bool:
        """Whether the job measures its sync delay (`sync_delay: "auto"` with overlapped rounds; with
        `replica_tau` "auto" is the round end: the replicas' rounds have different lengths)."""
        return self.overlap and self.sync_delay == "auto" and self.replica_tau is None

    def effective(self, name: str) -> float:
        """The value of the outer setting `name` (`AUTO_OUTER`'s: outer_lr, outer_momentum, feedback_decay) the
        rounds run with: as given, or what `auto` resolves to for this exchange (dense or sparse)."""
        value = getattr(self, name)
        return AUTO_OUTER[name][self.sparse] if value == "auto" else value

    @property
    def effective_stand_in(self) -> str:
        """The stand-in the rounds use: `stand_in`, with `auto` the `local` one (`shared` in blocking mode,
        which has no average in flight)."""
        if self.stand_in != "auto":
            return self.stand_in
        return "local" if self.overlap else "shared"

    def _check_sync_delay(self) -> None:
        accepted = f"null, 'auto', or an integer in [1, tau={self.tau}]"
        if isinstance(self.sync_delay, str):
            if self.sync_delay != "auto":
                fail("sync_delay", self.sync_delay, accepted)
        else:
            check_int("sync_delay", self.sync_delay, 1)
            if self.sync_delay > self.tau:
                fail("sync_delay", self.sync_delay, accepted)

    @property
    def sparse(self) -> bool:
        """Whether the exchange sends a top-k selection (`topk` < 1), all-gathered (docs/design.md §5)."""
        return self.topk < 1.0

    def _check_replica_tau(self) -> None:
        """`replica_tau`: "auto", or one integer in [1, tau] per replica, the largest tau (docs/design.md §3,
        "Replicas of different speeds"); a list is stored as a tuple. What it combines with is the support
        table's."""
        accepted = (
            f"null, 'auto', or a list of one integer in [1, tau={self.tau}] per replica, the largest equal to tau"
        )
        value = self.replica_tau
        if value == "auto":
            return
        if not isinstance(value, (list, tuple)) or not value:
            fail("replica_tau", value, accepted)
        for tau in value:
            if isinstance(tau, bool) or not isinstance(tau, int) or not 1 <= tau <= self.tau:
                fail("replica_tau", value, accepted)
        if max(value) != self.tau:
            fail("replica_tau", value, accepted)
        object.__setattr__(self, "replica_tau", tuple(value))

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> CO2Config:
        """Build from a plain dict, e.g. the `"co2"` section of a DeepSpeed JSON config."""
        return build_section(cls, "co2", section)

    @classmethod
    def coerce(cls, value: CO2Config | Mapping[str, Any] | None) -> CO2Config:
        """A `CO2Config`, a dict of its fields, or None (all defaults)."""
        return cls() if value is None else build_section(cls, "co2", value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def leaves(self) -> dict[str, Any]:
        """Every field as `{dotted name: value}` (`gap_penalty.mode`, ...), nested sections flattened."""
        return dotted(self.to_dict())

    def math_fields(self) -> dict[str, Any]:
        """The fields that change the trajectory (not timeouts, collectives or sharding). A field whose metadata
        names a `"neutral"` value (behaving as if it did not exist) is in only when it differs from it, so adding
        such a field keeps the identity of every existing config, and of the checkpoints saved with it."""
        plumbing = ("timeout_s", "collective", "shards_per_replica")  # the result is independent of them
        math = {k: v for k, v in _identity_fields(self).items() if k not in plumbing}
        math["stand_in"] = self.effective_stand_in  # `auto` is whichever it resolves to
        for name in AUTO_OUTER:  # likewise: a default config keeps the identity it had before `auto`
            math.pop(name, None)
            if self.effective(name) != _neutral(name):
                math[name] = self.effective(name)
        if not self.measures_sync_delay:
            math["sync_delay"] = self.steps_before_apply  # null and tau are the same schedule
        return math

    def math_hash(self) -> str:
        """Hash of `math_fields`: the config identity a checkpoint carries and a load compares."""
        return hashlib.sha256(json.dumps(self.math_fields(), sort_keys=True).encode()).hexdigest()[:16]

    def resolve_shards(self, world_size: int) -> int:
        """S as a number. `"node"`: the ranks per node as the launcher says (torchrun:
        LOCAL_WORLD_SIZE, the deepspeed launcher: LOCAL_SIZE, Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE);
        1 when none is set."""
        if self.shards_per_replica != "node":
            return int(self.shards_per_replica)
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            if name in os.environ:
                return int(os.environ[name])
        return 1
