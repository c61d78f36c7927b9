"""What the Lighthouse says about a quorum's members (docs/design.md §12).

torchft names each replica group `"<replica_id>:<uuid>"` (one uuid per launch), so the quorum's own
ids tell two launches with one `replica_id` apart; `QuorumIds` keeps them from the Manager's quorum
result. `live_members` reads which of them still heartbeat, from the Lighthouse's status page: an
exchange that waits for a peer the Lighthouse has dropped stops waiting (`wait_watched`) after the
heartbeat timeout, not after `timeout_s`. `post_end` records there that a launch reached the job's end
(`ended_members` reads it back), so that a replica that comes back after its peers ended is told so.
"""

from __future__ import annotations

import re
import time
import urllib.request
import warnings
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Optional

from ..core.errors import CO2Error

# torchft 0.2.0's Lighthouse status page: one item per heartbeating replica group, "old" once its last
# heartbeat is older than the heartbeat timeout (the quorum then leaves it out)
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(\w*)\s*">\s*(\S+): seen')
POLL_S = 0.5  # how often a waiting exchange asks the Lighthouse who is alive
# A launch that reached the job's end heartbeats once as "<its replica group id>/ended@<round>": no launch
# has that name, and the status page lists it (old after the heartbeat timeout) as long as the Lighthouse runs
ENDED = "/ended@"


class QuorumIds:
    """torchft's ManagerClient, recording the replica group ids of the last quorum it returned."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: tuple[str, ...] = ()

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.last = tuple(result.replica_ids)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class AbandonedCollective(CO2Error):
    """`wait_watched` stopped waiting for a collective that is still in flight."""


def replica_number(member: str) -> str:
    """'3:5f0c...' -> '3': the replica_id a launch was given."""
    return member.split(":")[0]


def check_unique(members: tuple[str, ...], round_index: int, replica_id: int) -> None:
    """Refuse a quorum in which two live launches carry this replica's id (each of them sees it and
    leaves); a replica whose own id is unique warns and goes on (its round is cut when they leave)."""
    counts = Counter(replica_number(m) for m in members)
    duplicated = sorted((n for n, c in counts.items() if c > 1), key=int)
    if not duplicated:
        return
    launches = [m for m in members if replica_number(m) in duplicated]
    if str(replica_id) not in duplicated:
        warnings.warn(
            f"co2 elastic: round {round_index}: replica_id {', '.join(duplicated)} is used by more than one live "
            f"launch ({launches}); they leave the job, replica {replica_id} goes on",
            stacklevel=3,
        )
        return
    raise CO2Error(
        f"co2 elastic: round {round_index}: replica_id {replica_id} is used by {counts[str(replica_id)]} live "
        f"launches of this job ({launches}); this launch leaves the job. Every replica group needs its own "
        f"replica_id: stop every launch of replica_id {replica_id} (a launcher killed without its workers "
        f"leaves them training: docs/elastic.md), then start one"
    )


def _heartbeats(lighthouse: str, timeout_s: float) -> Optional[list[tuple[str, str]]]:
    """(state, name) of every heartbeat on the Lighthouse's status page (state "old": past its timeout);
    None if it cannot be asked."""
    try:
        with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=timeout_s) as page:
            text = page.read().decode("utf-8", "replace")
    except Exception:
        return None
    return _HEARTBEAT.findall(text)


def live_members(lighthouse: str, timeout_s: float = 2.0) -> Optional[set[str]]:
    """The replica groups whose heartbeat the Lighthouse holds fresh; None if it cannot be asked."""
    beats = _heartbeats(lighthouse, timeout_s)
    if beats is None:
        return None
    return {member for state, member in beats if state != "old" and ENDED not in member}


def post_end(lighthouse: str, member: str, round_index: int, timeout_s: float) -> None:
    """Record on the Lighthouse that launch `member` ended the job at round end `round_index` (finalize()'s)."""
    from torchft._torchft import LighthouseClient

    timeout = timedelta(seconds=timeout_s)
    LighthouseClient(lighthouse, timeout).heartbeat(f"{member}{ENDED}{round_index}", timeout=timeout)


def ended_members(lighthouse: str, timeout_s: float = 2.0) -> dict[str, int]:
    """The launches that recorded the job's end (`post_end`), each with its round end; {} if none or the
    Lighthouse cannot be asked."""
    ended = (member.split(ENDED) for _, member in _heartbeats(lighthouse, timeout_s) or () if ENDED in member)
    return {member: int(round_index) for member, round_index in ended}


def wait_watched(
    work: Any, members: tuple[str, ...], lighthouse: str, timeout_s: float, alive: Callable[..., Any] = live_members
) -> None:
    """Wait for a collective over the quorum `members`: its own error if it fails; CO2Error once the
    Lighthouse no longer holds a member's heartbeat (it was dropped: waiting on cannot help) or after
    timeout_s. The collective itself may still complete later, into its own buffers."""
    deadline, next_poll = time.monotonic() + timeout_s, time.monotonic() + POLL_S
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise AbandonedCollective(
                f"co2 elastic: the exchange over {list(members)} did not end within timeout_s={timeout_s:g}"
            )
        if now >= next_poll:
            live = alive(lighthouse)
            dropped = [m for m in members if live is not None and m not in live]
            if dropped:
                raise AbandonedCollective(
                    f"co2 elastic: the Lighthouse dropped {dropped} (no heartbeat within its heartbeat timeout) "
                    f"while this replica waited for its data in the exchange"
                )
            next_poll = time.monotonic() + POLL_S
        time.sleep(0.005)
    work.wait()
