"""Elastic training (docs/design.md §12): replicas that die and come back while the others train on.

Real processes: a torchft Lighthouse, and one process per replica group (each its own world of one
rank, as one torchrun per replica launches it). Replicas SIGKILL themselves at a chosen point, so a
failure lands exactly mid-round or mid-exchange; the test restarts them. The survivors' parameters
are compared with the reference simulation run with the membership schedule they recorded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import models
from tests.reference import simulate

pytest.importorskip("torchft", reason="the elastic extra (torchft) is not installed")

TAU = 4
STEP_SLEEP_S = 0.03  # paces the replicas so that a restarted one finds the job still running
HEARTBEAT_TIMEOUT_MS = 3000
CONFIG = {"tau": TAU, "outer_lr": 0.7, "outer_momentum": 0.5, "timeout_s": 90.0}  # generous: 2 cores shared by many


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _lighthouse() -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse binary on an ephemeral port; returns the process and its address."""
    port = _free_port()
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    process = subprocess.Popen(
        [
            str(binary),
            "--bind",
            f"[::]:{port}",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "60000",
            "--quorum_tick_ms",
            "50",
            "--heartbeat_timeout_ms",
            str(HEARTBEAT_TIMEOUT_MS),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://localhost:{port}"


def replica_main(replica: int, lighthouse: str, out: str, steps: int, plan: dict) -> None:
    """One replica group of one rank: train `steps` inner steps (from where the job is when it joins),
    record every round's start point, its membership history and the final parameters in `out`.
    plan["die"]: ("round", t) SIGKILLs itself mid-round t (its exchange of round t - 1 done);
    ("exchange", t) when its exchange of round t starts, before any collective. plan["gate"]:
    (t, path): before round t, wait for `path` to exist. plan["announce"]: a path to create once
    imported (a restarted replica tells the survivors it is about to join)."""
    die = plan.get("die")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from co2_zero import CO2Config, CO2Error, CO2Optimizer
    from co2_zero.elastic import ElasticExchange, Membership

    port = _free_port()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://localhost:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    if die is not None and die[0] == "exchange":
        average = ElasticExchange._average

        def dying_average(self, work, g_buffer):
            if self.round_index == die[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return average(self, work, g_buffer)

        ElasticExchange._average = dying_average
    if plan.get("announce"):
        Path(plan["announce"]).touch()
    model = models.make_model("mlp")
    membership = Membership(lighthouse, replica, start_replicas=plan.get("start_replicas", 3))
    config = CO2Config(**{**CONFIG, "timeout_s": plan.get("timeout_s", CONFIG["timeout_s"])})
    try:
        opt = CO2Optimizer(models.make_optimizer("adam", model.parameters()), config, model, membership=membership)
        result = _train(replica, opt, model, membership, steps, plan)
    except CO2Error as error:
        result = {"error": str(error), "error_at": time.time()}
    torch.save(result, f"{out}.tmp")
    os.replace(f"{out}.tmp", out)
    dist.destroy_process_group()


def _train(replica: int, opt: Any, model: torch.nn.Module, membership: Any, steps: int, plan: dict) -> dict:
    """The training loop of `replica_main`; returns what the test reads."""
    die, gate, reached = plan.get("die"), plan.get("gate"), plan.get("reached")
    starts = {opt.engine.rounds: opt.flat_params.clone()}
    joined_at = opt.engine.rounds
    stalls = []
    step = opt.engine.inner_steps
    while step < steps:
        if die is not None and die[0] == "round" and step == die[1] * TAU + TAU // 2:
            opt.engine.pending_round.result(timeout=30)
            os.kill(os.getpid(), signal.SIGKILL)
        if reached is not None and step == reached[0] * TAU:
            Path(reached[1]).touch()
        if gate is not None and step == gate[0] * TAU:
            deadline = time.monotonic() + 300
            while not Path(gate[1]).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        x, y = models.batch(replica, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        step += 1
        if opt.round_ended:
            starts[opt.engine.rounds] = opt.flat_params.clone()
            stalls.append(opt.last_round["round_end_s"])
        # Past the gate, wait for the restarted replica (slowly, no extra steps) until it is in the quorum.
        waiting = gate is not None and step >= gate[0] * TAU and len(membership.history[-1].replicas) < 3
        time.sleep(1.0 if waiting else STEP_SLEEP_S)
    history = [(r.round, r.replicas, r.contributors, r.committed) for r in membership.history]
    opt.finalize()
    return {
        "starts": starts,
        "final": opt.flat_params.clone(),
        "history": history,
        "changes": list(membership.changes),
        "joined_at": joined_at,
        "stalls": stalls,
    }


class Job:
    """A Lighthouse and replica processes in a temporary directory; everything is killed at the end."""

    def __init__(self, tmp_path: Path, steps: int) -> None:
        self.tmp, self.steps = tmp_path, steps
        self.lighthouse, self.address = _lighthouse()
        self.processes: list[Any] = []
        self.ctx = torch.multiprocessing.get_context("spawn")

    def start(self, replica: int, tag: str = "", **plan: Any) -> Any:
        out = str(self.tmp / f"replica{replica}{tag}.pt")
        process = self.ctx.Process(target=replica_main, args=(replica, self.address, out, self.steps, plan))
        process.start()
        self.processes.append(process)
        return process

    def result(self, replica: int, tag: str = "") -> dict:
        return torch.load(self.tmp / f"replica{replica}{tag}.pt", weights_only=False)

    def wait(self, processes: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        assert all(p.exitcode is not None for p in processes), f"replicas still running after {timeout:.0f} s"

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        self.lighthouse.kill()
        self.lighthouse.wait()


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[Job] = []

    def make(steps: int) -> Job:
        jobs.append(Job(tmp_path, steps))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def _schedule(history: list[tuple], rounds: int) -> list:
    """The reference's schedule from a replica's history: contributors per round, None when cut."""
    schedule: list = [None] * rounds
    for round_index, _replicas, contributors, committed in history:
        if round_index < rounds:
            schedule[round_index] = set(contributors) if committed else None
    return schedule


def _reference_final(schedule: list, joins: list[tuple[int, int]], steps: int) -> torch.Tensor:
    out = simulate(
        lambda: models.make_model("mlp"),
        lambda params: models.make_optimizer("adam", params),
        models.batch,
        models.loss_fn,
        {k: v for k, v in CONFIG.items() if k != "timeout_s"},
        replicas=3,
        steps=steps,
        schedule=schedule,
        joins=joins,
    )
    return torch.cat([v.reshape(-1) for k, v in out[0].items()])


def test_three_replicas_without_failures_match_the_reference(job_factory):
    steps = 6 * TAU
    job = job_factory(steps)
    processes = [job.start(r) for r in range(3)]
    job.wait(processes, timeout=240)
    results = [job.result(r) for r in range(3)]
    assert results[0]["history"] == results[1]["history"] == results[2]["history"]
    for r in (1, 2):
        assert torch.equal(results[r]["final"], results[0]["final"])
        for t, start in results[0]["starts"].items():
            assert torch.equal(results[r]["starts"][t], start), f"round {t} starts differ on replica {r}"
    schedule = _schedule(results[0]["history"], steps // TAU)
    assert all(s == {0, 1, 2} for s in schedule), schedule
    torch.testing.assert_close(results[0]["final"], _reference_final(schedule, [], steps), rtol=1e-5, atol=1e-6)


def _assert_identical_round_starts(results: list[dict], first_round: int = 0) -> None:
    """Every replica's start point of every round it trained equals replica 0's, bit for bit."""
    for r, result in enumerate(results[1:], 1):
        for t, start in result["starts"].items():
            if t >= first_round:
                assert torch.equal(start, results[0]["starts"][t]), f"round {t} starts differ on replica {r}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["round", "exchange"])
def test_a_killed_replica_is_survived_then_rejoins(job_factory, tmp_path, where):
    """Replica 2 is SIGKILLed mid-round 4 (its exchange of round 3 done) or as its exchange of round 4
    starts. Replicas 0 and 1 go on without restarting; a cut exchange is skipped by both. Replica 2 is
    then restarted, joins at a round end from a live peer and is identical from its first round. The
    parameters equal the reference simulation with the recorded membership schedule."""
    rounds, killed_round = 14, 4
    job = job_factory(rounds * TAU)
    joining = str(tmp_path / "joining")
    survivors = [job.start(r, gate=(8, joining)) for r in (0, 1)]
    victim = job.start(2, die=(where, killed_round))
    job.wait([victim], timeout=300)
    assert victim.exitcode == -signal.SIGKILL
    rejoined = job.start(2, tag="b", announce=joining, start_replicas=2)  # never a job of its own
    job.wait([*survivors, rejoined], timeout=300)
    results = [job.result(0), job.result(1), job.result(2, tag="b")]

    history = results[0]["history"]
    assert results[1]["history"] == history
    _assert_identical_round_starts(results[:2])
    joined_at = results[2]["joined_at"]
    _assert_identical_round_starts([results[0], results[2]], first_round=joined_at)
    assert torch.equal(results[2]["final"], results[0]["final"]) and torch.equal(
        results[1]["final"], results[0]["final"]
    )

    schedule = _schedule(history, rounds)
    assert schedule[:killed_round] == [{0, 1, 2}] * killed_round, schedule
    if where == "exchange":  # the victim's exchange of round 4 never started: both survivors cut it
        assert schedule[killed_round] is None, schedule
    else:
        assert schedule[killed_round] == {0, 1}, schedule
    assert schedule[joined_at - 1] == {0, 1} and schedule[joined_at:] == [{0, 1, 2}] * (rounds - joined_at), schedule
    assert results[0]["changes"] == [
        f"replicas 3 -> 2 at round {killed_round + (where == 'exchange')}",
        f"replicas 2 -> 3 at round {joined_at - 1}",
    ], results[0]["changes"]
    stall = max(results[0]["stalls"])
    assert stall < 10.0, f"the survivors stalled {stall:.1f} s at a round end after the failure"
    expected = _reference_final(schedule, [(2, joined_at)], rounds * TAU)
    torch.testing.assert_close(results[0]["final"], expected, rtol=1e-5, atol=1e-6)


def test_a_replica_that_cannot_reach_the_lighthouse_fails_within_timeout(job_factory):
    job = job_factory(4 * TAU)
    job.address = f"http://localhost:{_free_port()}"  # nothing listens there
    began = time.time()
    job.wait([job.start(0, timeout_s=5.0)], timeout=180)
    result = job.result(0)
    assert "error" in result, "the replica trained without a Lighthouse"
    assert "Lighthouse" in result["error"] and "timeout_s=5" in result["error"], result["error"]
    assert result["error_at"] - began < 5.0 + 60.0  # process start-up (imports) under load, plus timeout_s


# the replicas' timeout_s in the dead Lighthouse test, which waits it out once after the kill: long enough
# for their start-up quorum under load
DEAD_LIGHTHOUSE_TIMEOUT_S = 10.0


@pytest.mark.slow
def test_a_dead_lighthouse_fails_the_next_round_end_within_timeout(job_factory, tmp_path):
    job = job_factory(12 * TAU)
    go = str(tmp_path / "go")
    replicas = [
        job.start(
            r,
            start_replicas=2,
            timeout_s=DEAD_LIGHTHOUSE_TIMEOUT_S,
            reached=(3, str(tmp_path / f"at{r}")),
            gate=(3, go),
        )
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"at{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    job.lighthouse.kill()
    job.lighthouse.wait()
    killed = time.time()
    Path(go).touch()
    job.wait(replicas, timeout=120)
    for r in (0, 1):
        result = job.result(r)
        assert "error" in result, f"replica {r} went on without its Lighthouse"
        assert "no quorum from the Lighthouse" in result["error"], result["error"]
        assert result["error_at"] - killed < DEAD_LIGHTHOUSE_TIMEOUT_S + 5.0, result["error_at"] - killed
