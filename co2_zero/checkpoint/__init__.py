"""Every checkpoint format co2_zero writes (docs/checkpoints.md; docs/design.md §7): one layout of per-rank
files and a marker, one identity record, collective and atomic saves and loads that validate everything
before any rank writes state, and resharding onto another R x S. An integration contributes only its
framework's own state (a `FrameworkState`); this package imports no integration.
"""

from .files import (
    MAX_TAG_BYTES,
    PathLike,
    check_tag,
    file_digest,
    load_file,
    plain_data_problem,
    save_atomic,
    write_atomic,
    write_text_atomic,
)
from .format import FORMAT, LATEST, MARKER, clean_temp_files, complete_checkpoints, rank_file_name
from .loading import load, load_checkpoint
from .record import FrameworkState, framework_state, load_record, optimizer_record, rank_record
from .resharding import consolidate, cut_rows, reshard, stand_in_cost
from .saving import save, save_checkpoint

__all__ = [
    "FORMAT",
    "LATEST",
    "MARKER",
    "MAX_TAG_BYTES",
    "FrameworkState",
    "PathLike",
    "check_tag",
    "clean_temp_files",
    "complete_checkpoints",
    "consolidate",
    "cut_rows",
    "file_digest",
    "framework_state",
    "load",
    "load_checkpoint",
    "load_file",
    "load_record",
    "optimizer_record",
    "plain_data_problem",
    "rank_file_name",
    "rank_record",
    "reshard",
    "save",
    "save_atomic",
    "save_checkpoint",
    "stand_in_cost",
    "write_atomic",
    "write_text_atomic",
]
