"""Resharding as pure functions over the layout (docs/design.md §7): the CO2 state keyed by parameter
tensor and element offset (`consolidate`), re-cut for any R x S and integration (`reshard`), and the
rows of a dim-0-sharded tensor cut from the pieces several files hold (`cut_rows`). No files, no
collectives."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..core.pace import Pace
from ..core.round_schedule import saved_pace


def consolidate(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's layout-independent share of a `RoundEngine.state_dict()`, for resharding.

    Pieces are keyed by parameter tensor and element offset instead of partition position, so a run
    with another R or S (or another integration) can load them (`reshard`). Each rank contributes its
    sub-shard of the shared state; the shares of all ranks of a run cover every parameter element
    exactly once. A stand-in's state (its replica's own round start and momentum) is its replica's own:
    each rank contributes it over its whole partition, with its replica's index.
    """
    geometry = state["geometry"]
    start, end = geometry["sub_shard"]
    momentum_start = geometry["momentum_range"][0]
    residuals = state.get("residuals") or {}
    gathered = (
        residuals.get("gathered") if residuals.get("gathered") is not None and residuals["gathered"].numel() else None
    )
    pieces = []
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        lo, hi = max(seg_start, start), min(seg_end, end)
        if lo >= hi:
            continue
        pieces.append(
            {
                "tensor_id": tensor_id,
                "offset": offset + lo - seg_start,
                "start_point": state["start_point"][lo:hi].cpu().clone(),
                "next_start": None if state["next_start"] is None else state["next_start"][lo:hi].cpu().clone(),
                "momentum": state["momentum"][lo - momentum_start : hi - momentum_start].cpu().clone(),
                "gathered": None if gathered is None else gathered[lo - start : hi - start].cpu().clone(),
            }
        )
    norms = state["previous_update_sq_norms"]
    grid = state["grid"]
    return {
        "config_hash": state["config_hash"],
        "signature": state["signature"],
        "num_tensors": geometry["num_tensors"],
        "tau": geometry["tau"],
        "applies_at": state.get("applies_at"),  # None: a state written before states said it
        "replicas": grid["replicas"],
        "replica": state["rank"] // grid["shards"],
        "inner_steps": state["inner_steps"],
        "rounds": state["rounds"],
        "skipped_rounds": state.get("skipped_rounds", 0),
        "run_id": state.get("run_id"),
        "fixed_sync_delay": state.get("fixed_sync_delay"),
        "fixed_replica_tau": state.get("fixed_replica_tau"),
        "stand_in": state.get("stand_in"),
        "pieces": pieces,
        "own_pieces": _partition_pieces(state, {key: state.get(key) for key in OWN}),
        "strategy": geometry.get("strategy"),
        "residual_pieces": _partition_pieces(state, {"displacement": residuals.get("displacement")}),
        "gathered_residual": None if "gathered" not in residuals else gathered is not None,
        "update_sq_norms_partial": None if norms is None else norms.cpu().clone(),
    }


OWN = ("own_start", "own_momentum")  # a stand-in's state: its replica's own, over a rank's whole partition


def _partition_pieces(state: dict[str, Any], tensors: dict[str, Optional[torch.Tensor]]) -> list[dict[str, Any]]:
    """`tensors` laid over this rank's whole partition (those that are not None), cut per parameter tensor:
    a replica's own state (a stand-in's, the error-feedback residual of its displacements); [] when none is."""
    held = {key: value for key, value in tensors.items() if value is not None}
    if not held:
        return []
    return [
        {
            "tensor_id": tensor_id,
            "offset": offset,
            **{key: value[seg_start:seg_end].cpu().clone() for key, value in held.items()},
        }
        for tensor_id, seg_start, seg_end, offset in state["geometry"]["segments"]
    ]


def reshard(
    shares: Sequence[dict[str, Any]],
    identity: dict[str, Any],
    sync_delay: Optional[int] = None,
    pace: Optional[Pace] = None,
) -> tuple[dict[str, Any], int]:
    """A `RoundEngine` state for the engine whose `identity()` is given, assembled from the shares of
    every rank of a saved run (any R x S, any integration). Returns (state, dropped steps).

    The state resumes at the saved run's last round start: a partial round cannot be carried across
    partitions, so its steps are dropped (their number is returned). With a sync delay d < tau the
    average that round start waits for has arrived, and is applied at once: the round starts from the
    newest shared start whatever step of the round was saved (docs/design.md §3, "checkpoints"). With a
    stand-in, replica m resumes from the stand-in of saved replica m % saved R (`_stand_in`).
    `sync_delay`: this run's steps before the apply point (its config's), which reads a state written
    before states said when their start point is applied (`_applies_at`). `pace`: the replicas' inner steps
    per round as this run's config sets them (None: tau; a saved `fixed_replica_tau` overrides it): replica m
    resumes at the inner steps saved replica m % saved R took before the last round start, its data
    position (with replica_tau the caller keeps R). Raises
    ValueError when the shares do not cover the target's partition or come from another co2 config or
    model.
    """
    for share in shares:
        for key in ("config_hash", "signature"):
            if share[key] != identity[key]:
                raise ValueError(
                    f"co2 checkpoint: the saved state has {key}={share[key]!r} but this run has {identity[key]!r}; "
                    f"resharding needs the same co2 config and model"
                )
    saved, geometry = shares[0], identity["geometry"]
    by_tensor = _by_tensor(share["pieces"] for share in shares)
    start_point = _assemble(by_tensor, "start_point", geometry)
    has_next = all(piece["next_start"] is not None for share in shares for piece in share["pieces"])
    next_start = _assemble(by_tensor, "next_start", geometry) if has_next and geometry["overlap"] else None
    applies_at, pending = _applies_at(saved, sync_delay)
    if next_start is not None and not pending:
        next_start = None  # scratch: the apply point had passed, and start_point holds the applied start
    if next_start is not None and 0 < applies_at < saved["tau"]:
        start_point, next_start = next_start, None  # the arrived average, applied at once
    whole_momentum = _assemble(by_tensor, "momentum", geometry)
    lo, hi = geometry["momentum_range"]
    partials = [s["update_sq_norms_partial"] for s in shares if s["update_sq_norms_partial"] is not None]
    norms = None
    if partials:  # only the sum over ranks matters: rank 0 carries it, the others zeros
        norms = torch.stack(partials).sum(0) if identity["rank"] == 0 else torch.zeros_like(partials[0])
    rounds, replica = saved["rounds"], identity["rank"] // identity["grid"]["shards"]
    mine = next(share for share in shares if share["replica"] == replica % saved["replicas"])
    fixed = saved.get("fixed_replica_tau")
    pace = saved_pace(fixed) if fixed is not None else pace or Pace((geometry["tau"],) * identity["grid"]["replicas"])
    inner_steps = pace.steps_at_round(replica, rounds)
    state = {
        **identity,
        "run_id": saved.get("run_id"),
        "inner_steps": inner_steps,
        "rounds": rounds,
        "skipped_rounds": saved.get("skipped_rounds", 0),
        "start_point": start_point,
        "next_start": next_start,
        "momentum": whole_momentum[lo:hi].clone(),
        **_stand_in(shares, identity, whole_momentum, applied_at_once=next_start is None),
        "previous_update_sq_norms": norms,
        "residuals": _residuals(shares, identity, by_tensor),
        "fixed_sync_delay": saved.get("fixed_sync_delay"),
        "fixed_replica_tau": fixed,
    }
    return state, mine["inner_steps"] - inner_steps


def _stand_in(
    shares: Sequence[dict[str, Any]], identity: dict[str, Any], whole_momentum: torch.Tensor, applied_at_once: bool
) -> dict[str, Optional[torch.Tensor]]:
    """The stand-in's state of the target rank's replica m, from saved replica m % saved R: its own start
    (unless the round starts from the newest shared start, the stand-in spent), and its momentum:
    `local`'s copy of the outer momentum as of the start point (the saved copy; the momentum itself
    once the average was applied, or when the saved run kept no copy)."""
    saved = shares[0]
    stand_in, saved_replicas = saved.get("stand_in"), saved["replicas"]
    if stand_in != "local":
        return {"own_start": None, "own_momentum": None}
    grid = identity["grid"]
    source = (identity["rank"] // grid["shards"]) % saved_replicas
    own = _by_tensor(share["own_pieces"] for share in shares if share["replica"] == source)
    held = {key for pieces in own.values() for piece in pieces for key in OWN if piece.get(key) is not None}
    geometry = identity["geometry"]
    own_start = None if applied_at_once or "own_start" not in held else _assemble(own, "own_start", geometry)
    copied = not applied_at_once and "own_momentum" in held
    return {
        "own_start": own_start,
        "own_momentum": _assemble(own, "own_momentum", geometry) if copied else whole_momentum,
    }


def _residuals(
    shares: Sequence[dict[str, Any]], identity: dict[str, Any], by_tensor: dict[int, list[dict[str, Any]]]
) -> Optional[dict[str, torch.Tensor]]:
    """The error-feedback residuals (`comm.Residuals`) of the target rank, or None when the saved run kept
    none (docs/design.md §7). `displacement`, a replica's own unsent error: with the same R, saved replica
    m's laid over this rank's partition; with another R, the mean over the saved replicas (the exchange
    sends the mean of what the replicas send, so the mean of their residuals is what the average still
    owes: kept exactly for any R). `gathered`, an owner's unsent error per element of its sub-shard: cut
    like the start point, when both runs use the same collective (else it means another thing: 0)."""
    if not any(share["residual_pieces"] for share in shares):
        return None
    geometry, replicas = identity["geometry"], shares[0]["replicas"]
    own = [_by_tensor(s["residual_pieces"] for s in shares if s["replica"] == r) for r in range(replicas)]
    if identity["grid"]["replicas"] == replicas:
        displacement = _assemble(own[identity["rank"] // identity["grid"]["shards"]], "displacement", geometry)
    else:
        displacement = torch.stack([_assemble(pieces, "displacement", geometry) for pieces in own]).mean(0)
    start, end = geometry["sub_shard"]
    gathered = torch.zeros(0 if shares[0]["gathered_residual"] is False else end - start, dtype=torch.float32)
    if shares[0]["gathered_residual"] and shares[0]["strategy"] == geometry.get("strategy"):
        gathered = _assemble(by_tensor, "gathered", geometry)[start:end]
    return {"displacement": displacement, "gathered": gathered}


def stand_in_cost(shares: Sequence[dict[str, Any]], state: dict[str, Any], keeps_copy: bool) -> Optional[str]:
    """What a resharded load of `state` (from `shares`) cannot rebuild of the stand-in, or None: the local
    stand-in's copy of the outer momentum as of the start point, for a target that keeps one
    (`keeps_copy`: reduce_scatter, momentum > 0) from a run that kept none (all_reduce), while the next
    start point is still pending (no sync delay). The momentum the saved run reached stands in for it."""
    applied = state["next_start"] is None
    kept = any(piece.get("own_momentum") is not None for share in shares for piece in share["own_pieces"])
    if shares[0].get("stand_in") != "local" or not keeps_copy or applied or kept:
        return None
    return (
        "co2 resharding: the saved run read the outer momentum itself (collective all_reduce) and kept no copy "
        "of it as of its start point, which this run's local stand-in (reduce_scatter) follows: the momentum one "
        "outer step ahead stands in for it, so with Nesterov momentum the stand-ins after the load are made from "
        "a copy that is off by part of one outer step, an error that shrinks by a factor beta/(1 + beta) every "
        "round (the shared start point and the averages stay exact). Resume with collective all_reduce to avoid it"
    )


def _by_tensor(groups: Any) -> dict[int, list[dict[str, Any]]]:
    """Pieces grouped by their parameter tensor."""
    by_tensor: dict[int, list[dict[str, Any]]] = {}
    for pieces in groups:
        for piece in pieces:
            by_tensor.setdefault(piece["tensor_id"], []).append(piece)
    return by_tensor


def _assemble(by_tensor: dict[int, list[dict[str, Any]]], field: str, geometry: dict[str, Any]) -> torch.Tensor:
    """`field` over this rank's whole (padded) partition, copied from the saved pieces that overlap it;
    ValueError if they do not cover it."""
    out = torch.zeros(geometry["padded"], dtype=torch.float32)
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        here = seg_start - offset  # partition index of this tensor's element 0
        covered = 0
        for piece in by_tensor.get(tensor_id, ()):
            there, values = piece["offset"], piece[field]  # tensor element of the piece's element 0
            lo, hi = max(offset, there), min(offset + seg_end - seg_start, there + values.numel())
            if lo >= hi:
                continue
            covered += hi - lo
            out[here + lo : here + hi] = values[lo - there : hi - there]
        if covered != seg_end - seg_start:
            raise ValueError(
                f"co2 checkpoint: the saved shares cover {covered} of the {seg_end - seg_start} elements of "
                f"parameter tensor {tensor_id} this rank needs ({field}); every rank's file of the saved run "
                f"is needed"
            )
    return out


def cut_rows(pieces: Sequence[tuple[int, torch.Tensor]], first: int, rows: int) -> torch.Tensor:
    """Rows [first, first + rows) of a tensor given as pieces (first row, rows of it): what an FSDP2 rank
    holds of it, or (first 0, every row) all of it. Pieces may repeat rows; ValueError names the rows
    that no piece holds."""
    like = pieces[0][1]
    out = like.new_empty((rows, *like.shape[1:]))
    covered = torch.zeros(rows, dtype=torch.bool)
    for start, piece in pieces:
        lo, hi = max(first, start), min(first + rows, start + piece.shape[0])
        if lo < hi:
            out[lo - first : hi - first] = piece[lo - start : hi - start]
            covered[lo - first : hi - first] = True
    if not covered.all():
        gaps = (~covered).nonzero().flatten() + first
        raise ValueError(f"rows {int(gaps[0])}..{int(gaps[-1])} ({len(gaps)} rows) are in none of the saved files")
    return out


def _applies_at(saved: dict[str, Any], sync_delay: Optional[int]) -> tuple[int, bool]:
    """(the step of a round its average is applied at, whether the saved next start is still pending).
    A state that says `applies_at` carries a next start only while one is pending. An older one carried
    the buffer at every step, scratch after the apply point: the delay it ran (fixed by "auto", else this
    run's, the config hash being the same) and its step counter say which."""
    tau = saved["tau"]
    if saved["applies_at"] is not None:
        return saved["applies_at"], True
    delay = saved["fixed_sync_delay"] or (tau if sync_delay is None else sync_delay)
    after_apply = 0 < delay < tau and saved["rounds"] > 0 and saved["inner_steps"] % tau >= delay
    return delay, not after_apply
