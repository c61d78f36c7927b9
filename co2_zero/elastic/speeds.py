"""Replicas of different speeds in an elastic job (docs/elastic.md, "Replicas of different speeds").

Each round's average weighs every contributor of that round's quorum by the inner steps it trained,
g = Σ τ_r·D_r / Σ τ_r, as design §3 does for a fixed grid; here the weights travel with the quorum's rows
(`agreement.row`), so they follow whoever is in the quorum. With `replica_tau: "auto"` each replica also
posts its step time and sets its next rounds' steps from the quorum's times (`taus_for_speeds`: the fastest
runs τ, each other the steps it completes in about that time), re-measured every round, so a replica that
slows down mid-run ends its rounds with the others instead of falling behind the Lighthouse's join timeout.
A replica of several ranks is one speed: its slowest rank's time, and the fewest steps any of its ranks
chose (`ElasticExchange._take_round_steps`). Pure arithmetic; the exchange calls it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..core.pace import taus_for_speeds


def displacement_scale(mine: int, weights: Sequence[int]) -> float:
    """The factor n·τ_r / Σ τ that turns the exchange's plain mean over the n contributors into the weighted
    average Σ τ_r·D_r / Σ τ: exactly 1.0 when every weight is `mine` (then no multiplication, and the average
    is the plain mean bit for bit). `mine` 0 (not contributing: a zero displacement) gives 0."""
    return len(weights) * mine / sum(weights)


def steps_for(tau: int, step_us: Sequence[int], mine: int) -> Optional[int]:
    """Replica `mine`'s inner steps for a round, from the quorum's step times `step_us` (microseconds, one per
    replica in quorum order; 0: not measured, left out): its `taus_for_speeds` among the measured. None while
    its own is not measured."""
    if step_us[mine] <= 0:
        return None
    measured = [t for t in step_us if t > 0]
    return taus_for_speeds([1.0 / t for t in measured], tau)[measured.index(step_us[mine])]
