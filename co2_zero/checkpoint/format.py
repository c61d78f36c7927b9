"""The checkpoint layout, one source for every name (docs/design.md §7): `latest_co2`, the tag
directories, each rank's file `co2_rank<NNNNN>.<save id>.pt`, the marker `co2_complete.json`; the
identity record every file and the marker carry; reading markers; and which files are leftovers (of
killed or failed saves) that a rank may remove."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .files import PathLike, check_tag, remove_if_empty, temp_pattern

FORMAT = "co2_zero.checkpoint/2"  # in every identity record and marker; a load refuses any other
MARKER = "co2_complete.json"  # in a tag directory: written once every rank's file is durable
LATEST = "latest_co2"  # in the checkpoint root: the tag of the newest complete checkpoint
_RANK_PREFIX = "co2_rank"
RANK_FILE = re.compile(rf"{_RANK_PREFIX}(\d{{5}})\.([0-9a-f]{{16}})\.pt")  # groups: rank, save id


def rank_file_name(rank: int, save_id: str) -> str:
    """The name of rank `rank`'s file of save `save_id` inside a checkpoint's tag directory."""
    return f"{_RANK_PREFIX}{rank:05d}.{save_id}.pt"


def identity_record(integration: str, engine: Any, tag: str, save_id: str) -> dict[str, Any]:
    """Who wrote a file and for which run: in every rank's file (with its rank) and in the marker."""
    topology = engine.topology
    return {
        "format": FORMAT,
        "integration": integration,
        "config_hash": engine.config.math_hash(),
        "config": engine.config.math_fields(),  # what a refused load names when the hash differs
        "grid": {"replicas": topology.replicas, "shards": topology.shards},
        "world_size": topology.world_size,
        "rank": topology.rank,
        "step": engine.inner_steps,
        "run_id": engine.run_id,
        "tag": tag,
        "save_id": save_id,
    }


def read_marker(directory: Path) -> dict[str, Any]:
    """The marker of the checkpoint in `directory`, checked to be of this format."""
    return parse_marker((directory / MARKER).read_bytes())


def parse_marker(raw: bytes) -> dict[str, Any]:
    marker = json.loads(raw.decode())
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(f"{MARKER} has format {marker.get('format') if isinstance(marker, dict) else None!r}")
    return marker


def marker_names(where: Path, save_id: str) -> bool:
    """Whether `where` holds a marker (readable or not) that could name save `save_id`."""
    try:
        return read_marker(where).get("save_id") == save_id
    except FileNotFoundError:
        return False
    except Exception:
        return True  # a damaged marker might still name it: keep its files


def complete_checkpoints(directory: PathLike) -> list[tuple[str, dict[str, Any]]]:
    """(tag, marker) of every complete checkpoint under `directory`, oldest first (by step, then time)."""
    root, found = Path(directory), []
    if not root.is_dir():
        return []
    for sub in root.iterdir():
        try:
            if sub.is_dir() and not sub.is_symlink() and (sub / MARKER).is_file():
                found.append((check_tag(sub.name), read_marker(sub)))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda item: (item[1].get("step", -1), item[1].get("saved_at", 0.0)))


def clean_temp_files(root: PathLike, rank: int, world_size: int) -> int:
    """Remove the temporary files a killed save of this rank left under `root` (rank 0 also those of the
    marker, `latest_co2` and of ranks >= world_size). Only files this rank itself would write: no race
    with another rank's save. Returns how many were removed."""
    root = Path(root)
    if not root.is_dir():
        return 0
    mine = re.compile(
        temp_pattern(rf"{_RANK_PREFIX}(\d{{5}})") + "|" + temp_pattern(f"({re.escape(MARKER)}|{re.escape(LATEST)})")
    )
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


def tidy(root: Path, rank: int) -> None:
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
                keep = read_marker(directory).get("save_id")
            except Exception:
                continue  # never delete what a damaged marker might still name
        else:
            keep = None  # a save that never completed: nothing of it is needed
        removed = False
        for path in directory.iterdir():
            match = RANK_FILE.fullmatch(path.name)
            if match and int(match.group(1)) == rank and match.group(2) != keep:
                path.unlink(missing_ok=True)
                removed = True
        if removed:
            remove_if_empty(directory)
