"""The schema's checks of a single field (`co2_zero.core.config`): its type and range, a choice among values
(a retired value named with what to set instead), a nested section given as a mapping. Each refusal is a
ValueError naming the field, the value and what would be accepted; combinations are the support table's."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# Values a field no longer takes: (field, value) -> (why, what to set instead); the CHANGELOG says when.
RETIRED = {
    ("stand_in", "eager"): (
        "the eager stand-in trained worse than local in its own study",
        "'local' (what the default 'auto' picks with overlap: true), or 'shared'",
    ),
}


def fail(name: str, value: Any, accepted: str) -> None:
    raise ValueError(f"co2 config: {name}={value!r} is invalid; accepted: {accepted}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(name, value, "true or false")


def is_int_at_least(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def check_int(name: str, value: Any, minimum: int) -> None:
    if not is_int_at_least(value, minimum):
        fail(name, value, f"an integer >= {minimum}")


def check_number(name: str, value: Any, accepted: str, ok) -> None:
    """A finite int or float for which `ok` holds (inf and NaN are refused: they poison the outer state)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, value, accepted)
    if not math.isfinite(float(value)) or not ok(float(value)):
        fail(name, value, accepted)


def check_number_or_auto(name: str, value: Any, accepted: str, ok) -> None:
    """`check_number`, or the string "auto" (resolved by the config: `CO2Config.effective`)."""
    if value != "auto":
        check_number(name, value, accepted, ok)


def as_floats(instance: Any, *names: str) -> None:
    """Store int values of float fields as floats, so `1` (JSON) and `1.0` (Python) are one config."""
    for name in names:
        object.__setattr__(instance, name, float(getattr(instance, name)))


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if isinstance(value, str) and (name, value) in RETIRED:
        why, accepted = RETIRED[name, value]
        raise ValueError(f"co2 config: {name}={value!r} is retired ({why}); accepted: {accepted}")
    if value not in choices:
        fail(name, value, " | ".join(repr(c) for c in choices))


def build_section(cls, name: str, value: Any):
    """Accept a nested section as the dataclass itself or as a mapping of its fields."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        fail(name, value, f"a mapping with keys {[f.name for f in dataclasses.fields(cls)]}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            fail(f"{name}.{key}", value[key], f"no such key; known keys of {name}: {sorted(known)}")
    return cls(**value)
