"""Files that are whole or absent: tags that stay inside the directory, atomic and durable writes with
their size and SHA-256, `weights_only` reads, the plain-data check, and one-line error descriptions
(a full disk named as one). Knows no checkpoint layout (`format`) and no other rank (`agreement`)."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

import torch

PathLike = Union[str, os.PathLike]


MAX_TAG_BYTES = 200


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


def tag_dir(root: Path, tag: str) -> Path:
    """root/tag, refusing a tag directory that is a link leading out of root."""
    directory = root / check_tag(tag)
    if directory.exists() and directory.resolve().parent != root.resolve():
        raise ValueError(f"co2 checkpoint: {directory} leads outside {root} (a symbolic link?); refused")
    return directory


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
    """The temporary file beside `path` that `write_atomic` renames over it (`temp_pattern` matches it)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def temp_pattern(name: str) -> str:
    """A regular expression for the temporary files of the files whose names `name` (a regular
    expression) matches: what a write killed before its rename leaves."""
    return rf"\.{name}\..*\.tmp"


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


def describe(error: BaseException) -> str:
    """One line: the error's type and message (for weights_only refusals, torch's reason only)."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
        reason = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
        text = (
            "refused by torch.load(weights_only=True): the file holds something other than plain data and "
            f"tensors, which could run code when unpickled ({reason.group(1) if reason else 'unsupported content'})"
        )
    return " ".join(text.split())


def describe_write_error(error: BaseException, directory: Path) -> str:
    """`describe(error)`, led by "no space left on the device <directory>" when the disk is full: an
    errno ENOSPC anywhere in the chain, or torch.save's "unexpected pos" (its zip writer wrote less
    than it meant to: what a full disk looks like through torch.save)."""
    if not _is_disk_full(error):
        return describe(error)
    try:
        stats = os.statvfs(directory if directory.exists() else directory.parent)
        free = f" ({stats.f_bavail * stats.f_frsize} bytes free now)"
    except OSError:
        free = ""
    return f"no space left on the device {directory}{free}; {describe(error)}"


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


def remove_if_empty(directory: Path) -> None:
    """rmdir, only if empty: the last rank to remove its file of a checkpoint directory succeeds."""
    try:
        directory.rmdir()
    except OSError:
        pass
