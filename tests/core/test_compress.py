"""The compressed exchange (comm_dtype int8/fp8 with error feedback, docs/design.md §5).

The quantizer against the plain per-block code of tests/reference_compress.py; CO2Optimizer and CO2OSS
on real gloo processes against `reference.simulate` with that reference's exchange, at every round
start of every replica (the shared start, or with the defaults' local stand-in each replica's own);
replicas at the shared start bit-identical; the bytes each round sends and the state each rank holds
against their formulas; exact resume of the residuals; a NaN round skipped; and int8
training the training script's default model with the defaults to within 2% of fp32's validation loss.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from co2_zero import CO2Optimizer
from co2_zero.core.compress import BLOCK, FORMATS, RecordLayout, dequantize_into, quantize_into, quantize_with_feedback_
from tests import models
from tests.compare import assert_close
from tests.dist_utils import run_ranks
from tests.reference import replica_round_starts, resolve_config, simulate
from tests.reference_compress import CompressedExchange, roundtrip

ROOT = Path(__file__).resolve().parents[2]
# CO2 as published (the shared start); scenarios without a stand_in run the defaults' local stand-in
HEAVY_BALL = {"outer_lr": 0.8, "outer_momentum": 0.5, "nesterov": False, "stand_in": "shared"}
NESTEROV = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "stand_in": "shared"}
ADAPTIVE = {"mode": "adaptive", "strength": 1.5}

# "uneven" has 527 parameters: sub-shards of 264 (R = 2) and 132 (R = 4) elements, so full blocks,
# short last blocks and blocks spanning several tensors all occur.
SCENARIOS_R2 = {
    "int8-overlap-reducescatter": dict(
        config={**HEAVY_BALL, "tau": 3, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8"},
        steps=13, model="uneven",
    ),
    # The norm clip's global norm sums in another order here (per segment) than in the reference (one
    # vector_norm), so a displacement value on an int8 rounding boundary can round the other way; the runs
    # then differ by up to a quantum (5.2e-5 here) until the error feedback takes it back: `atol` allows that
    # (test_reference_without_error_feedback_would_not_match shows it still tells a wrong exchange apart).
    "int8-overlap-allreduce-clipnorm": dict(
        config={**NESTEROV, "tau": 2, "gap_penalty": ADAPTIVE, "clip": {"mode": "norm", "threshold": 0.1},
                "collective": "all_reduce", "comm_dtype": "int8"},
        steps=10, model="uneven", optimizer="adam", atol=6e-5,
    ),
    "fp8-blocking-reducescatter": dict(
        config={**NESTEROV, "overlap": False, "tau": 2, "gap_penalty": {"mode": "none"},
                "collective": "reduce_scatter", "comm_dtype": "fp8"},
        steps=8, model="uneven", optimizer="adam",
    ),
    "fp8-overlap-allreduce-batchnorm": dict(
        config={**HEAVY_BALL, "tau": 2, "gap_penalty": {"mode": "constant", "value": 2.0},
                "collective": "all_reduce", "comm_dtype": "fp8"},
        steps=8, model="bn",
    ),
    "int8-blocking-localsgd-allreduce": dict(
        config={"outer_lr": 1.0, "outer_momentum": 0.0, "overlap": False, "tau": 3, "gap_penalty": {"mode": "none"},
                "collective": "all_reduce", "comm_dtype": "int8"},
        steps=9,
    ),
    # the defaults (the local stand-in, Nesterov 0.9): with reduce_scatter its copy of the momentum
    # follows the new start points as they arrive, quantized
    "int8-defaults-reducescatter": dict(
        config={"tau": 3, "collective": "reduce_scatter", "comm_dtype": "int8"}, steps=13, model="uneven",
    ),
    "fp8-local-allreduce-adaptive": dict(
        config={"stand_in": "local", "tau": 2, "gap_penalty": ADAPTIVE, "collective": "all_reduce",
                "comm_dtype": "fp8"},
        steps=8, model="uneven", optimizer="adam",
    ),
    "int4-defaults-reducescatter": dict(
        config={"tau": 3, "collective": "reduce_scatter", "comm_dtype": "int4"}, steps=13, model="uneven",
    ),
    "int2-defaults-allreduce": dict(
        config={"tau": 3, "collective": "all_reduce", "comm_dtype": "int2"}, steps=13, model="uneven",
        optimizer="adam",
    ),
}  # fmt: skip
SCENARIOS_R4 = {
    "r4-int8-overlap-reducescatter": dict(
        config={**NESTEROV, "tau": 2, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8"},
        steps=8, model="uneven",
    ),
    "r4-fp8-overlap-allreduce": dict(
        config={**HEAVY_BALL, "tau": 3, "gap_penalty": ADAPTIVE, "collective": "all_reduce", "comm_dtype": "fp8"},
        steps=9, model="uneven",
    ),
    "r4-int8-blocking-allreduce": dict(
        config={**HEAVY_BALL, "overlap": False, "tau": 2, "gap_penalty": {"mode": "constant", "value": 1.5},
                "collective": "all_reduce", "comm_dtype": "int8"},
        steps=6, model="uneven", optimizer="adam",
    ),
    "r4-fp8-blocking-reducescatter": dict(
        config={**HEAVY_BALL, "overlap": False, "tau": 2, "gap_penalty": {"mode": "none"},
                "collective": "reduce_scatter", "comm_dtype": "fp8"},
        steps=6,
    ),
    "r4-int8-defaults-reducescatter": dict(
        config={"tau": 2, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8"},
        steps=8, model="uneven",
    ),
}  # fmt: skip
# the bytes a round sends, on a model large enough that the per-tensor norms do not matter
WIDE_CONFIG = {**HEAVY_BALL, "tau": 1, "overlap": False, "gap_penalty": ADAPTIVE}
COMM_DTYPES = ("fp32", "bf16", "int8", "fp8", "int4", "int2")
STRATEGIES = ("reduce_scatter", "all_reduce")
RESUME = dict(
    config={**HEAVY_BALL, "tau": 3, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8"},
    steps=14, save_at=7, model="uneven", optimizer="adam",
)  # fmt: skip
NAN_ROUND = dict(
    config={**HEAVY_BALL, "tau": 2, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8",
            "nonfinite": "skip_round"},
    steps=10, poison_step=5, model="uneven",
)  # fmt: skip


# ---- the quantizer alone -------------------------------------------------------------------------


def _quantized_roundtrip(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    layout = RecordLayout.for_length(rows.shape[-1], bits=FORMATS[fmt].bits)
    records = torch.empty(rows.shape[0], layout.nbytes, dtype=torch.uint8)
    quantize_into(rows, FORMATS[fmt], records, scratch=torch.empty_like(rows))
    return dequantize_into(records, FORMATS[fmt], out=torch.empty_like(rows))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("length", [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK - 5])
def test_quantizer_matches_reference_bit_for_bit(fmt, length):
    gen = torch.Generator().manual_seed(length)
    rows = torch.randn(3, length, generator=gen) * torch.tensor([[1e-3], [1.0], [50.0]])
    rows[1, : min(length, BLOCK)] = 0.0  # an all-zero block
    got = _quantized_roundtrip(rows, fmt)
    for row, expected in zip(got, rows):
        assert torch.equal(row, roundtrip(expected, fmt))
    assert not torch.equal(got, rows) or length == 1  # it does quantize
    for lo in range(0, length, BLOCK):  # half a step: int8 of the block's scale, fp8 of the value
        block, back = rows[:, lo : lo + BLOCK], got[:, lo : lo + BLOCK]
        scale = block.abs().amax(-1, keepdim=True) / FORMATS[fmt].qmax
        bound = 0.5 * scale if fmt != "fp8" else 2**-4 * block.abs() + 2**-10 * scale  # e4m3: subnormals
        assert bool(((back - block).abs() <= bound * (1 + 1e-5)).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantizer_on_cuda_matches_cpu_bit_for_bit(fmt):
    """The same records and residuals on both devices: replicas on different devices would still agree."""
    rows = torch.randn(3, 3 * BLOCK - 5, generator=torch.Generator().manual_seed(0)) * 5
    records = {}
    for device in ("cpu", "cuda"):
        x, residual = rows.to(device), torch.full_like(rows, 0.01, device=device)
        nbytes = RecordLayout.for_length(rows.shape[-1], bits=FORMATS[fmt].bits).nbytes
        out = torch.empty(3, nbytes, dtype=torch.uint8, device=device)
        quantize_with_feedback_(x, residual, FORMATS[fmt], out)
        records[device] = (out.cpu(), residual.cpu())
    assert torch.equal(records["cpu"][0], records["cuda"][0]) and torch.equal(records["cpu"][1], records["cuda"][1])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nonfinite_blocks_stay_nonfinite(fmt):
    rows = torch.randn(2, 2 * BLOCK + 3)
    rows[0, 5], rows[1, BLOCK + 1] = float("nan"), float("inf")
    got = _quantized_roundtrip(rows, fmt)
    assert not got[0, :BLOCK].isfinite().any() and not got[1, BLOCK : 2 * BLOCK].isfinite().any()
    assert got[0, BLOCK:].isfinite().all() and got[1, :BLOCK].isfinite().all() and got[1, 2 * BLOCK :].isfinite().all()


def test_record_bytes():
    for length in (1, 255, 256, 257, 10_000):
        layout = RecordLayout.for_length(length)
        assert layout.blocks == math.ceil(length / BLOCK)
        assert layout.nbytes % 4 == 0 and 0 <= layout.nbytes - (4 * layout.blocks + length) < 4
        for bits in (4, 2):  # packed: bits/8 bytes per value
            packed = RecordLayout.for_length(length, bits=bits)
            assert 0 <= packed.nbytes - (4 * packed.blocks + math.ceil(length * bits / 8)) < 4
    for bits, ratio in ((8, 0.2540), (4, 0.1290), (2, 0.0665)):  # (256·bits/8 + 4) / 1024
        assert RecordLayout.for_length(10_000 * BLOCK, bits=bits).nbytes / (4 * 10_000 * BLOCK) < ratio


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_error_feedback_loses_nothing_over_time(fmt):
    """Sending the same vector K times: with feedback the sum of what arrived stays within one
    quantization step of K times the vector; without, the rounding error of every round adds up."""
    small = 1e-3 if fmt in ("int8", "fp8") else 0.14 / FORMATS[fmt].qmax  # below half a step
    vector = torch.full((1, BLOCK), small)
    vector[0, 0] = 1.0  # small elements next to a large one: int formats round them to 0, fp8 loses bits
    layout, fmt_ = RecordLayout.for_length(BLOCK, bits=FORMATS[fmt].bits), FORMATS[fmt]
    residual, records = torch.zeros_like(vector), torch.empty(1, layout.nbytes, dtype=torch.uint8)
    arrived_with = torch.zeros_like(vector)
    rounds = 200
    for _ in range(rounds):
        quantize_with_feedback_(vector.clone(), residual, fmt_, records)
        arrived_with += dequantize_into(records, fmt_, out=torch.empty_like(vector))
    arrived_without = rounds * _quantized_roundtrip(vector, fmt)
    step = 1.0 / FORMATS[fmt].qmax if fmt != "fp8" else 2**-4 * small
    error_with = float((arrived_with - rounds * vector).abs().max())
    error_without = float((arrived_without - rounds * vector).abs().max())
    assert error_with <= 2 * step
    assert error_without > 10 * error_with


# ---- CO2Optimizer on gloo processes ------------------------------------------------------------------


def _wide_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Linear(256, 256)


def _model(kind: str) -> nn.Module:
    return _wide_model() if kind == "wide" else models.make_model(kind)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


def _train(rank: int, model, opt, steps: range, starts: list, poison_step: int = -1) -> None:
    """Train on `models.batch`; `poison_step`: rank 1 sets a weight to NaN right before that step
    (after the backward, so the inner optimizer's state stays finite)."""
    for step in steps:
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        if step == poison_step and rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        opt.step()
        if opt.round_ended:
            starts.append(_snapshot(model))


def _build(sc: dict):
    model = _model(sc.get("model", "mlp"))
    opt = CO2Optimizer(models.make_optimizer(sc.get("optimizer", "sgd"), model.parameters()), sc["config"], model=model)
    return model, opt


def run_scenario(rank: int, sc: dict) -> dict:
    model, opt = _build(sc)
    starts = [_snapshot(model)]
    _train(rank, model, opt, range(sc["steps"]), starts, sc.get("poison_step", -1))
    result = {"starts": starts, "strategy": opt.engine.exchange.strategy}
    result["residuals_finite"] = all(bool(r.isfinite().all()) for r in opt.engine.exchange.residuals)
    opt.finalize()
    result["final"] = _snapshot(model)
    return result


def resume_run(rank: int, sc: dict) -> dict:
    """Train to `save_at` (mid-round, an exchange in flight), save; the uninterrupted run goes on; a
    fresh optimizer resumes from the saved state, and another from it with the residuals zeroed."""
    model, opt = _build(sc)
    _train(rank, model, opt, range(sc["save_at"]), [])
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    runs = {}
    for name in ("uninterrupted", "resumed", "residuals-zeroed"):
        if name != "uninterrupted":
            model, opt = _build(sc)
            model.load_state_dict(saved_model)
            state = copy.deepcopy(saved)
            if name == "residuals-zeroed":
                for residual in state["co2"]["residuals"].values():
                    residual.zero_()
            opt.load_state_dict(state)
        starts: list = []
        _train(rank, model, opt, range(sc["save_at"], sc["steps"]), starts)
        opt.finalize()
        runs[name] = starts + [_snapshot(model)]
    residuals = saved["co2"]["residuals"]
    runs["saved_residual_norms"] = [float(r.norm()) for r in residuals.values()]
    return runs


def two_rounds_on_the_wide_model(rank: int, sc: dict) -> dict:
    """bytes_sent after each of two steps, co2_state_bytes and the outer step's segment index bytes; then
    finalize()."""
    model, opt = _build(sc)
    sent: list = []
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sent.append(opt.last_round["bytes_sent"])
    out = {"sent": sent, "state": opt.co2_state_bytes(), "index_bytes": opt.engine.exchange.index_bytes}
    opt.finalize()
    return out


def bytes_run(rank: int, replicas: int) -> dict:
    """bytes_sent of a round and co2_state_bytes, per comm_dtype and strategy, on the wide model."""
    out = {}
    for comm_dtype in COMM_DTYPES:
        for strategy in STRATEGIES:
            sc = {"config": {**WIDE_CONFIG, "comm_dtype": comm_dtype, "collective": strategy}, "model": "wide"}
            out[(comm_dtype, strategy)] = two_rounds_on_the_wide_model(rank, sc)
    return out


def train_scenarios(rank: int, world: int, scenarios: dict, extras: tuple) -> dict:
    results = {name: run_scenario(rank, sc) for name, sc in scenarios.items()}
    if "resume" in extras:
        results["resume"] = resume_run(rank, RESUME)
    if "nan" in extras:
        results["nan"] = run_scenario(rank, NAN_ROUND)
    results["bytes"] = bytes_run(rank, world)
    return results


@pytest.fixture(scope="module")
def results_r2():
    return run_ranks(train_scenarios, 2, SCENARIOS_R2, ("resume", "nan"), timeout=300.0)


@pytest.fixture(scope="module")
def results_r4():
    return run_ranks(train_scenarios, 4, SCENARIOS_R4, (), timeout=300.0)


def _shared_start(sc: dict) -> bool:
    """Whether every replica starts each round at the shared start (no stand-in)."""
    return resolve_config(sc["config"])["stand_in"] == "shared"


def _reference(sc: dict, replicas: int, partitions=None, shards: int = 1):
    """Every replica's start of every round, and finals, of the reference with the compressed exchange
    of `sc`'s config: [round][replica], [replica]."""
    config = sc["config"]
    exchange = CompressedExchange(config["comm_dtype"], config["collective"], replicas, partitions)
    starts: list = []
    step_record: list = []
    kind, opt_kind = sc.get("model", "mlp"), sc.get("optimizer", "sgd")
    sharded = {"shards": shards, "shard_batch": lambda r, s, k: models.shard_batch(r, s, k, shards)}
    finals = simulate(
        lambda: _model(kind),
        lambda params: models.make_optimizer(opt_kind, params),
        models.batch,  # S > 1: shard_batch instead
        models.loss_fn,
        config,
        replicas=replicas,
        steps=sc["steps"],
        record=starts,
        step_record=step_record,
        exchange=exchange,
        **({} if shards == 1 else sharded),
    )
    return replica_round_starts(starts, step_record, config["tau"]), finals


def _check_against_reference(results: list, scenarios: dict, name: str) -> None:
    sc = scenarios[name]
    starts, finals = _reference(sc, len(results))
    assert len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["strategy"] == sc["config"]["collective"]
        assert len(got["starts"]) == len(starts)
        atol = sc.get("atol", 1e-6)
        for t, (a, e) in enumerate(zip(got["starts"], starts)):
            assert_close(a, e[rank], f"{name} rank {rank} round-{t} start", atol=atol)
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final", atol=atol)


@pytest.mark.parametrize("name", list(SCENARIOS_R2))
def test_two_replicas_match_reference(results_r2, name):
    _check_against_reference(results_r2, SCENARIOS_R2, name)


@pytest.mark.parametrize("name", list(SCENARIOS_R4))
def test_four_replicas_match_reference(results_r4, name):
    _check_against_reference(results_r4, SCENARIOS_R4, name)


@pytest.mark.parametrize("name", ["int8-overlap-reducescatter", "int8-overlap-allreduce-clipnorm"])
def test_reference_without_error_feedback_would_not_match(results_r2, name):
    """The comparison can tell: a reference that drops the residuals ends far from the library, beyond
    the scenario's tolerance."""
    sc = SCENARIOS_R2[name]
    collective = sc["config"]["collective"]

    class NoFeedback(CompressedExchange):
        def _send(self, vector, residual):
            return super()._send(vector, torch.zeros_like(residual))

    starts: list = []
    simulate(lambda: _model(sc["model"]), lambda p: models.make_optimizer(sc.get("optimizer", "sgd"), p),
             models.batch, models.loss_fn, sc["config"], 2, sc["steps"], record=starts,
             exchange=NoFeedback("int8", collective, 2))  # fmt: skip
    last = results_r2[0][name]["starts"][-1]
    assert max(float((last[k] - v).abs().max()) for k, v in starts[-1].items()) > 3 * sc.get("atol", 1e-5)


def test_replicas_identical_at_every_round_start(results_r2, results_r4):
    shared_r2, shared_r4 = (
        [n for n, sc in scenarios.items() if _shared_start(sc)] for scenarios in (SCENARIOS_R2, SCENARIOS_R4)
    )
    for results, names in ((results_r2, [*shared_r2, "nan"]), (results_r4, shared_r4)):
        for name in names:
            for other in results[1:]:
                assert len(other[name]["starts"]) == len(results[0][name]["starts"])
                for a, b in zip(results[0][name]["starts"], other[name]["starts"]):
                    assert all(torch.equal(a[k], b[k]) for k in a), name
                assert all(torch.equal(results[0][name]["final"][k], v) for k, v in other[name]["final"].items()), name


def assert_resumed_exactly(runs: dict) -> None:
    """A resumed run equals the uninterrupted one at every recorded point, and one resumed with its
    residuals zeroed does not (the residuals matter)."""
    assert len(runs["resumed"]) == len(runs["uninterrupted"]) >= 3
    for a, b in zip(runs["resumed"], runs["uninterrupted"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    last_zeroed, last = runs["residuals-zeroed"][-1], runs["uninterrupted"][-1]
    assert not all(torch.equal(last_zeroed[k], last[k]) for k in last)


def test_resume_restores_the_residuals_exactly(results_r2):
    for per_rank in results_r2:
        runs = per_rank["resume"]
        assert min(runs["saved_residual_norms"]) > 0  # there was something to restore
        assert_resumed_exactly(runs)


def test_nan_round_is_skipped_and_residuals_restart(results_r2):
    sc = NAN_ROUND
    for per_rank in results_r2:
        got = per_rank["nan"]
        assert got["residuals_finite"]
        assert all(bool(v.isfinite().all()) for start in got["starts"] for v in start.values())
        # the poisoned round (round poison_step // tau) is skipped: its pipeline leaves the start point as is
        skipped = sc["poison_step"] // sc["config"]["tau"]
        a, b = got["starts"][skipped + 2], got["starts"][skipped + 1]  # overlap: applied one round later
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(got["starts"][skipped + 3][k], a[k]) for k in a)  # and training goes on


def _norm_bytes(model: nn.Module, world: int) -> int:
    """The per-tensor norm all-reduce of the outer step (g and the gap: 2 float64 per tensor)."""
    tensors = len(list(model.parameters()))
    return 2 * (world - 1) * (2 * tensors * 8) // world


def test_bytes_sent_per_round_match_the_wire_formulas(results_r2, results_r4):
    for results in (results_r2, results_r4):
        replicas = len(results)
        model = _wide_model()
        padded = math.ceil(sum(p.numel() for p in model.parameters()) / replicas) * replicas
        record = {f: RecordLayout.for_length(padded // replicas, bits=FORMATS[f].bits).nbytes for f in FORMATS}
        share = (replicas - 1) / replicas
        expected = {
            ("fp32", "reduce_scatter"): share * 4 * padded + share * 4 * padded,  # reduce-scatter + all-gather
            ("fp32", "all_reduce"): 2 * share * 4 * padded,
            ("bf16", "reduce_scatter"): share * 2 * padded + share * 4 * padded,  # the start point: fp32
            ("bf16", "all_reduce"): 2 * share * 2 * padded,
        }
        for quantized in ("int8", "fp8", "int4", "int2"):
            for strategy in STRATEGIES:  # all-to-all of R records, all-gather of R records
                expected[(quantized, strategy)] = 2 * share * replicas * record[quantized]
        for per_rank in results:
            for key, wire in expected.items():
                sent = per_rank["bytes"][key]["sent"]
                assert sent == [int(wire) + _norm_bytes(model, replicas)] * 2, (replicas, key, sent)
            for strategy in STRATEGIES:
                fp32, int8 = (per_rank["bytes"][(d, strategy)]["sent"][-1] for d in ("fp32", "int8"))
                assert int8 <= 0.27 * fp32, (replicas, strategy, int8 / fp32)


def test_state_bytes_match_memory_formula(results_r2, results_r4):
    """2Ψ/S + 2Ψ/N (reduce_scatter) or 3Ψ/S (all_reduce) fp32 words, plus a float64 per tensor; int8 and
    fp8 add the residuals: Ψ/S for the displacement and Ψ/N for what the owner gathers."""
    for results in (results_r2, results_r4):
        replicas = len(results)
        model = _wide_model()
        padded = math.ceil(sum(p.numel() for p in model.parameters()) / replicas) * replicas
        tensors = len(list(model.parameters()))
        for per_rank in results:
            for (comm_dtype, strategy), got in per_rank["bytes"].items():
                words = 2 * padded + 2 * padded // replicas if strategy == "reduce_scatter" else 3 * padded
                if comm_dtype in FORMATS:
                    words += padded + padded // replicas
                assert got["state"] == 4 * words + 8 * tensors + got["index_bytes"], (comm_dtype, strategy)


# ---- CO2OSS, S = 2 x R = 2 ---------------------------------------------------------------------------

SHARDED = {
    "oss-int8-overlap-reducescatter": dict(
        config={**NESTEROV, "tau": 2, "gap_penalty": ADAPTIVE, "collective": "reduce_scatter", "comm_dtype": "int8"},
        steps=8, model="uneven", optimizer="adam",
    ),
    "oss-fp8-blocking-allreduce": dict(
        config={**HEAVY_BALL, "overlap": False, "tau": 3, "gap_penalty": {"mode": "none"},
                "collective": "all_reduce", "comm_dtype": "fp8"},
        steps=9, model="uneven",
    ),
    "oss-int8-defaults-reducescatter": dict(
        config={"tau": 2, "collective": "reduce_scatter", "comm_dtype": "int8"}, steps=8, model="uneven",
    ),
}  # fmt: skip


def train_sharded(rank: int, world: int, shards: int, scenarios: Optional[dict] = None) -> dict:
    from co2_zero.fairscale import CO2OSS, ShardedDataParallel

    replica, shard = divmod(rank, shards)
    results = {}
    for name, sc in (scenarios or SHARDED).items():
        model = models.make_model(sc["model"])
        probe = models.make_optimizer(sc.get("optimizer", "sgd"), [torch.zeros(1, requires_grad=True)])
        opt = CO2OSS(model.parameters(), optim=type(probe), co2={**sc["config"], "shards_per_replica": shards},
                     **probe.defaults)  # fmt: skip
        net = ShardedDataParallel(model, opt, process_group=opt.group, broadcast_buffers=False)
        starts = [_snapshot(model)]
        for step in range(sc["steps"]):
            x, y = models.shard_batch(replica, shard, step, shards)
            opt.zero_grad()
            models.loss_fn(net(x), y).backward()
            opt.step()
            if opt.round_ended:
                starts.append(_snapshot(model))
        results[name] = {"starts": starts, "segments": [tuple(s) for s in opt.engine.layout.segments]}
        opt.finalize()
    return results


@pytest.fixture(scope="module")
def results_sharded():
    pytest.importorskip("co2_zero.fairscale")
    return run_ranks(train_sharded, 4, 2, timeout=300.0)


@pytest.mark.parametrize("name", list(SHARDED))
def test_fairscale_two_shards_match_reference(results_sharded, name):
    """The partitions are OSS's buckets: the reference quantizes each shard's partition as laid out there."""
    check_sharded(results_sharded, name, SHARDED[name], _reference)


def check_sharded(results_sharded: list, name: str, sc: dict, reference) -> None:
    """Every rank's round starts against `reference(sc, replicas, partitions, shards)`'s, the partitions
    those of replica 0's ranks; the shards of a replica (every rank, at the shared start) agree."""
    shards = 2
    names = [n for n, _ in models.make_model(sc["model"]).named_parameters()]
    partitions = [  # rank `shard` is (replica 0, shard); every replica lays its partition out alike
        [
            (names[tensor_id], offset, offset + end - start)
            for tensor_id, start, end, offset in per_rank[name]["segments"]
        ]
        for per_rank in results_sharded[:shards]
    ]
    assert all(partitions) and sum(len(p) for p in partitions) == len(names)
    starts, _ = reference(sc, len(results_sharded) // shards, partitions, shards)
    for rank, per_rank in enumerate(results_sharded):
        got, replica = per_rank[name]["starts"], rank // shards
        assert len(got) == len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
        for t, (a, e) in enumerate(zip(got, starts)):
            assert_close(a, e[replica], f"{name} rank {rank} round-{t} start")
        same = results_sharded[replica * shards if not _shared_start(sc) else 0][name]["starts"]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got, same) for k in a)  # the shards of a replica agree


# ---- convergence: the training script's default model, 2 ranks ----------------------------------------


def _train_lm(tmp_path: Path, comm_dtype: str) -> dict:
    out = tmp_path / f"{comm_dtype}.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        # the defaults (the local stand-in)
        str(ROOT / "scripts" / "train_lm.py"), "--method", "co2", "--comm_dtype", comm_dtype,
        "--max_steps", "96", "--eval_every", "0", "--eval_batches", "8", "--data_bytes", "1000000",
        "--no_progress", "--out_json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return next(r for r in records if r.get("summary"))


def test_int8_converges_like_fp32_on_the_training_script(tmp_path):
    fp32, int8 = _train_lm(tmp_path, "fp32"), _train_lm(tmp_path, "int8")
    assert int8["args"]["tau"] == fp32["args"]["tau"] and int8["steps"] == fp32["steps"] == 96
    assert fp32["val_loss"] < fp32["initial_val_loss"] - 1.0  # it trained
    assert abs(int8["val_loss"] - fp32["val_loss"]) <= 0.02 * fp32["val_loss"], (int8["val_loss"], fp32["val_loss"])
