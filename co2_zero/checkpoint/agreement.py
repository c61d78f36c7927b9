"""The cross-rank agreement of a save or a load: fixed-size int64 vectors exchanged with a deadline on
the engine's main-thread group of all ranks (`topology.gather_fingerprints`), never pickling. Text (a
failing rank's reason, the chosen tag) travels as UTF-8 packed into int64 words, so every rank can name
every failing rank's file and reason."""

from __future__ import annotations

import hashlib
import secrets
import struct
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from ..core.errors import CO2Error, CO2TimeoutError, refusal
from ..core.topology import gather_fingerprints, text_words, words_text

TEXT_WORDS = 64  # an error message or a path in an agreement: 512 bytes of UTF-8
TAG_WORDS = 32  # a tag (at most files.MAX_TAG_BYTES = 200 bytes) in the load's choice: 256 bytes


def problem_words(problem: Optional[str]) -> list[int]:
    """A rank's problem (None: none) as the TEXT_WORDS int64 that end its row of an exchange."""
    return text_words(problem or "", TEXT_WORDS)


def hex_words(digest: str) -> list[int]:
    """A SHA-256 hex digest as 4 int64."""
    return list(struct.unpack("<4q", bytes.fromhex(digest)))


def words_hex(words: Sequence[int]) -> str:
    """The SHA-256 hex digest `hex_words` packed."""
    return struct.pack("<4q", *words).hex()


def id_word() -> int:
    """A fresh random identifier (a save id, a run id) as one non-negative int64."""
    return secrets.randbits(63)


def as_hex(word: int) -> str:
    """An `id_word` as the 16 hex digits file names and identity records carry."""
    return f"{word:016x}"


class Agreement:
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
        table = self.exchange([0 if problem is None else 1, *problem_words(problem)], what)
        raise_failed(self, [(rank, row[0], row[1:]) for rank, row in enumerate(table)])


def raise_failed(
    agreement: Agreement, reports: Sequence[tuple[int, int, Sequence[int]]], cause: Optional[BaseException] = None
) -> None:
    """reports: (rank, failed flag, message words); raise CO2Error listing the failed ranks, if any
    (`cause`: this rank's own original error, kept as the CO2Error's cause); a load's refusal, which changed
    nothing, is `refused`."""
    failed = [(rank, words_text(words)) for rank, flag, words in reports if flag]
    if failed:
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in failed)
        error_type = refusal if agreement.action.startswith("load") else CO2Error
        raise error_type(
            f"co2 checkpoint {agreement.action} {agreement.where} failed on rank(s) {[r for r, _ in failed]}:\n"
            f"{lines}\n{agreement.consequence}"
        ) from cause


def refuse_unusable_engine(engine: Any, action: str, where: Path) -> None:
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


class SaveSeen(NamedTuple):
    """The save a rank's marker of the chosen checkpoint describes: what that rank would apply."""

    save_id: str
    step: int
    digest: str  # SHA-256 hex of the marker's bytes; "" when this rank could not read it

    def words(self) -> list[int]:
        return [self.step, *hex_words(self.digest or "0" * 64), *text_words(self.save_id, 2)]

    @staticmethod
    def from_words(words: Sequence[int]) -> SaveSeen:
        digest = words_hex(words[1:5])
        return SaveSeen(words_text(words[5:7]), words[0], "" if digest == "0" * 64 else digest)


SEEN_WORDS = 7


UNSEEN = SaveSeen("", -1, "")


def seen_in(raw: bytes, marker: dict[str, Any]) -> SaveSeen:
    step = marker.get("step")
    step = step if type(step) is int and abs(step) < 2**62 else -1
    return SaveSeen(str(marker.get("save_id"))[:16], step, hashlib.sha256(raw).hexdigest())


def refuse_different_saves(agreement: Agreement, seen: Sequence[SaveSeen]) -> None:
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
