"""Elastic faults that would end with replicas holding different models (issue 37): two live launches of
one replica_id, a replica frozen (SIGSTOP) in its exchange longer than timeout_s.

Real processes, as tests/elastic/test_elastic.py runs them (its Job: a torchft Lighthouse and one process per
replica group); the faults are hooks each replica installs once imported (plan["hooks"]).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from tests.dist_utils import busy_host
from tests.elastic.test_elastic import (  # noqa: F401  (job_factory: the fixture)
    CONFIG,
    HEARTBEAT_TIMEOUT_MS,
    TAU,
    _reference_final,
    _schedule,
    job_factory,
)

pytest.importorskip("torchft", reason="the elastic extra (torchft) is not installed")

HERE = "tests.elastic.test_elastic_faults"


def freeze_in_exchange(round_index: int, seconds: float, resumed: str, until: str = "") -> None:
    """Hook: SIGSTOP this whole process (its heartbeats too) inside its exchange of round `round_index`,
    after the small all-reduce of who contributes (its peers are then inside the average, waiting for
    its data); a helper process sends SIGCONT `seconds` later (given `until`: once that path exists, then
    `seconds`); `resumed` is created once it runs again. The stop is sent to the calling thread (the
    exchange's): a process-directed SIGSTOP is taken by the main thread, and on a loaded host the exchange
    thread ran on for milliseconds, long enough to finish the round's average before the stop landed."""
    from co2_zero import elastic

    original = elastic.ElasticExchange._who_contributes
    wait = f"while [ ! -e {until} ]; do sleep 0.2; done; " if until else ""

    def frozen(self, peers):
        contributors = original(self, peers)
        if self.round_index == round_index:
            subprocess.Popen(["sh", "-c", f"{wait}sleep {seconds}; kill -CONT {os.getpid()}"])
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            Path(resumed).touch()
        return contributors

    elastic.ElasticExchange._who_contributes = frozen


def _told_behind_while_replica_0_goes_on(job) -> dict:
    """Replica 1, frozen past its peers' rounds, left saying it is behind; replica 0 went on: its result."""
    frozen_result = job.result(1)
    error = frozen_result.get("error", "")
    assert "replica 1 is behind its peers" in error and "restart it to rejoin" in error, frozen_result.get("history")
    result = job.result(0)
    assert "error" not in result, result["error"]
    return result


def test_two_launches_of_one_replica_id_are_refused_on_both(job_factory):  # noqa: F811
    """Replica 0, then two launches with replica_id 1. The first quorum that holds both (at the start, or
    when the second joins) is refused on both, naming the id: never a quorum [0, 1, 1] whose average
    sums three displacements and divides by two. Replica 0 goes on alone to the end."""
    job = job_factory(8 * TAU)
    lone = job.start(0, start_replicas=1, replicas=3, step_sleep_s=0.25)
    twins = [*job.start(1, start_replicas=2, replicas=3), *job.start(1, tag="b", start_replicas=2, replicas=3)]
    job.wait([*lone, *twins], timeout=300)
    for tag in ("", "b"):
        error = job.result(1, tag=tag).get("error", "")
        assert "replica_id 1 is used by 2 live launches" in error, (tag, error)
    survivor = job.result(0)
    assert "error" not in survivor, survivor["error"]
    history = survivor["history"]
    duplicated = [record for record in history if len(set(record[1])) < len(record[1])]
    assert all(not committed for *_, committed in duplicated), history  # never an average over a duplicate
    assert history[-1][1] == (0,), history


@pytest.mark.slow
def test_a_replica_frozen_in_its_exchange_longer_than_timeout_s_leaves_and_the_others_go_on(job_factory, tmp_path):  # noqa: F811
    """Replica 1 is frozen (SIGSTOP) inside its exchange of round 2 for longer than timeout_s. Replica 0
    stops waiting for its data once the Lighthouse drops it (the heartbeat timeout, 3 s here), not after
    timeout_s, cuts that round and trains on alone. When replica 1 runs again its peer is rounds ahead:
    it must not take the peer's counters under its training loop (step, LR, data), so it leaves with a
    CO2Error that says it is behind its peers, instead of training on and ending with another model. A
    freeze that outlasts the job: test_a_replica_frozen_until_its_peer_ended_the_job_leaves_saying_so."""
    timeout_s, frozen_round, resumed = 15.0, 2, tmp_path / "resumed"
    job = job_factory(12 * TAU)  # past round 5, replica 0 steps slowly until a quorum holds both: it still
    plan = {"start_replicas": 2, "replicas": 2, "timeout_s": timeout_s}  # trains when replica 1 runs again
    survivor = job.start(0, gate=(5, str(resumed)), **plan)
    hook = (HERE, "freeze_in_exchange", (frozen_round, timeout_s + 4, str(resumed)))
    frozen = job.start(1, hooks=[hook], **plan)
    job.wait([*survivor, *frozen], timeout=300)
    result = _told_behind_while_replica_0_goes_on(job)
    history = result["history"]
    assert [committed for t, _, _, committed in history if t == frozen_round] == [False], history
    after = [(contributors, committed) for t, _, contributors, committed in history if t > frozen_round]
    assert all(contributors == (0,) for contributors, committed in after if committed), history
    stall = max(result["stalls"])
    limit = HEARTBEAT_TIMEOUT_MS / 1000 + 5.0  # the heartbeat timeout, a poll, a quorum on a loaded host
    assert stall < min(limit, timeout_s - 4), f"replica 0 stalled {stall:.1f} s waiting for the frozen replica"


def test_a_replica_frozen_until_its_peer_ended_the_job_leaves_saying_so(job_factory, tmp_path):  # noqa: F811
    """Issue 66: replica 1 is frozen (SIGSTOP) inside its exchange of round 1 until replica 0 has ended the
    job, on a loaded host. Replica 0 goes on alone, with a warning naming the round and the replica it
    lost. Replica 1 then wakes alone in its quorum: it must not train the remaining rounds by itself and
    exit 0 with a second final model of the job; it leaves with a CO2Error saying the job ended without it."""
    rounds, frozen_round, resumed = 6, 1, tmp_path / "resumed"
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": 2, "replicas": 2, "timeout_s": 20.0}
    ended = tmp_path / "replica0_rank0.pt"  # replica 0's result: written after its finalize()
    with busy_host():
        survivor = job.start(0, **plan)
        frozen = job.start(
            1, hooks=[(HERE, "freeze_in_exchange", (frozen_round, 1.0, str(resumed), str(ended)))], **plan
        )
        job.wait([*survivor, *frozen], timeout=300)
    assert resumed.stat().st_mtime >= ended.stat().st_mtime, "replica 1 ran again before replica 0 ended"
    frozen_result = job.result(1)
    error = frozen_result.get("error", "")
    assert "the job ended without replica 1: replica(s) [0]" in error, frozen_result.get("history")
    assert f"at round end {rounds}" in error, error
    result = job.result(0)
    assert "error" not in result, result["error"]
    lost = [w for w in result["warnings"] if "replica 0 lost replica(s) [1]" in w and "goes on with replicas [0]" in w]
    assert len(lost) == 1 and re.search(r"round [12]:", lost[0]), result["warnings"]


def test_a_replica_frozen_while_its_peer_trains_on_leaves_behind_not_as_if_the_job_ended(job_factory, tmp_path):  # noqa: F811
    """Issue 66, the freeze that does not outlast the job, on a loaded host: replica 1 is frozen in its
    exchange of round 1 until replica 0 has trained to round 3; replica 0 then waits at round 5 until it
    runs again. Woken while its peer still trains, replica 1 is told it is behind (not that the job
    ended) and leaves; replica 0 ends the job without an error."""
    reached, resumed = tmp_path / "reached", tmp_path / "resumed"
    job = job_factory(8 * TAU)
    plan = {"start_replicas": 2, "replicas": 2, "timeout_s": 20.0}
    with busy_host():
        survivor = job.start(0, reached=(3, str(reached)), gate=(5, str(resumed)), **plan)
        frozen = job.start(1, hooks=[(HERE, "freeze_in_exchange", (1, 1.0, str(resumed), str(reached)))], **plan)
        job.wait([*survivor, *frozen], timeout=300)
    assert resumed.stat().st_mtime >= reached.stat().st_mtime, "replica 1 ran before replica 0 reached round 3"
    _told_behind_while_replica_0_goes_on(job)


def late_final_quorum(seconds: float) -> None:
    """Hook: this replica asks for finalize()'s last quorum `seconds` late (heartbeating all along)."""
    import time

    from co2_zero import elastic

    original = elastic.Membership.final_quorum

    def late(self, round_index):
        time.sleep(seconds)
        return original(self, round_index)

    elastic.Membership.final_quorum = late


@pytest.mark.slow
def test_a_replica_that_cannot_heal_its_last_round_at_the_end_fails_naming_the_others(job_factory):  # noqa: F811
    """Three replicas; replica 1's copy of the last round's average is lost (an error only it sees) while
    the others commit that round, and it asks for finalize()'s last quorum 8 s late: the others' final
    quorum leaves it out (join timeout 1 s), they end and leave. Nobody is left to heal it from, so it
    cannot end with their model: it fails naming them, while the two that agree end without an error
    and with one model (never an exit 0 with a model of its own)."""
    rounds, replicas = 5, 3
    job = job_factory(rounds * TAU, join_timeout_ms=1000)
    plan = {"start_replicas": replicas, "replicas": replicas}
    processes = [p for r in (0, 2) for p in job.start(r, **plan)]
    processes += job.start(1, fail_exchange=rounds - 1, hooks=[(HERE, "late_final_quorum", (8.0,))], **plan)
    job.wait(processes, timeout=300)
    error = job.result(1).get("error", "")
    assert "finalize: replica 1 cut its last exchange (round 4)" in error and "replicas [0, 2]" in error, error
    results = [job.result(r) for r in (0, 2)]
    assert all("error" not in result for result in results), [result.get("error") for result in results]
    assert results[0]["history"][-1][3] and torch.equal(results[0]["final"], results[1]["final"])


def nan_displacement_at(round_index: int) -> None:
    """Hook: this replica's displacement of round `round_index` holds a NaN when its exchange starts."""
    from co2_zero import elastic

    original = elastic.ElasticExchange._pipeline

    def poisoned(self, job):
        if job.round_index == round_index:
            job.work[0] = float("nan")
        return original(self, job)

    elastic.ElasticExchange._pipeline = poisoned


@pytest.mark.slow
def test_a_nonfinite_displacement_is_named_by_replica_id_on_every_replica(job_factory):  # noqa: F811
    """Replicas 0 and 1 (each its own launch, so each is replica 0 of its launch); replica 1's round 2
    displacement holds a NaN. Under nonfinite "raise" both stop naming replica 1 by its id: not by its
    index in its launch (0), and not [] on the healthy one."""
    job = job_factory(5 * TAU)
    plan = {"start_replicas": 2, "replicas": 2}
    processes = [*job.start(0, **plan), *job.start(1, hooks=[(HERE, "nan_displacement_at", (2,))], **plan)]
    job.wait(processes, timeout=300)
    for r in (0, 1):
        error = job.result(r).get("error", "")
        assert "round 2: the displacement of replica(s) [1] holds NaN or Inf" in error, (r, error)


def test_replicas_with_different_configs_are_refused_on_both_naming_the_field(job_factory):  # noqa: F811
    """Two replicas started with different outer lrs: neither has trained, neither is a majority, so
    both are refused at the start-up meeting, each naming the field and both values (never a bare config
    hash on one replica and a timeout on the other)."""
    job = job_factory(3 * TAU)
    lrs = {0: 0.7, 1: 0.5}
    processes = [p for r, lr in lrs.items() for p in job.start(r, start_replicas=2, config={**CONFIG, "outer_lr": lr})]
    job.wait(processes, timeout=300)
    for r, lr in lrs.items():
        error = job.result(r).get("error", "")
        assert f"outer_lr={lr!r} here, {lrs[1 - r]!r} there" in error and "it leaves the job" in error, (r, error)


@pytest.mark.slow
@pytest.mark.parametrize("flag,values", [("--seed", ("1", "2")), ("--dtype", ("float32", "bfloat16"))])
def test_the_training_job_refuses_replicas_with_another_seed_or_dtype(tmp_path, flag, values):
    """Two replicas of `co2-train` started with another --seed (their validation would differ for one
    model) or --dtype (one trains in bf16): both exit non-zero, each naming the setting and both values."""
    from tests.elastic.test_elastic_train import Replicas

    job = Replicas(tmp_path)
    try:
        names = [job.start(r, ["--max_steps", "8", "--start_replicas", "2", flag, v]) for r, v in enumerate(values)]
        for name, mine, theirs in ((names[0], *values), (names[1], *values[::-1])):
            job.running[name].wait(timeout=400)
            stderr = (tmp_path / f"{name}.err").read_text()
            assert job.running[name].returncode != 0, stderr[-2000:]
            named = f"job {flag[2:]}={mine!r} here, {theirs!r} there"
            if flag == "--seed":
                named = f"job seed={int(mine)!r} here, {int(theirs)!r} there"
            assert named in stderr, stderr[-2000:]
    finally:
        job.close()


def documented_join_timeout_ms() -> int:
    """The --join_timeout_ms of the Lighthouse command docs/elastic.md tells users to run."""
    text = (Path(__file__).parents[2] / "docs" / "elastic.md").read_text()
    return int(re.search(r"torchft_lighthouse [^\n]*--join_timeout_ms (\d+)", text).group(1))


@pytest.mark.slow
def test_a_replica_late_for_one_quorum_on_a_loaded_host_is_waited_for(job_factory):  # noqa: F811
    """The documented Lighthouse settings, a busy loop beside the replicas, and replica 2 reaching its
    round end 2 six seconds late (heartbeating: a slow step, a swap-in): the others' quorum waits for
    it instead of leaving it out (which would throw it out of the job, behind its peers), so every
    round is averaged over all three and the model is the reference's."""
    rounds, late_round = 6, 2
    job = job_factory(rounds * TAU, join_timeout_ms=documented_join_timeout_ms())
    with busy_host():
        plan = {"start_replicas": 3, "replicas": 3}
        processes = [p for r in range(2) for p in job.start(r, **plan)]
        processes += job.start(2, straggle=(late_round, 6.0), **plan)
        job.wait(processes, timeout=300)
    results = [job.result(r) for r in range(3)]
    assert all("error" not in result for result in results), [result.get("error") for result in results]
    schedule = _schedule(results[0]["history"], rounds)
    assert schedule == [{0, 1, 2}] * rounds, schedule
    assert all(torch.equal(result["final"], results[0]["final"]) for result in results)
    torch.testing.assert_close(results[0]["final"], _reference_final(schedule, [], rounds * TAU), rtol=1e-5, atol=1e-6)


def drift_before_finalize() -> None:
    """Hook: this replica's final model differs from its peers' in one weight when finalize() meets
    them (a drift nothing else caught)."""
    from co2_zero import elastic

    original = elastic.ElasticExchange.agree_final

    def drifted(self, round_index):
        self.final[1][0] += 1.0  # the final model (the engine's next start point, handed over by reference)
        return original(self, round_index)

    elastic.ElasticExchange.agree_final = drifted


def test_replicas_whose_final_models_differ_fail_naming_each_other(job_factory):  # noqa: F811
    """Two replicas meet in finalize()'s quorum holding different final models: neither ends as if it
    held the job's model; each fails naming the other and the shared start point that differs."""
    job = job_factory(3 * TAU)
    plan = {"start_replicas": 2, "replicas": 2}
    processes = [*job.start(0, **plan), *job.start(1, hooks=[(HERE, "drift_before_finalize", ())], **plan)]
    job.wait(processes, timeout=300)
    for r in (0, 1):
        error = job.result(r).get("error", "")
        assert f"replica {1 - r}: shared start point (digest)=" in error and "it leaves the job" in error, (r, error)
