"""Old import paths of the modules that moved into `co2_zero.core` (and the tuner into `co2_zero.train`).

`import co2_zero.config` still works and gives the module itself, with a DeprecationWarning that says
what to import instead; CHANGELOG.md lists the moves. One table, read by one import hook.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Optional, Sequence

MOVED = {
    "co2_zero.config": "co2_zero.core.config",
    "co2_zero.errors": "co2_zero.core.errors",
    "co2_zero.topology": "co2_zero.core.topology",
    "co2_zero.outer": "co2_zero.core.outer",
    "co2_zero.compress": "co2_zero.core.compress",
    "co2_zero.sparse": "co2_zero.core.sparse",
    "co2_zero.pace": "co2_zero.core.pace",
    "co2_zero.comm": "co2_zero.core.comm",
    "co2_zero.partition": "co2_zero.core.partition",
    "co2_zero.startup": "co2_zero.core.startup",
    "co2_zero.buffers": "co2_zero.core.buffers",
    "co2_zero.engine": "co2_zero.core.engine",
    "co2_zero.step_budget": "co2_zero.core.step_budget",
    "co2_zero.engine_state": "co2_zero.core.round_state",
    "co2_zero.sync_delay": "co2_zero.core.schedule",
    "co2_zero.agreement": "co2_zero.core.parameter_order",
    "co2_zero.tune_tau": "co2_zero.train.tune_tau",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec):  # type: ignore[override]
        warnings.warn(f"{spec.name} moved to {self.new}; import {self.new} instead", DeprecationWarning, 3)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """The module is the new one, already run; importlib has just given it the old name's spec."""
        module.__spec__ = self.spec


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds each old name of `MOVED` as its new module."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target=None):  # type: ignore[override]
        new = MOVED.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(new)) if new else None


def install() -> None:
    """Once per process: old names resolve (with a warning) after every other finder has failed."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
