"""MkDocs hook: the configuration reference, generated from `CO2Config`'s own schema at build time.

Every field of `CO2Config` (nested `GapPenalty` and `Clip` fields as `gap_penalty.mode`, ...) becomes
one row: its type and default from `dataclasses.fields`, its description from the field's
`metadata["doc"]`, and what it accepts from the validation itself (the accepted-values text of the
`ValueError` a deliberately bad value raises; `metadata["accepted"]` where that text is incomplete).
Nothing here restates a fact the schema holds. A page includes it with the line
`<!-- co2-config-reference -->`, and the full `"co2"` section at its defaults with
`<!-- co2-config-defaults -->`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from co2_zero.core.config import CO2Config  # noqa: E402

REFERENCE_MARKER = "<!-- co2-config-reference -->"
DEFAULTS_MARKER = "<!-- co2-config-defaults -->"
_NOT_A_VALUE = object()  # no field accepts it, so the validation says what it would accept instead


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _accepted(path: tuple[str, ...]) -> str:
    """What the validation of the field at `path` accepts, in its own words."""
    value: Any = _NOT_A_VALUE
    for name in reversed(path[1:]):
        value = {name: value}
    try:
        CO2Config(**{path[0]: value})
    except ValueError as err:
        return str(err).split("accepted: ", 1)[1]
    raise AssertionError(f"CO2Config accepted {_NOT_A_VALUE!r} for {'.'.join(path)}")


def _type(f: dataclasses.Field) -> str:
    return re.sub(r"Union\[(\w+), (\w+)\]", r"\1 | \2", str(f.type))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(cls: type, prefix: tuple[str, ...] = ()) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        default = _default(f)
        if dataclasses.is_dataclass(default):
            rows += _rows(type(default), path)
            continue
        accepted = f.metadata.get("accepted") or _accepted(path)
        cells = [f"`{'.'.join(path)}`", f"`{_type(f)}`", f"`{json.dumps(default)}`", accepted, f.metadata["doc"]]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def reference_markdown() -> str:
    """One table row per leaf field of `CO2Config`: name, type, default (as JSON), accepted, meaning."""
    head = ["| field | type | default | accepted | meaning |", "|---|---|---|---|---|"]
    return "\n".join(head + _rows(CO2Config))


def defaults_markdown() -> str:
    """The `"co2"` section of a DeepSpeed JSON config with every field at its default."""
    return "```json\n" + json.dumps({"co2": CO2Config().to_dict()}, indent=2) + "\n```"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(REFERENCE_MARKER, reference_markdown()).replace(DEFAULTS_MARKER, defaults_markdown())
