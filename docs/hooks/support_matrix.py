"""MkDocs hook: what combines with what, generated from the support table (`co2_zero.core.support.TABLE`).

Two tables: the matrix of the settings each integration refuses (a row of `TABLE` whose context is only
where the config runs), and every refused combination with why and what to set instead. Nothing here
restates a fact the table holds. A page includes them with the line `<!-- co2-support-matrix -->`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from co2_zero.core.support import TABLE, Refusal  # noqa: E402

MARKER = "<!-- co2-support-matrix -->"
WHERE = {"integration", "driver", "elastic"}  # the facts that say where a config runs
COLUMNS: dict[str, dict[str, Any]] = {
    "CO2Optimizer": {"integration": "plain", "elastic": False},
    "FSDP2": {"integration": "fsdp2", "elastic": False},
    "FairScale OSS": {"integration": "fairscale", "elastic": False},
    "DeepSpeed": {"integration": "deepspeed", "elastic": False},
    "HF Trainer": {"integration": "deepspeed", "driver": "hf-trainer", "elastic": False},
    "Lightning CO2Strategy": {"integration": "plain", "driver": "lightning", "elastic": False},
    "elastic CO2Optimizer": {"integration": "plain", "elastic": True},
    "elastic FSDP2": {"integration": "fsdp2", "elastic": True},
}


def _name(fact: str) -> str:
    return f"`{fact.removeprefix('plan.')}`" + (" (resolved)" if fact.startswith("plan.") else "")


def _option(row: Refusal) -> str:
    return f"{_name(row.subject)}: {row.refused}"


def _refuses_there(row: Refusal, where: dict[str, Any]) -> bool:
    return all(name in where and values.holds(where[name]) for name, values in row.context)


def matrix_markdown() -> str:
    """One line per setting that some integration refuses whatever else is set; ✗ where it is refused."""
    rows = [row for row in TABLE if {name for name, _ in row.context} <= WHERE]
    options = list(dict.fromkeys(_option(row) for row in rows))
    lines = ["| setting | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for option in options:
        mine = [row for row in rows if _option(row) == option]
        cells = ["✗" if any(_refuses_there(row, where) for row in mine) else "✓" for where in COLUMNS.values()]
        lines.append(f"| {option} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def refusals_markdown() -> str:
    """Every row of the table: the setting refused, what with, why, and what to set instead."""
    lines = ["| refused | with | why | accepted instead |", "|---|---|---|---|"]
    for row in TABLE:
        context = " and ".join(f"{_name(name)}: {values}" for name, values in row.context)
        cells = [_option(row), context, row.why, row.accepted.replace(" ({tau})", "")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    tables = matrix_markdown() + "\n\nEvery refused combination:\n\n" + refusals_markdown()
    return markdown.replace(MARKER, tables)


if __name__ == "__main__":
    print(matrix_markdown() + "\n\n" + refusals_markdown())
