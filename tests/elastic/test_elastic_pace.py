"""Elastic replicas of different speeds (`replica_tau: "auto"` with a membership; docs/elastic.md, "Replicas of
different speeds"): each round's average weighs its contributors by the inner steps they trained, and each
replica sets its steps per round from its step time against the quorum's fastest, every round.

Real processes, as tests/elastic/test_elastic.py runs them (its Job: a torchft Lighthouse and one process per
replica), with a busy loop beside them. Each replica's steps are paced by a sleep, so its speed is known; the
test counts the steps each replica's own loop trained in every round, records every displacement it sent and
the average it received, and computes the weighted average from them itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from co2_zero.elastic.speeds import displacement_scale, steps_for
from tests import models
from tests.elastic.test_elastic import DYING_POINTS, _die_at, _full, _model, job_factory  # noqa: F401  (job_factory: the fixture)
from tests.elastic.test_elastic_faults import documented_join_timeout_ms
from tests.reference import simulate_paced

pytest.importorskip("torchft", reason="the elastic extra (torchft) is not installed")

TAU = 4
CONFIG = {"tau": TAU, "replica_tau": "auto", "timeout_s": 90.0}  # the defaults otherwise
FIRST_MEASURED = 3  # rounds 0-2 run tau: round 0 is not timed, round 1's speeds reach the exchange of round 1,
# whose result the round end 2 takes for round 3


def paced_main(replica: int, rank: int, port: int, lighthouse: str, out: str, rounds: int, plan: dict) -> None:
    """Rank `rank` of one replica (its own world of plan["shards"] ranks, 1 by default; with 2, FSDP2's model):
    train until `rounds` rounds ended, each step plan["step_s"] from the end of the last (plan["slow_s"] on the
    ranks plan["slow_ranks"], default all, of replica plan["slow"] from round plan["slow_from"]): the forward and
    backward, then a sleep for the rest, so that what the job times does not depend on the host's load, as long
    as a step's compute is shorter than its period; record the steps
    its loop trained per round, every displacement it sent and average it received (its partition), its history,
    the whole model at every round start and at the end. plan["skew"] = (replica, rank, factor): that rank reads
    each round's training time `factor` times longer than it was. plan["die"], plan["die_ranks"]: as
    test_elastic.replica_main's; a replica that leaves with a CO2Error records it."""
    shards = plan.get("shards", 1)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from co2_zero import CO2Config, CO2Error, CO2Optimizer
    from co2_zero.elastic import Membership

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=shards,
                            timeout=timedelta(seconds=60))  # fmt: skip
    Path(plan["pid_files"][rank]).write_text(str(os.getpid()))
    averages = _record_averages()
    if plan.get("die") and rank in plan.get("die_ranks", range(shards)):
        _die_at(*DYING_POINTS[plan["die"][0]], plan["die"][1], plan)
    if plan.get("skew", (None,))[:2] == (replica, rank):
        _skew_round_time(plan["skew"][2])
    if plan.get("fail_exchange", (None,))[0] == replica:  # (replica, round): its copy of that average is lost
        from tests.elastic.test_elastic import _fail_exchange_at

        _fail_exchange_at(plan["fail_exchange"][1])
    if plan.get("announce"):
        Path(plan["announce"]).touch()
    config = CO2Config(**CONFIG, **plan.get("config", {}), **({"shards_per_replica": shards} if shards > 1 else {}))
    model = _model(config, shards)
    membership = Membership(lighthouse, replica, start_replicas=plan.get("start_replicas", 2))
    try:
        opt = CO2Optimizer(models.make_optimizer("adam", model.parameters()), config, model, membership=membership)
        trained, in_round, step, joined_at, every_step = {}, 0, 0, opt.engine.rounds, []
        starts = {opt.engine.rounds: _full(model)}
        slow_rank = replica == plan.get("slow") and rank in plan.get("slow_ranks", range(shards))
        if plan.get("every_step") is not None:  # (test_elastic_schedule.py): also before the first step
            plan["every_step"](opt, 0, record=every_step)
        stepped = time.perf_counter()
        while opt.engine.rounds < rounds:
            slow = slow_rank and opt.engine.rounds >= plan.get("slow_from", 0)
            # a replica is starting: step slowly (few steps, round ends still met) until it is in the quorum
            joining = plan.get("wait_for") and opt.engine.rounds >= plan["wait_for"][0] and _joining(plan, membership)
            x, y = models.shard_batch(replica, rank, step, shards) if shards > 1 else models.batch(replica, step)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            period = 1.0 if joining else plan["slow_s"] if slow else plan["step_s"]
            time.sleep(max(0.0, stepped + period - time.perf_counter()))  # the step time the job measures: period
            opt.step()
            stepped = time.perf_counter()
            step, in_round = step + 1, in_round + 1
            if plan.get("every_step") is not None:  # (test_elastic_schedule.py): its checks at every step
                plan["every_step"](opt, in_round if not opt.round_ended else 0, record=every_step)
            if opt.round_ended:
                trained[opt.engine.rounds - 1], in_round = in_round, 0
                starts[opt.engine.rounds] = _full(model)
                if plan.get("reached") and opt.engine.rounds == plan["reached"][0]:
                    Path(plan["reached"][1]).touch()
        opt.finalize()
        result = {
            "trained": trained,
            "averages": averages,
            "history": [(r.round, r.replicas, r.contributors, r.committed, r.weights) for r in membership.history],
            "inner_steps": opt.engine.inner_steps,
            "joined_at": joined_at,
            "starts": starts,
            "final": _full(model),
            "every_step": every_step,
        }
    except CO2Error as error:  # this replica left the job (a lost sibling rank): what it said
        result = {"error": str(error)}
    torch.save(result, f"{out}.tmp")
    os.replace(f"{out}.tmp", out)
    dist.destroy_process_group()


def _skew_round_time(factor: float) -> None:
    """Make this rank read each round's training time (`RoundEngine.round_train_s`) `factor` times longer than
    it was, where the exchange takes it: its measure of the replica's speed differs from its siblings'."""
    from co2_zero import elastic

    original = elastic.ElasticExchange._take_round_steps

    def skewed(self, at):
        if at.round_train_s is not None:
            at = dataclasses.replace(at, round_train_s=at.round_train_s * factor)
        return original(self, at)

    elastic.ElasticExchange._take_round_steps = skewed


def _assert_the_reference_at_every_round_start(results: list[dict], rounds: int, shards: int = 1) -> None:
    """`simulate_paced` (tests/reference.py) run with the steps each replica's loop counted in each round:
    every replica's parameters at every round start (its stand-in) and the final model."""
    taus = [tuple(result["trained"][t] for result in results) for t in range(rounds)]
    record: list[list[dict]] = []
    out = simulate_paced(
        lambda: models.make_model("mlp"),
        lambda params: models.make_optimizer("adam", params),
        models.batch,
        models.loss_fn,
        {k: v for k, v in CONFIG.items() if k not in ("timeout_s", "replica_tau")},
        [TAU] * len(results),
        rounds,
        shards=shards,
        shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards),
        round_taus=taus,
        step_record=record,
    )
    for r, result in enumerate(results):
        ends = [sum(tau[r] for tau in taus[: t + 1]) - 1 for t in range(rounds)]  # its step that ended round t
        expected = [_full(models.make_model("mlp"))] + [_flat_params(record[r][k]) for k in ends]
        for t in range(rounds + 1):
            torch.testing.assert_close(result["starts"][t], expected[t], rtol=1e-5, atol=1e-6, msg=f"{r}, {t}")
    torch.testing.assert_close(results[0]["final"], _flat_params(out[0]), rtol=1e-5, atol=1e-6)


def _flat_params(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in params.values()])


def _joining(plan: dict, membership: Any) -> bool:
    """plan["wait_for"] = (round, path, replicas): past that round, until the last quorum holds `replicas`
    (the replica that announces itself at `path` is started then)."""
    return len(membership.history[-1].replicas) < plan["wait_for"][2]


def _record_averages() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Wrap the exchange's average: per round, the displacement this replica sent (as it entered the
    exchange) and the average it received."""
    from co2_zero import elastic

    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    original = elastic.ElasticExchange._average

    def recording(self, work, g_buffer):
        sent = work[: self.layout.length].clone()
        g = original(self, work, g_buffer)
        recorded[self.round_index] = (sent, g[: self.layout.length].clone())
        return g

    elastic.ElasticExchange._average = recording
    return recorded


def _run(job_factory, rounds: int, **plan: Any) -> list[dict]:  # noqa: F811
    """`_run_ranks`: each replica's rank 0."""
    return [ranks[0] for ranks in _run_ranks(job_factory, rounds, **plan)]


def _run_ranks(job_factory, rounds: int, **plan: Any) -> list[list[dict]]:  # noqa: F811
    """Replicas 0 and 1 (plan["shards"] ranks each) beside a busy loop, under the documented Lighthouse settings;
    every rank exits 0. Per replica, its ranks' results."""
    job = job_factory(rounds, join_timeout_ms=documented_join_timeout_ms())
    job.target = paced_main
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        processes = [p for r in range(2) for p in job.start(r, **plan)]
        job.wait(processes, timeout=300)
    finally:
        busy.kill()
        busy.wait()
    assert [p.exitcode for p in processes] == [0] * len(processes)
    return [[job.result(r, rank=s) for s in range(plan.get("shards", 1))] for r in range(2)]


def _assert_every_round_averaged_both(results: list[dict], rounds: int) -> None:
    """Every round's quorum held both replicas, both contributed, the round was committed, and the weights
    each recorded are the steps the replicas' own loops counted; one model at the end."""
    for result in results:
        assert [t for t, *_ in result["history"]] == list(range(rounds)), result["history"]
        for t, replicas, contributors, committed, weights in result["history"]:
            assert (replicas, contributors, committed) == ((0, 1), (0, 1), True), result["history"]
            assert weights == (results[0]["trained"][t], results[1]["trained"][t]), (t, weights)
        assert result["inner_steps"] == rounds * TAU  # the job's clock: a short round counts as tau steps
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_a_replica_at_half_speed_keeps_its_place_with_half_the_steps_and_a_weighted_average(job_factory):  # noqa: F811
    """Replica 1 steps at half replica 0's speed from the start, under CPU load. From the first round its
    speed is known, it trains 2 steps per round against replica 0's 4 and stays in every quorum; each
    round's average is Σ τ_r·D_r / Σ τ_r of the displacements the replicas sent (computed here), and the
    rounds both trained 4 steps average to the plain mean bit for bit; the run ends with one model."""
    rounds = 7
    results = _run(job_factory, rounds, step_s=0.1, slow=1, slow_s=0.2)
    _assert_every_round_averaged_both(results, rounds)
    fast, slow = (results[r]["trained"] for r in range(2))
    assert [fast[t] for t in range(rounds)] == [TAU] * rounds, fast
    assert [slow[t] for t in range(rounds)] == [TAU] * FIRST_MEASURED + [TAU // 2] * (rounds - FIRST_MEASURED), slow
    _assert_weighted_averages(results, rounds)
    _assert_the_reference_at_every_round_start(results, rounds)


def _assert_weighted_averages(results: list[dict], rounds: int) -> None:
    """Each round's average, the same on both replicas, is Σ τ_r·D_r / Σ τ_r of the displacements the two sent
    (one rank of each; τ_r the steps its loop counted): the plain mean bit for bit when the steps are equal."""
    for t in range(rounds):
        (d0, g), (d1, g1) = results[0]["averages"][t], results[1]["averages"][t]
        w0, w1 = results[0]["trained"][t], results[1]["trained"][t]
        assert torch.equal(g, g1), t
        if w0 == w1:
            assert torch.equal(g, (d0 + d1) / 2), f"round {t}: equal weights, not the plain mean bit for bit"
        else:
            expected = (w0 * d0.double() + w1 * d1.double()) / (w0 + w1)
            torch.testing.assert_close(g.double(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_the_ranks_of_a_slow_fsdp2_replica_agree_on_its_steps(job_factory):  # noqa: F811
    """S × R = 2 × 2 (FSDP2 over each replica's two ranks), under CPU load. Rank 1 of replica 1 steps slowly (a
    sleep in its steps only; its sibling waits for it in FSDP2's collectives) and reads each round's time 3 times
    longer than its sibling, so on their own the two would choose different steps and their collectives would
    not meet. The replica's ranks agree (its step time is its slowest rank's, its steps the fewest either chose):
    both ranks of each replica train the same steps every round, the slow replica fewer than τ from round 3 on
    and the fast one τ; each shard's average is Σ τ_r·D_r / Σ τ_r of that shard's displacements; every round
    start matches the reference, and the model ends identical on every rank."""
    rounds = 6
    plan = {"shards": 2, "step_s": 0.05, "slow": 1, "slow_ranks": [1], "slow_s": 0.1, "skew": (1, 1, 3.0)}
    replicas = _run_ranks(job_factory, rounds, **plan)
    for ranks in replicas:
        assert ranks[0]["trained"] == ranks[1]["trained"], [rank["trained"] for rank in ranks]
        assert ranks[0]["history"] == ranks[1]["history"]
    fast, slow = (replicas[r][0]["trained"] for r in range(2))
    assert [fast[t] for t in range(rounds)] == [TAU] * rounds, fast
    assert [slow[t] for t in range(FIRST_MEASURED)] == [TAU] * FIRST_MEASURED, slow
    assert all(slow[t] < TAU for t in range(FIRST_MEASURED, rounds)), slow
    for shard in range(2):
        _assert_every_round_averaged_both([ranks[shard] for ranks in replicas], rounds)
        _assert_weighted_averages([ranks[shard] for ranks in replicas], rounds)
    _assert_the_reference_at_every_round_start([ranks[0] for ranks in replicas], rounds, shards=2)
    assert all(torch.equal(rank["final"], replicas[0][0]["final"]) for ranks in replicas for rank in ranks)


def test_a_replica_that_slows_mid_run_is_absorbed(job_factory):  # noqa: F811
    """Both replicas at one speed; replica 1 steps 4 times slower from round 3. Its steps per round drop (to
    the 1 it completes in replica 0's 4) two rounds later, it never misses a quorum, and replica 0 keeps 4."""
    rounds, slow_from = 9, 3
    results = _run(job_factory, rounds, step_s=0.1, slow=1, slow_from=slow_from, slow_s=0.4)
    _assert_every_round_averaged_both(results, rounds)
    fast, slow = (results[r]["trained"] for r in range(2))
    assert [slow[t] for t in range(FIRST_MEASURED)] == [TAU] * FIRST_MEASURED, slow
    absorbed = slow_from + 2  # its slow round is measured in its exchange, which the next round end takes
    assert [slow[t] for t in range(absorbed, rounds)] == [1] * (rounds - absorbed), slow
    assert [fast[t] for t in range(absorbed, rounds)] == [TAU] * (rounds - absorbed), fast
    _assert_the_reference_at_every_round_start(results, rounds)


@pytest.mark.slow
def test_a_rank_lost_as_its_replica_agrees_on_its_steps_takes_the_replica_out(job_factory):  # noqa: F811
    """S × R = 2 × 2 (FSDP2) with `replica_tau: "auto"`: rank 1 of replica 1 is SIGKILLed as its round end 4
    begins, before the replica's ranks agree on their steps (the one all-reduce that also checks that every
    rank of the replica is there). Its sibling leaves with the CO2Error naming the replica and the round
    (never a hang); replica 0 goes on alone from round 4 and ends, both its ranks with one model."""
    rounds, lost_round, lost_rank = 7, 4, 1
    job = job_factory(rounds, join_timeout_ms=documented_join_timeout_ms())
    job.target = paced_main
    plan = {"shards": 2, "step_s": 0.05}
    survivor = job.start(0, **plan)
    broken = job.start(1, die=("agreement", lost_round), die_ranks=[lost_rank], **plan)
    job.wait([*survivor, *broken], timeout=300)
    assert broken[lost_rank].exitcode == -signal.SIGKILL
    assert [p.exitcode for p in survivor] == [0, 0]
    left = job.result(1, rank=1 - lost_rank)
    assert f"round {lost_round}: not every rank of replica 1 (2 ranks) reached the round end" in left.get(
        "error", ""
    ), left
    ranks = [job.result(0, rank=s) for s in range(2)]
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["trained"] == ranks[1]["trained"]
    quorums = {t: set(replicas) for t, replicas, _, _, _ in ranks[0]["history"]}
    assert [quorums[t] for t in range(lost_round)] == [{0, 1}] * lost_round, quorums
    assert [quorums[t] for t in range(lost_round, rounds)] == [{0}] * (rounds - lost_round), quorums
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


@pytest.mark.parametrize("replicas", [2, 3, 4, 7])
@pytest.mark.parametrize("tau", [1, 3, 4, 32])
def test_equal_weights_scale_by_exactly_one(replicas, tau):
    """Equal steps everywhere: the factor is 1.0 exactly, so the exchange sends the plain mean's values."""
    assert displacement_scale(tau, [tau] * replicas) == 1.0


def test_the_weights_give_the_weighted_average():
    """n·τ_r / Σ τ over the plain mean: Σ_r (n·τ_r/Στ)·D_r / n = Σ τ_r·D_r / Σ τ."""
    weights, d = [4, 2, 1], torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    mean = sum(displacement_scale(w, weights) * d[r] for r, w in enumerate(weights)) / len(weights)
    assert float(mean) == pytest.approx((4 * 1 + 2 * 10 + 1 * 100) / 7)
    assert displacement_scale(0, weights) == 0.0  # a zero displacement (a joiner) stays zero


def test_steps_follow_the_speed_against_the_quorums_times():
    assert steps_for(32, [100, 100], 1) == 32  # the fastest runs tau
    assert steps_for(32, [100, 200], 1) == 16
    assert steps_for(32, [100, 0, 400], 2) == 8  # a replica not measured yet (0) is left out
    assert steps_for(32, [100, 206], 1) == 15  # the steps it completes in the fastest's round, not rounded up
    assert steps_for(32, [100, 101], 1) == 32  # a hair slower: worth the fastest's wait
    assert steps_for(4, [100, 10_000], 1) == 1  # at least one step
    assert steps_for(4, [100, 0], 1) is None  # not measured yet: the exchange keeps what it had


def _assert_weights_are_the_steps_trained(results: list[dict]) -> None:
    """Every committed round's weights are the steps each contributor's own loop counted in that round."""
    for result in results:
        for t, _, contributors, committed, weights in result["history"]:
            if committed:
                trained = tuple(results[r]["trained"][t] for r in contributors)
                assert weights == trained, (t, contributors, weights, trained)


def test_a_replica_at_half_speed_that_loses_an_average_heals_from_a_faster_peer(job_factory):  # noqa: F811
    """Replica 1, at half speed (2 steps per round from round 3), loses its copy of round 4's average while
    replica 0 commits it. At round end 5 it heals from replica 0, whose counters are its own: a round counts
    tau steps on the job's clock whatever steps it trained. Both end with one model, exit 0."""
    rounds = 8
    results = _run(job_factory, rounds, step_s=0.1, slow=1, slow_s=0.2, fail_exchange=(1, 4))
    committed = [{t: c for t, _, _, c, _ in result["history"]} for result in results]
    assert committed[0] == {t: True for t in range(rounds)}, results[0]["history"]
    assert committed[1] == {t: t != 4 for t in range(rounds)}, results[1]["history"]
    assert results[1]["trained"][4] == TAU // 2  # it did train fewer steps than its peer when it healed
    _assert_weights_are_the_steps_trained(results)
    assert torch.equal(results[0]["final"], results[1]["final"])


@pytest.mark.slow
def test_a_replica_that_joins_a_job_of_replicas_at_different_speeds_trains_with_them(job_factory, tmp_path):  # noqa: F811
    """Replicas 0 (fast) and 1 (half speed) train; replica 2 is started after round 4 and joins from a live
    peer at a round end (the job's clock: rounds x tau). From then on every round averages the three with
    the steps each trained; one model at the end, every process exits 0."""
    rounds, announced, reached = 14, tmp_path / "joining", tmp_path / "reached"
    job = job_factory(rounds, join_timeout_ms=documented_join_timeout_ms())
    job.target = paced_main
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        plan = {
            "step_s": 0.1,
            "slow": 1,
            "slow_s": 0.2,
            "wait_for": (5, str(announced), 3),
            "reached": (4, str(reached)),
        }
        first = [p for r in range(2) for p in job.start(r, **plan)]
        deadline = time.monotonic() + 120
        while not reached.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        joiner = job.start(2, announce=str(announced), start_replicas=1, step_s=0.1)
        job.wait([*first, *joiner], timeout=300)
    finally:
        busy.kill()
        busy.wait()
    assert [p.exitcode for p in [*first, *joiner]] == [0, 0, 0]
    results = [job.result(r) for r in range(3)]
    joined_at = results[2]["joined_at"]
    assert 4 < joined_at < rounds, joined_at
    contributors = {t: c for t, _, c, committed, _ in results[0]["history"] if committed}
    assert all(contributors[t] == (0, 1, 2) for t in range(joined_at, rounds)), results[0]["history"]
    _assert_weights_are_the_steps_trained(results)
    assert all(torch.equal(result["final"], results[0]["final"]) for result in results)


def test_the_round_end_agreement_of_a_replica_is_also_its_check_that_every_rank_is_there(monkeypatch):
    """S > 1 with `replica_tau: "auto"`: the replica's ranks agree on their steps at a round end in one
    all-reduce (`replica_max`); the check before the quorum that every rank reached that round end sends
    no second one. At a round end with no agreement the check sends its own."""
    from co2_zero.elastic import membership as membership_module

    sent = []

    class Done:
        def wait(self, timeout: timedelta) -> bool:
            return True

    monkeypatch.setattr(membership_module.dist, "all_reduce", lambda t, **kwargs: sent.append(t.tolist()) or Done())
    monkeypatch.setattr(membership_module, "collective_device", lambda group: torch.device("cpu"))
    member = membership_module.Membership("http://localhost:1", replica_id=0)
    member.topology = SimpleNamespace(world_size=2, control_group=None)
    member._at = SimpleNamespace(served={})  # what the engine handed over at the round end
    assert member.replica_max([1500, -3], 4) == [1500, -3]
    member.prepare_background_round(4)
    assert sent == [[1500, -3]]
    member.prepare_background_round(5)
    assert sent == [[1500, -3], [0]]
