"""A save: collective, every rank's file durable before rank 0's marker names them all, and `latest_co2`
after it (docs/design.md §7). A failure anywhere ends on every rank with one CO2Error naming each
failing rank's file and reason; the previous complete checkpoints are untouched."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..core.errors import CO2Error, CO2TimeoutError
from ..core.topology import fingerprint
from .agreement import (
    Agreement,
    as_hex,
    hex_words,
    id_word,
    problem_words,
    raise_failed,
    refuse_unusable_engine,
    words_hex,
)
from .files import (
    PathLike,
    check_tag,
    describe,
    describe_write_error,
    remove_if_empty,
    save_atomic,
    tag_dir,
    write_text_atomic,
)
from .format import LATEST, MARKER, clean_temp_files, identity_record, marker_names, rank_file_name, read_marker, tidy
from .record import FrameworkState, framework_state, rank_record


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


def save_checkpoint(
    directory: PathLike,
    framework: FrameworkState,
    extra: Any = None,
    tag: Optional[str] = None,
    write_latest: bool = True,
) -> Path:
    """Save one complete checkpoint of every rank under `directory/tag` (collective); returns that
    directory. `tag` defaults to `step<inner steps>`. Raises CO2Error on every rank if any rank failed;
    the previous complete checkpoints are then untouched. With replica_tau the step is each rank's on the
    fastest replica's clock (`pace.Pace.agreed_step`): save at a round end, or at the same share of a round.
    Protocol: co2_zero.checkpoint, docs/design.md §7."""
    engine = framework.engine
    root = Path(directory)
    tag = check_tag(tag if tag is not None else f"step{engine.agreed_step:08d}")
    where = root / tag
    refuse_unusable_engine(engine, "save to", where)
    agreement = Agreement(engine, "save to", where)
    save_id = _agree_to_save(agreement, root, tag, engine)
    try:
        _write_save(agreement, where, identity_record(framework.integration, engine, tag, save_id), framework, extra)
    except CO2TimeoutError:
        raise  # no agreement on the outcome: what this rank wrote stays until the next save or load removes it
    except CO2Error:
        _remove_failed_save(root, where, agreement, save_id)  # every rank heard of the failure: no marker
        raise
    _confirm_marker(agreement, root, where, save_id)
    if write_latest:
        _write_latest(agreement, root, tag)
    tidy(root, agreement.rank)
    return where


def _agree_to_save(agreement: Agreement, root: Path, tag: str, engine: Any) -> str:
    """The first exchange of a save: same tag and step everywhere, the directory usable; returns the
    fresh save id (rank 0's draw) and sets the engine's run id if it has none yet."""
    agreement.consequence = "Nothing was written; the previous complete checkpoints are untouched."
    problem = None
    try:
        tag_dir(root, tag)
        clean_temp_files(root, agreement.rank, agreement.world)
    except (OSError, ValueError) as error:
        problem = f"{root}: {describe(error)}"
    tidy(root, agreement.rank)  # before the exchange: no rank writes into the directory before it ends
    mine = [int(problem is not None), fingerprint(tag), engine.agreed_step, id_word(), id_word()]
    table = agreement.exchange([*mine, *problem_words(problem)], "save: agree on tag and step")
    if any(row[1:3] != table[0][1:3] for row in table):
        counts = ", ".join(f"rank {r}: step {row[2]}" for r, row in enumerate(table))
        raise CO2Error(
            f"co2 checkpoint save to {root / tag}: the ranks are at different steps or use different tags "
            f"({counts}); every rank must save after the same number of optimizer steps (with replica_tau: the "
            f"same share of the same round, steps counted on the fastest replica's clock), with the same tag. "
            f"{agreement.consequence}"
        )
    raise_failed(agreement, [(r, row[0], row[5:]) for r, row in enumerate(table)])
    if engine.run_id is None:
        engine.name_run(as_hex(table[0][4]))
    return as_hex(table[0][3])


def _write_save(
    agreement: Agreement, where: Path, identity: dict[str, Any], framework: FrameworkState, extra: Any
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


def _write_rank_files(
    agreement: Agreement, where: Path, identity: dict[str, Any], framework: FrameworkState, extra: Any
) -> list[dict[str, Any]]:
    """Every rank writes its file durably; returns the marker's list of files (name, bytes, SHA-256)."""
    name = rank_file_name(agreement.rank, identity["save_id"])
    size, digest, problem, cause = 0, "0" * 64, None, None
    try:
        size, digest = save_atomic({"identity": identity, **rank_record(framework, extra)}, where / name)
    except Exception as error:  # a full disk (OSError, or RuntimeError from torch.save), a bad extra, ...
        problem, cause = f"{name}: {describe_write_error(error, where)}", error
    table = agreement.exchange(
        [int(problem is not None), size, *hex_words(digest), *problem_words(problem)], "save: every file durable"
    )
    raise_failed(agreement, [(r, row[0], row[6:]) for r, row in enumerate(table)], cause)
    return [
        {"rank": r, "name": rank_file_name(r, identity["save_id"]), "bytes": row[1], "sha256": words_hex(row[2:6])}
        for r, row in enumerate(table)
    ]


def _write_marker(where: Path, marker: dict[str, Any]) -> Optional[str]:
    """Rank 0 writes the marker; on failure returns why, having removed a marker of this save that a
    failure after the rename may have left (the others are about to remove the files it names)."""
    try:
        write_text_atomic(where / MARKER, json.dumps(marker, indent=1))
        return None
    except Exception as error:
        if marker_names(where, marker["save_id"]):
            (where / MARKER).unlink(missing_ok=True)
        return f"{MARKER}: {describe_write_error(error, where)}"


def _confirm_marker(agreement: Agreement, root: Path, where: Path, save_id: str) -> None:
    """Every rank reads the marker rank 0 wrote: a directory that is not shared fails every rank."""
    agreement.consequence = (
        f"Rank 0's {MARKER} is written, but a rank that does not see it cannot load this checkpoint; the "
        f"previous complete checkpoints are untouched."
    )
    try:
        seen = read_marker(where).get("save_id")
    except Exception as error:
        seen = f"unreadable ({describe(error)})"
    problem = None
    if seen != save_id:
        problem = f"{where / MARKER} names save {seen!r} here, rank 0 wrote {save_id!r}: is {root} shared?"
    agreement.outcome(problem, "save: marker seen")


def _write_latest(agreement: Agreement, root: Path, tag: str) -> None:
    """Rank 0 points `latest_co2` at the new checkpoint. If that fails every rank raises CO2Error saying
    what is true: the checkpoint is complete and loads by its tag; `latest_co2` names the previous one."""
    problem = None
    if agreement.rank == 0:
        try:
            write_text_atomic(root / LATEST, tag)
        except Exception as error:
            problem = f"{LATEST}: {describe_write_error(error, root)}; it still names {_latest_named(root)}"
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


def _remove_failed_save(root: Path, where: Path, agreement: Agreement, save_id: str) -> None:
    """After every rank heard that save `save_id` failed: remove this rank's file of it and its temp
    files, then the tag directory if that left it empty, so failed saves cannot fill a disk. Only this
    rank's files (no race with another rank), never those a marker names. A courtesy: an OSError is
    ignored (the next save or load removes what no marker names)."""
    try:
        if not marker_names(where, save_id):
            (where / rank_file_name(agreement.rank, save_id)).unlink(missing_ok=True)
        clean_temp_files(root, agreement.rank, agreement.world)
        remove_if_empty(where)
    except OSError:
        pass
