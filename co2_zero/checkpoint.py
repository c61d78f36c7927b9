"""Every checkpoint format co2_zero writes (docs/design.md §7): one layout, one identity record.

On disk, for every integration (plain PyTorch, FSDP2, FairScale, DeepSpeed)::

    <directory>/
      latest_co2                          the tag of the newest complete checkpoint (text)
      <tag>/                              one checkpoint (default tag: step<inner steps>, DeepSpeed: global_step<N>)
        co2_rank00000.<save id>.pt        rank 0's file: identity, co2 state, module, framework state, extra
        co2_rank00001.<save id>.pt
        co2_complete.json                 the marker: written once every rank's file is durable

A save is collective. The ranks agree on the tag, the step and a fresh save id; each rank writes its
file atomically (temporary file, fsync, rename, fsync of the directory) under a name that carries the
save id, so a save never overwrites a file a complete checkpoint still needs (a reused tag included);
the ranks then exchange their file's size and SHA-256 and only when every rank succeeded does rank 0
write the marker that names them; once every rank sees it, `latest_co2`. A checkpoint without a marker
is never loaded. A save that failed, as every rank heard, removes every rank's file of it before it
raises; each rank also removes its own files that no marker names (left by a save cut short) at the
start of every save and after every successful load, so failed saves cannot fill a disk.

A load is collective too. Rank 0 chooses one complete checkpoint (the given tag, else the one
`latest_co2` names, else the newest complete one) and tells the others (a fixed-size tensor, no
pickling); every rank then validates everything it will need: its file's size and digest against the
marker, `torch.load(weights_only=True)`, the identity (co2 config hash, grid, world size, rank, save
id), the shapes of the co2 state, the module and the framework's state. Only when every rank reports
success, and every rank read the same save (save id, step and marker digest: a rank with a stale view
of the directory would resume elsewhere), does any rank write model, optimizer or CO2 state, so a
refused load changes nothing. Every failure (a full disk, a dead peer, a damaged or crafted file on one
rank) ends on every rank with a CO2Error naming the rank, the file and what was wrong, within
`timeout_s` per agreement.

Resharding (`reshard=True`) re-cuts the CO2 state per parameter tensor (`consolidate`, `reshard`: pure
functions over the layout) from every rank's file, so a checkpoint of any integration and any R x S
loads on any other. Files hold plain tensors only: an FSDP2 rank's module entries and optimizer moments
are its rows of each tensor (`module_rows` says where they belong), which a load of another layout cuts
anew (`cut_rows`) and writes into what each rank holds, in place. The directory must be on a file
system every rank sees.

An integration contributes only its framework's own state through a `FrameworkState` (see there); this
module does the files, the agreement, the marker and the validation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import secrets
import struct
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Callable, NamedTuple, Optional, Protocol, Sequence, Union

import torch

from .errors import CO2Error, CO2TimeoutError
from .topology import fingerprint, gather_fingerprints, text_words, words_text

PathLike = Union[str, os.PathLike]

FORMAT = "co2_zero.checkpoint/2"
MARKER = "co2_complete.json"
LATEST = "latest_co2"
MAX_TAG_BYTES = 200
_RANK_FILE = re.compile(r"co2_rank(\d{5})\.([0-9a-f]{16})\.pt")
_TEXT_WORDS = 64  # an error message or a path in an agreement: 512 bytes of UTF-8
_TAG_WORDS = 32


# ---- names that cannot escape the directory -------------------------------------------------------------


def check_tag(tag: Any) -> str:
    """`tag` if it names a directory directly inside a checkpoint directory, else ValueError.

    Refused: empty, absolute, '.', '..', path separators, a leading '.', NUL, over 200 bytes. The same
    rule applies to the tag read from `latest_co2`, so a crafted file cannot point a load elsewhere.
    """
    text = str(tag)
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    if (
        not text
        or text in (".", "..")
        or text.startswith(".")
        or any(s in text for s in separators)
        or "\0" in text
        or len(text.encode()) > MAX_TAG_BYTES
        or os.path.isabs(text)
    ):
        raise ValueError(
            f"co2 checkpoint: tag={text!r} is invalid; accepted: a plain directory name (no path separator, "
            f"not starting with '.', at most {MAX_TAG_BYTES} bytes) that stays inside the checkpoint directory"
        )
    return text


def _tag_dir(root: Path, tag: str) -> Path:
    """root/tag, refusing a tag directory that is a link leading out of root."""
    directory = root / check_tag(tag)
    if directory.exists() and directory.resolve().parent != root.resolve():
        raise ValueError(f"co2 checkpoint: {directory} leads outside {root} (a symbolic link?); refused")
    return directory


def rank_file_name(rank: int, save_id: str) -> str:
    """The name of rank `rank`'s file of save `save_id` inside a checkpoint's tag directory."""
    return f"co2_rank{rank:05d}.{save_id}.pt"


# ---- atomic, durable files with normal permissions -------------------------------------------------------


class _HashingWriter:
    """A write-only file wrapper that hashes (SHA-256) and counts what passes through."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += len(view)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_atomic(path: PathLike, write: Callable[[IO[bytes]], None]) -> tuple[int, str]:
    """Call write(file) on a temporary file beside `path`, fsync it, rename it over `path`, fsync the
    directory. Returns (bytes, SHA-256 hex) of what was written. The file gets the usual permissions
    (0666 minus the umask; `tempfile.mkstemp` would make it 0600). A crash leaves the previous `path`
    whole and at most a `.<name>.*.tmp` file, removed by the next save or load of the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.hash.hexdigest()


def save_atomic(obj: Any, path: PathLike) -> tuple[int, str]:
    """torch.save plain data (`plain_data_problem` is None) to `path` atomically; (bytes, SHA-256)."""
    problem = plain_data_problem(obj)
    if problem is not None:
        raise ValueError(f"co2 checkpoint: {problem}")
    return write_atomic(path, lambda f: torch.save(obj, f))


def write_text_atomic(path: PathLike, text: str) -> None:
    """Write a small text file (the marker, `latest_co2`) atomically."""
    write_atomic(path, lambda f: f.write(text.encode()))


def load_file(path: PathLike, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True: plain containers and tensors only, never code."""
    return torch.load(Path(path), map_location=map_location, weights_only=True)


def file_digest(path: PathLike) -> tuple[int, str]:
    """(bytes, SHA-256 hex) of a file, read in 1 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


_PLAIN_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


def plain_data_problem(obj: Any, where: str = "state") -> Optional[str]:
    """None if `obj` is made of what `torch.load(weights_only=True)` reads back (dicts, lists, tuples,
    sets, numbers, strings, tensors, dtypes, devices), else a phrase naming the first offender."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN_SCALARS):
        return None
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                return f"{where} has a key of type {type(key).__name__}"
            problem = plain_data_problem(value, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if type(obj) in (list, tuple, set, frozenset):
        for i, value in enumerate(obj):
            problem = plain_data_problem(value, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    return (
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True) "
        f"refuses; checkpoint files hold plain data only (dicts, lists, numbers, strings, tensors): pass "
        f"e.g. its state_dict()"
    )


def clean_temp_files(root: PathLike, rank: int, world_size: int) -> int:
    """Remove the temporary files a killed save of this rank left under `root` (rank 0 also those of the
    marker, `latest_co2` and of ranks >= world_size). Only files this rank itself would write: no race
    with another rank's save. Returns how many were removed."""
    root = Path(root)
    if not root.is_dir():
        return 0
    mine = re.compile(r"\.co2_rank(\d{5})\..*\.tmp|\.(co2_complete\.json|latest_co2)\..*\.tmp")
    removed = 0
    for directory in [root, *(d for d in root.iterdir() if d.is_dir() and not d.is_symlink())]:
        for path in directory.iterdir():
            match = mine.fullmatch(path.name)
            if match is None:
                continue
            owner = int(match.group(1)) if match.group(1) is not None else 0
            if owner == rank or (rank == 0 and owner >= world_size):
                path.unlink(missing_ok=True)
                removed += 1
    return removed


# ---- the layout-independent CO2 state (pure functions) ---------------------------------------------------


def consolidate(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's layout-independent share of a `RoundEngine.state_dict()`, for resharding.

    Pieces are keyed by parameter tensor and element offset instead of partition position, so a run
    with another R or S (or another integration) can load them (`reshard`). Each rank contributes its
    sub-shard; the shares of all ranks of a run cover every parameter element exactly once.
    """
    geometry = state["geometry"]
    start, end = geometry["sub_shard"]
    momentum_start = geometry["momentum_range"][0]
    pieces = []
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        lo, hi = max(seg_start, start), min(seg_end, end)
        if lo >= hi:
            continue
        pieces.append(
            {
                "tensor_id": tensor_id,
                "offset": offset + lo - seg_start,
                "start_point": state["start_point"][lo:hi].cpu().clone(),
                "next_start": None if state["next_start"] is None else state["next_start"][lo:hi].cpu().clone(),
                "momentum": state["momentum"][lo - momentum_start : hi - momentum_start].cpu().clone(),
            }
        )
    norms = state["previous_update_sq_norms"]
    return {
        "config_hash": state["config_hash"],
        "signature": state["signature"],
        "num_tensors": geometry["num_tensors"],
        "tau": geometry["tau"],
        "inner_steps": state["inner_steps"],
        "rounds": state["rounds"],
        "skipped_rounds": state.get("skipped_rounds", 0),
        "run_id": state.get("run_id"),
        "pieces": pieces,
        "update_sq_norms_partial": None if norms is None else norms.cpu().clone(),
    }


def reshard(shares: Sequence[dict[str, Any]], identity: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A `RoundEngine` state for the engine whose `identity()` is given, assembled from the shares of
    every rank of a saved run (any R x S, any integration). Returns (state, dropped steps).

    The state resumes at the saved run's last round start: a partial round cannot be carried across
    partitions, so its steps are dropped (their number is returned). Raises ValueError when the shares
    do not cover the target's partition or come from another co2 config or model.
    """
    geometry = identity["geometry"]
    for share in shares:
        for key in ("config_hash", "signature"):
            if share[key] != identity[key]:
                raise ValueError(
                    f"co2 checkpoint: the saved state has {key}={share[key]!r} but this run has {identity[key]!r}; "
                    f"resharding needs the same co2 config and model"
                )
    saved = shares[0]
    padded, overlap = geometry["padded"], geometry["overlap"]
    momentum_lo, momentum_hi = geometry["momentum_range"]
    start_point = torch.zeros(padded, dtype=torch.float32)
    next_start = torch.zeros(padded, dtype=torch.float32) if overlap else None
    momentum = torch.zeros(momentum_hi - momentum_lo, dtype=torch.float32)
    by_tensor: dict[int, list[dict[str, Any]]] = {}
    for share in shares:
        for piece in share["pieces"]:
            by_tensor.setdefault(piece["tensor_id"], []).append(piece)
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        here = seg_start - offset  # partition index of this tensor's element 0
        covered = 0
        for piece in by_tensor.get(tensor_id, ()):
            there = piece["offset"]  # tensor element of the piece's element 0
            lo, hi = max(offset, there), min(offset + seg_end - seg_start, there + piece["start_point"].numel())
            if lo >= hi:
                continue
            covered += hi - lo
            start_point[here + lo : here + hi] = piece["start_point"][lo - there : hi - there]
            if overlap:
                if piece["next_start"] is None:
                    raise ValueError("co2 checkpoint: saved in blocking mode (overlap false); this run overlaps")
                next_start[here + lo : here + hi] = piece["next_start"][lo - there : hi - there]
            m_lo, m_hi = max(here + lo, momentum_lo), min(here + hi, momentum_hi)
            if m_lo < m_hi:
                momentum[m_lo - momentum_lo : m_hi - momentum_lo] = piece["momentum"][
                    m_lo - here - there : m_hi - here - there
                ]
        if covered != seg_end - seg_start:
            raise ValueError(
                f"co2 checkpoint: the saved shares cover {covered} of the {seg_end - seg_start} elements of "
                f"parameter tensor {tensor_id} this rank needs; every rank's file of the saved run is needed"
            )
    partials = [s["update_sq_norms_partial"] for s in shares if s["update_sq_norms_partial"] is not None]
    norms = None
    if partials:  # only the sum over ranks matters: rank 0 carries it, the others zeros
        norms = torch.stack(partials).sum(0) if identity["rank"] == 0 else torch.zeros_like(partials[0])
    rounds = saved["rounds"]
    state = {
        **identity,
        "run_id": saved.get("run_id"),
        "inner_steps": rounds * geometry["tau"],
        "rounds": rounds,
        "skipped_rounds": saved.get("skipped_rounds", 0),
        "start_point": start_point,
        "next_start": next_start,
        "momentum": momentum,
        "previous_update_sq_norms": norms,
    }
    return state, saved["inner_steps"] - rounds * saved["tau"]


# ---- what an integration contributes ---------------------------------------------------------------------


class FrameworkState(Protocol):
    """An integration's part of a checkpoint: its framework's own state, and how to load it.

    `capture()` returns plain data (weights_only-loadable); `check(saved)` raises ValueError naming
    what does not fit and changes nothing; `restore(saved)` loads a checked state; `after_reshard(saved)`
    runs after a resharded load (`saved`: the framework state of the file the module came from when it
    was written by the same integration, else None; the inner optimizer state is not carried across
    partitions). `module_excluded()` names module state entries the framework restores itself (e.g.
    DeepSpeed's trainable parameters, restored from its fp32 partition) and that are not saved.
    """

    integration: str
    engine: Any  # the RoundEngine
    module: torch.nn.Module

    def module_excluded(self) -> set[str]: ...

    def capture(self) -> dict[str, Any]: ...

    def check(self, saved: dict[str, Any]) -> None: ...

    def restore(self, saved: dict[str, Any]) -> None: ...

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None: ...


class InnerOptimizerState:
    """The framework state of `CO2Optimizer` and `CO2OSS`: the inner torch optimizer's state dict
    (for CO2OSS: OSS's local optimizer, this rank's shard). The wrapper's param groups are its own
    objects, kept in step with the inner optimizer's: `before_capture` brings the inner ones up to date
    (an LR scheduler writes the wrapper's), `after_load` makes the wrapper follow the loaded ones.
    State of FSDP2 parameters (DTensor moments) is stored as this rank's rows (`local_optimizer_state`)
    and made a DTensor like its parameter again on load."""

    def __init__(
        self,
        integration: str,
        engine: Any,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        after_load: Callable[[], None] = lambda: None,
        before_capture: Callable[[], None] = lambda: None,
    ) -> None:
        self.integration, self.engine, self.module = integration, engine, module
        self.optimizer, self.after_load, self.before_capture = optimizer, after_load, before_capture

    def module_excluded(self) -> set[str]:
        return set()

    def capture(self) -> dict[str, Any]:
        self.before_capture()
        inner, sharded = local_optimizer_state(self.optimizer.state_dict())
        return {"inner_optimizer": inner, "sharded_state": sharded}

    def check(self, saved: dict[str, Any]) -> None:
        inner = saved.get("inner_optimizer") if isinstance(saved, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
            raise ValueError("the inner optimizer state is missing or not a torch optimizer state dict")
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g.get("params", ())) for g in inner["param_groups"]]
        if mine != theirs:
            raise ValueError(f"the inner optimizer has parameter groups of sizes {mine} here but {theirs} in the file")
        self._sharded_state(saved)  # the entries of FSDP2 parameters fit their shards
        current = local_optimizer_state(self.optimizer.state_dict())[0]["state"]  # where this run has state
        for index, entry in inner.get("state", {}).items():
            if not isinstance(index, int) or not 0 <= index < sum(mine):
                raise ValueError(f"the inner optimizer state names parameter {index!r}, which does not exist here")
            for key, value in entry.items():
                like = current.get(index, {}).get(key)
                if not isinstance(like, torch.Tensor):
                    continue
                if not isinstance(value, torch.Tensor) or value.shape != like.shape:
                    shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"the inner optimizer state {key!r} of parameter {index} is {shown} in the file, "
                        f"{tuple(like.shape)} here"
                    )

    def restore(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self._sharded_state(saved))
        self.after_load()

    def _sharded_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The saved inner state dict with the entries `sharded_state` names made DTensors like their
        parameters (`fsdp.sharded_like`); ValueError when one does not fit."""
        from . import fsdp

        inner, names = saved["inner_optimizer"], saved.get("sharded_state") or []
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {index: dict(entry) for index, entry in inner.get("state", {}).items()}
        for item in names:
            index, key = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
            value = state.get(index, {}).get(key)
            rows = fsdp.local_rows(params[index]) if isinstance(index, int) and 0 <= index < len(params) else None
            if rows is None or not isinstance(value, torch.Tensor) or value.shape != rows[1].shape:
                raise ValueError(
                    f"the inner optimizer state names {item!r} as the rows of an FSDP2 parameter, which does not "
                    f"fit this model's parameters"
                )
            state[index][key] = fsdp.sharded_like(value, params[index])
        return {**inner, "state": state}

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None:
        """The inner optimizer state starts fresh: its partition changed."""
        self.optimizer.state.clear()


def local_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """A torch optimizer state dict as plain data, and the [parameter index, key] of each entry that was a
    DTensor (the state of an FSDP2 parameter, e.g. Adam's moments), now this rank's rows: a file holds
    no DTensor, which would need the saving run's device mesh to be read."""
    from . import fsdp

    state, sharded = {}, []
    for index, entry in state_dict.get("state", {}).items():
        state[index] = dict(entry)
        for key, value in entry.items():
            rows = fsdp.local_rows(value)
            if rows is not None:
                state[index][key] = rows[1]
                sharded.append([index, key])
    return {**state_dict, "state": state}, sharded


def framework_state(model: torch.nn.Module, optimizer: Any) -> FrameworkState:
    """The `FrameworkState` of a CO2 optimizer (`CO2Optimizer`, `CO2OSS`): its `checkpoint_state(model)`."""
    engine = getattr(optimizer, "engine", None)
    if engine is None:
        raise ValueError(
            f"co2 checkpoint: {type(optimizer).__name__} is not a CO2 optimizer (CO2Optimizer, CO2OSS); "
            f"for DeepSpeed use co2_zero.deepspeed.save_checkpoint / load_checkpoint"
        )
    return optimizer.checkpoint_state(model)


# ---- agreement: fixed-size int64 vectors, no pickling ----------------------------------------------------


def _id_word() -> int:
    return secrets.randbits(63)


def _hex(word: int) -> str:
    return f"{word:016x}"


class _Agreement:
    """The collectives of one save or load, on the engine's main-thread group of all ranks."""

    def __init__(self, engine: Any, action: str, where: Path) -> None:
        topology = engine.topology
        self.rank, self.world = topology.rank, topology.world_size
        self.group, self.timeout_s = topology.control_group, engine.config.timeout_s
        self.action, self.where = action, where
        self.consequence = ""  # what a failure of the next exchange means for the user's files and state

    def exchange(self, values: list[int], what: str) -> list[list[int]]:
        try:
            return gather_fingerprints(values, self.group, self.timeout_s, what)
        except CO2TimeoutError as error:
            raise CO2TimeoutError(
                f"co2 checkpoint {self.action} {self.where}: not every rank of global ranks "
                f"{list(range(self.world))} reached '{what}' within timeout_s={self.timeout_s:g} (rank "
                f"{self.rank} did); a rank died, is stuck, or failed before it (its own error says why). "
                f"{self.consequence}"
            ) from error

    def outcome(self, problem: Optional[str], what: str) -> None:
        """Every rank reports None or a problem; if any rank has one, every rank raises CO2Error
        listing each failing rank's problem."""
        table = self.exchange([0 if problem is None else 1, *text_words(problem or "", _TEXT_WORDS)], what)
        _raise_failed(self, [(rank, row[0], row[1:]) for rank, row in enumerate(table)])


def _describe(error: BaseException) -> str:
    """One line: the error's type and message (for weights_only refusals, torch's reason only)."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
        reason = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
        text = (
            "refused by torch.load(weights_only=True): the file holds something other than plain data and "
            f"tensors, which could run code when unpickled ({reason.group(1) if reason else 'unsupported content'})"
        )
    return " ".join(text.split())


# ---- save ------------------------------------------------------------------------------------------------


def save_checkpoint(
    directory: PathLike,
    framework: FrameworkState,
    extra: Any = None,
    tag: Optional[str] = None,
    write_latest: bool = True,
) -> Path:
    """Save one complete checkpoint of every rank under `directory/tag` (collective); returns that
    directory. `tag` defaults to `step<inner steps>`. Raises CO2Error on every rank if any rank failed;
    the previous complete checkpoints are then untouched. See the module docstring."""
    engine = framework.engine
    root = Path(directory)
    tag = check_tag(tag if tag is not None else f"step{engine.inner_steps:08d}")
    where = root / tag
    _refuse_unusable_engine(engine, "save to", where)
    agreement = _Agreement(engine, "save to", where)
    save_id = _agree_to_save(agreement, root, tag, engine)
    try:
        _write_save(agreement, where, _identity(framework, tag, save_id, engine.inner_steps), framework, extra)
    except CO2TimeoutError:
        raise  # no agreement on the outcome: what this rank wrote stays until the next save or load removes it
    except CO2Error:
        _remove_failed_save(root, where, agreement, save_id)  # every rank heard of the failure: no marker
        raise
    _confirm_marker(agreement, root, where, save_id)
    if write_latest:
        _write_latest(agreement, root, tag)
    _tidy(root, agreement.rank)
    return where


def _refuse_unusable_engine(engine: Any, action: str, where: Path) -> None:
    """CO2Error on this rank, before any collective, when the engine cannot take part in a save or load:
    after finalize() or a failure its process groups are released (torch would only say that a process
    group is not in the world group map)."""
    verb = "saved" if action.startswith("save") else "loaded"
    if engine.finalized:
        raise CO2Error(
            f"co2 checkpoint {action} {where}: finalize() already ended this CO2 optimizer's training and released "
            f"its process groups; nothing was {verb}. Save the checkpoint before finalize(); after finalize() every "
            f"rank holds the same final model: save it with torch.save(model.state_dict(), ...); to train on, build "
            f"a new CO2 optimizer and load a checkpoint saved before finalize() into it"
        )
    if engine.failed is not None:
        raise CO2Error(
            f"co2 checkpoint {action} {where}: this CO2 optimizer failed earlier and cannot take part in a "
            f"checkpoint ({engine.failed}); nothing was {verb}. Restart every rank, build a new CO2 optimizer and "
            f"load the last complete checkpoint into it"
        )


def _write_save(
    agreement: _Agreement, where: Path, identity: dict[str, Any], framework: FrameworkState, extra: Any
) -> None:
    """Every rank's file, then rank 0's marker naming them all; CO2Error on every rank if any failed."""
    agreement.consequence = (
        "This save did not complete: no marker names its files, so it will never be loaded; they are removed "
        "(at once, or by the next save or load of the directory where a rank did not answer). The previous "
        "complete checkpoints (an earlier save of the same tag included) are untouched."
    )
    files = _write_rank_files(agreement, where, identity, framework, extra)
    problem = None
    if agreement.rank == 0:
        marker = {k: v for k, v in identity.items() if k != "rank"}
        marker.update(files=files, saved_at=time.time())
        problem = _write_marker(where, marker)
    agreement.outcome(problem, "save: marker written")


def _write_marker(where: Path, marker: dict[str, Any]) -> Optional[str]:
    """Rank 0 writes the marker; on failure returns why, having removed a marker of this save that a
    failure after the rename may have left (the others are about to remove the files it names)."""
    try:
        write_text_atomic(where / MARKER, json.dumps(marker, indent=1))
        return None
    except Exception as error:
        if _marker_names(where, marker["save_id"]):
            (where / MARKER).unlink(missing_ok=True)
        return f"{MARKER}: {_describe_write_error(error, where)}"


def _marker_names(where: Path, save_id: str) -> bool:
    """Whether `where` holds a marker (readable or not) that could name save `save_id`."""
    try:
        return _read_marker(where).get("save_id") == save_id
    except FileNotFoundError:
        return False
    except Exception:
        return True  # a damaged marker might still name it: keep its files


def _confirm_marker(agreement: _Agreement, root: Path, where: Path, save_id: str) -> None:
    """Every rank reads the marker rank 0 wrote: a directory that is not shared fails every rank."""
    agreement.consequence = (
        f"Rank 0's {MARKER} is written, but a rank that does not see it cannot load this checkpoint; the "
        f"previous complete checkpoints are untouched."
    )
    try:
        seen = _read_marker(where).get("save_id")
    except Exception as error:
        seen = f"unreadable ({_describe(error)})"
    problem = None
    if seen != save_id:
        problem = f"{where / MARKER} names save {seen!r} here, rank 0 wrote {save_id!r}: is {root} shared?"
    agreement.outcome(problem, "save: marker seen")


def _write_latest(agreement: _Agreement, root: Path, tag: str) -> None:
    """Rank 0 points `latest_co2` at the new checkpoint. If that fails every rank raises CO2Error saying
    what is true: the checkpoint is complete and loads by its tag; `latest_co2` names the previous one."""
    problem = None
    if agreement.rank == 0:
        try:
            write_text_atomic(root / LATEST, tag)
        except Exception as error:
            problem = f"{LATEST}: {_describe_write_error(error, root)}; it still names {_latest_named(root)}"
    agreement.consequence = (
        f"The checkpoint {root / tag} itself is complete (its marker names every rank's file) and loads with "
        f"tag={tag!r}; only {root / LATEST} was not updated, so a load without a tag picks what it still names."
    )
    agreement.outcome(problem, "save: latest_co2 written")


def _latest_named(root: Path) -> str:
    """What `latest_co2` names, for a message."""
    try:
        return repr((root / LATEST).read_text().strip()[:80])
    except OSError:
        return "nothing (it does not exist)"


def _remove_failed_save(root: Path, where: Path, agreement: _Agreement, save_id: str) -> None:
    """After every rank heard that save `save_id` failed: remove this rank's file of it and its temp
    files, then the tag directory if that left it empty, so failed saves cannot fill a disk. Only this
    rank's files (no race with another rank), never those a marker names. A courtesy: an OSError is
    ignored (the next save or load removes what no marker names)."""
    try:
        if not _marker_names(where, save_id):
            (where / rank_file_name(agreement.rank, save_id)).unlink(missing_ok=True)
        clean_temp_files(root, agreement.rank, agreement.world)
        _remove_if_empty(where)
    except OSError:
        pass


def _agree_to_save(agreement: _Agreement, root: Path, tag: str, engine: Any) -> str:
    """The first exchange of a save: same tag and step everywhere, the directory usable; returns the
    fresh save id (rank 0's draw) and sets the engine's run id if it has none yet."""
    agreement.consequence = "Nothing was written; the previous complete checkpoints are untouched."
    problem = None
    try:
        _tag_dir(root, tag)
        clean_temp_files(root, agreement.rank, agreement.world)
    except (OSError, ValueError) as error:
        problem = f"{root}: {_describe(error)}"
    _tidy(root, agreement.rank)  # before the exchange: no rank writes into the directory before it ends
    mine = [int(problem is not None), fingerprint(tag), engine.inner_steps, _id_word(), _id_word()]
    table = agreement.exchange([*mine, *text_words(problem or "", _TEXT_WORDS)], "save: agree on tag and step")
    if any(row[1:3] != table[0][1:3] for row in table):
        counts = ", ".join(f"rank {r}: step {row[2]}" for r, row in enumerate(table))
        raise CO2Error(
            f"co2 checkpoint save to {root / tag}: the ranks are at different steps or use different tags "
            f"({counts}); every rank must save after the same number of optimizer steps, with the same tag. "
            f"{agreement.consequence}"
        )
    _raise_failed(agreement, [(r, row[0], row[5:]) for r, row in enumerate(table)])
    if engine.run_id is None:
        engine.run_id = _hex(table[0][4])
    return _hex(table[0][3])


def _write_rank_files(
    agreement: _Agreement, where: Path, identity: dict[str, Any], framework: FrameworkState, extra: Any
) -> list[dict[str, Any]]:
    """Every rank writes its file durably; returns the marker's list of files (name, bytes, SHA-256)."""
    name = rank_file_name(agreement.rank, identity["save_id"])
    size, digest, problem, cause = 0, "0" * 64, None, None
    try:
        payload = {
            "identity": identity,
            "co2": framework.engine.state_dict(),
            **_module_state(framework),
            "framework": framework.capture(),
            "extra": extra,
        }
        size, digest = save_atomic(payload, where / name)
    except Exception as error:  # a full disk (OSError, or RuntimeError from torch.save), a bad extra, ...
        problem, cause = f"{name}: {_describe_write_error(error, where)}", error
    digest_words = list(struct.unpack("<4q", bytes.fromhex(digest)))
    table = agreement.exchange(
        [int(problem is not None), size, *digest_words, *text_words(problem or "", _TEXT_WORDS)],
        "save: every file durable",
    )
    _raise_failed(agreement, [(r, row[0], row[6:]) for r, row in enumerate(table)], cause)
    return [
        {"rank": r, "name": rank_file_name(r, identity["save_id"]), "bytes": row[1], "sha256": _words_hex(row[2:6])}
        for r, row in enumerate(table)
    ]


def _raise_failed(
    agreement: _Agreement, reports: Sequence[tuple[int, int, Sequence[int]]], cause: Optional[BaseException] = None
) -> None:
    """reports: (rank, failed flag, message words); raise CO2Error listing the failed ranks, if any
    (`cause`: this rank's own original error, kept as the CO2Error's cause)."""
    failed = [(rank, words_text(words)) for rank, flag, words in reports if flag]
    if failed:
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in failed)
        raise CO2Error(
            f"co2 checkpoint {agreement.action} {agreement.where} failed on rank(s) {[r for r, _ in failed]}:\n"
            f"{lines}\n{agreement.consequence}"
        ) from cause


def _describe_write_error(error: BaseException, directory: Path) -> str:
    """`_describe(error)`, led by "no space left on the device <directory>" when the disk is full: an
    errno ENOSPC anywhere in the chain, or torch.save's "unexpected pos" (its zip writer wrote less
    than it meant to: what a full disk looks like through torch.save)."""
    if not _is_disk_full(error):
        return _describe(error)
    try:
        stats = os.statvfs(directory if directory.exists() else directory.parent)
        free = f" ({stats.f_bavail * stats.f_frsize} bytes free now)"
    except OSError:
        free = ""
    return f"no space left on the device {directory}{free}; {_describe(error)}"


def _is_disk_full(error: Optional[BaseException]) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _words_hex(words: Sequence[int]) -> str:
    return struct.pack("<4q", *words).hex()


def _identity(framework: FrameworkState, tag: str, save_id: str, steps: int) -> dict[str, Any]:
    engine = framework.engine
    topology = engine.topology
    return {
        "format": FORMAT,
        "integration": framework.integration,
        "config_hash": engine.config.math_hash(),
        "grid": {"replicas": topology.replicas, "shards": topology.shards},
        "world_size": topology.world_size,
        "rank": topology.rank,
        "step": steps,
        "run_id": engine.run_id,
        "tag": tag,
        "save_id": save_id,
    }


def _module_state(framework: FrameworkState) -> dict[str, Any]:
    """The module's part of a file, plain tensors only: `module` holds every entry (but the excluded)
    whole, or for an FSDP2 model the rows this rank holds, and `module_rows[key] = [first row, shape of
    the whole tensor]` says where such rows belong."""
    excluded = framework.module_excluded()
    entries, rows = {}, {}
    for key, value in framework.module.state_dict().items():
        if key not in excluded:
            first, entries[key] = _held(value)
            if first is not None:
                rows[key] = [first, list(value.shape)]
    return {"module": entries, "module_rows": rows}


def _tidy(root: Path, rank: int) -> None:
    """`_remove_superseded`, as a courtesy: an OSError leaves the rest for the next save or load."""
    try:
        _remove_superseded(root, rank)
    except OSError:
        pass


def _remove_superseded(root: Path, rank: int) -> None:
    """Remove this rank's files no marker names: those of an earlier save of a reused tag and of saves
    that never completed. A checkpoint directory this left empty is removed too (by the last rank).
    Only this rank's own files, and only where no rank can be writing (outside its own saves)."""
    if not root.is_dir():
        return
    for directory in (d for d in root.iterdir() if d.is_dir() and not d.is_symlink()):
        if (directory / MARKER).exists():
            try:
                keep = _read_marker(directory).get("save_id")
            except Exception:
                continue  # never delete what a damaged marker might still name
        else:
            keep = None  # a save that never completed: nothing of it is needed
        removed = False
        for path in directory.iterdir():
            match = _RANK_FILE.fullmatch(path.name)
            if match and int(match.group(1)) == rank and match.group(2) != keep:
                path.unlink(missing_ok=True)
                removed = True
        if removed:
            _remove_if_empty(directory)


def _remove_if_empty(directory: Path) -> None:
    """rmdir, only if empty: the last rank to remove its file of a checkpoint directory succeeds."""
    try:
        directory.rmdir()
    except OSError:
        pass


# ---- load ------------------------------------------------------------------------------------------------


def _read_marker(directory: Path) -> dict[str, Any]:
    return _parse_marker((directory / MARKER).read_bytes())


def _parse_marker(raw: bytes) -> dict[str, Any]:
    marker = json.loads(raw.decode())
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(f"{MARKER} has format {marker.get('format') if isinstance(marker, dict) else None!r}")
    return marker


def complete_checkpoints(directory: PathLike) -> list[tuple[str, dict[str, Any]]]:
    """(tag, marker) of every complete checkpoint under `directory`, oldest first (by step, then time)."""
    root, found = Path(directory), []
    if not root.is_dir():
        return []
    for sub in root.iterdir():
        try:
            if sub.is_dir() and not sub.is_symlink() and (sub / MARKER).is_file():
                found.append((check_tag(sub.name), _read_marker(sub)))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda item: (item[1].get("step", -1), item[1].get("saved_at", 0.0)))


class _Choice(NamedTuple):
    tag: Optional[str]  # None: nothing to load
    problem: Optional[str]  # a reason to refuse, for every rank


def _choose(root: Path, tag: Optional[str]) -> _Choice:
    """Rank 0's choice of the checkpoint to load."""
    complete = dict(complete_checkpoints(root))
    if tag is not None:
        tag = check_tag(tag)
        if tag in complete:
            return _Choice(tag, None)
        state = "does not exist" if not (root / tag).exists() else f"is incomplete (no valid {MARKER})"
        return _Choice(None, f"{root / tag} {state}; complete checkpoints in {root}: {sorted(complete)}")
    latest = root / LATEST
    if latest.is_file():
        named = latest.read_text().strip()
        try:
            check_tag(named)
        except ValueError:
            return _Choice(None, f"{latest} names {named[:80]!r}, which is not a tag inside {root}; refused")
        if named in complete:
            return _Choice(named, None)
        warnings.warn(
            f"co2 checkpoint: {latest} names {named!r}, which is not a complete checkpoint; loading the newest "
            f"complete one instead",
            stacklevel=4,
        )
    if not complete:
        return _Choice(None, None)
    return _Choice(list(complete)[-1], None)


def load_checkpoint(
    directory: PathLike,
    framework: FrameworkState,
    tag: Optional[str] = None,
    reshard: bool = False,
) -> Optional[tuple[Path, Any]]:
    """Load one complete checkpoint on every rank (collective): returns (its directory, its extra), or
    None when `directory` holds no complete checkpoint at all. Raises CO2Error on every rank when any
    rank cannot load it; nothing was changed then. See the module docstring."""
    engine = framework.engine
    root = Path(directory)
    _refuse_unusable_engine(engine, "load from", root)
    agreement = _Agreement(engine, "load from", root)
    agreement.consequence = "Nothing was loaded: the model, the optimizers and the CO2 state are unchanged."
    try:
        clean_temp_files(root, agreement.rank, agreement.world)
    except OSError:
        pass  # cleaning is a courtesy; the load does not depend on it
    chosen = _agree_on_choice(agreement, root, tag)
    if chosen is None:
        return None
    where = root / chosen
    agreement.where = where
    try:
        plan, problem = _prepare(where, framework, reshard), None
    except _Refused as refusal:
        plan, problem = None, str(refusal)
    except Exception as error:  # a malformed file can fail anywhere; every rank must still hear of it
        plan, problem = None, f"{where.name}: {_describe(error)}"
    _agree_to_apply(agreement, plan, problem)
    assert plan is not None
    plan.apply()
    _tidy(root, agreement.rank)  # every rank agreed on the markers: what none names is a leftover
    return where, plan.extra


def _agree_on_choice(agreement: _Agreement, root: Path, tag: Optional[str]) -> Optional[str]:
    """Rank 0 chooses the tag to load (`_choose`) and every rank receives it; None: nothing to load.
    CO2Error on every rank when rank 0 refuses."""
    kind, chosen, problem = 0, "", ""
    if agreement.rank == 0:
        try:
            choice = _choose(root, tag)
            kind = 2 if choice.problem else (1 if choice.tag is None else 0)
            chosen, problem = choice.tag or "", choice.problem or ""
        except Exception as error:
            kind, problem = 2, f"{root}: {_describe(error)}"
    table = agreement.exchange(
        [kind, *text_words(chosen, _TAG_WORDS), *text_words(problem, _TEXT_WORDS)], "load: choose"
    )
    kind, chosen = table[0][0], words_text(table[0][1 : 1 + _TAG_WORDS])
    if kind == 2:
        raise CO2Error(
            f"co2 checkpoint load from {root} refused: {words_text(table[0][1 + _TAG_WORDS :])}. "
            f"{agreement.consequence}"
        )
    return None if kind == 1 else chosen


def _agree_to_apply(agreement: _Agreement, plan: Optional[_Plan], problem: Optional[str]) -> None:
    """The last exchange of a load: every rank validated, and every rank is about to apply the same save
    (save id, step, marker digest: a rank with a stale or non-shared view of the directory would
    otherwise resume elsewhere). Else CO2Error on every rank, before any rank changed anything."""
    seen = _UNSEEN if plan is None else plan.seen
    table = agreement.exchange(
        [int(problem is not None), *seen.words(), *text_words(problem or "", _TEXT_WORDS)], "load: every rank validated"
    )
    _refuse_different_saves(agreement, [_SaveSeen.from_words(row[1 : 1 + _SEEN_WORDS]) for row in table])
    _raise_failed(agreement, [(r, row[0], row[1 + _SEEN_WORDS :]) for r, row in enumerate(table)])


class _SaveSeen(NamedTuple):
    """The save a rank's marker of the chosen checkpoint describes: what that rank would apply."""

    save_id: str
    step: int
    digest: str  # SHA-256 hex of the marker's bytes; "" when this rank could not read it

    def words(self) -> list[int]:
        digest = bytes.fromhex(self.digest) if self.digest else bytes(32)
        return [self.step, *struct.unpack("<4q", digest), *text_words(self.save_id, 2)]

    @staticmethod
    def from_words(words: Sequence[int]) -> _SaveSeen:
        digest = _words_hex(words[1:5])
        return _SaveSeen(words_text(words[5:7]), words[0], "" if digest == "0" * 64 else digest)


_SEEN_WORDS = 7
_UNSEEN = _SaveSeen("", -1, "")


def _seen_in(raw: bytes, marker: dict[str, Any]) -> _SaveSeen:
    step = marker.get("step")
    step = step if type(step) is int and abs(step) < 2**62 else -1
    return _SaveSeen(str(marker.get("save_id"))[:16], step, hashlib.sha256(raw).hexdigest())


def _refuse_different_saves(agreement: _Agreement, seen: Sequence[_SaveSeen]) -> None:
    """CO2Error on every rank when the ranks that read their marker read different saves."""
    read = [(rank, s) for rank, s in enumerate(seen) if s.digest]
    if len({s for _, s in read}) <= 1:
        return
    fields = ("save id", "step", "marker digest")
    differ = [name for index, name in enumerate(fields) if len({s[index] for _, s in read}) > 1]
    views = ", ".join(f"rank {r}: save {s.save_id} at step {s.step}, marker SHA-256 {s.digest[:16]}" for r, s in read)
    raise CO2Error(
        f"co2 checkpoint load from {agreement.where} refused: the ranks read different saves of it ({views}); "
        f"they differ in {', '.join(differ)}. Every rank must read the same files: the directory must be on a "
        f"file system every rank shares, written completely (a rank seeing an older save of a reused tag would "
        f"resume at another step). {agreement.consequence}"
    )


class _Refused(Exception):
    """Why this rank cannot load the chosen checkpoint (file and reason)."""


class _Plan(NamedTuple):
    """What a rank will write once every rank validated, and the save it comes from."""

    apply: Callable[[], None]
    extra: Any
    seen: _SaveSeen = _UNSEEN


def _open(directory: Path, marker: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s payload, after checking it against the marker; raises _Refused naming the file."""
    files = marker.get("files", [])
    entry = files[rank] if 0 <= rank < len(files) else None
    if not isinstance(entry, dict) or not _RANK_FILE.fullmatch(str(entry.get("name"))):
        raise _Refused(f"{directory / MARKER}: no valid entry for rank {rank}")
    path = directory / entry["name"]
    try:
        size, digest = file_digest(path)
    except OSError as error:
        raise _Refused(f"{entry['name']}: missing or unreadable ({_describe(error)})") from error
    if size != entry.get("bytes") or digest != entry.get("sha256"):
        raise _Refused(
            f"{entry['name']}: {size} bytes with SHA-256 {digest[:12]}..., the marker says {entry.get('bytes')} "
            f"bytes with {str(entry.get('sha256'))[:12]}... (empty, truncated or damaged)"
        )
    try:
        payload = load_file(path)
    except Exception as error:
        raise _Refused(f"{entry['name']}: {_describe(error)}") from error
    if not isinstance(payload, dict) or not isinstance(payload.get("identity"), dict):
        raise _Refused(f"{entry['name']}: not a co2_zero checkpoint file (no identity record)")
    identity = payload["identity"]
    for key in ("format", "save_id", "run_id", "tag", "integration", "config_hash", "grid", "world_size"):
        if identity.get(key) != marker.get(key):
            raise _Refused(f"{entry['name']}: {key}={identity.get(key)!r} but the marker says {marker.get(key)!r}")
    if identity.get("rank") != rank:
        raise _Refused(f"{entry['name']}: written by rank {identity.get('rank')!r}, listed for rank {rank}")
    return payload


# ---- the module's state: whole tensors, or the rows an FSDP2 rank holds ----------------------------------


def _held(value: torch.Tensor) -> tuple[Optional[int], torch.Tensor]:
    """(first row, what this rank holds) of a module state entry: an FSDP2 DTensor's local rows (the
    parameter's own storage), else (None, the whole tensor)."""
    from . import fsdp

    rows = fsdp.local_rows(value)
    return (None, value) if rows is None else rows


def _shown(value: Any, where: Any = None) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    text = f"{value.dtype} {tuple(value.shape)}"
    if type(value) is not torch.Tensor:
        text += f" ({type(value).__name__})"
    return text if where is None else f"{text}, rows from {where[0]} of {tuple(where[1])}"


def cut_rows(pieces: Sequence[tuple[int, torch.Tensor]], first: int, rows: int) -> torch.Tensor:
    """Rows [first, first + rows) of a tensor given as pieces (first row, rows of it): what an FSDP2 rank
    holds of it, or (first 0, every row) all of it. Pieces may repeat rows; ValueError names the rows
    that no piece holds."""
    like = pieces[0][1]
    out = like.new_empty((rows, *like.shape[1:]))
    covered = torch.zeros(rows, dtype=torch.bool)
    for start, piece in pieces:
        lo, hi = max(first, start), min(first + rows, start + piece.shape[0])
        if lo < hi:
            out[lo - first : hi - first] = piece[lo - start : hi - start]
            covered[lo - first : hi - first] = True
    if not covered.all():
        gaps = (~covered).nonzero().flatten() + first
        raise ValueError(f"rows {int(gaps[0])}..{int(gaps[-1])} ({len(gaps)} rows) are in none of the saved files")
    return out


class _Piece(NamedTuple):
    """A saved module entry, or the rows of it one FSDP2 rank held."""

    first: int  # its first row in the whole tensor
    tensor: torch.Tensor
    shape: tuple[int, ...]  # of the whole tensor
    file: str


def _saved_pieces(payload: dict[str, Any], name: str, needed: set[str], whole: bool) -> dict[str, _Piece]:
    """The pieces of the `needed` module entries in one saved file: rows of FSDP2 entries always, whole
    entries only when `whole` (every file of a replica holds the same ones: one is enough)."""
    module, rows = payload.get("module"), payload.get("module_rows", {})
    if not isinstance(module, dict) or not isinstance(rows, dict):
        raise _Refused(f"{name}: the module state is missing")
    found = {}
    for key in needed & set(module):
        value, where = module[key], rows.get(key)
        if where is None and not whole:
            continue
        valid_where = where is None or (
            isinstance(where, list) and len(where) == 2 and isinstance(where[0], int) and isinstance(where[1], list)
        )
        if type(value) is not torch.Tensor or not valid_where or (where is not None and value.dim() == 0):
            raise _Refused(f"{name}: module entry {key!r} is {_shown(value)} with rows record {where!r}")
        first, shape = (0, tuple(value.shape)) if where is None else (where[0], tuple(where[1]))
        found[key] = _Piece(first, value, shape, name)
    return found


def _module_for_here(
    module: torch.nn.Module, pieces: dict[str, list[_Piece]], needed: set[str], source: str
) -> dict[str, Any]:
    """What this rank holds of every `needed` module entry (whole, or its FSDP2 rows), cut from the
    saved pieces (`source`: the file whole entries come from); _Refused naming the file and the entry
    when they do not fit this model."""
    current = module.state_dict()
    missing = sorted(k for k in needed if not pieces.get(k))
    if missing:
        raise _Refused(f"{source}: the module state lacks {missing[:5]} (a different model?)")
    state = {}
    for key in sorted(needed):
        whole = current[key]
        first, held = _held(whole)
        for piece in pieces[key]:
            rows = piece.tensor.shape[0] if piece.tensor.dim() else 0
            if (
                piece.shape != tuple(whole.shape)
                or piece.tensor.dtype != whole.dtype
                or piece.tensor.shape[1:] != whole.shape[1:]
                or not 0 <= piece.first <= piece.first + rows <= (whole.shape[0] if whole.dim() else 0)
            ):
                raise _Refused(
                    f"{piece.file}: module entry {key!r} is {_shown(piece.tensor, [piece.first, piece.shape])}; "
                    f"this model has {whole.dtype} {tuple(whole.shape)}"
                )
        if whole.dim() == 0:
            state[key] = pieces[key][0].tensor
            continue
        try:
            state[key] = cut_rows([(p.first, p.tensor) for p in pieces[key]], first or 0, held.shape[0])
        except ValueError as error:
            where = f"{source} and its replica's files"
            raise _Refused(f"{where}: module entry {key!r} {tuple(whole.shape)}: {error}") from error
    return state


def _write_module(module: torch.nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Write a checked module state (whole entries, or this rank's FSDP2 rows) into the module. FSDP2:
    each entry into what this rank holds of it, in place (FSDP2 keeps references to its sharded
    parameters and CO2's partition views them: never new Parameters); else `load_state_dict`."""
    from . import fsdp

    current = module.state_dict(keep_vars=True)
    if not fsdp.is_sharded(list(current.values())):
        module.load_state_dict(state, strict=strict)
        return
    with torch.no_grad():
        for key, value in state.items():
            _held(current[key])[1].copy_(value)


def _check_module(module: torch.nn.Module, payload: dict[str, Any], needed: set[str], name: str) -> None:
    """The file's module state is exactly what this rank holds of the `needed` entries (same run layout)."""
    saved, rows = payload.get("module"), payload.get("module_rows", {})
    if not isinstance(saved, dict) or not isinstance(rows, dict):
        raise _Refused(f"{name}: the module state is missing")
    current = module.state_dict()
    missing = sorted(needed - set(saved))
    if missing:
        raise _Refused(f"{name}: the module state lacks {missing[:5]} (a different model?)")
    for key in needed:
        first, want = _held(current[key])
        where = None if first is None else [first, list(current[key].shape)]
        got = saved[key]
        if (
            type(got) is not torch.Tensor
            or got.shape != want.shape
            or got.dtype != want.dtype
            or rows.get(key) != where
        ):
            raise _Refused(
                f"{name}: module entry {key!r} is {_shown(got, rows.get(key))}; this rank holds {_shown(want, where)}"
            )


def _prepare(directory: Path, framework: FrameworkState, resharding: bool) -> _Plan:
    """Everything that can fail, with nothing changed yet: read and check what this rank needs."""
    engine = framework.engine
    topology = engine.topology
    try:
        engine.state_dict()  # usable (not failed, not finalized), and no round in flight any more
    except CO2Error as error:
        raise _Refused(str(error)) from error
    try:
        raw = (directory / MARKER).read_bytes()
        marker = _parse_marker(raw)
    except Exception as error:
        raise _Refused(f"{directory / MARKER}: {_describe(error)}") from error
    seen = _seen_in(raw, marker)
    if not resharding:
        return _prepare_same(directory, marker, framework)._replace(seen=seen)
    saved_world, saved_grid = marker.get("world_size"), marker.get("grid")
    saved_shards = saved_grid.get("shards") if isinstance(saved_grid, dict) else None
    if not isinstance(saved_world, int) or not isinstance(saved_shards, int) or not 0 < saved_shards <= saved_world:
        raise _Refused(f"{directory / MARKER}: world_size={saved_world!r}, grid={saved_grid!r}")
    trainable = {n for n, p in framework.module.named_parameters(remove_duplicate=False) if p.requires_grad}
    needed = set(framework.module.state_dict()) - trainable
    # Buffers and frozen parameters come from the saved replica of rank `rank % saved world`: whole from
    # that rank's file, FSDP2 rows from every file of its replica.
    source_rank = topology.rank % saved_world
    shares, source, pieces = [], None, {}
    for saved_rank in range(saved_world):
        payload = _open(directory, marker, saved_rank)
        name = marker["files"][saved_rank]["name"]
        try:
            shares.append(consolidate(payload["co2"]))
        except Exception as error:
            raise _Refused(f"{name}: the co2 state cannot be consolidated ({_describe(error)})") from error
        if saved_rank // saved_shards == source_rank // saved_shards:
            for key, piece in _saved_pieces(payload, name, needed, whole=saved_rank == source_rank).items():
                pieces.setdefault(key, []).append(piece)
        if saved_rank == source_rank:
            source = (name, payload)
        del payload
    name, payload = source
    try:
        state, dropped = reshard(shares, engine.identity())
        engine.check_state_dict(state)
    except ValueError as error:
        raise _Refused(f"{directory.name}: {error}") from error
    module_state = _module_for_here(framework.module, pieces, needed, name)
    same_framework = payload["identity"].get("integration") == framework.integration
    saved_framework = payload["framework"] if same_framework else None

    def apply() -> None:
        if dropped:
            warnings.warn(
                f"co2 resharding: {dropped} step(s) after the saved run's last round end are dropped; training "
                f"resumes at its last round start (step {state['inner_steps']})",
                stacklevel=4,
            )
        _write_module(framework.module, module_state, strict=False)
        engine.load_state_dict(state)
        engine.restart_from_start_point()
        framework.after_reshard(saved_framework)

    return _Plan(apply, payload["extra"], seen)


def _prepare_same(directory: Path, marker: dict[str, Any], framework: FrameworkState) -> _Plan:
    engine = framework.engine
    topology = engine.topology
    here = {
        "integration": framework.integration,
        "config_hash": engine.config.math_hash(),
        "grid": {"replicas": topology.replicas, "shards": topology.shards},
        "world_size": topology.world_size,
    }
    for key, value in here.items():
        if marker.get(key) != value:
            hint = "resume with the same co2 config" if key == "config_hash" else "or pass reshard=True"
            raise _Refused(f"{directory.name}: {key}={marker.get(key)!r} in the checkpoint, {value!r} here; {hint}")
    payload = _open(directory, marker, topology.rank)
    name = marker["files"][topology.rank]["name"]
    try:
        engine.check_state_dict(payload.get("co2"))
    except ValueError as error:
        raise _Refused(f"{name}: {error}") from error
    needed = set(framework.module.state_dict()) - framework.module_excluded()
    _check_module(framework.module, payload, needed, name)
    unknown = sorted(set(payload["module"]) - needed)
    if unknown:
        raise _Refused(f"{name}: the module state has entries this model lacks: {unknown[:5]}")
    try:
        framework.check(payload.get("framework"))
    except ValueError as error:
        raise _Refused(f"{name}: {error}") from error

    def apply() -> None:
        _write_module(framework.module, payload["module"], strict=not framework.module_excluded())
        framework.restore(payload["framework"])
        engine.load_state_dict(payload["co2"])

    return _Plan(apply, payload.get("extra"))


# ---- the public entry points for CO2Optimizer and CO2OSS -------------------------------------------------


def save(
    directory: PathLike, model: torch.nn.Module, optimizer: Any, extra: Any = None, tag: Optional[str] = None
) -> Path:
    """Save model, optimizer (inner and CO2 state) and `extra` of every rank as one complete checkpoint.

    Collective: every rank calls it. Waits for the round in flight, so it can be called at any inner
    step. Layout and protocol: docs/design.md §7.

    Args:
        directory: the checkpoint root, on a file system every rank sees.
        model: the module whose state is saved (this rank's shards under FSDP2).
        optimizer: a `CO2Optimizer` or `co2_zero.fairscale.CO2OSS`.
        extra: plain data (dicts, lists, numbers, strings, tensors) kept in every rank's file and
            returned by `load`, e.g. `{"sched": sched.state_dict()}`.
        tag: the checkpoint's directory name; defaults to `step<inner steps>`.

    Returns:
        The checkpoint's directory, `directory/tag`.

    Raises:
        ValueError: `tag` could escape `directory` (absolute, `..`, a path separator).
        CO2Error: on every rank, when any rank failed (naming it, its file and why); the previous
            checkpoints are untouched and the failed one is never loaded.
    """
    return save_checkpoint(directory, framework_state(model, optimizer), extra=extra, tag=tag)


def load(
    directory: PathLike, model: torch.nn.Module, optimizer: Any, reshard: bool = False, tag: Optional[str] = None
) -> Any:
    """Load a complete checkpoint written by `save` (collective); returns its `extra`.

    Without `tag`: the one `latest_co2` names, else the newest complete one; never a partial one. Same
    topology: every rank restores its own file and the run continues bit for bit. `reshard=True`
    assembles the CO2 state per parameter tensor from every rank's file, so R, S and the integration may
    differ from the saved run's: training resumes at its last round start, the inner optimizer state
    starts fresh. A refused load (CO2Error on every rank) changes nothing.

    Args:
        directory: the checkpoint root given to `save`.
        model: the module to restore, built as in the saved run (or for the new layout with `reshard`).
        optimizer: a `CO2Optimizer` or `co2_zero.fairscale.CO2OSS` over `model`.
        reshard: load a checkpoint of another R x S or integration.
        tag: load this checkpoint instead of the newest complete one.

    Returns:
        The `extra` given to `save`.

    Raises:
        CO2Error: on every rank, when there is no complete checkpoint, or any rank's file is missing,
            damaged or from another config or grid (naming the rank, the file and what was wrong).
    """
    loaded = load_checkpoint(directory, framework_state(model, optimizer), tag=tag, reshard=reshard)
    if loaded is None:
        raise CO2Error(f"co2 checkpoint: no complete checkpoint in {directory}; nothing was loaded")
    return loaded[1]
