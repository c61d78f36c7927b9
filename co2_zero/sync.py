"""The round state machine shared by every integration (DESIGN.md §3).

An integration hands the engine its `Partition` (views of the live fp32 master parameters it owns)
and a `refresh` callback that spreads a rewritten partition to the rest of its replica. It then calls
`inner_step_done()` after every applied inner optimizer step; every `tau`-th call ends a round:

1. wait for the pipeline in flight (it produced the next start point),
2. D = start point - live parameters, computed in the retiring buffer; launch the pipeline on it,
3. live parameters <- next start point; refresh; the two partition buffers trade roles.

Only step 3 ever writes the live parameters.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import Layout, OuterExchange, PipelineJob, wire_bytes
from .config import CO2Config
from .errors import CO2Error, CO2TimeoutError
from .outer import Segment
from .topology import Topology, fingerprint, gather_fingerprints

STATE_VERSION = 1


@dataclass
class Partition:
    """This rank's share of the live fp32 master parameters, as the integration found it.

    chunks: 1-D fp32 views of the live parameters, in partition order (one per ZeRO param group, or
    one flat buffer). segments: which global parameter tensor each piece of the concatenated chunks
    belongs to. num_tensors: parameter tensors in the whole model.
    """

    chunks: list[torch.Tensor]
    segments: Sequence[Segment]
    num_tensors: int
    signature: str  # parameter_signature() of the whole model, to catch ranks with different models

    @property
    def length(self) -> int:
        return sum(c.numel() for c in self.chunks)


class RoundEngine:
    """CO2's per-rank state and round ends. See the module docstring."""

    def __init__(
        self,
        partition: Partition,
        config: CO2Config,
        topology: Topology,
        refresh: Callable[[], None] = lambda: None,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        for i, chunk in enumerate(partition.chunks):
            if chunk.dtype != torch.float32 or chunk.dim() != 1:
                raise ValueError(
                    f"co2: partition chunk {i} is {chunk.dtype} with shape {tuple(chunk.shape)}; the "
                    f"live master parameters must be 1-D float32 views"
                )
        self.config = config
        self.topology = topology
        self.partition = partition
        self.refresh = refresh
        self.buffers = [b for b in buffers if b.is_floating_point()]
        device = partition.chunks[0].device if partition.chunks else torch.device("cpu")

        replicas = topology.replicas
        padded = max(replicas, math.ceil(partition.length / replicas) * replicas)
        self.layout = Layout(
            length=partition.length,
            padded=padded,
            sub_shard=padded // replicas,
            segments=tuple(partition.segments),
            num_tensors=partition.num_tensors,
        )
        self._check_agreement()
        self._common_start()
        self.exchange = OuterExchange(config, topology, self.layout, device)
        self._at_exit = weakref.finalize(self, _shutdown, self.exchange, topology)

        # The two partition buffers that trade roles every round (start point B; D, then Nx).
        self.start_point = torch.zeros(padded, dtype=torch.float32, device=device)
        self._gather_live(self.start_point)
        self.next_start = self.start_point.clone()
        self.momentum = torch.zeros(self.exchange.slice_length, dtype=torch.float32, device=device)
        reduce_scatter = self.exchange.strategy == "reduce_scatter"
        self.g_buffer = torch.zeros_like(self.momentum) if reduce_scatter else None
        self.previous_update_sq_norms: Optional[torch.Tensor] = None

        self.inner_steps = 0
        self.rounds = 0
        self.pending_round: Optional[Future] = None
        self.finalized = False
        self.failed: Optional[BaseException] = None
        self.last_round: dict[str, Any] = {}
        self._bytes_reported = 0  # of exchange.bytes_sent, already in some last_round

    # ---- the round --------------------------------------------------------------------------------

    def inner_step_done(self) -> bool:
        """Count one applied inner step; end the round on every tau-th. Returns True if it did."""
        self._check_usable()
        self.inner_steps += 1
        if self.inner_steps % self.config.tau:
            return False
        self._round_end()
        return True

    def _round_end(self) -> None:
        began = time.perf_counter()
        wait_s = self._wait_pending()  # step 1: next_start now holds x_{t+1}
        sent = self._exchange_bytes_since_last_report()
        overlap = self.config.overlap
        if overlap:  # D overwrites the retiring start point; the update applies to x_{t+1}
            base, work = self.next_start, self.start_point
        else:  # blocking: D goes to the spare buffer; the update applies to x_t, right now
            base, work = self.start_point, self.next_start
        self._subtract_live(self.start_point, out=work)  # step 2: D = B - x
        gap = self.previous_update_sq_norms if overlap else None
        self.pending_round = self.exchange.launch(
            PipelineJob(work, base, self.momentum, self.g_buffer, gap, self.rounds)
        )
        if not overlap:
            wait_s += self._wait_pending()
            sent += self._exchange_bytes_since_last_report()
        new_start, spare = (base, work) if overlap else (work, base)
        self._set_live(new_start)  # step 3: x <- Nx; refresh
        self.start_point, self.next_start = new_start, spare
        self.rounds += 1
        sent += self._average_buffers()
        self.last_round = {
            "round": self.rounds - 1,
            "inner_step": self.inner_steps,
            "wait_s": wait_s,
            "round_end_s": time.perf_counter() - began,
            "bytes_sent": sent,
        }

    def _exchange_bytes_since_last_report(self) -> int:
        """Bytes this rank's finished pipelines sent since the last call (read with none in flight)."""
        sent, self._bytes_reported = self.exchange.bytes_sent - self._bytes_reported, self.exchange.bytes_sent
        return sent

    def finalize(self) -> None:
        """End training with one model on every rank (DESIGN.md §3): the last start point produced."""
        self._check_usable()
        dropped = self.inner_steps % self.config.tau
        if dropped:
            warnings.warn(
                f"co2 finalize: the {dropped} inner step(s) since the last round end (step "
                f"{self.inner_steps - dropped}) are dropped; every rank returns to the start point",
                stacklevel=3,
            )
        self._wait_pending()
        self._set_live(self.next_start if self.config.overlap else self.start_point)
        self._average_buffers()
        self.finalized = True
        self.close()

    def close(self) -> None:
        """Stop the background worker and release the CO2 process groups (not the inner group,
        which the integration's framework keeps using). Also runs at interpreter exit."""
        self._at_exit()

    # ---- waiting with a deadline ---------------------------------------------------------------------

    def _wait_pending(self) -> float:
        """Wait for the pipeline in flight (if any); returns the seconds spent blocked."""
        if self.pending_round is None:
            return 0.0
        began = time.perf_counter()
        future, self.pending_round = self.pending_round, None
        round_index = self.rounds - 1
        where = self.topology.describe_outer()
        try:
            result, done = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self.failed = CO2TimeoutError(
                f"co2: round {round_index}: the background exchange on the {where} did not finish "
                f"within timeout_s={self.config.timeout_s}; a peer rank is probably dead or stuck"
            )
        except CO2Error as error:
            self.failed = error
        except Exception as error:  # the collective failed: a peer died or its group timed out
            self.failed = CO2Error(
                f"co2: round {round_index}: the background exchange on the {where} failed: "
                f"{type(error).__name__}: {error}"
            )
            self.failed.__cause__ = error
        if self.failed is not None:
            self.close()
            raise self.failed
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.previous_update_sq_norms = result.update_sq_norms
        return time.perf_counter() - began

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise CO2Error(f"co2: this optimizer already failed and cannot continue: {self.failed}")
        if self.finalized:
            raise CO2Error("co2: finalize() ended training; build a new CO2 optimizer to train again")

    # ---- the live partition ----------------------------------------------------------------------------

    def _chunk_slices(self):
        offset = 0
        for chunk in self.partition.chunks:
            yield chunk, slice(offset, offset + chunk.numel())
            offset += chunk.numel()

    @torch.no_grad()
    def _gather_live(self, out: torch.Tensor) -> None:
        """out <- live partition."""
        for chunk, where in self._chunk_slices():
            out[where].copy_(chunk)

    @torch.no_grad()
    def _subtract_live(self, start_point: torch.Tensor, out: torch.Tensor) -> None:
        """out <- start_point - live partition (the padding stays zero)."""
        for chunk, where in self._chunk_slices():
            torch.sub(start_point[where], chunk, out=out[where])

    @torch.no_grad()
    def _common_start(self) -> None:
        """Every replica starts from replica 0's parameters (a framework broadcasts its model only
        within its data-parallel group, here a replica). Before the worker exists: the outer group
        is free, and `_check_agreement` made sure the partitions have the same layout."""
        if self.topology.replicas > 1:
            for chunk in self.partition.chunks:
                dist.broadcast(chunk, src=self.topology.outer_ranks[0], group=self.topology.outer_group)
            self.refresh()

    def _set_live(self, flat: torch.Tensor) -> None:
        """live partition <- flat, then let the integration spread it over its replica."""
        with torch.no_grad():
            for chunk, where in self._chunk_slices():
                chunk.copy_(flat[where])
        self.refresh()

    def _average_buffers(self) -> int:
        """Average float module buffers over every rank (main thread, its own group). Returns the
        bytes this rank sent (`comm.wire_bytes`)."""
        if not self.buffers:
            return 0
        flat = torch.cat([b.detach().reshape(-1).float() for b in self.buffers])
        try:
            dist.all_reduce(flat, group=self.topology.buffer_group)
        except Exception as error:
            self.failed = CO2Error(f"co2: round {self.rounds - 1}: averaging module buffers failed: {error}")
            raise self.failed from error
        flat.div_(self.topology.world_size)
        offset = 0
        for b in self.buffers:
            b.data.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        return wire_bytes("all_reduce", flat.numel() * flat.element_size(), self.topology.world_size)

    # ---- agreement, state, footprint ---------------------------------------------------------------

    def _check_agreement(self) -> None:
        """Fail fast, naming the difference, when ranks hold different models or partition layouts
        (a fingerprint exchange at start-up instead of a hang later; the configs and the grid were
        compared when the topology was built)."""
        topo, layout = self.topology, self.layout
        mine = [
            fingerprint(self.partition.num_tensors),
            fingerprint(self.partition.signature),
            topo.shard_index,
            layout.length,
            fingerprint(tuple(tuple(seg) for seg in layout.segments)),
        ]
        table = gather_fingerprints(mine, topo.norm_group, self.config.timeout_s, "start-up model check")
        for rank, theirs in enumerate(table):
            if theirs[:2] != mine[:2]:
                raise CO2Error(
                    f"co2: rank {topo.rank} and rank {rank} disagree on the (parameter tensors, shape signature): "
                    f"{self.partition.num_tensors} tensors here; every rank must build the same model"
                )
            if theirs[2] == topo.shard_index and theirs[3:] != mine[3:]:
                raise CO2Error(
                    f"co2: rank {topo.rank} and rank {rank} own shard {topo.shard_index} but their "
                    f"partitions differ ({layout.length} elements here vs {theirs[3]}, or a different split "
                    f"into tensors); every replica must partition the model the same way"
                )

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be loaded here."""
        topo, layout = self.topology, self.layout
        return {
            "version": STATE_VERSION,
            "config_hash": self.config.math_hash(),
            "grid": {"replicas": topo.replicas, "shards": topo.shards, "rank": topo.rank},
            "layout": {"length": layout.length, "padded": layout.padded, "num_tensors": layout.num_tensors},
            "strategy": self.exchange.strategy,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state. Waits for the round in flight so its result is included."""
        self._check_usable()
        self._wait_pending()
        return {
            **self._identity(),
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "start_point": self.start_point,
            "next_start": self.next_start if self.config.overlap else None,
            "momentum": self.momentum,
            "previous_update_sq_norms": self.previous_update_sq_norms,
            # comm_dtype int8/fp8: the error-feedback residuals (comm.Residuals), else None
            "residuals": None if self.exchange.residuals is None else self.exchange.residuals._asdict(),
            # enough geometry to re-cut the state per parameter tensor (`consolidate`)
            "segments": [tuple(seg) for seg in self.layout.segments],
            "sub_shard": self.layout.sub_shard_range(self.topology.replica_index),
            "momentum_start": self.exchange.slice.start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved on this same rank of the same topology and config."""
        self._check_usable()
        self._wait_pending()
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(
                    f"co2 checkpoint: {key}={state.get(key)!r} does not match this run's {value!r}; "
                    f"resume with the same co2 config, topology and model"
                )
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])
        self.start_point.copy_(state["start_point"])
        if state["next_start"] is not None:
            self.next_start.copy_(state["next_start"])
        self.momentum.copy_(state["momentum"])
        norms = state["previous_update_sq_norms"]
        self.previous_update_sq_norms = None if norms is None else norms.to(self.momentum.device).clone()
        if self.exchange.residuals is not None:
            if state.get("residuals") is None:
                raise ValueError(
                    f"co2 checkpoint: residuals=None, but comm_dtype={self.config.comm_dtype!r} needs the "
                    f"saved error-feedback residuals; resume from a state saved with the same co2 config"
                )
            for name, residual in self.exchange.residuals._asdict().items():
                residual.copy_(state["residuals"][name])

    def load_consolidated(self, shares: Sequence[dict[str, Any]]) -> None:
        """Load `consolidate(state)` of every rank's saved `state_dict()`, from a run with any R x S.

        Training resumes at the saved run's last round start: the live parameters are set to the
        start point (a partial round cannot be carried across topologies; it is dropped with a
        warning).
        """
        self._check_usable()
        self._wait_pending()
        for share in shares:
            if share["config_hash"] != self.config.math_hash() or share["num_tensors"] != self.layout.num_tensors:
                raise ValueError(
                    "co2 checkpoint: the consolidated state was saved with another co2 config or model "
                    f"(config hash {share['config_hash']}, {share['num_tensors']} tensors; here "
                    f"{self.config.math_hash()}, {self.layout.num_tensors})"
                )
        saved = shares[0]
        dropped = saved["inner_steps"] - saved["rounds"] * self.config.tau
        if dropped:
            warnings.warn(f"co2 resharding: {dropped} step(s) after the last round end are dropped", stacklevel=2)
        by_tensor: dict[int, list[dict[str, Any]]] = {}
        for share in shares:
            for piece in share["pieces"]:
                by_tensor.setdefault(piece["tensor_id"], []).append(piece)
        computed = self.exchange.slice  # the momentum covers these partition elements
        for seg in self.layout.segments:
            here = seg.start - seg.offset  # partition index of this tensor's element 0
            for piece in by_tensor.get(seg.tensor_id, ()):
                there = piece["offset"]  # tensor element of the piece's element 0
                lo = max(seg.offset, there)
                hi = min(seg.offset + seg.end - seg.start, there + piece["start_point"].numel())
                if lo >= hi:
                    continue
                self.start_point[here + lo : here + hi].copy_(piece["start_point"][lo - there : hi - there])
                if self.config.overlap:
                    self.next_start[here + lo : here + hi].copy_(piece["next_start"][lo - there : hi - there])
                m_lo, m_hi = max(here + lo, computed.start), min(here + hi, computed.stop)
                if m_lo < m_hi:
                    self.momentum[m_lo - computed.start : m_hi - computed.start].copy_(
                        piece["momentum"][m_lo - here - there : m_hi - here - there]
                    )
        partials = [s["update_sq_norms_partial"] for s in shares if s["update_sq_norms_partial"] is not None]
        if partials and self.topology.rank == 0:  # only the sum over ranks matters
            self.previous_update_sq_norms = torch.stack(partials).sum(0).to(self.momentum.device)
        elif partials:
            self.previous_update_sq_norms = torch.zeros_like(partials[0]).to(self.momentum.device)
        self.rounds = int(saved["rounds"])
        self.inner_steps = self.rounds * self.config.tau
        self._set_live(self.start_point)

    def state_bytes(self) -> int:
        """Bytes of CO2 state this rank holds (DESIGN.md §4: 2Ψ/S + 2Ψ/N fp32 words with
        reduce_scatter, 3Ψ/S with all_reduce, plus per-tensor norms; int8/fp8 add the residuals,
        Ψ/S + Ψ/N)."""
        tensors = [self.start_point, self.next_start, self.momentum, self.g_buffer, self.previous_update_sq_norms]
        tensors += list(self.exchange.residuals or ())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class CO2Steps:
    """What every integration's optimizer adds to its framework's optimizer, around `self.engine`."""

    engine: RoundEngine
    round_ended: bool = False  # did the last step() end a round

    def _count_step(self, applied: bool = True) -> None:
        """After the framework's step: count it for CO2 if it was applied (not skipped on overflow)."""
        self.round_ended = applied and self.engine.inner_step_done()

    @property
    def last_round(self) -> dict[str, Any]:
        """The last round end: round, inner_step, wait_s, round_end_s, bytes_sent."""
        return self.engine.last_round

    def finalize(self) -> None:
        """Wait for the round in flight and give every rank the same model (DESIGN.md §3)."""
        self.engine.finalize()

    def co2_state_bytes(self) -> int:
        """Bytes of CO2 state on this rank (DESIGN.md §4)."""
        return self.engine.state_bytes()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "engine"):
            raise RuntimeError("co2: parameters cannot be added after the CO2 partition was built")
        super().add_param_group(param_group)  # type: ignore[misc]


def consolidate(state: dict[str, Any]) -> dict[str, Any]:
    """One rank's layout-independent share of a `RoundEngine.state_dict()`, for resharding.

    Pieces are keyed by parameter tensor and element offset instead of partition position, so a run
    with another R or S can load them (`RoundEngine.load_consolidated`). Each rank contributes its
    sub-shard; the shares of all ranks cover every parameter element exactly once.
    """
    start, end = state["sub_shard"]
    layout_segments = [Segment(*seg) for seg in state["segments"]]
    pieces = []
    for seg in layout_segments:
        lo, hi = max(seg.start, start), min(seg.end, end)
        if lo >= hi:
            continue
        momentum = slice(lo - state["momentum_start"], hi - state["momentum_start"])
        pieces.append(
            {
                "tensor_id": seg.tensor_id,
                "offset": seg.offset + lo - seg.start,
                "start_point": state["start_point"][lo:hi].cpu().clone(),
                "next_start": None if state["next_start"] is None else state["next_start"][lo:hi].cpu().clone(),
                "momentum": state["momentum"][momentum].cpu().clone(),
            }
        )
    norms = state["previous_update_sq_norms"]
    return {
        "config_hash": state["config_hash"],
        "num_tensors": state["layout"]["num_tensors"],
        "inner_steps": state["inner_steps"],
        "rounds": state["rounds"],
        "pieces": pieces,
        "update_sq_norms_partial": None if norms is None else norms.cpu().clone(),
    }


def parameter_signature(shapes: Sequence[Sequence[int]]) -> str:
    """A short hash of the model's parameter shapes, in order."""
    return hashlib.sha256(repr([tuple(s) for s in shapes]).encode()).hexdigest()[:16]


def _shutdown(exchange: OuterExchange, topology: Topology) -> None:
    # A worker still blocked in a collective keeps its groups: destroying them under it would crash.
    if exchange.close():
        topology.destroy()
