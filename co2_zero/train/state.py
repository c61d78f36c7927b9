"""The training run's changing state, as a few small named objects instead of one bag of fields.

`Console` (rank 0's log lines, progress bar and JSON records), `Clock` (training time, validation and
checkpoints excluded), `RoundEnd` (what one log point measured of the exchange) and `Tally` (the losses
since the last log line, the round ends since the start).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import torch

# The library's INFO lines (what `replica_tau: "auto"` fixed) among the job's own, on rank 0's stderr
LIBRARY_LOG = logging.StreamHandler()
LIBRARY_LOG.setFormatter(logging.Formatter("%(message)s"))


class Console:
    """Rank 0's output: log lines on stderr, under a progress bar only when stderr is a terminal (piped
    to a file, bar and lines would run together), the library's INFO lines, and the --out_json records."""

    def __init__(self, master: bool, out_json: Optional[str], progress: bool) -> None:
        self.master, self.out_json = master, out_json
        self.progress = master and progress and sys.stderr.isatty()
        self.bar: Any = None
        if self.master:
            library = logging.getLogger("co2_zero")
            library.addHandler(LIBRARY_LOG)  # once per process: the same handler is not added twice
            library.setLevel(logging.INFO)

    def line(self, msg: str) -> None:
        if not self.master:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            sys.stderr.write(msg + "\n")  # one write: a line from another thread cannot land inside it
            sys.stderr.flush()

    def record(self, **fields: Any) -> None:
        if self.master and self.out_json:
            with open(self.out_json, "a") as f:
                f.write(json.dumps(fields) + "\n")

    def new_json(self) -> None:
        """Start --out_json empty (a fresh run; a resumed one appends)."""
        if self.master and self.out_json:
            Path(self.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out_json).write_text("")

    def open_bar(self, total: int, initial: int) -> None:
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stderr, mininterval=0.1)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class Clock:
    """Training time: wall-clock since `start` minus the pauses (validation, checkpoints); and the
    step and time of the last log line, which start the next interval."""

    t0: float = 0.0
    paused_s: float = 0.0
    t_last: float = 0.0
    step_last: int = 0

    def start(self, step: int) -> None:
        self.t0 = self.t_last = time.perf_counter()
        self.paused_s, self.step_last = 0.0, step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t

    def training_s(self, now: Optional[float] = None) -> float:
        return (time.perf_counter() if now is None else now) - self.t0 - self.paused_s

    def mark(self, step: int) -> None:
        self.t_last, self.step_last = time.perf_counter(), step


class RoundEnd(NamedTuple):
    """What a log point reports of the exchange: seconds blocked on it and the round-end seconds (None:
    not measured, e.g. ddp's exchange inside backward) and this rank's bytes sent since the last one."""

    wait_s: Optional[float]
    round_end_s: Optional[float]
    bytes_sent: float = 0.0
    senders_per_sent: Optional[float] = None  # the sparse exchange's overlap (`last_round`); None: dense
    payload_ratio: Optional[float] = None  # fp32 bytes / one replica's payload bytes (`last_round`)


@dataclass
class Tally:
    """The losses since the last log line (a device tensor: no host sync per step), and since the start
    the log lines, the round ends and what they measured on this rank."""

    loss_sum: Any = 0.0
    loss_n: int = 0
    log_lines: int = 0
    rounds: int = 0
    wait_s: float = 0.0
    round_end_s: float = 0.0
    bytes_sent: float = 0.0
    last_mfu: Optional[float] = None
    senders_per_sent: list = field(default_factory=list)  # the sparse exchange's, one per round end
    payload_ratio: Optional[float] = None
    changes_shown: int = 0  # elastic: the membership changes already printed
    rounds_reported: int = 0  # elastic: the rounds of the membership's history already in --events_jsonl

    def exchange_record(self) -> dict[str, Any]:
        """What the summary record says of the exchange: rounds, wire bytes, the payload ratio to fp32, the
        sparse exchange's overlap per round."""
        overlap = self.senders_per_sent or None
        return {
            "rounds": self.rounds,
            "bytes_sent": self.bytes_sent,
            "payload_ratio": self.payload_ratio,
            "senders_per_sent": overlap,
        }

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum, self.loss_n = self.loss_sum + loss.double(), self.loss_n + 1

    def add_round_end(self, end: RoundEnd, co2: bool) -> None:
        self.rounds += int(co2)
        self.bytes_sent += end.bytes_sent
        self.payload_ratio = end.payload_ratio or self.payload_ratio
        if end.senders_per_sent is not None:
            self.senders_per_sent.append(end.senders_per_sent)
        if end.wait_s is not None:
            self.wait_s += end.wait_s
            self.round_end_s += end.round_end_s or 0.0
