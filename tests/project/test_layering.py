"""The layers of co2_zero, read from the source (ast), not from a running import: the core and the
checkpoint package know no integration (each adapter passes its `FrameworkState`), no module imports
itself back, no module outgrows the limit, and the old module paths still import (docs/design.md §10)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("layer", ["checkpoint", "core"])
def test_the_core_and_checkpoint_packages_import_no_integration(layer):
    files = sorted((ROOT / "co2_zero" / layer).glob("*.py"))
    assert len(files) > 1, f"co2_zero/{layer} is a package of several files"
    package = ["co2_zero", layer]
    offenders = {
        path.name: sorted(n for n in imported_modules(path.read_text(), package) if forbidden(n)) for path in files
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"co2_zero/{layer} imports integrations or frameworks: {offenders}"


def test_the_import_reader_sees_relative_and_nested_imports():
    """The reader itself: relative imports inside a function are resolved and caught."""
    names = imported_modules("def f():\n    from .. import fsdp\n    from ..optim import CO2Optimizer\n", PACKAGE)
    assert {"co2_zero.fsdp", "co2_zero.optim"} <= names
    assert all(forbidden(n) for n in ("co2_zero.fsdp", "co2_zero.optim.CO2Optimizer", "deepspeed.runtime"))
    assert not forbidden("co2_zero.core.topology") and not forbidden("co2_zero.optimizer_math")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of co2_zero it imports (type-only imports included), over every module of the
    package, read from the source."""
    modules = {}
    for path in sorted((ROOT / "co2_zero").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[:-1]  # the package a relative import starts from (an __init__'s own)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (path, package)
    return {
        name: {m for m in imported_modules(path.read_text(), package) if m in modules and m != name}
        for name, (path, package) in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of `graph`, each as the path that closes it (depth-first)."""
    found, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                found.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_the_package_imports_in_no_cycle():
    """One direction between any two modules of co2_zero, type-only imports included (the round state does
    not import the engine that owns it; the elastic exchange asks its membership through a Protocol)."""
    graph = import_graph()
    assert {"co2_zero.core.engine", "co2_zero.train.loop", "co2_zero.elastic.membership"} <= set(graph), graph
    assert graph["co2_zero.core.engine"] and graph["co2_zero.optim"], graph
    assert cycles(graph) == [], cycles(graph)


def test_the_cycle_finder_finds_a_type_only_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_old_module_paths_import_the_moved_modules_with_a_warning_naming_the_new_path():
    """Every entry of co2_zero.moved.MOVED: the old name is the new module object, with a DeprecationWarning
    naming the new path; the new module keeps its own name and spec."""
    import importlib
    import sys
    import warnings

    from co2_zero.moved import MOVED

    for old, new in MOVED.items():
        assert not (ROOT / Path(*old.split("."))).with_suffix(".py").exists(), f"{old} is still a file"
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert module.__spec__.name == new and module.__name__ == new, old
        assert any(f"import {new} instead" in str(w.message) for w in caught), (old, [str(w.message) for w in caught])
        sys.modules.pop(old)


def test_an_unknown_module_of_the_package_is_still_an_import_error():
    import importlib

    import co2_zero  # noqa: F401  installs the finder

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("co2_zero.no_such_module")


MAX_MODULE_LINES = 450  # a module longer than this wants a piece given its own home (docs/design.md §10)


def test_no_module_is_longer_than_the_limit():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "co2_zero").rglob("*.py")}
    assert len(lengths) > 40, lengths
    assert {p: n for p, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def engine_calls(source: str) -> list[str]:
    """Every call in `source` of a method on something named `engine` (`engine.adopt(...)`,
    `self.engine.state_for_peer()`, `membership.engine.identity()`), as the text of the callee."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name == "engine":
                found.append(ast.unparse(node.func))
    return found


def test_the_engine_call_reader_sees_plain_and_attribute_owners():
    source = "def f(engine, self):\n    engine.adopt(1)\n    self.engine.state_for_peer()\n    engine.rounds\n"
    source += "    g(engine)\n    self.engine_calls()\n"
    assert engine_calls(source) == ["engine.adopt", "self.engine.state_for_peer"]


def test_elastic_calls_no_round_engine_method():
    """The elastic membership and exchange get what they need from the engine as plain values passed in, and
    answer with data (the quorum, a peer's state to adopt): they never call back into the engine mid-round."""
    files = sorted((ROOT / "co2_zero" / "elastic").glob("*.py"))
    assert len(files) > 3, files
    offenders = {path.name: engine_calls(path.read_text()) for path in files}
    assert {name: calls for name, calls in offenders.items() if calls} == {}


def test_no_module_keeps_its_layout_from_the_formatter():
    """A module is laid out by `ruff format` as it comes: a `fmt: skip` (or `fmt: off`) folds lines to meet
    the length limit instead of splitting the module where its responsibilities part."""
    pragmas = ("fmt: skip", "fmt: off")
    found = {
        f"{p.relative_to(ROOT)}:{number}"
        for p in (ROOT / "co2_zero").rglob("*.py")
        for number, line in enumerate(p.read_text().splitlines(), 1)
        if any(pragma in line for pragma in pragmas)
    }
    assert found == set(), sorted(found)
