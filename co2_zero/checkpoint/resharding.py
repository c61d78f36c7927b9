"""Resharding as pure functions over the layout (docs/design.md §7): the CO2 state keyed by parameter
tensor and element offset (`consolidate`), re-cut for any R x S and integration (`reshard`), and the
rows of a dim-0-sharded tensor cut from the pieces several files hold (`cut_rows`). No files, no
collectives."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def consolidate(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's layout-independent share of a `RoundEngine.state_dict()`, for resharding.

    Pieces are keyed by parameter tensor and element offset instead of partition position, so a run
    with another R or S (or another integration) can load them (`reshard`). Each rank contributes its
    sub-shard; the shares of all ranks of a run cover every parameter element exactly once.
    """
    geometry = state["geometry"]
    start, end = geometry["sub_shard"]
    momentum_start = geometry["momentum_range"][0]
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
            }
        )
    norms = state["previous_update_sq_norms"]
    return {
        "config_hash": state["config_hash"],
        "signature": state["signature"],
        "num_tensors": geometry["num_tensors"],
        "tau": geometry["tau"],
        "inner_steps": state["inner_steps"],
        "rounds": state["rounds"],
        "skipped_rounds": state.get("skipped_rounds", 0),
        "run_id": state.get("run_id"),
        "fixed_sync_delay": state.get("fixed_sync_delay"),
        "stand_in": state.get("stand_in"),
        "pieces": pieces,
        "update_sq_norms_partial": None if norms is None else norms.cpu().clone(),
    }


def reshard(shares: Sequence[dict[str, Any]], identity: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A `RoundEngine` state for the engine whose `identity()` is given, assembled from the shares of
    every rank of a saved run (any R x S, any integration). Returns (state, dropped steps).

    The state resumes at the saved run's last round start: a partial round cannot be carried across
    partitions, so its steps are dropped (their number is returned). Raises ValueError when the shares
    do not cover the target's partition or come from another co2 config or model.
    """
    for share in shares:
        for key in ("config_hash", "signature"):
            if share[key] != identity[key]:
                raise ValueError(
                    f"co2 checkpoint: the saved state has {key}={share[key]!r} but this run has {identity[key]!r}; "
                    f"resharding needs the same co2 config and model"
                )
    saved = shares[0]
    start_point, next_start, whole_momentum = _assemble(shares, identity["geometry"])
    lo, hi = identity["geometry"]["momentum_range"]
    partials = [s["update_sq_norms_partial"] for s in shares if s["update_sq_norms_partial"] is not None]
    norms = None
    if partials:  # only the sum over ranks matters: rank 0 carries it, the others zeros
        norms = torch.stack(partials).sum(0) if identity["rank"] == 0 else torch.zeros_like(partials[0])
    rounds = saved["rounds"]
    state = {
        **identity,
        "run_id": saved.get("run_id"),
        "inner_steps": rounds * identity["geometry"]["tau"],
        "rounds": rounds,
        "skipped_rounds": saved.get("skipped_rounds", 0),
        "start_point": start_point,
        "next_start": next_start,
        "momentum": whole_momentum[lo:hi].clone(),
        # the local stand-in reads the outer momentum over the whole partition (a copy where it is sharded)
        "own_momentum": whole_momentum if saved.get("stand_in") == "local" else None,
        "previous_update_sq_norms": norms,
        "fixed_sync_delay": saved.get("fixed_sync_delay"),
    }
    return state, saved["inner_steps"] - rounds * saved["tau"]


def _assemble(
    shares: Sequence[dict[str, Any]], geometry: dict[str, Any]
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """This rank's start point, next start point (None in blocking mode) and outer momentum, each over
    its whole partition, copied from the saved pieces that overlap it; ValueError if they do not cover it."""
    padded, overlap = geometry["padded"], geometry["overlap"]
    start_point = torch.zeros(padded, dtype=torch.float32)
    next_start = torch.zeros(padded, dtype=torch.float32) if overlap else None
    momentum = torch.zeros(padded, dtype=torch.float32)
    by_tensor: dict[int, list[dict[str, Any]]] = {}
    for share in shares:
        for piece in share["pieces"]:
            by_tensor.setdefault(piece["tensor_id"], []).append(piece)
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        here = seg_start - offset  # partition index of this tensor's element 0
        covered = 0
        for piece in by_tensor.get(tensor_id, ()):
            there = piece["offset"]  # tensor element of the piece's element 0
            lo, hi = max(offset, there), min(offset + seg_end - seg_start, there + piece["start_point"].numel())
            if lo >= hi:
                continue
            covered += hi - lo
            start_point[here + lo : here + hi] = piece["start_point"][lo - there : hi - there]
            if overlap:
                if piece["next_start"] is None:
                    raise ValueError("co2 checkpoint: saved in blocking mode (overlap false); this run overlaps")
                next_start[here + lo : here + hi] = piece["next_start"][lo - there : hi - there]
            momentum[here + lo : here + hi] = piece["momentum"][lo - there : hi - there]
        if covered != seg_end - seg_start:
            raise ValueError(
                f"co2 checkpoint: the saved shares cover {covered} of the {seg_end - seg_start} elements of "
                f"parameter tensor {tensor_id} this rank needs; every rank's file of the saved run is needed"
            )
    return start_point, next_start, momentum


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
