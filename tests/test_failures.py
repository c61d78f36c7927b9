"""Failures end with a clear error, never a hang: dead or stuck peers, mismatched ranks, bad numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from co2_zero import CO2Config, CO2Error, CO2Optimizer, CO2TimeoutError, NonFiniteError, checkpoint
from co2_zero.topology import Topology
from tests import models
from tests.dist_utils import launch_ranks, run_ranks

TIMEOUT_S = 4.0


def _train(rank: int, opt: CO2Optimizer, model: torch.nn.Module, steps: int, before_step=None) -> None:
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()


def peer_lost(rank: int, world: int, how: str) -> dict:
    """Rank 1 dies (or hangs) before the first round end; rank 0 must fail within the deadline."""
    model = models.make_model("mlp")
    config = CO2Config(tau=2, timeout_s=TIMEOUT_S, outer_momentum=0.5)
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config)
    if rank == 1:
        _train(rank, opt, model, 1)
        if how == "exit":
            os._exit(0)
        time.sleep(3 * TIMEOUT_S)  # alive but never reaching the round end
        os._exit(0)
    began = time.monotonic()
    try:
        _train(rank, opt, model, 40)
    except CO2Error as error:
        return {"error": error, "elapsed": time.monotonic() - began}
    return {"error": None, "elapsed": time.monotonic() - began}


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_lost_peer_fails_within_timeout_naming_round_and_group(how):
    result = run_ranks(peer_lost, 2, how, allow_exit=(1,), timeout=60)[0]
    error = result["error"]
    assert isinstance(error, CO2Error), f"rank 0 finished 40 steps without noticing its peer: {result}"
    message = str(error)
    assert "round 0" in message and "outer group" in message and "[0, 1]" in message, message
    if how == "hang":
        assert isinstance(error, CO2TimeoutError) or "timed out" in message.lower() or "timeout" in message.lower()
    assert result["elapsed"] < TIMEOUT_S + 6.0, result


def misconfigured(rank: int, world: int) -> dict:
    """Each case raises on every rank at start-up (or at the round after a bad one)."""
    out = {}

    def attempt(name, build_and_train):
        try:
            build_and_train()
            out[name] = None
        except (CO2Error, ValueError) as error:
            out[name] = error

    def different_tau():
        model = models.make_model("mlp")
        CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config(tau=2 + rank))

    def different_model():
        model = models.make_model("mlp" if rank == 0 else "uneven")
        CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config())

    def shards_do_not_divide():
        Topology.build(CO2Config(shards_per_replica=3))

    def different_shards():  # "node" read on nodes of different sizes
        began = time.monotonic()
        try:
            Topology.build(CO2Config(shards_per_replica=1 + rank, timeout_s=TIMEOUT_S))
        finally:
            out["different_shards_s"] = time.monotonic() - began

    def nonfinite(policy, collective="auto"):
        def run():
            model = models.make_model("mlp")
            config = CO2Config(tau=2, nonfinite=policy, collective=collective)
            opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config)

            def poison(step):
                if rank == 1 and step == 1:
                    with torch.no_grad():
                        next(model.parameters())[0, 0] = float("nan")

            _train(rank, opt, model, 8, before_step=poison)
            opt.finalize()
            out[f"{policy}-params"] = {n: p.detach().clone() for n, p in model.named_parameters()}

        return run

    attempt("different_tau", different_tau)
    attempt("different_model", different_model)
    attempt("shards_do_not_divide", shards_do_not_divide)
    attempt("different_shards", different_shards)
    attempt("nonfinite_raise", nonfinite("raise"))  # gloo: all_reduce
    attempt("nonfinite_raise_reduce_scatter", nonfinite("raise", "reduce_scatter"))
    attempt("nonfinite_skip", nonfinite("skip_round"))
    return out


@pytest.fixture(scope="module")
def misconfigured_results():
    return run_ranks(misconfigured, 2, timeout=120)


def test_ranks_with_different_configs_fail_naming_the_field(misconfigured_results):
    for rank, result in enumerate(misconfigured_results):
        error = result["different_tau"]
        mine, theirs = 2 + rank, 3 - rank
        assert isinstance(error, CO2Error) and f"tau={mine} here vs {theirs}" in str(error), error


def test_ranks_with_different_models_fail_at_start(misconfigured_results):
    for result in misconfigured_results:
        error = result["different_model"]
        assert isinstance(error, CO2Error) and "shape signature" in str(error), error


def test_shards_that_do_not_divide_the_world_are_rejected(misconfigured_results):
    for result in misconfigured_results:
        error = result["shards_do_not_divide"]
        assert isinstance(error, ValueError) and "shards_per_replica=3" in str(error), error


def test_different_shards_per_replica_fail_naming_the_field_before_any_group(misconfigured_results):
    for rank, result in enumerate(misconfigured_results):
        error = result["different_shards"]
        assert isinstance(error, CO2Error), error
        assert f"shards_per_replica={1 + rank} here vs {2 - rank}" in str(error), error
        assert result["different_shards_s"] < TIMEOUT_S, result["different_shards_s"]


def never_builds(rank: int, world: int) -> dict:
    """Rank 1 never constructs the optimizer; rank 0 must fail naming the start-up check, in time."""
    if rank == 1:
        time.sleep(TIMEOUT_S + 3.0)
        os._exit(0)
    began = time.monotonic()
    model = models.make_model("mlp")
    try:
        CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config(timeout_s=TIMEOUT_S))
    except CO2Error as error:
        return {"error": error, "elapsed": time.monotonic() - began}
    return {"error": None, "elapsed": time.monotonic() - began}


def test_rank_that_never_builds_the_optimizer_fails_the_others_in_time():
    result = run_ranks(never_builds, 2, allow_exit=(1,), timeout=60)[0]
    error = result["error"]
    assert isinstance(error, CO2TimeoutError), result
    assert "start-up check" in str(error) and "[0, 1]" in str(error), error
    assert result["elapsed"] < TIMEOUT_S + 5.0, result


@pytest.mark.parametrize("case", ["nonfinite_raise", "nonfinite_raise_reduce_scatter"])
def test_nonfinite_displacement_raises_naming_round_and_replica(misconfigured_results, case):
    for result in misconfigured_results:
        error = result[case]
        assert isinstance(error, NonFiniteError), error
        assert "round 0" in str(error) and "replica(s) [1]" in str(error), error


def test_nonfinite_skip_round_keeps_replicas_consistent(misconfigured_results):
    assert all(r["nonfinite_skip"] is None for r in misconfigured_results)
    first, second = (r["skip_round-params"] for r in misconfigured_results)
    for name, value in first.items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, second[name]), name


def killed_mid_round(rank: int, world: int, root: str) -> str:
    """Checkpoint at the round end after step 6; rank 1 then dies by SIGKILL in the middle of round 2."""
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), CO2Config(tau=3, timeout_s=TIMEOUT_S))

    def die_or_save(step):
        if step == 6:
            checkpoint.save(root, model, opt, extra={"step": 6})
        if rank == 1 and step == 8:
            os.kill(os.getpid(), signal.SIGKILL)

    _train(rank, opt, model, 60, before_step=die_or_save)
    return "rank 0 trained on without its peer"


def resume_after_kill(rank: int, world: int, root: str) -> dict:
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), CO2Config(tau=3, timeout_s=TIMEOUT_S))
    step = checkpoint.load(root, model, opt)["step"]
    for k in range(step, step + 6):
        x, y = models.batch(rank, k)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
    opt.finalize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sigkill_mid_round_fails_the_others_and_keeps_the_checkpoint(tmp_path):
    outcomes = launch_ranks(killed_mid_round, 2, str(tmp_path), timeout=120)
    survivor, killed = outcomes
    assert killed.exitcode == -signal.SIGKILL, killed
    assert survivor.exitcode not in (0, None), f"rank 0 did not fail: {survivor}"
    error = survivor.error
    assert "CO2Error" in error and "round 2" in error and "outer group" in error, error
    assert survivor.ended_at - killed.ended_at < TIMEOUT_S + 10.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["co2_rank00000.pt", "co2_rank00001.pt"]  # no temp files
    first, second = run_ranks(resume_after_kill, 2, str(tmp_path), timeout=120)
    for name, value in first.items():
        assert torch.isfinite(value).all() and torch.equal(value, second[name]), name


def test_ctrl_c_stops_every_rank(tmp_path):
    """SIGINT to the whole launch (what a terminal's Ctrl-C does) ends torchrun and every worker."""
    marker = f"co2-ctrl-c-{os.getpid()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), str(Path(__file__).parent / "workers" / "co2_forever.py"), marker]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launch.stdout), daemon=True)
    reader.start()
    began = time.monotonic()
    while not any("round 5" in line for line in lines):
        assert launch.poll() is None, "".join(lines)
        assert time.monotonic() - began < 90, "workers did not start training"
        time.sleep(0.1)
    os.killpg(launch.pid, signal.SIGINT)
    try:
        launch.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        pytest.fail("ranks still running 30 s after Ctrl-C")
    assert launch.returncode != 0
    leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"workers left running: {leftovers}"
