"""Elastic training (docs/design.md §12): replicas that die and come back while the others train on.

Real processes: a torchft Lighthouse, and one process per replica group (each its own world of one
rank, as one torchrun per replica launches it). Replicas SIGKILL themselves at a chosen point, so a
failure lands exactly mid-round or mid-exchange; the test restarts them. The survivors' parameters
are compared with the reference simulation run with the membership schedule they recorded.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from co2_zero.core.config import PUBLISHED
from tests import models
from tests.reference import replica_round_starts, simulate

pytest.importorskip("torchft", reason="the elastic extra (torchft) is not installed")

TAU = 4
STEP_SLEEP_S = 0.03  # paces the replicas so that a restarted one finds the job still running
HEARTBEAT_TIMEOUT_MS = 3000
# CO2 as published (the shared start elastic mode runs) at these outer lr and momentum; timeout_s generous:
# 2 cores shared by many
CONFIG = {**PUBLISHED, "tau": TAU, "outer_lr": 0.7, "outer_momentum": 0.5, "timeout_s": 90.0}
# the library's defaults: the local stand-in and DiLoCo's outer step (sync_delay "auto" is the round end here)
DEFAULTS = {"tau": TAU, "timeout_s": CONFIG["timeout_s"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _lighthouse(join_timeout_ms: int = 60000) -> tuple[subprocess.Popen, str]:
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
            str(join_timeout_ms),
            "--quorum_tick_ms",
            "50",
            "--heartbeat_timeout_ms",
            str(HEARTBEAT_TIMEOUT_MS),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://localhost:{port}"


def replica_main(replica: int, rank: int, port: int, lighthouse: str, out: str, steps: int, plan: dict) -> None:
    """Rank `rank` of one replica group (its own world of plan["shards"] ranks, 1 by default; with 2, the
    model is FSDP2's over the replica): train `steps` inner steps (from where the job is when it joins),
    record every round's start point (this rank's partition), its membership history, the round ends at
    which it took a live peer's state, the outer state it holds and the final parameters in `out`.
    plan["die"]: ("round", t) SIGKILLs itself mid-round t (its exchange of round t - 1 done); ("exchange",
    t) when its exchange of round t starts, before any collective; ("round_end", t) as its round end t
    asks for the quorum. plan["die_ranks"]: the ranks
    that die (default: all); the first of them to get there SIGKILLs them all at once, as a lost node
    would end them (a sibling left alive for a moment would fail in a collective instead: exit code 1,
    not a kill). plan["gate"]: (t, path): before round t, wait for `path` to exist.
    plan["announce"]: a path to create once imported (a restarted replica tells the survivors it is
    about to join). plan["config"]: the CO2 config's fields (default: CONFIG). plan["hooks"]: (module,
    function, args) to call once imported (faults defined in other test files)."""
    shards = plan.get("shards", 1)
    die = plan.get("die") if rank in plan.get("die_ranks", range(shards)) else None
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from co2_zero import CO2Config, CO2Error, CO2Optimizer
    from co2_zero.elastic import Membership

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=shards, timeout=timedelta(seconds=60)
    )
    Path(plan["pid_files"][rank]).write_text(str(os.getpid()))
    if die is not None and die[0] in DYING_POINTS:
        _die_at(*DYING_POINTS[die[0]], die[1], plan)
    if plan.get("fail_exchange") is not None:
        _fail_exchange_at(plan["fail_exchange"])
    if plan.get("straggle") is not None:
        _straggle_at(*plan["straggle"])
    for module, name, args in plan.get("hooks", ()):  # other files' faults (test_elastic_faults.py)
        getattr(importlib.import_module(module), name)(*args)
    if plan.get("announce"):
        Path(plan["announce"]).touch()
    fields = plan.get("config", CONFIG)
    timeout_s = plan.get("timeout_s", fields["timeout_s"])
    config = CO2Config(**{**fields, "timeout_s": timeout_s, "shards_per_replica": shards})
    model = _model(config, shards)
    membership = Membership(lighthouse, replica, start_replicas=plan.get("start_replicas", 3))
    healed_at = _record_heals(membership)
    with warnings.catch_warnings(record=True) as caught:  # the library's warnings, e.g. a lost peer's
        warnings.simplefilter("always")
        try:
            opt = CO2Optimizer(models.make_optimizer("adam", model.parameters()), config, model, membership=membership)
            train = _train(replica, rank, opt, model, membership, steps, {**plan, "die": die})
            result = {**train, "healed_at": healed_at}
        except CO2Error as error:
            result = {"error": str(error), "error_at": time.time()}
    result["warnings"] = [str(w.message) for w in caught]
    torch.save(result, f"{out}.tmp")
    os.replace(f"{out}.tmp", out)
    dist.destroy_process_group()


# Where a replica can SIGKILL itself in the library: the method, wrapped in the dying process only, and
# how to read the round it is called for.
# "average": after the small all-reduce of who contributes, so the peers are inside the average's.
# "agreement": as the replica's ranks agree on their steps (`replica_tau: "auto"`, S > 1), before the quorum.
DYING_POINTS = {
    "exchange": ("ElasticExchange", "_average", lambda self, args: self.round_index, "before"),
    "average": ("ElasticExchange", "_who_contributes", lambda self, args: self.round_index, "after"),
    "round_end": ("Membership", "_check_replica_whole", lambda self, args: args[0], "before"),
    "agreement": ("Membership", "replica_max", lambda self, args: args[1], "before"),
}


def _kill_dying_ranks(plan: dict) -> None:
    """SIGKILL every rank of plan["die_ranks"] (all of the replica by default), this process last."""
    own = os.getpid()
    ranks = plan.get("die_ranks", range(plan.get("shards", 1)))
    for pid in {int(Path(plan["pid_files"][r]).read_text()) for r in ranks} - {own}:
        with contextlib.suppress(ProcessLookupError):  # a sibling that got there first is gone already
            os.kill(pid, signal.SIGKILL)
    os.kill(own, signal.SIGKILL)


def _die_at(cls: str, method: str, round_of: Any, when: str, round_index: int, plan: dict) -> None:
    """Make `co2_zero.elastic.<cls>.<method>` SIGKILL the dying ranks when called for round
    `round_index` (`when`: before it runs, or after it returned)."""
    from co2_zero import elastic

    owner = getattr(elastic, cls)
    original = getattr(owner, method)

    def dying(self, *args):
        due = round_of(self, args) == round_index
        if due and when == "before":
            _kill_dying_ranks(plan)
        result = original(self, *args)
        if due:
            _kill_dying_ranks(plan)
        return result

    setattr(owner, method, dying)


def _fail_exchange_at(round_index: int) -> None:
    """Make this replica's exchange of round `round_index` fail after its average completed (an error
    only this replica sees): it cuts the round while its peers commit it."""
    from co2_zero import elastic

    original = elastic.Membership.settle

    def failing(self, peers, index, contributors, error):
        injected = RuntimeError("injected: this replica's copy of the average is lost")
        return original(self, peers, index, contributors, injected if index == round_index else error)

    elastic.Membership.settle = failing


def _record_heals(membership: Any) -> list[int]:
    """The round ends at which `membership` takes a live peer's state once training has begun (a heal, or
    a join), filled in as they happen; the start-up's, where every replica takes one peer's x_0, is left out.
    Wraps the instance's `_load_state_dict` before its engine is built (the Manager keeps that callback)."""
    healed_at: list[int] = []
    load = membership._load_state_dict

    def recording(state: dict) -> None:
        load(state)
        if state["inner_steps"]:
            healed_at.append(state["rounds"])

    membership._load_state_dict = recording
    return healed_at


def _straggle_at(round_index: int, seconds: float) -> None:
    """Make this replica reach its round end `round_index` `seconds` late (heartbeating all along)."""
    from co2_zero import elastic

    original = elastic.Membership.prepare_background_round

    def late(self, index):
        if index == round_index:
            time.sleep(seconds)
        return original(self, index)

    elastic.Membership.prepare_background_round = late


def _model(config: Any, shards: int) -> torch.nn.Module:
    """The test model; with shards > 1, FSDP2's (fully_shard over the replica's ranks)."""
    model = models.make_model("mlp")
    if shards > 1:
        from co2_zero.fsdp import replica_mesh
        from tests.integrations.test_fsdp import shard

        shard(model, replica_mesh(config))
    return model


def _partition(opt: Any) -> torch.Tensor:
    """This rank's partition of the live parameters (the whole model when S = 1)."""
    return torch.cat([c.detach().reshape(-1) for c in opt.engine.partition.chunks]).clone()


def _full(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (gathered over the replica's ranks under FSDP2), in the model's order."""
    return torch.cat(
        [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1) for p in model.parameters()]
    )


def outer_state_words(engine: Any) -> dict[torch.dtype, int]:
    """Elements per dtype of every tensor the engine, its round state, its exchange and its membership hold
    as outer state (attributes that are tensors, or tuples of tensors), each storage counted once: what an
    elastic rank holds, found from the objects, not from a formula."""
    storages: dict[int, torch.Tensor] = {}
    for owner in (engine, engine.state, engine.exchange, engine.exchange.membership):
        for value in vars(owner).values():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    storages.setdefault(t.untyped_storage().data_ptr(), t)
    words: dict[torch.dtype, int] = {}
    for t in storages.values():
        words[t.dtype] = words.get(t.dtype, 0) + t.numel()
    return words


def _train(replica: int, rank: int, opt: Any, model: torch.nn.Module, membership: Any, steps: int, plan: dict) -> dict:
    """The training loop of `replica_main`; returns what the test reads."""
    die, gate, reached = plan.get("die"), plan.get("gate"), plan.get("reached")
    shards, full_quorum = plan.get("shards", 1), plan.get("replicas", 3)
    starts = {opt.engine.rounds: _partition(opt)}
    joined_at = opt.engine.rounds
    stalls = []
    step = opt.engine.inner_steps
    while step < steps:
        if die is not None and die[0] == "round" and step == die[1] * TAU + TAU // 2:
            opt.engine.pending_round.result(timeout=30)
            if shards > 1:  # every rank's shard of the exchange is done before the first kills them all
                torch.distributed.barrier()
            _kill_dying_ranks(plan)
        if reached is not None and step == reached[0] * TAU:
            Path(reached[1]).touch()
        if gate is not None and step == gate[0] * TAU:
            deadline = time.monotonic() + 300
            while not Path(gate[1]).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        x, y = models.shard_batch(replica, rank, step, shards) if shards > 1 else models.batch(replica, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        step += 1
        if opt.round_ended:
            starts[opt.engine.rounds] = _partition(opt)
            stalls.append(opt.last_round["round_end_s"])
        # Past the gate, wait for the restarted replica (slowly, no extra steps) until it is in the quorum.
        waiting = gate is not None and step >= gate[0] * TAU and len(membership.history[-1].replicas) < full_quorum
        time.sleep(1.0 if waiting else plan.get("step_sleep_s", STEP_SLEEP_S))
    words = outer_state_words(opt.engine)
    partition_length = opt.engine.layout.length
    opt.finalize()  # waits for the last round's exchange: its record is in the history
    history = [(r.round, r.replicas, r.contributors, r.committed) for r in membership.history]
    return {
        "starts": starts,
        "final": _full(model),
        "history": history,
        "changes": list(membership.changes),
        "joined_at": joined_at,
        "stalls": stalls,
        "outer_state_words": words,
        "partition_length": partition_length,
    }


class Job:
    """A Lighthouse and replica processes in a temporary directory; everything is killed at the end."""

    def __init__(self, tmp_path: Path, steps: int, join_timeout_ms: int = 60000) -> None:
        self.tmp, self.steps = tmp_path, steps
        self.lighthouse, self.address = _lighthouse(join_timeout_ms)
        self.processes: list[Any] = []
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.target = replica_main  # what each rank runs: (replica, rank, port, lighthouse, out, steps, plan)

    def start(self, replica: int, tag: str = "", **plan: Any) -> list[Any]:
        """Launch replica `replica`: plan["shards"] processes (1 by default), its own world."""
        port, processes, shards = _free_port(), [], plan.get("shards", 1)
        plan = {**plan, "pid_files": [str(self.tmp / f"replica{replica}{tag}_rank{r}.pid") for r in range(shards)]}
        for rank in range(shards):
            out = str(self.tmp / f"replica{replica}{tag}_rank{rank}.pt")
            args = (replica, rank, port, self.address, out, self.steps, plan)
            processes.append(self.ctx.Process(target=self.target, args=args))
            processes[-1].start()
        self.processes += processes
        return processes

    def result(self, replica: int, tag: str = "", rank: int = 0) -> dict:
        return torch.load(self.tmp / f"replica{replica}{tag}_rank{rank}.pt", weights_only=False)

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

    def make(steps: int, join_timeout_ms: int = 60000) -> Job:
        jobs.append(Job(tmp_path, steps, join_timeout_ms))
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


def _reference_final(
    schedule: list, joins: list[tuple[int, int]], steps: int, replicas: int = 3, shards: int = 1
) -> torch.Tensor:
    return _reference(CONFIG, schedule, joins, steps, replicas, shards)[0]


def _reference(
    config: dict,
    schedule: list,
    joins: list[tuple[int, int]],
    steps: int,
    replicas: int = 3,
    shards: int = 1,
    heals: tuple[tuple[int, int], ...] = (),
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The reference run with the recorded membership schedule (and heals, `simulate`'s): its final model,
    and per round start every replica's parameters there (its stand-in, with one), each flattened in the
    model's order."""
    record: list = []
    step_record: list = []
    out = simulate(
        lambda: models.make_model("mlp"),
        lambda params: models.make_optimizer("adam", params),
        models.batch,
        models.loss_fn,
        {k: v for k, v in config.items() if k != "timeout_s"},
        replicas=replicas,
        steps=steps,
        shards=shards,
        shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards),
        schedule=schedule,
        joins=joins,
        heals=heals,
        record=record,
        step_record=step_record,
    )
    starts = [[_flat(p) for p in per_replica] for per_replica in replica_round_starts(record, step_record, TAU)]
    return _flat(out[0]), starts


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every tensor of a reference parameter dict, flattened and joined in the model's order."""
    return torch.cat([v.reshape(-1) for v in params.values()])


def _assert_identical_round_starts(results: list[dict], first_round: int = 0) -> None:
    """Every replica's start point of every round it trained equals the first one's, bit for bit (each
    result is one rank of a replica; compare the same rank of each replica)."""
    for r, result in enumerate(results[1:], 1):
        for t, start in result["starts"].items():
            if t >= first_round:
                assert torch.equal(start, results[0]["starts"][t]), f"round {t} starts differ on replica {r}"


def _psi() -> int:
    return sum(p.numel() for p in models.make_model("mlp").parameters() if p.requires_grad)


def _assert_outer_state_is_3_psi_over_s(ranks: list[dict], num_tensors: int) -> None:
    """design §12: an elastic rank holds 3Ψ/S fp32 words of outer state (two partition buffers and a
    partition-sized momentum) plus one float64 gap norm per tensor; over the S ranks of a replica, 3Ψ."""
    for result in ranks:
        words = result["outer_state_words"]
        assert words == {torch.float32: 3 * result["partition_length"], torch.float64: num_tensors}, words
    assert sum(r["outer_state_words"][torch.float32] for r in ranks) == 3 * _psi()


# (replicas, shards): three replicas of one rank (plain CO2Optimizer), two of two ranks (FSDP2, S = 2).
SHAPES = [pytest.param(3, 1, id="3x1-plain"), pytest.param(2, 2, id="2x2-fsdp2")]


@pytest.mark.parametrize("replicas,shards", SHAPES)
def test_replicas_without_failures_match_the_reference(job_factory, replicas, shards):
    """Every round start is bit-identical across replicas (rank s of each), the final model equals the
    reference, and every rank holds 3Ψ/S fp32 words of outer state."""
    steps = 6 * TAU
    job = job_factory(steps)
    plan = {"shards": shards, "start_replicas": replicas, "replicas": replicas}
    job.wait([p for r in range(replicas) for p in job.start(r, **plan)], timeout=300)
    results = [[job.result(r, rank=s) for s in range(shards)] for r in range(replicas)]
    history = results[0][0]["history"]
    for s in range(shards):
        _assert_identical_round_starts([results[r][s] for r in range(replicas)])
        for r in range(replicas):
            assert results[r][s]["history"] == history
            assert torch.equal(results[r][s]["final"], results[0][0]["final"])
    num_tensors = len(list(models.make_model("mlp").parameters()))
    for ranks in results:
        _assert_outer_state_is_3_psi_over_s(ranks, num_tensors)
    schedule = _schedule(history, steps // TAU)
    assert all(members == set(range(replicas)) for members in schedule), schedule
    expected = _reference_final(schedule, [], steps, replicas, shards)
    torch.testing.assert_close(results[0][0]["final"], expected, rtol=1e-5, atol=1e-6)


def _kill_and_rejoin(job: Job, joining: Path, plan: dict, victim: int, die: tuple) -> None:
    """Start every replica below `victim` (past round 8 they wait for `joining`), then `victim`, which dies
    at `die` (every rank of it SIGKILLed); restart it as tag "b" (it announces itself at `joining` and
    joins the survivors' job, never a job of its own) and wait for everyone."""
    survivors = [p for r in range(victim) for p in job.start(r, gate=(8, str(joining)), **plan)]
    dead = job.start(victim, die=die, **plan)
    job.wait(dead, timeout=300)
    assert all(p.exitcode == -signal.SIGKILL for p in dead), [p.exitcode for p in dead]
    rejoined = job.start(victim, tag="b", announce=str(joining), **{**plan, "start_replicas": 2})
    job.wait([*survivors, *rejoined], timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas,shards,where",
    [
        pytest.param(3, 1, "round", id="3x1-round"),
        pytest.param(3, 1, "exchange", id="3x1-exchange"),
        pytest.param(2, 2, "round", id="2x2-fsdp2-round"),
        pytest.param(2, 2, "exchange", id="2x2-fsdp2-exchange"),
    ],
)
def test_a_killed_replica_is_survived_then_rejoins(job_factory, tmp_path, replicas, shards, where):
    """The last replica (every rank of it) is SIGKILLed mid-round 4 (its exchange of round 3 done) or as
    its exchange of round 4 starts. The others go on without restarting; a cut exchange is skipped by
    all. The victim is then restarted, joins at a round end from a live peer and is identical from its
    first round. The parameters equal the reference simulation with the recorded membership schedule."""
    rounds, killed_round, victim = 14, 4, replicas - 1
    job = job_factory(rounds * TAU)
    plan = {"shards": shards, "start_replicas": replicas, "replicas": replicas}
    _kill_and_rejoin(job, tmp_path / "joining", plan, victim, (where, killed_round))
    results = [[job.result(r, rank=s) for s in range(shards)] for r in range(victim)]
    results.append([job.result(victim, tag="b", rank=s) for s in range(shards)])

    history = results[0][0]["history"]
    joined_at = results[victim][0]["joined_at"]
    for s in range(shards):
        _assert_identical_round_starts([results[r][s] for r in range(victim)])
        _assert_identical_round_starts([results[0][s], results[victim][s]], first_round=joined_at)
        for r in range(replicas):
            assert r == victim or results[r][s]["history"] == history
            assert torch.equal(results[r][s]["final"], results[0][0]["final"])

    schedule = _schedule(history, rounds)
    everyone, others = set(range(replicas)), set(range(victim))
    assert schedule[:killed_round] == [everyone] * killed_round, schedule
    if where == "exchange":  # the victim's exchange of round 4 never started: every survivor cut it
        assert schedule[killed_round] is None, schedule
    else:
        assert schedule[killed_round] == others, schedule
    assert schedule[joined_at - 1] == others and schedule[joined_at:] == [everyone] * (rounds - joined_at), schedule
    first_quorum_after = killed_round + (where == "exchange")
    if joined_at - 1 == first_quorum_after:  # the victim was back before the survivors' next quorum
        expected_changes = []  # (seen with the exchange cut): the quorum never shrank, nothing to report
        assert all(len(quorum) == replicas for _, quorum, _, _ in history), history
    else:
        expected_changes = [
            f"replicas {replicas} -> {victim} at round {first_quorum_after}",
            f"replicas {victim} -> {replicas} at round {joined_at - 1}",
        ]
    assert results[0][0]["changes"] == expected_changes, (results[0][0]["changes"], history)
    stall = max(results[0][0]["stalls"])
    assert stall < 10.0, f"the survivors stalled {stall:.1f} s at a round end after the failure"
    expected = _reference_final(schedule, [(victim, joined_at)], rounds * TAU, replicas, shards)
    torch.testing.assert_close(results[0][0]["final"], expected, rtol=1e-5, atol=1e-6)


# the default run's killed replica (the other kills: `-m slow`)
@pytest.mark.parametrize("where", ["round", pytest.param("exchange", marks=pytest.mark.slow)])
def test_the_defaults_survive_a_killed_replica_that_rejoins(job_factory, tmp_path, where):
    """The defaults (the local stand-in: each replica starts a round from the outer step the average will
    take, on its own displacement) in elastic mode. Replica 2 is SIGKILLed mid-round 4, or as its exchange
    of round 4 starts (the survivors cut that round: the momentum the stand-ins read stays), and restarted;
    it joins at a round end, its first stand-in made from a zero displacement. Every replica's round
    starts and every final model equal the reference's with the recorded membership schedule."""
    replicas, rounds, killed_round, victim = 3, 14, 4, 2
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": replicas, "replicas": replicas, "config": DEFAULTS}
    _kill_and_rejoin(job, tmp_path / "joining", plan, victim, (where, killed_round))
    results = [job.result(r) for r in range(victim)] + [job.result(victim, tag="b")]
    assert all("error" not in result for result in results), [result.get("error") for result in results]

    schedule = _schedule(results[0]["history"], rounds)
    joined_at = results[victim]["joined_at"]
    assert schedule[killed_round] == (None if where == "exchange" else set(range(victim))), schedule
    assert schedule[joined_at:] == [set(range(replicas))] * (rounds - joined_at), schedule
    final, starts = _reference(DEFAULTS, schedule, [(victim, joined_at)], rounds * TAU, replicas)
    for r, result in enumerate(results):
        for t, start in result["starts"].items():
            torch.testing.assert_close(start, starts[t][r], rtol=1e-5, atol=1e-6, msg=f"replica {r} round {t}")
        torch.testing.assert_close(result["final"], final, rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0]["starts"][rounds - 1], results[1]["starts"][rounds - 1]), "no stand-in"


@pytest.mark.slow
def test_a_replica_killed_inside_the_average_stalls_no_survivor(job_factory):
    """Four replicas; the last is SIGKILLed inside round 4's exchange, after the small all-reduce of who
    contributes, so the three survivors are inside the average's all-reduce without it. With four
    ranks, gloo fails that collective at once only for the dead rank's neighbours; a survivor that waits
    for a neighbour's data fails only when that neighbour closes its connections. Every survivor must cut
    round 4 and go on within seconds (not the group's timeout_s, nor the Lighthouse's join timeout
    while it waits for the stuck one), and match the reference."""
    rounds, killed_round, replicas = 10, 4, 4
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": replicas, "replicas": replicas}
    survivors = [p for r in range(replicas - 1) for p in job.start(r, **plan)]
    dead = job.start(replicas - 1, die=("average", killed_round), **plan)
    job.wait([*survivors, *dead], timeout=300)
    assert dead[0].exitcode == -signal.SIGKILL
    results = [job.result(r) for r in range(replicas - 1)]
    _assert_identical_round_starts(results)
    history = results[0]["history"]
    assert all(result["history"] == history for result in results)
    schedule = _schedule(history, rounds)
    assert schedule[killed_round] is None, schedule  # the victim's displacement never arrived: cut
    assert schedule[killed_round + 1 :] == [{0, 1, 2}] * (rounds - killed_round - 1), schedule
    for r, result in enumerate(results):
        stall = max(result["stalls"])
        assert stall < 10.0, f"survivor {r} stalled {stall:.1f} s at a round end after the failure"
        assert torch.equal(result["final"], results[0]["final"])
    expected = _reference_final(schedule, [], rounds * TAU, replicas)
    torch.testing.assert_close(results[0]["final"], expected, rtol=1e-5, atol=1e-6)


def test_a_round_cut_on_one_replica_only_heals_it_at_the_next_round_end(job_factory):
    """The defaults (the local stand-in). Replica 1's copy of round 2's average is lost (an error only it
    sees) while its peers commit the round: it is one outer step behind them. Having cut its last exchange,
    it asks for its next quorum on the main thread, not in the background (where a straggler that learns
    it is behind must leave), and heals there from a live peer at round end 3. Its round 3 displacement
    counts (its stand-in for round 3 came from the shared state), and it starts round 4 from the shared
    start it received, not from the stand-in it made from its stale start and momentum (design §3, §12).
    Every replica's parameters at every round start and every final model equal the reference's with
    that heal."""
    rounds, replicas, cut, behind = 6, 3, 2, 1
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": replicas, "replicas": replicas, "config": DEFAULTS}
    processes = [p for r in range(replicas) if r != behind for p in job.start(r, **plan)]
    processes += job.start(behind, fail_exchange=cut, **plan)
    job.wait(processes, timeout=300)
    results = [job.result(r) for r in range(replicas)]
    assert all("error" not in result for result in results), [result.get("error") for result in results]

    everyone = [set(range(replicas))] * rounds
    for r, result in enumerate(results):
        history = result["history"]
        assert [set(contributors) for _, _, contributors, _ in history] == everyone, (r, history)
        assert [committed for *_, committed in history] == [r != behind or t != cut for t in range(rounds)], (
            r,
            history,
        )
        assert result["healed_at"] == ([cut + 1] if r == behind else []), (r, result["healed_at"])
    final, starts = _reference(DEFAULTS, everyone, [], rounds * TAU, replicas, heals=((behind, cut + 2),))
    for t in range(rounds + 1):  # round by round: a failure names the first round start that differs
        for r, result in enumerate(results):
            torch.testing.assert_close(
                result["starts"][t], starts[t][r], rtol=1e-5, atol=1e-6, msg=f"replica {r} round {t}"
            )
    for result in results:
        assert torch.equal(result["final"], results[0]["final"]), "the replicas ended with different models"
    torch.testing.assert_close(results[0]["final"], final, rtol=1e-5, atol=1e-6)


def test_a_last_round_cut_on_one_replica_only_still_ends_with_one_model(job_factory):
    """Replica 1's copy of the last round's average is lost (an error only it sees) while the others
    commit that round. There is no next round end to heal it; finalize() meets the quorum once more,
    where it heals from a live peer: every replica ends with the committed model, the reference's."""
    rounds, replicas = 5, 3
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": replicas, "replicas": replicas}
    processes = [p for r in range(replicas) if r != 1 for p in job.start(r, **plan)]
    processes += job.start(1, fail_exchange=rounds - 1, **plan)
    job.wait(processes, timeout=300)
    results = [job.result(r) for r in range(replicas)]
    assert results[1]["history"][-1][3] is False and results[0]["history"][-1][3] is True, results[1]["history"]
    for result in results:
        assert torch.equal(result["final"], results[0]["final"]), "the replicas ended with different models"
    everyone = [set(range(replicas))] * rounds
    expected = _reference_final(everyone, [], rounds * TAU, replicas)
    torch.testing.assert_close(results[1]["final"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_survivors_quorum_waits_beside_the_next_round(job_factory):
    """Replica 1 is SIGKILLed at its round end 2, as it would ask for the quorum; replica 0 asks for its
    quorum in the background and trains round 3 meanwhile. Rounds last longer than the Lighthouse's
    heartbeat timeout here, so the survivor never stalls at a round end for the lost peer (asked for on
    the main thread, as before design §12's background quorum, it stalled the heartbeat timeout), and
    its round 2 is averaged over itself alone, as the reference with that schedule."""
    rounds, lost_round, step_sleep_s = 5, 2, 2 * HEARTBEAT_TIMEOUT_MS / 1000 / TAU
    job = job_factory(rounds * TAU)
    plan = {"start_replicas": 2, "replicas": 2, "step_sleep_s": step_sleep_s}
    survivor = job.start(0, **plan)
    dead = job.start(1, die=("round_end", lost_round), **plan)
    job.wait([*survivor, *dead], timeout=300)
    assert dead[0].exitcode == -signal.SIGKILL
    result = job.result(0)
    schedule = _schedule(result["history"], rounds)
    assert schedule == [{0, 1}] * lost_round + [{0}] * (rounds - lost_round), schedule
    stall = max(result["stalls"])
    assert stall < HEARTBEAT_TIMEOUT_MS / 1000 / 2, f"the survivor stalled {stall:.1f} s at a round end"
    expected = _reference_final(schedule, [], rounds * TAU, replicas=2)
    torch.testing.assert_close(result["final"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_straggler_left_out_of_a_quorum_leaves_with_an_error(job_factory):
    """Replica 2 reaches its round end 2 four seconds late, longer than the Lighthouse's join timeout (1 s):
    the others average round 2 (and more) without it. It learns it is behind only in a quorum asked for
    in the background, while its next round already trains from its own start point, where it cannot
    heal: it leaves with a CO2Error that says so, and the others go on, identical, as the reference."""
    rounds, late_round = 10, 2
    job = job_factory(rounds * TAU, join_timeout_ms=1000)
    plan = {"start_replicas": 3, "replicas": 3, "step_sleep_s": 0.3}  # the others still train when it is back
    others = [p for r in range(2) for p in job.start(r, **plan)]
    straggler = job.start(2, straggle=(late_round, 4.0), **plan)
    job.wait([*others, *straggler], timeout=300)
    error = job.result(2).get("error", "")
    assert "replica 2 is behind its peers" in error and "restart it to rejoin" in error, error
    results = [job.result(r) for r in range(2)]
    _assert_identical_round_starts(results)
    assert results[0]["history"] == results[1]["history"]
    schedule = _schedule(results[0]["history"], rounds)
    assert schedule[:late_round] == [{0, 1, 2}] * late_round and schedule[late_round] == {0, 1}, schedule
    assert all(contributors in ({0, 1}, None) for contributors in schedule[late_round:]), schedule
    assert torch.equal(results[0]["final"], results[1]["final"])
    expected = _reference_final(schedule, [], rounds * TAU, replicas=3)
    torch.testing.assert_close(results[0]["final"], expected, rtol=1e-5, atol=1e-6)


def test_one_lost_rank_takes_its_replica_out(job_factory):
    """S = 2: rank 1 of replica 1 (not the rank whose Manager heartbeats) is SIGKILLed as its round end 2
    begins. The replica is the unit that fails: its rank 0 leaves with a CO2Error naming the replica
    (never a hang), which stops its Manager, so replica 0 goes on alone after the heartbeat timeout
    (not the Lighthouse's join timeout) and matches the reference."""
    rounds, lost_round, lost_rank = 6, 2, 1
    job = job_factory(rounds * TAU)
    plan = {"shards": 2, "start_replicas": 2, "replicas": 2}
    survivor = job.start(0, **plan)
    broken = job.start(1, die=("round_end", lost_round), die_ranks=[lost_rank], **plan)
    job.wait([*survivor, *broken], timeout=300)
    assert broken[lost_rank].exitcode == -signal.SIGKILL
    left = job.result(1, rank=1 - lost_rank)
    assert "error" in left, "the remaining rank of a broken replica trained on"
    assert f"round {lost_round}: not every rank of replica 1 (2 ranks) reached the round end" in left["error"], left[
        "error"
    ]
    results = [job.result(0, rank=s) for s in range(2)]
    assert results[0]["history"] == results[1]["history"]
    schedule = _schedule(results[0]["history"], rounds)
    assert schedule[:lost_round] == [{0, 1}] * lost_round and schedule[lost_round:] == [{0}] * (rounds - lost_round)
    assert results[0]["changes"] == [f"replicas 2 -> 1 at round {lost_round}"], results[0]["changes"]
    stall = max(results[0]["stalls"])
    assert stall < 10.0, f"replica 0 stalled {stall:.1f} s at a round end after replica 1 lost a rank"
    expected = _reference_final(schedule, [], rounds * TAU, replicas=2, shards=2)
    torch.testing.assert_close(results[0]["final"], expected, rtol=1e-5, atol=1e-6)


def test_a_replica_that_cannot_reach_the_lighthouse_fails_within_timeout(job_factory):
    job = job_factory(4 * TAU)
    job.address = f"http://localhost:{_free_port()}"  # nothing listens there
    began = time.time()
    job.wait(job.start(0, timeout_s=5.0), timeout=180)
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
        p
        for r in (0, 1)
        for p in job.start(
            r,
            start_replicas=2,
            timeout_s=DEAD_LIGHTHOUSE_TIMEOUT_S,
            reached=(3, str(tmp_path / f"at{r}")),
            gate=(3, go),
        )
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


def _build_co2oss(membership: Any) -> Any:
    from co2_zero.fairscale import CO2OSS

    return CO2OSS(models.make_model("mlp").parameters(), co2={"tau": TAU}, lr=0.1, membership=membership)


def _build_deepspeed(membership: Any) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from co2_zero import deepspeed as co2_deepspeed

    model = models.make_model("mlp")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "co2": {"tau": TAU}}
    return co2_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, membership=membership
    )


@pytest.mark.parametrize(
    "build,entry_point",
    [(_build_co2oss, "co2_zero.fairscale.CO2OSS"), (_build_deepspeed, "co2_zero.deepspeed.initialize")],
    ids=["fairscale", "deepspeed"],
)
def test_engines_that_are_not_elastic_refuse_a_membership_naming_what_is(build, entry_point):
    """FairScale's OSS and DeepSpeed take no membership: refused before anything is built (no process
    group is needed to see it), naming the engines that are elastic."""
    from co2_zero import CO2Error
    from co2_zero.elastic import Membership

    with pytest.raises(CO2Error) as refused:
        build(Membership("http://localhost:1", 0))
    message = str(refused.value)
    assert "an elastic membership (membership=) is not supported with" in message, message
    assert entry_point in message and "plain parameters" in message and "FSDP2" in message, message


@pytest.mark.parametrize("field,value", [("sync_delay", 2)])
def test_elastic_mode_refuses_what_its_quorums_cannot_heal(monkeypatch, field, value):
    """Quorums form and heal at round ends (design §12): an average applied mid-round is refused at
    construction, naming the field, its value and what is accepted; `sync_delay: "auto"` is the round end
    there (the plan's elastic rewrite, `co2_zero.core.plan`), and the defaults (the local stand-in) and the
    published shared start are accepted."""
    from types import SimpleNamespace

    from co2_zero import CO2Config, CO2Error
    from co2_zero.core.plan import resolve

    topology = SimpleNamespace(replicas=1, shards=1, outer_group=None)
    published = {**PUBLISHED, "tau": 4, "sync_delay": "auto"}
    for accepted in (published, {"tau": 4}, {"tau": 4, "stand_in": "local"}):
        resolve(CO2Config(**accepted), topology, elastic=True, backend="gloo")
    with pytest.raises(CO2Error, match=f"{field}={value!r}.* is not supported with an elastic membership .*accepted: "):
        resolve(CO2Config(**{**published, field: value}), topology, elastic=True, backend="gloo")
