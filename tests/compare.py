"""Copies and exact comparisons of training state, shared by the distributed tests.

A rank snapshots what a load could change (`clone_state`, `param_copies`) and the test later checks
it is bit for bit what it was (`same`): a refused load must change nothing, a resumed run must
continue exactly.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch


def clone_state(value: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples whose tensors are detached clones."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_state(v) for v in value)
    return copy.deepcopy(value)


def param_copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a detached copy of every parameter of `module`."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def same(a: Any, b: Any) -> bool:
    """Exactly equal: the same nesting, keys, shapes and values (lists and tuples alike)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_close(actual: dict, expected: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every tensor of `expected` is in `actual` and close to it (the reference's float tolerance)."""
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{what}/{k}: {m}")


@contextlib.contextmanager
def torch_save_fails(error: BaseException, active: bool):
    """torch.save writes a little, then raises `error` (a filling disk), in this process only."""
    original = torch.save

    def failing(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 part of a zip header")
        raise error

    if active:
        torch.save = failing
    try:
        yield
    finally:
        torch.save = original
