"""The layers of co2_zero, read from the source (ast), not from a running import: the checkpoint package
knows no integration (each passes its `FrameworkState`), so the core never depends on an adapter."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "co2_zero" / "checkpoint"
PACKAGE = ["co2_zero", "checkpoint"]
INTEGRATIONS = (
    "fsdp",
    "fairscale",
    "deepspeed",
    "hf",
    "lightning",
    "optim",
    "integration",
    "elastic",
    "train",
)
FRAMEWORKS = (
    "fairscale",
    "deepspeed",
    "transformers",
    "accelerate",
    "lightning",
    "torchft",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
)


def imported_modules(source: str, package: Sequence[str]) -> set[str]:
    """Every module `source` (a module of `package`, e.g. ["co2_zero", "checkpoint"]) imports, as absolute
    dotted names (relative imports resolved), wherever the import is (module level or in a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import fsdp`
    return found


def forbidden(name: str) -> bool:
    banned = [f"co2_zero.{m}" for m in INTEGRATIONS] + list(FRAMEWORKS)
    return any(name == b or name.startswith(b + ".") for b in banned)


def test_checkpoint_package_imports_no_integration():
    files = sorted(CHECKPOINT.glob("*.py"))
    assert len(files) > 1, "co2_zero/checkpoint is a package of several files"
    offenders = {
        path.name: sorted(n for n in imported_modules(path.read_text(), PACKAGE) if forbidden(n)) for path in files
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"co2_zero/checkpoint imports integrations or frameworks: {offenders}"


def test_the_import_reader_sees_relative_and_nested_imports():
    """The reader itself: relative imports inside a function are resolved and caught."""
    names = imported_modules("def f():\n    from .. import fsdp\n    from ..optim import CO2Optimizer\n", PACKAGE)
    assert {"co2_zero.fsdp", "co2_zero.optim"} <= names
    assert all(forbidden(n) for n in ("co2_zero.fsdp", "co2_zero.optim.CO2Optimizer", "deepspeed.runtime"))
    assert not forbidden("co2_zero.core.topology") and not forbidden("co2_zero.optimizer_math")
