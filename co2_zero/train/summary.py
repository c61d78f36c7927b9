"""The training job's last line and record: what it trained, how fast, what it exchanged, and an elastic
replica's membership."""

from __future__ import annotations

from typing import Any, Optional

from .state import Tally


def elastic_summary(job: Any) -> str:
    """The summary line's elastic end: where this replica joined and every change of the quorum it saw."""
    membership = job.trainer.membership
    if membership is None:
        return ""
    joined = f" | joined at step {job.joined_at}" if job.joined_at is not None else ""
    return f"{joined} | membership: {', '.join(membership.changes) or 'no changes'}"


def elastic_record(job: Any) -> dict:
    """The summary record's elastic fields (none when not elastic)."""
    membership = job.trainer.membership
    if membership is None:
        return {}
    return {"replica_id": job.args.replica_id, "joined_at": job.joined_at, "membership_changes": membership.changes}


def summary_line(
    final: float,
    initial: float,
    steps_run: int,
    resumed_at: Optional[int],
    train_s: float,
    tokens_per_s: float,
    grid: tuple[int, int],
    co2: Optional[Tally],
) -> str:
    """The run's last line. Parsers read its start, "final val loss X (initial Y)"; new fields go at
    the end. `co2`: the tally of a CO2 run (rounds, rank 0's bytes sent and seconds blocked)."""
    resumed = f" (resumed at step {resumed_at})" if resumed_at is not None else ""
    line = (
        f"final val loss {final:.4f} (initial {initial:.4f}) | {steps_run} steps{resumed} in {train_s:.1f}s | "
        f"{tokens_per_s:,.0f} tok/s | R x S = {grid[0]} x {grid[1]}"
    )
    if co2 is not None:
        rounds = f"{co2.rounds} round" + ("" if co2.rounds == 1 else "s")
        line += f" | {rounds} | rank 0: {shown_bytes(co2.bytes_sent)} sent, {co2.wait_s:.2f}s blocked"
    return line


def shown_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
