"""A rank's record in a checkpoint file and how it meets the live objects: what an integration
contributes (`FrameworkState`), the record one function builds (`optimizer_record`, `rank_record`) and
its validate-then-apply (`check_record`, `apply_record`; `load_record` for the optimizers'
`load_state_dict`), and the module's state as whole tensors or the rows this rank holds (checked against
this rank, cut for a resharded load, written back in place). The package imports no integration: each
passes its `FrameworkState`."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

import torch

from .resharding import cut_rows


class FrameworkState(Protocol):
    """An integration's part of a checkpoint: its framework's own state, and how to load it.

    `capture()` returns plain data (weights_only-loadable); `check(saved)` raises ValueError naming
    what does not fit and changes nothing; `restore(saved)` loads a checked state; `after_reshard(saved)`
    runs after a resharded load (`saved`: the framework state of the file the module came from when it
    was written by the same integration, else None; the inner optimizer state is not carried across
    partitions). `module_excluded()` names module state entries the framework restores itself (e.g.
    DeepSpeed's trainable parameters, restored from its fp32 partition) and that are not saved.
    `local_rows(value)` says what this rank holds of a module state entry sharded by rows (FSDP2's
    DTensors): (its first row, this rank's rows as the live storage, written in place on a load); None
    when it holds the entry whole. The checkpoint package knows no framework: this is how it learns.
    """

    integration: str
    engine: Any  # the RoundEngine
    module: torch.nn.Module

    def module_excluded(self) -> set[str]: ...

    def capture(self) -> dict[str, Any]: ...

    def check(self, saved: dict[str, Any]) -> None: ...

    def restore(self, saved: dict[str, Any]) -> None: ...

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None: ...

    def local_rows(self, value: torch.Tensor) -> Optional[tuple[int, torch.Tensor]]: ...


def framework_state(model: torch.nn.Module, optimizer: Any) -> FrameworkState:
    """The `FrameworkState` of a CO2 optimizer (`CO2Optimizer`, `CO2OSS`): its `checkpoint_state(model)`."""
    engine = getattr(optimizer, "engine", None)
    if engine is None:
        raise ValueError(
            f"co2 checkpoint: {type(optimizer).__name__} is not a CO2 optimizer (CO2Optimizer, CO2OSS); "
            f"for DeepSpeed use co2_zero.deepspeed.save_checkpoint / load_checkpoint"
        )
    return optimizer.checkpoint_state(model)


class Refused(Exception):
    """Why this rank cannot load the chosen checkpoint (file and reason)."""


def optimizer_record(framework: FrameworkState, finalized_ok: bool = False) -> dict[str, Any]:
    """What a rank persists of its optimizers: `{"co2": the CO2 state, "framework": the framework's own
    state}`. The one function that builds it, for a checkpoint file (`rank_record`) and for the
    optimizers' `state_dict()` forms, which are views of it (docs/design.md §7). `finalized_ok`: a
    finalized engine handed its state over, its record holds `"co2": None` (else CO2Error)."""
    engine = framework.engine
    co2 = None if finalized_ok and engine.finalized else engine.state_dict()  # waits for the round in flight
    return {"co2": co2, "framework": framework.capture()}


def rank_record(framework: FrameworkState, extra: Any) -> dict[str, Any]:
    """What a rank's file holds besides its identity: its `optimizer_record`, the module
    (`module_record`) and `extra`. One function builds it, so every way of saving writes the same."""
    return {**optimizer_record(framework), **module_record(framework), "extra": extra}


def check_record(framework: FrameworkState, record: dict[str, Any], fields: dict[str, str]) -> None:
    """Check the parts of an `optimizer_record` that `fields` names ("co2", "framework": each with the
    name its errors start with) against this rank; ValueError "{name}: what does not fit", for the first
    part that does not. Changes nothing."""
    checks = {"co2": framework.engine.check_state_dict, "framework": framework.check}
    for part, name in fields.items():
        try:
            checks[part](record.get(part))
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error


def apply_record(framework: FrameworkState, record: dict[str, Any]) -> None:
    """Write a checked `optimizer_record`: the framework's state, then the CO2 state (when it has one)."""
    framework.restore(record["framework"])
    if record.get("co2") is not None:
        framework.engine.load_state_dict(record["co2"])


def refused(what: str, problem: str) -> ValueError:
    """The error of an optimizer's `load_state_dict` that refused a state (`problem` names the field)."""
    return ValueError(f"co2 {what} refused, nothing was changed: {problem}")


def load_record(framework: FrameworkState, record: dict[str, Any], what: str, fields: dict[str, str]) -> None:
    """An optimizer's `load_state_dict` as `checkpoint.load` does it for one rank: every check
    (`check_record` over `fields`) before anything changes, then `apply_record`. ValueError (`refused`)
    naming the field and changing nothing; CO2Error when the CO2 state is to be loaded and the engine
    failed or was finalized. Waits for the round in flight first, so nothing fails once writing began."""
    if "co2" in fields:
        framework.engine.state_dict()  # usable, and no round in flight any more
    try:
        check_record(framework, record, fields)
    except ValueError as error:
        raise refused(what, str(error)) from error
    apply_record(framework, record)


def module_record(framework: FrameworkState) -> dict[str, Any]:
    """The module's part of a file, plain tensors only: `module` holds every entry (but the excluded)
    whole, or for an FSDP2 model the rows this rank holds, and `module_rows[key] = [first row, shape of
    the whole tensor]` says where such rows belong."""
    excluded = framework.module_excluded()
    entries, rows = {}, {}
    for key, value in framework.module.state_dict().items():
        if key not in excluded:
            first, entries[key] = held(framework, value)
            if first is not None:
                rows[key] = [first, list(value.shape)]
    return {"module": entries, "module_rows": rows}


def held(framework: FrameworkState, value: torch.Tensor) -> tuple[Optional[int], torch.Tensor]:
    """(first row, what this rank holds) of a module state entry: the rows the framework says this rank
    holds (FSDP2: a DTensor's local tensor, the parameter's own storage), else (None, the whole tensor)."""
    rows = framework.local_rows(value)
    return (None, value) if rows is None else rows


def _shown(value: Any, where: Any = None) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    text = f"{value.dtype} {tuple(value.shape)}"
    if type(value) is not torch.Tensor:
        text += f" ({type(value).__name__})"
    return text if where is None else f"{text}, rows from {where[0]} of {tuple(where[1])}"


class _Piece(NamedTuple):
    """A saved module entry, or the rows of it one FSDP2 rank held."""

    first: int  # its first row in the whole tensor
    tensor: torch.Tensor
    shape: tuple[int, ...]  # of the whole tensor
    file: str


def saved_pieces(payload: dict[str, Any], name: str, needed: set[str], whole: bool) -> dict[str, _Piece]:
    """The pieces of the `needed` module entries in one saved file: rows of FSDP2 entries always, whole
    entries only when `whole` (every file of a replica holds the same ones: one is enough)."""
    module, rows = payload.get("module"), payload.get("module_rows", {})
    if not isinstance(module, dict) or not isinstance(rows, dict):
        raise Refused(f"{name}: the module state is missing")
    found = {}
    for key in needed & set(module):
        value, where = module[key], rows.get(key)
        if where is None and not whole:
            continue
        valid_where = where is None or (
            isinstance(where, list) and len(where) == 2 and isinstance(where[0], int) and isinstance(where[1], list)
        )
        if type(value) is not torch.Tensor or not valid_where or (where is not None and value.dim() == 0):
            raise Refused(f"{name}: module entry {key!r} is {_shown(value)} with rows record {where!r}")
        first, shape = (0, tuple(value.shape)) if where is None else (where[0], tuple(where[1]))
        found[key] = _Piece(first, value, shape, name)
    return found


def module_for_here(
    framework: FrameworkState, pieces: dict[str, list[_Piece]], needed: set[str], source: str
) -> dict[str, Any]:
    """What this rank holds of every `needed` module entry (whole, or its FSDP2 rows), cut from the
    saved pieces (`source`: the file whole entries come from); Refused naming the file and the entry
    when they do not fit this model."""
    current = framework.module.state_dict()
    missing = sorted(k for k in needed if not pieces.get(k))
    if missing:
        raise Refused(f"{source}: the module state lacks {missing[:5]} (a different model?)")
    state = {}
    for key in sorted(needed):
        whole = current[key]
        first, mine = held(framework, whole)
        for piece in pieces[key]:
            rows = piece.tensor.shape[0] if piece.tensor.dim() else 0
            if (
                piece.shape != tuple(whole.shape)
                or piece.tensor.dtype != whole.dtype
                or piece.tensor.shape[1:] != whole.shape[1:]
                or not 0 <= piece.first <= piece.first + rows <= (whole.shape[0] if whole.dim() else 0)
            ):
                raise Refused(
                    f"{piece.file}: module entry {key!r} is {_shown(piece.tensor, [piece.first, piece.shape])}; "
                    f"this model has {whole.dtype} {tuple(whole.shape)}"
                )
        if whole.dim() == 0:
            state[key] = pieces[key][0].tensor
            continue
        try:
            state[key] = cut_rows([(p.first, p.tensor) for p in pieces[key]], first or 0, mine.shape[0])
        except ValueError as error:
            where = f"{source} and its replica's files"
            raise Refused(f"{where}: module entry {key!r} {tuple(whole.shape)}: {error}") from error
    return state


def write_module(framework: FrameworkState, state: dict[str, Any], strict: bool) -> None:
    """Write a checked module state (whole entries, or this rank's rows) into the module. A module with
    entries sharded by rows (FSDP2): each entry into what this rank holds of it, in place (FSDP2 keeps
    references to its sharded parameters and CO2's partition views them: never new Parameters); else
    `load_state_dict`."""
    module = framework.module
    current = module.state_dict(keep_vars=True)
    if all(framework.local_rows(value) is None for value in current.values()):
        module.load_state_dict(state, strict=strict)
        return
    with torch.no_grad():
        for key, value in state.items():
            held(framework, current[key])[1].copy_(value)


def check_module(framework: FrameworkState, payload: dict[str, Any], needed: set[str], name: str) -> None:
    """The file's module state is exactly what this rank holds of the `needed` entries (same run layout)."""
    saved, rows = payload.get("module"), payload.get("module_rows", {})
    if not isinstance(saved, dict) or not isinstance(rows, dict):
        raise Refused(f"{name}: the module state is missing")
    current = framework.module.state_dict()
    missing = sorted(needed - set(saved))
    if missing:
        raise Refused(f"{name}: the module state lacks {missing[:5]} (a different model?)")
    for key in needed:
        first, want = held(framework, current[key])
        where = None if first is None else [first, list(current[key].shape)]
        got = saved[key]
        if (
            type(got) is not torch.Tensor
            or got.shape != want.shape
            or got.dtype != want.dtype
            or rows.get(key) != where
        ):
            raise Refused(
                f"{name}: module entry {key!r} is {_shown(got, rows.get(key))}; this rank holds {_shown(want, where)}"
            )
