"""What the ranks must agree on while they run, checked by fingerprint exchanges (docs/design.md §5).

- **Which parameter sits at each place of the partition** (start-up): a tensor id is a position in the
  partition order, and every rank must mean the same parameter by it, not only one of the same shape
  (param groups built from a `set` of names list the tensors in a different order in every process;
  CO2 would then average one rank's weight with another rank's other weight).
- **How many inner steps each rank took** (every round end and `finalize()`): a rank that calls
  `finalize()` tells the others at once, so a rank that trained on learns it at its next wait instead
  of blocking on a round its peers never run. The same announcement carries the inner steps the last
  exchange took on the rank (`sync_delay: "auto"`, `co2_zero.core.schedule`), so all ranks fix one delay.

Everything travels as fixed-size int64 vectors (`topology.gather_fingerprints`): no pickling.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import CO2Error, CO2TimeoutError, is_timeout
from .pace import Pace
from .topology import Topology, collective_device, fingerprint, gather_fingerprints, text_words, words_text

_NAME_WORDS = 32  # a parameter's name in a start-up error: 256 bytes of UTF-8
_MAX_DIMS = 8  # dims of a shape printed in a start-up error (more are rare; the rest print as "...")


class TensorIdentity(NamedTuple):
    """One parameter tensor of the partition order: its name and its (global) shape. `named`: the name
    comes from the model; else it is the tensor's position among the optimizer's parameters."""

    name: str
    shape: tuple[int, ...]
    named: bool


def identify(params: Sequence[torch.Tensor], module: Optional[torch.nn.Module]) -> list[TensorIdentity]:
    """The identity of each of `params` (in partition order): its name in `module` where it has one,
    else its position in `params`."""
    names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
    outside = " (not in the model)" if module is not None else ""
    return [
        TensorIdentity(names[id(p)], tuple(p.shape), True)
        if id(p) in names
        else TensorIdentity(f"optimizer parameter {i}{outside}", tuple(p.shape), False)
        for i, p in enumerate(params)
    ]


def in_model_order(params: Sequence[torch.Tensor], module: torch.nn.Module) -> list[torch.Tensor]:
    """`params` in the order of `module.named_parameters()` (those it does not hold last, in their
    own order): a canonical order that does not depend on how the param groups listed them."""
    position = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    return sorted(params, key=lambda p: position.get(id(p), len(position)))


# ---- start-up: the same parameter at every place of the partition --------------------------------------


def agree_on_parameters(tensors: Sequence[TensorIdentity], group: Any, timeout_s: float) -> None:
    """Raise CO2Error, with the same message on every rank, unless every rank has the same parameter
    (name and shape) at every position of the partition order. Collective over `group`."""
    what = "start-up model check"
    counts = [row[0] for row in gather_fingerprints([len(tensors)], group, timeout_s, what)]
    width = max(counts)
    codes = [code for t in tensors for code in (fingerprint(t.name), fingerprint(t.shape))]
    table = gather_fingerprints(codes + [0, 0] * (width - len(tensors)), group, timeout_s, what)
    first = _first_difference(table)
    if first is None:
        return
    position, other = first
    details = gather_fingerprints(_detail_words(tensors, position), group, timeout_s, what)
    raise CO2Error(_parameters_message(position, (0, other), details, counts))


def _first_difference(table: Sequence[Sequence[int]]) -> Optional[tuple[int, int]]:
    """(position, rank) of the first position where some rank's (name, shape) differs from rank 0's."""
    for position in range(len(table[0]) // 2):
        column = [tuple(row[2 * position : 2 * position + 2]) for row in table]
        for rank, entry in enumerate(column):
            if entry != column[0]:
                return position, rank
    return None


def _detail_words(tensors: Sequence[TensorIdentity], position: int) -> list[int]:
    """[present, named, ndim, dims..., name...] of the tensor at `position` (zeros if there is none)."""
    if position >= len(tensors):
        return [0] * (3 + _MAX_DIMS + _NAME_WORDS)
    name, shape, named = tensors[position]
    dims = list(shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    return [1, int(named), len(shape), *dims, *text_words(name, _NAME_WORDS)]


def _describe_detail(words: Sequence[int], count: int) -> str:
    present, _, ndim = words[:3]
    if not present:
        return f"no parameter there (it has {count} parameter tensors)"
    dims = ", ".join(str(d) for d in words[3 : 3 + min(ndim, _MAX_DIMS)]) + (", ..." if ndim > _MAX_DIMS else "")
    shape = f"({dims},)" if ndim == 1 else f"({dims})"
    return f"{words_text(words[3 + _MAX_DIMS :])!r} (shape {shape})"


def _parameters_message(position: int, ranks: tuple[int, int], details: Sequence[Sequence[int]], counts) -> str:
    a, b = ranks
    here, there = details[a], details[b]
    same_shape = here[0] and there[0] and here[2 : 3 + _MAX_DIMS] == there[2 : 3 + _MAX_DIMS]
    if same_shape:
        advice = (
            "The ranks list the same-shaped parameters in a different order: build the inner optimizer's "
            "param groups in the same order on every rank (a set of names iterates in a different order in "
            "every process; follow model.named_parameters())"
        )
    else:
        sizes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        advice = f"Every rank must build the same model and optimizer (parameter tensors: {sizes})"
    if not (here[1] and there[1]):
        advice += ". Pass the model (model=...) so that parameters are compared by name"
    return (
        f"co2: the ranks disagree on the parameter at position {position} of the CO2 partition order (the "
        f"trainable parameters in partition order): rank {a} has {_describe_detail(here, counts[a])} where rank "
        f"{b} has {_describe_detail(there, counts[b])}. {advice}"
    )


# ---- inner steps: announced at every round end and at finalize() ---------------------------------------


class Announcement(NamedTuple):
    """One rank's step announcement, the fields of one message (the run-time decisions' inputs travel in it)."""

    steps: int  # the rank's inner steps
    finalizing: int  # 1 in finalize()
    exchange_steps: int  # sync_delay "auto": the steps the counted exchange took (`DelayMeter.to_post`), else 0
    step_ns: int  # replica_tau "auto" at a deciding step: the mean inner step (`PaceMeter.to_post`), else 0


class StepAnnouncements:
    """Every rank's `Announcement` all-gathered without blocking, on the main thread's group.

    Each rank posts one at every round end and one in `finalize()`, so the k-th announcements of all
    ranks meet even when one rank finalizes while another trains on: the one that trains on reads a
    "finalizing" row from a peer at its next wait (`ready`/`collect`) and can report the step counts
    instead of waiting, until its deadline, for a round its peer never runs. At most one is in flight.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self._work: Any = None
        self._rows: list[torch.Tensor] = []

    def post(self, steps: int, finalizing: bool, exchange_steps: int = 0, step_ns: int = 0) -> None:
        if self._work is not None:
            raise RuntimeError("co2: a step announcement is still in flight; collect it first")
        device = collective_device(self.group)
        mine = torch.tensor([steps, int(finalizing), exchange_steps, step_ns], dtype=torch.int64, device=device)
        self._rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        self._work = dist.all_gather(self._rows, mine, group=self.group, async_op=True)

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def release(self) -> None:
        """Drop the group and what refers to it (the groups are being destroyed; none may be in flight)."""
        self.group, self._work, self._rows = None, None, []

    def ready(self) -> bool:
        """True when the announcement in flight has arrived from every rank (never blocks)."""
        return self._work is not None and self._work.is_completed()

    def collect(self, deadline: float) -> Optional[list[Announcement]]:
        """Every rank's `Announcement` in flight, in rank order (None if there is none), waiting until the
        `time.monotonic()` deadline: CO2TimeoutError past it (or past the group's own), CO2Error when the group
        failed otherwise (a peer's connection closed)."""
        if self._work is None:
            return None
        try:
            self._work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as error:  # a deadline (the wait's or the group's), or a peer's connection lost
            detail = f"{type(error).__name__}: {error}"
            if is_timeout(error) or time.monotonic() >= deadline:
                raise CO2TimeoutError(detail) from error
            raise CO2Error(detail) from error
        self._work = None
        return [Announcement(*row.tolist()) for row in self._rows]


def steps_mismatch(
    rows: Sequence[Sequence[int]], rank: int, steps: int, pace: Optional[Pace] = None, shards: int = 1
) -> Optional[str]:
    """The finalize error for announcement `rows`, or None when every rank is at the same step and
    agrees on finalizing. This rank's own count is `steps` (it may have trained on since it posted).
    `pace` (replicas of different speeds, `co2_zero.core.pace`; global rank r is replica r // `shards`): the
    ranks then have to agree on the round ends they passed, not on the steps (steps past the last are
    dropped). None, or a uniform pace: the steps."""
    rows = [[row[0], row[1]] for row in rows]  # [steps, finalizing]; the exchange steps and step times differ
    paced = pace if pace is not None and not pace.uniform else None
    rounds = [paced.rounds_at(r // shards, s) if paced else s for r, (s, _) in enumerate(rows)]
    compared = [[count, done] for count, (_, done) in zip(rounds, rows)]
    if all(row == compared[0] for row in compared):
        return None
    counts = ", ".join(
        f"rank {r}: {steps if r == rank else s}{'' if done or r == rank else ' or more'}"
        + (f" (round {rounds[r]} at tau {paced.tau(r // shards, rounds[r])})" if paced else "")
        for r, (s, done) in enumerate(rows)
    )
    training = [r for r, (_, done) in enumerate(rows) if not done]
    note = (
        f" Rank(s) {training} had not called finalize(): they ended a round at the step shown and trained on"
        if training
        else ""
    )
    what = "rounds (replica_tau: each replica its own steps per round)" if paced else "inner steps"
    same = "the same number of rounds" if paced else "the same number of optimizer steps"
    return (
        f"co2 finalize: the ranks took different numbers of {what} ({counts}); every rank must call "
        f"finalize() after {same}.{note} (this is rank {rank}, at inner step {steps})"
    )


def announcement_failure(
    error: CO2Error, where: str, topology: Topology, inner_steps: int, timeout_s: float
) -> CO2Error:
    """The engine's failure when collecting a step announcement failed (`error`: its deadline passed, or the
    control group failed); `where` names the round end or finalize."""
    finalizing = where == "co2 finalize"
    here = f"rank {topology.rank} at inner step {inner_steps}"
    if isinstance(error, CO2TimeoutError):
        what = "called finalize()" if finalizing else "reached this round end"
        return CO2TimeoutError(
            f"{where}: not every rank of the {topology.describe_control()} {what} within timeout_s="
            f"{timeout_s:g} ({here}); a rank died, is stuck{', or skipped finalize()' if finalizing else ''}"
        )
    return CO2Error(
        f"{where}: the step announcement on the {topology.describe_control()} failed ({here}): "
        f"{error}; a rank died or left"
    )
