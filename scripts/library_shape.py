"""The library's size and shape (docs/design.md §10, "Size and shape"): its modules and lines, `fmt: skip`s,
the longest function, `RoundEngine`'s constructor parameters, `_round_end`'s length, and every line that writes
a run-time decision (builds an `ApplySchedule`, sets a pace, a round's steps or the exchange's staleness or
displacement weight).

    python -m scripts.library_shape            # this tree
    python -m scripts.library_shape /some/tree # another checkout (e.g. `git archive REV co2_zero | tar -x`)
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

DECISION_WRITES = re.compile(r"ApplySchedule\(|\.set_staleness\(|\.set_displacement_scale\(|\bround_steps = |\.pace = ")


def _functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef | None:
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == cls]
    return next((f for c in classes for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name), None)


def shape(root: Path) -> dict:
    """The figures of the package under `root` (the directory holding `co2_zero/`)."""
    files = sorted((root / "co2_zero").rglob("*.py"))
    texts = {f.relative_to(root).as_posix(): f.read_text() for f in files}
    trees = {name: ast.parse(text) for name, text in texts.items()}
    sizes = [(f.end_lineno - f.lineno + 1, f"{n}:{f.name}") for n, t in trees.items() for f in _functions(t)]
    writes = [
        f"{name}:{number}"
        for name, text in texts.items()
        for number, line in enumerate(text.splitlines(), 1)
        if DECISION_WRITES.search(line) and not line.lstrip().startswith(("class ", "#", '"'))
    ]
    engine = trees["co2_zero/core/engine.py"]
    init, round_end = _method(engine, "RoundEngine", "__init__"), _method(engine, "RoundEngine", "_round_end")
    return {
        "modules": len(files),
        "lines": sum(len(text.splitlines()) for text in texts.values()),
        "fmt_skips": sum(text.count("fmt: skip") for text in texts.values()),
        "longest_function": max(sizes),
        "engine_init_parameters": len(init.args.args) - 1 + len(init.args.kwonlyargs),
        "round_end_lines": round_end.end_lineno - round_end.lineno + 1,
        "decision_writes": writes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".", type=Path, help="the directory holding co2_zero/")
    for key, value in shape(p.parse_args().root).items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
