"""CO2Optimizer on real gloo processes against the independent single-process reference.

All scenarios of one world size run in one spawn (process start-up dominates the cost); each test
then checks one property of the recorded results.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from co2_zero import CO2Optimizer
from tests import models
from tests.compare import assert_close
from tests.dist_utils import run_ranks
from tests.reference import replica_round_starts, resolve_config, simulate, stand_in_words
from tests.scenarios import co2

SCENARIOS_R2 = {
    "overlap-heavyball-adaptive-allreduce": dict(config=co2("overlap-heavyball-adaptive-allreduce-t3"), steps=13),
    "overlap-heavyball-adaptive-reducescatter": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t3"), steps=13
    ),
    "overlap-nesterov-constant-clipvalue": dict(
        config=co2("overlap-shared-nesterov-constant2.0-clipvalue-reducescatter-t2"),
        steps=10,
        optimizer="adam",
    ),
    "overlap-tau1-none-clipnorm-perturbed-init": dict(
        config=co2("overlap-shared-lr1.0-m0.3-nopenalty-clipnorm-allreduce-t1"),
        steps=7,
        perturbed_init=True,
    ),
    "overlap-adaptive-clipnorm-uneven": dict(
        config=co2("overlap-shared-nesterov-adaptive-clipnorm-reducescatter-t2"),
        steps=9,
        model="uneven",
    ),
    "blocking-heavyball-adaptive-clipnorm": dict(
        config=co2("blocking-shared-heavyball-adaptive-clipnorm-reducescatter-t3"),
        steps=12,
    ),
    "blocking-diloco-allreduce": dict(
        config=co2("blocking-nesterov-nopenalty-allreduce-t2"),
        steps=8,
        optimizer="adam",
    ),
    "localsgd": dict(
        config=co2("blocking-localsgd-nopenalty-reducescatter-t3"),
        steps=9,
    ),
    "overlap-batchnorm-buffers": dict(
        config=co2("overlap-heavyball-adaptive-allreduce-t2"),
        steps=6,
        model="bn",
    ),
    "overlap-slow-collective": dict(
        config=co2("overlap-heavyball-adaptive-allreduce-t2"),
        steps=8,
        slow=0.3,
    ),
    # CO2Config's defaults but tau (the local stand-in, Nesterov 0.9, outer lr 0.5, no penalty; "auto"
    # measures in rounds 0-4, applying at the round end: 4 rounds here)
    "defaults": dict(config=co2("defaults-t3"), steps=13),
    # the local stand-in clips its own step as the outer step clips m (all_reduce: gloo's `auto`)
    "defaults-clipnorm": dict(config=co2("defaults-clipnorm-t3"), steps=13),
    "local-nesterov-constant-clipvalue-allreduce": dict(
        config=co2("overlap-nesterov-constant2.0-clipvalue-allreduce-t2"),
        steps=10,
        optimizer="adam",
    ),
    "local-heavyball-adaptive-clipnorm-allreduce-uneven": dict(
        config=co2("overlap-heavyball-adaptive-clipnorm-allreduce-t2"),
        steps=9,
        model="uneven",
    ),
}

SCENARIOS_R4 = {
    "r4-overlap-nesterov-adaptive-clipnorm-reducescatter": dict(
        config=co2("overlap-shared-nesterov-adaptive-clipnorm-reducescatter-t2"),
        steps=8,
        model="uneven",
    ),
    "r4-overlap-heavyball-clipvalue-allreduce": dict(
        config=co2("overlap-shared-heavyball-adaptive-clipvalue-allreduce-t3"),
        steps=9,
    ),
    "r4-local-heavyball-adaptive-clipvalue": dict(
        config=co2("overlap-heavyball-adaptive-clipvalue-t3"),
        steps=9,
    ),
    "r4-blocking-slowmo": dict(
        config=co2("blocking-heavyball-constant1.5-reducescatter-t2"),
        steps=6,
    ),
}


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


def run_scenario(rank: int, sc: dict) -> dict:
    """Train one scenario on this rank; record start points and what happened between them."""
    model = models.make_model(sc.get("model", "mlp"))
    if sc.get("perturbed_init") and rank > 0:  # CO2 must start every replica from replica 0's x_0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * rank)
    inner = models.make_optimizer(sc.get("optimizer", "sgd"), model.parameters())
    opt = CO2Optimizer(inner, sc["config"], model=model)

    starts = [_snapshot(model)]  # parameters and buffers at every round start
    after_inner: list = []
    checks = {"live_changed": 0, "in_flight": 0}
    last_inner: dict = {}

    def pre_hook(optimizer, args, kwargs):  # nothing may touch the live parameters between steps
        if "flat" in last_inner and not torch.equal(last_inner["flat"], opt.flat_params):
            checks["live_changed"] += 1

    def post_hook(optimizer, args, kwargs):
        last_inner["flat"] = opt.flat_params.clone()
        after_inner.append({n: p.detach().clone() for n, p in model.named_parameters()})

    inner.register_step_pre_hook(pre_hook)
    inner.register_step_post_hook(post_hook)
    for step in range(sc["steps"]):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        if opt.round_ended:
            starts.append(_snapshot(model))
            last_inner.pop("flat")  # a round end may (must) change the live parameters
            pending = opt.engine.pending_round
            checks["in_flight"] += int(pending is not None and not pending.done())
    bytes_held = opt.co2_state_bytes()
    opt.finalize()
    return {
        "starts": starts,
        "final": _snapshot(model),
        "after_inner": after_inner,
        "bytes": bytes_held,
        "index_bytes": opt.engine.exchange.index_bytes,
        "strategy": opt.engine.exchange.strategy,
        **checks,
    }


def train_scenarios(rank: int, world: int, scenarios: dict) -> dict:
    """Child process: every scenario in turn; `slow` ones get a deliberately slow collective."""
    import co2_zero.core.comm

    original_average = co2_zero.core.comm.OuterExchange._average
    results = {}
    for name, sc in scenarios.items():
        delay = sc.get("slow", 0.0)

        def slow_average(self, *args, _delay=delay):
            time.sleep(_delay)
            return original_average(self, *args)

        co2_zero.core.comm.OuterExchange._average = slow_average if delay else original_average
        results[name] = run_scenario(rank, sc)
    co2_zero.core.comm.OuterExchange._average = original_average
    return results


def _reference(sc: dict, replicas: int):
    """(per round start, every replica's parameters there: the shared start, or its stand-in; finals)."""
    shared: list = []
    steps: list = []
    model_kind, opt_kind = sc.get("model", "mlp"), sc.get("optimizer", "sgd")
    finals = simulate(
        lambda: models.make_model(model_kind),
        lambda params: models.make_optimizer(opt_kind, params),
        models.batch,
        models.loss_fn,
        sc["config"],
        replicas=replicas,
        steps=sc["steps"],
        record=shared,
        step_record=steps,
    )
    return replica_round_starts(shared, steps, sc["config"]["tau"]), finals


@pytest.fixture(scope="module")
def results_r2():
    return run_ranks(train_scenarios, 2, SCENARIOS_R2)


@pytest.fixture(scope="module")
def results_r4():
    return run_ranks(train_scenarios, 4, SCENARIOS_R4)


def _check_against_reference(results, scenarios, name):
    sc = scenarios[name]
    starts, finals = _reference(sc, len(results))
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert len(got["starts"]) == len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
        for t, (a, e) in enumerate(zip(got["starts"], starts)):
            assert_close(a, e[rank], f"{name} rank {rank} round-{t} start")
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final")


@pytest.mark.parametrize("name", list(SCENARIOS_R2))
def test_two_replicas_match_reference(results_r2, name):
    _check_against_reference(results_r2, SCENARIOS_R2, name)


@pytest.mark.parametrize("name", list(SCENARIOS_R4))
def test_four_replicas_match_reference(results_r4, name):
    _check_against_reference(results_r4, SCENARIOS_R4, name)


def test_replicas_identical_at_every_round_start(results_r2, results_r4):
    """As published (the shared start) at every round start; with a stand-in (the defaults' `local`) the
    replicas start rounds apart by design (design §3); every replica ends with one model."""
    for results, scenarios in ((results_r2, SCENARIOS_R2), (results_r4, SCENARIOS_R4)):
        for name, sc in scenarios.items():
            shared = resolve_config(sc["config"])["stand_in"] == "shared"
            for other in results[1:]:
                for a, b in zip(results[0][name]["starts"], other[name]["starts"]) if shared else []:
                    assert all(torch.equal(a[k], b[k]) for k in a), name
                assert all(torch.equal(results[0][name]["final"][k], v) for k, v in other[name]["final"].items())


def test_local_sgd_start_points_are_exact_replica_averages(results_r2):
    tau = SCENARIOS_R2["localsgd"]["config"]["tau"]
    per_rank = [r["localsgd"] for r in results_r2]
    rounds = len(per_rank[0]["starts"]) - 1
    assert rounds == 3
    for t in range(rounds):
        ends = [r["after_inner"][(t + 1) * tau - 1] for r in per_rank]
        for key in ends[0]:
            mean = torch.stack([e[key] for e in ends]).mean(0)
            torch.testing.assert_close(per_rank[0]["starts"][t + 1][key], mean, rtol=1e-6, atol=1e-7)


def test_live_parameters_only_change_at_round_ends(results_r2):
    for rank in results_r2:
        slow = rank["overlap-slow-collective"]
        assert slow["in_flight"] >= 3, "the slow pipeline should still be running after round ends"
        for name in SCENARIOS_R2:
            assert rank[name]["live_changed"] == 0, name


def test_state_bytes_match_memory_formula(results_r2, results_r4):
    for results, scenarios in ((results_r2, SCENARIOS_R2), (results_r4, SCENARIOS_R4)):
        replicas = len(results)
        for name, sc in scenarios.items():
            model = models.make_model(sc.get("model", "mlp"))
            psi = sum(p.numel() for p in model.parameters())
            tensors = len(list(model.parameters()))
            padded = math.ceil(psi / replicas) * replicas
            got = results[0][name]
            if got["strategy"] == "reduce_scatter":  # 2Ψ/S + 2Ψ/N, S = 1
                words = 2 * padded + 2 * padded // replicas
            else:  # all_reduce: both partition buffers and a full-partition momentum
                words = 3 * padded
            words += stand_in_words(sc["config"], got["strategy"], padded)
            # plus the outer step's segment index (its size is tested in test_outer_kernels.py)
            assert got["bytes"] == 4 * words + 8 * tensors + got["index_bytes"], name


def test_finalize_ends_the_co2_groups_threads(tmp_path):
    """After finalize() no thread of a CO2 group is alive, though the optimizer is still referenced and
    nothing is garbage-collected: threads left to interpreter shutdown can abort the process (design §8)."""
    root = Path(__file__).resolve().parents[2]
    worker = root / "tests" / "workers" / "groups_after_finalize.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*launcher, str(worker), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)} == {0: [], 1: []}
