"""`patch()` / `unpatch()`: routing DeepSpeed's own entry point through co2_zero (docs/design.md §6.3).

Trainer, Accelerate and Lightning call `deepspeed.initialize` themselves, and DeepSpeed ignores unknown
top-level keys, so a "co2" section would be dropped without a word. `patch()` replaces the *code* of
DeepSpeed's function object (reaching a name bound by `from deepspeed import initialize` too) with
`_dispatch`, which builds CO2 for a config with a co2 section and runs a copy of the original otherwise
(co2_zero's own `initialize` included: nothing recurses). Importing co2_zero.deepspeed changes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import types
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import deepspeed

from .. import checkpoint
from ..core.errors import CO2Error
from ..core.topology import gather_fingerprints
from .checkpoints import load_checkpoint, save_checkpoint
from .config import _config_source, _load_ds_config, _refuse_misspelt_section
from .engine import initialize
from .optimizer import CO2ZeroOptimizer
from .workarounds import _forget_replica_mpu, _without_shm_comm_build


class _EntryPoint:
    """The routing of DeepSpeed's `initialize` in this process."""

    def __init__(self) -> None:
        self.plain: Optional[types.FunctionType] = None  # a copy of DeepSpeed's initialize as shipped, while patched
        self.signature: Optional[inspect.Signature] = None
        self.patched = False
        self.undo = contextlib.ExitStack()  # what patch() changed


_ENTRY = _EntryPoint()
_PLAIN_ATTRIBUTE = "__co2_zero_plain__"  # on DeepSpeed's function object while routed: its original
_ABSENT = object()


def _routed_initialize(*args: Any, **kwargs: Any) -> Any:
    # This code runs as DeepSpeed's own function object, with the deepspeed package's module globals:
    # only builtins and absolute imports are visible here.
    from co2_zero.deepspeed.routing import _dispatch

    return _dispatch(args, kwargs)


def _plain_copy(function: types.FunctionType) -> types.FunctionType:
    """A new function object with `function`'s code, defaults and names (DeepSpeed's initialize as shipped)."""
    plain = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__)
    plain.__kwdefaults__ = function.__kwdefaults__
    for name in ("__doc__", "__qualname__", "__module__"):
        setattr(plain, name, getattr(function, name))
    return plain


@contextlib.contextmanager
def _routed_entry_point() -> Iterator[None]:
    """DeepSpeed's `initialize` function object runs `_dispatch` inside the block; on exit its original
    code object, defaults and attributes are back exactly. A routing left by an earlier copy of this module
    (removed from sys.modules while patched) is adopted: its original is on the function object."""
    function = deepspeed.initialize
    if not isinstance(function, types.FunctionType) or function.__closure__:
        raise CO2Error(
            f"co2: deepspeed.initialize is {function!r}, not DeepSpeed's function (replaced by another library?); "
            f"co2_zero cannot route it. Call co2_zero.deepspeed.initialize directly"
        )
    adopted = getattr(function, _PLAIN_ATTRIBUTE, None)
    plain = adopted or _plain_copy(function)
    wrapped = _ABSENT if adopted else function.__dict__.get("__wrapped__", _ABSENT)
    function.__code__ = _routed_initialize.__code__
    function.__defaults__ = function.__kwdefaults__ = None
    function.__wrapped__ = plain  # type: ignore[attr-defined]  # inspect.signature shows DeepSpeed's
    setattr(function, _PLAIN_ATTRIBUTE, plain)
    _ENTRY.plain, _ENTRY.signature = plain, inspect.signature(plain)
    try:
        yield
    finally:
        function.__code__, function.__defaults__ = plain.__code__, plain.__defaults__
        function.__kwdefaults__ = plain.__kwdefaults__
        function.__dict__.pop(_PLAIN_ATTRIBUTE, None)  # an adopting copy may have put it back already
        if wrapped is _ABSENT:
            function.__dict__.pop("__wrapped__", None)
        else:
            function.__wrapped__ = wrapped  # type: ignore[attr-defined]
        _ENTRY.plain = _ENTRY.signature = None


def _dispatch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DeepSpeed's `initialize(*args, **kwargs)` while patched: CO2 for a config with a co2 section,
    DeepSpeed as shipped otherwise; a misspelt section ("CO2") is refused."""
    plain = _ENTRY.plain
    try:
        arguments = _ENTRY.signature.bind(*args, **kwargs).arguments
    except TypeError:
        return plain(*args, **kwargs)  # DeepSpeed's own error for bad arguments
    if not _has_co2_section(arguments):
        if arguments.get("mpu") is None:
            _forget_replica_mpu()
        return plain(*args, **kwargs)
    return _initialize_for_framework(arguments)


def _has_co2_section(arguments: Mapping[str, Any]) -> bool:
    """Whether the DeepSpeed config among `initialize`'s arguments has a top-level "co2" key. Raises
    ValueError for a near miss of it ("CO2", "co_2"), which DeepSpeed would silently ignore."""
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None:
            config = getattr(arguments.get("args"), name, None)
    if config is None:
        return False
    try:
        ds_config = config if isinstance(config, Mapping) else _load_ds_config(config)
    except (OSError, ValueError, TypeError):  # unreadable: DeepSpeed reports it in its own words
        return False
    _refuse_misspelt_section(ds_config, _config_source(config))
    return "co2" in ds_config


def _initialize_for_framework(arguments: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """`initialize` for a framework that called `deepspeed.initialize`: the engine's checkpoint methods
    also take DeepSpeed's keyword arguments, which Trainer passes (`load_module_strict`, ...)."""
    engine, zero, loader, scheduler = initialize(**arguments)

    def save(
        save_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        client_state: Optional[Mapping[str, Any]] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Path:
        """`co2_zero.deepspeed.save_checkpoint` with DeepSpeed's signature. Frozen parameters are always
        kept (a CO2 checkpoint restores the module state it was saved with)."""
        return save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load(
        load_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[Optional[Path], dict[str, Any]]:
        """`co2_zero.deepspeed.load_checkpoint` with DeepSpeed's signature. Only a full load is possible,
        and a directory holding a plain DeepSpeed checkpoint (no CO2 state) is refused."""
        full = {
            "load_optimizer_states": True,
            "load_lr_scheduler_states": True,
            "load_module_only": False,
            "custom_load_fn": None,
        }
        given = dict(zip(full, (load_optimizer_states, load_lr_scheduler_states, load_module_only, custom_load_fn)))
        for name, value in given.items():
            if value != full[name]:
                raise ValueError(
                    f"co2: load_checkpoint({name}={value!r}) is not supported; accepted: {name}={full[name]!r}. A "
                    f"CO2 checkpoint restores the model, the inner optimizer, the LR scheduler and the CO2 state "
                    f"together; a partial load would continue CO2 from state that does not belong to it"
                )
        directory, client_state = load_checkpoint(engine, load_dir, tag)
        if directory is None and _seen_on_any_rank((Path(load_dir) / "latest").is_file(), zero):
            raise CO2Error(
                f"co2: {load_dir} holds a plain DeepSpeed checkpoint ('latest' but no '{checkpoint.LATEST}'): it has "
                f"no CO2 state, and resuming from it would silently restart CO2; refused"
            )
        return directory, client_state

    engine.save_checkpoint, engine.load_checkpoint = save, load
    return engine, zero, loader, scheduler


def _seen_on_any_rank(seen: bool, zero: CO2ZeroOptimizer) -> bool:
    """Whether any rank saw it (one fingerprint all-gather on the main-thread CO2 group, with a deadline)."""
    group, timeout_s = zero.topology.control_group, zero.config.timeout_s
    return any(row[0] for row in gather_fingerprints([int(seen)], group, timeout_s, "checkpoint directory check"))


class _Patch:
    """What `patch()` returns; as a context manager it restores the state before `patch()` on exit."""

    def __init__(self, was_patched: bool) -> None:
        self.was_patched = was_patched

    def __enter__(self) -> _Patch:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.was_patched:
            unpatch()


def patch() -> _Patch:
    """From now on, `deepspeed.initialize` builds CO2 when its config has a "co2" section.

    For frameworks that call `deepspeed.initialize` themselves (Hugging Face Trainer, Accelerate,
    Lightning): such a call then runs `co2_zero.deepspeed.initialize`, and the engine's
    `save_checkpoint` / `load_checkpoint` (with DeepSpeed's signature) write and read CO2's per-rank
    checkpoints. A config without a co2 section gets DeepSpeed as shipped; one with a misspelt section
    ("CO2", "co_2") is refused. It reaches callers that looked `deepspeed.initialize` up before or after
    this call: it rewrites the code of DeepSpeed's function object (importing co2_zero changes nothing in
    DeepSpeed; this call does). While patched, DeepSpeed's comm backend is also created without its
    inference-only shared-memory op (a JIT build of 40-85 s on CPU), whoever creates it: Accelerate calls
    `deepspeed.init_distributed` itself unless run with `cpu=True`.

    Idempotent. `unpatch()` undoes it; `with co2_zero.deepspeed.patch(): ...` undoes it on exit.

    Returns:
        A context manager whose exit calls `unpatch()`; ignoring it keeps the patch.
    """
    was_patched = _ENTRY.patched
    if not was_patched:
        with contextlib.ExitStack() as changes:  # all of them or none
            changes.enter_context(_routed_entry_point())
            changes.enter_context(_without_shm_comm_build())
            _ENTRY.undo = changes.pop_all()
        _ENTRY.patched = True
        atexit.register(unpatch)  # undone while the interpreter can still run it, not in module teardown
    return _Patch(was_patched)


def unpatch() -> None:
    """Undo `patch()`: `deepspeed.initialize` runs DeepSpeed's original code object again (a co2
    section is then ignored by DeepSpeed, without a word). Idempotent."""
    if _ENTRY.patched:
        _ENTRY.undo.close()
        _ENTRY.patched = False
        atexit.unregister(unpatch)
