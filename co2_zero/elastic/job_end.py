"""The end of an elastic job, recorded where every replica can see it: the Lighthouse (docs/design.md §12).

A replica frozen or stalled past its peers' end of the job must not wake up, find itself alone in a quorum
and train the remaining rounds by itself: the job would end with two final models. Each launch that ends
the job records so on the Lighthouse (`record_end`); a replica whose quorum lost launches asks whether
they ended the job (`check_lost`): then it leaves, else they died and it goes on, saying whom it lost.
"""

from __future__ import annotations

import warnings
from typing import Protocol, Sequence

from ..core.errors import CO2Error
from .lighthouse import ended_members, post_end, replica_number


class Member(Protocol):
    """What `check_lost` reads of this replica's membership (`membership.Membership`)."""

    lighthouse: str
    replica_id: int
    min_replicas: int
    timeout_s: float


def record_end(lighthouse: str, member: str, round_index: int, timeout_s: float) -> None:
    """Record on the Lighthouse that launch `member` ended the job at round end `round_index`; a warning
    (not an error: this replica's model is final) when the Lighthouse cannot take it."""
    try:
        post_end(lighthouse, member, round_index, timeout_s)
    except Exception as error:
        warnings.warn(
            f"co2 elastic: finalize: {member} could not record the job's end on the Lighthouse {lighthouse} "
            f"({type(error).__name__}: {error}); a replica that comes back after its peers ended is not told so",
            stacklevel=4,
        )


def check_lost(me: Member, round_index: int, lost: Sequence[str], replicas: Sequence[int]) -> None:
    """`lost`: the launches of the previous quorum that the quorum of round `round_index` (`replicas`) lacks.
    Those that ended the job at a later round end make this replica leave (CO2Error): it was away while
    they trained on. Others (they died or stalled) are named in a warning, and this replica goes on with
    the quorum it has (torchft forms none below min_replicas)."""
    if not lost:
        return
    ended = {m: r for m, r in ended_members(me.lighthouse).items() if m in lost}
    ahead = sorted(int(replica_number(m)) for m, r in ended.items() if r > round_index)
    if ahead:
        raise CO2Error(
            f"co2 elastic: round {round_index}: the job ended without replica {me.replica_id}: replica(s) {ahead} "
            f"of its last quorum ended the job at round end {max(ended.values())} while it was away (frozen or "
            f"stalled, e.g. longer than timeout_s={me.timeout_s:g}); it is at round {round_index} with replicas "
            f"{list(replicas)}. Training on would make a second final model of the job, so it leaves: the job's "
            f"final model is theirs"
        )
    died = sorted(int(replica_number(m)) for m in lost if m not in ended)
    if died:
        warnings.warn(
            f"co2 elastic: round {round_index}: replica {me.replica_id} lost replica(s) {died} (the Lighthouse "
            f"dropped them before they ended the job: they died or stalled); it goes on with replicas "
            f"{list(replicas)}, as min_replicas={me.min_replicas} allows",
            stacklevel=4,
        )
