"""Elastic training: replicas that come and go while training goes on (docs/design.md §12).

Membership is torchft's: a Lighthouse keeps the quorum of replica groups, and one `torchft.Manager`
per replica heartbeats to it, forms a quorum at every round end, reconfigures a process group over
that quorum and heals a replica that is behind from a live peer. co2_zero runs no protocol of its
own. This package is the narrow seam between the two:

- `membership.Membership`, what a user passes to `CO2Optimizer`: the torchft Manager, the quorum of
  each round, the commit vote, and healing (what a live peer sends a replica that is behind).
  `Membership.attach` joins the job when the engine is built: at start-up every replica takes the
  start point of one peer; a replica that (re)joins a running job receives the start point and the
  outer state from a live peer and takes part in that round's exchange with a zero displacement.
- `exchange.ElasticExchange`, the engine's `OuterExchange` in an elastic job: it averages each
  round's displacement over the replicas of that round's quorum (not a fixed outer group) and
  applies the result only if the commit vote says this replica's average is complete; otherwise the
  round is skipped exactly like `nonfinite: "skip_round"` (next start point = base). It weighs each
  contributor by the inner steps it trained; with `replica_tau: "auto"` each replica's steps per round
  follow its speed against the quorum's fastest (`speeds.py`).

Each replica group is its own launch: its ranks form the engine's world (R = 1 as far as the engine
knows), and the replicas meet only through the quorum's process group. The outer state is the
`all_reduce` strategy's: every replica keeps the whole partition's, so a lost replica takes nothing
with it and nothing needs re-cutting when R changes.
"""

from .exchange import ElasticExchange, Peers
from .membership import Membership, RoundRecord

__all__ = ["ElasticExchange", "Membership", "Peers", "RoundRecord"]
