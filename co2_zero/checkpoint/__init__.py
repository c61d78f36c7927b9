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
package does the files, the agreement, the marker and the validation, and imports no integration. Its
parts: `files` (tags, atomic I/O, digests, the plain-data check), `format` (every name, the identity
record, the marker), `agreement` (the fixed-size exchanges), `resharding` (pure functions), `record`
(a rank's record and the module state), and `saving` / `loading` on top.
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
