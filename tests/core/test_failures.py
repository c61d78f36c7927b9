"""Failures end with a clear error, never a hang: dead or stuck peers, mismatched ranks, bad numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from co2_zero import CO2Config, CO2Error, CO2Optimizer, CO2TimeoutError, NonFiniteError, checkpoint
from co2_zero.core.config import PUBLISHED
from co2_zero.core.topology import Topology
from tests import models
from tests.compare import assert_close
from tests.dist_utils import launch_ranks, run_ranks
from tests.reference import replica_round_starts, simulate

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
    sync_delay = 1 if how.endswith("sync-delay") else None  # then rank 0 waits at the apply point, mid-round
    config = CO2Config(
        tau=2, timeout_s=TIMEOUT_S, outer_momentum=0.5, overlap=how != "exit-blocking", sync_delay=sync_delay
    )
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config)
    if rank == 1:
        _train(rank, opt, model, 1)
        if how.startswith("exit"):
            os._exit(0)
        time.sleep(3 * TIMEOUT_S)  # alive but never reaching the round end
        os._exit(0)
    began = time.monotonic()
    try:
        _train(rank, opt, model, 40)
    except CO2Error as error:
        return {"error": error, "elapsed": time.monotonic() - began, "at_step": opt.engine.inner_steps}
    return {"error": None, "elapsed": time.monotonic() - began}


@pytest.mark.parametrize("how", ["exit", "hang", "exit-blocking", "hang-sync-delay"])
def test_lost_peer_fails_within_timeout_naming_round_and_group(how):
    """Blocking mode names the round like overlap mode does (round 0 for the first round, not -1)."""
    result = run_ranks(peer_lost, 2, how, allow_exit=(1,), timeout=60)[0]
    error = result["error"]
    assert isinstance(error, CO2Error), f"rank 0 finished 40 steps without noticing its peer: {result}"
    message = str(error)
    assert "round 0" in message and "[0, 1]" in message, message
    if how.startswith("hang"):
        assert isinstance(error, CO2TimeoutError) and f"timeout_s={TIMEOUT_S:g}" in message, repr(error)
        assert "outer group" in message, message
    else:  # the exchange or the step announcement, whichever noticed first: a lost peer, no deadline passed
        assert not isinstance(error, CO2TimeoutError) and ("outer group" in message or "control group" in message)
    assert result["elapsed"] < TIMEOUT_S + 6.0, result
    if how.endswith("sync-delay"):  # waited for at the apply point (inner step 3), not at round 1's end (4)
        assert result["at_step"] == 3, result


def test_a_failed_step_announcement_is_a_timeout_only_when_a_deadline_passed():
    """A peer that left closes the control group's connection at once: that is a CO2Error naming the
    cause, not a CO2TimeoutError claiming timeout_s passed (it was the message whichever wait noticed)."""
    from co2_zero.core.parameter_order import StepAnnouncements

    class FailedWork:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def wait(self, timeout) -> None:
            raise self.error

    announcements = StepAnnouncements(group=None)
    cases = [(RuntimeError("Connection closed by peer [127.0.0.1]:2259"), time.monotonic() + 60, CO2Error),
             (RuntimeError("Timed out waiting 4000ms for recv operation"), time.monotonic() + 60, CO2TimeoutError),
             (RuntimeError("Operation failed"), time.monotonic() - 1, CO2TimeoutError)]  # fmt: skip
    for error, deadline, expected in cases:
        announcements._work = FailedWork(error)
        with pytest.raises(CO2Error) as raised:
            announcements.collect(deadline)
        assert type(raised.value) is expected and str(error) in str(raised.value), repr(raised.value)


def peer_frozen(rank: int, world: int, where: str) -> dict:
    """Rank 1 stops itself (SIGSTOP) in the middle of round 1: its connections stay open, so only a
    deadline can notice. Whichever clock fires first (the group's timeout inside gloo, or the
    library's own wait), rank 0 must raise CO2TimeoutError. `where`: "pipeline" (no buffers: round 1's
    exchange fails in gloo while round 2 computes) or "buffers" (BatchNorm: round 1's buffer averaging
    fails first, on the main thread)."""
    pids = [0] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    model = models.make_model("bn" if where == "buffers" else "mlp")
    config = CO2Config(tau=2, timeout_s=TIMEOUT_S)
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config, model=model)

    def freeze(step):
        if rank == 1 and step == 3:
            opt.state_dict()  # waits for round 0's exchange: the stop leaves nothing half-sent
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank == 0 and step == 4:  # round 2 computes a while: gloo's timeout of round 1 fires first
            time.sleep(TIMEOUT_S / 2)

    began = time.monotonic()
    try:
        _train(rank, opt, model, 40, before_step=freeze)
    except CO2Error as error:
        return {
            "type": type(error).__name__,
            "timeout": isinstance(error, CO2TimeoutError),
            "message": str(error),
            "elapsed": time.monotonic() - began,
        }
    finally:
        os.kill(pids[1], signal.SIGKILL)  # end the stopped peer now rather than at the launch's deadline
    return {"type": None, "elapsed": time.monotonic() - began}


@pytest.mark.parametrize("where", ["pipeline", "buffers"])
def test_frozen_peer_raises_co2_timeout_error_naming_round_group_and_timeout(where):
    result = run_ranks(peer_frozen, 2, where, allow_exit=(1,), timeout=60)[0]
    assert result["type"] == "CO2TimeoutError" and result["timeout"], result
    message = result["message"]
    # round 1's step announcement is posted on the control group just before its exchange starts, and
    # the frozen peer answers neither: both time out within moments, and the first seen is named
    groups = ["control group"] + (["outer group of shard 0"] if where == "pipeline" else [])
    assert any(f"{group} (global ranks [0, 1])" in message for group in groups), message
    assert "round 1" in message and f"timeout_s={TIMEOUT_S:g}" in message, message
    assert result["elapsed"] < TIMEOUT_S + 10.0, result


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

    def different_model(named: bool):
        def build():
            model = models.make_model("mlp" if rank == 0 else "uneven")
            CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config(), model=model if named else None)

        return build

    def shards_do_not_divide():
        Topology.build(CO2Config(shards_per_replica=3))

    def different_shards():  # "node" read on nodes of different sizes
        began = time.monotonic()
        try:
            Topology.build(CO2Config(shards_per_replica=1 + rank, timeout_s=TIMEOUT_S))
        finally:
            out["different_shards_s"] = time.monotonic() - began

    def clip_with_local_stand_in_over_reduce_scatter():
        model = models.make_model("mlp")
        config = CO2Config(clip={"mode": "norm", "threshold": 1.0}, collective="reduce_scatter")
        CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)

    def nonfinite(policy, collective="auto"):
        def run():
            model = models.make_model("mlp")
            # CO2 as published for both policies (the shared start: replicas identical at round starts)
            config = CO2Config(**{**PUBLISHED, "tau": 2}, nonfinite=policy, collective=collective)
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
    attempt("different_model", different_model(named=False))
    attempt("different_model_named", different_model(named=True))
    attempt("shards_do_not_divide", shards_do_not_divide)
    attempt("clip_local_reduce_scatter", clip_with_local_stand_in_over_reduce_scatter)
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


@pytest.mark.parametrize(
    ("case", "first", "second"),
    [
        ("different_model", "'optimizer parameter 0' (shape (8, 4))", "'optimizer parameter 0' (shape (64, 4))"),
        ("different_model_named", "'0.weight' (shape (8, 4))", "'0.weight' (shape (64, 4))"),
    ],
)
def test_ranks_with_different_models_fail_at_start_naming_the_first_tensor(misconfigured_results, case, first, second):
    """The same message on every rank: the position, and each rank's name and shape there."""
    errors = [result[case] for result in misconfigured_results]
    assert all(isinstance(error, CO2Error) for error in errors), errors
    message = str(errors[0])
    assert str(errors[1]) == message, errors
    assert "position 0 of the CO2 partition order" in message, message
    assert f"rank 0 has {first} where rank 1 has {second}" in message, message
    assert "rank 0: 4, rank 1: 6" in message, message  # the tensor counts (mlp: 4, uneven: 6)
    assert ("Pass the model" in message) == (case == "different_model"), message


def test_the_local_stand_in_with_a_clip_refuses_reduce_scatter_naming_what_is_accepted(misconfigured_results):
    """With reduce_scatter the local stand-in follows a copy of the outer momentum, which a clipped step
    leaves unknown (design §3): refused when built, on every rank, before any collective."""
    for result in misconfigured_results:
        error = result["clip_local_reduce_scatter"]
        assert isinstance(error, ValueError), error
        message = str(error)
        assert "collective='reduce_scatter'" in message and "clip.mode='norm'" in message, message
        accepted = "accepted: collective: 'all_reduce' (or topk < 1, which all-gathers), or stand_in: 'shared'"
        assert accepted in message, message


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


def single_replica_warnings(rank: int, world: int) -> dict:
    """Topology.build on one machine (LOCAL_WORLD_SIZE = the world): "node" (R = 1), then S = 1 (R = 2).
    Returns, per setting, the R = 1 warnings this rank gave and the number of replicas."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    out = {}
    for shards in ("node", 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            topology = Topology.build(CO2Config(shards_per_replica=shards, timeout_s=TIMEOUT_S))
        out[shards] = ([str(w.message) for w in caught if "R = 1" in str(w.message)], topology.replicas)
        topology.destroy(inner=True)
    return out


def test_one_replica_on_one_machine_warns_on_rank_0_only():
    """`shards_per_replica: "node"` on one machine puts every rank in one replica: CO2 averages nothing."""
    results = run_ranks(single_replica_warnings, 2, timeout=120)
    (warned, replicas), (silent, _) = results[0]["node"], results[1]["node"]
    assert replicas == 1 and len(warned) == 1 and silent == [], results
    for phrase in ('shards_per_replica="node"', "S = 2 with world size 2", "R = 1", "1 makes every rank a replica"):
        assert phrase in warned[0], warned[0]
    for rank, result in enumerate(results):
        assert result[1] == ([], 2), (rank, result[1])  # S = 1: two replicas, no warning


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
    ((tag, marker),) = checkpoint.complete_checkpoints(tmp_path)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert files == sorted(
        [
            checkpoint.LATEST,
            tag,
            *(f"{tag}/{name}" for name in [checkpoint.MARKER, *(f["name"] for f in marker["files"])]),
        ]
    ), files  # no temp files
    first, second = run_ranks(resume_after_kill, 2, str(tmp_path), timeout=120)
    for name, value in first.items():
        assert torch.isfinite(value).all() and torch.equal(value, second[name]), name


def test_ctrl_c_stops_every_rank(tmp_path):
    """SIGINT to the whole launch (what a terminal's Ctrl-C does) ends torchrun and every worker."""
    marker = f"co2-ctrl-c-{os.getpid()}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29500 + os.getpid() % 1000),
        str(Path(__file__).parents[1] / "workers" / "co2_forever.py"),
        marker,
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    launch = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
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
        pytest.fail("ranks still running 30 s after Ctrl-C; the launch's last lines:\n" + "".join(lines[-40:]))
    assert launch.returncode != 0
    leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"workers left running: {leftovers}"


def slow_worker_exit(rank: int, world: int) -> bool:
    """finalize() on a host so busy that the idle background worker takes 2 s to end: is it joined?"""
    from co2_zero.core.worker import BackgroundWorker

    run = BackgroundWorker._run

    def run_then_linger(worker: BackgroundWorker) -> None:
        run(worker)
        time.sleep(2.0)  # what a starved thread's last steps cost: it ends after the interpreter might

    BackgroundWorker._run = run_then_linger
    model = models.make_model()
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config(tau=2, timeout_s=10), model=model)
    _train(rank, opt, model, 4)
    opt.finalize()
    return opt.engine.exchange.worker._thread.is_alive()


def test_finalize_joins_a_worker_slow_to_end():
    """A worker thread that outlives finalize() and ends while the interpreter shuts down aborts the
    process ("terminate called without an active exception", once in CI): finalize() waits for it."""
    assert run_ranks(slow_worker_exit, 2, timeout=120) == [False, False]


# ---- skip_round with Adam, frozen parameters, finalize after different step counts ----------------------


def _nan_gradient_on_rank_1(rank: int, model: torch.nn.Module, step: int) -> None:
    if rank == 1 and step == 3:
        next(model.parameters()).grad[0, 0] = float("nan")


def _train_with_a_nan_gradient_on_rank_1(rank: int, model, opt: CO2Optimizer, steps: int) -> tuple[list, list]:
    """Train `steps` steps, rank 1's gradient NaN at step 3 -> the parameters and `skipped_rounds` at
    every round end."""
    starts, skipped = [], []
    for step in range(steps):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        _nan_gradient_on_rank_1(rank, model, step)
        opt.step()
        if opt.round_ended:
            assert opt.last_round["round"] == len(skipped), opt.last_round  # 0 for the first, both modes
            skipped.append(opt.last_round["skipped_rounds"])
            starts.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return starts, skipped


def skip_round_with_adam(rank: int, overlap: bool) -> dict:
    """Adam, skip_round, a NaN gradient on rank 1 at step 3 (round 1): that round is skipped, rank 1's
    Adam state is reset, and every later round trains normally."""
    model = models.make_model("mlp")
    config = CO2Config(**{**PUBLISHED, "tau": 2}, nonfinite="skip_round", overlap=overlap, timeout_s=TIMEOUT_S)
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), config, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        starts, skipped = _train_with_a_nan_gradient_on_rank_1(rank, model, opt, 12)
        adam_finite = all(torch.isfinite(t).all() for s in opt.optimizer.state.values() for t in s.values())
        opt.finalize()
    return {
        "skipped": skipped,
        "starts": starts,
        "adam_finite": adam_finite,
        "warnings": [str(w.message) for w in caught],
        "final": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


SKIP_STEPS = 10  # 5 rounds at tau 2: sync_delay "auto" applies at the round end while it measures (0-4)


def skip_round_with_the_defaults(rank: int, collective: str) -> dict:
    """The defaults (the local stand-in) with skip_round and Adam: rank 1's NaN gradient at step 3 (the
    last of round 1) makes its displacement non-finite; it restarts round 2 from the shared start with
    a fresh Adam while rank 0 starts it from its stand-in; round 1 is skipped. Every round start and the
    final model, for the reference."""
    model = models.make_model("mlp")
    config = CO2Config(tau=2, nonfinite="skip_round", collective=collective, timeout_s=TIMEOUT_S)
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), config, model=model)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        starts, skipped = _train_with_a_nan_gradient_on_rank_1(rank, model, opt, SKIP_STEPS)
        opt.finalize()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    stand_in = opt.engine.config.effective_stand_in
    return {"starts": [first, *starts], "skipped": skipped, "final": final, "stand_in": stand_in}


def frozen_parameters(rank: int) -> dict:
    """The first layer's weight is frozen; rank 1's differs at construction (another init)."""
    out = {}
    model = models.make_model("mlp")
    frozen = model[0].weight
    frozen.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            frozen.add_(1.0)
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(tau=2, timeout_s=TIMEOUT_S), model)
    out["frozen_after_build"] = frozen.detach().clone()
    _train(rank, opt, model, 6)
    opt.finalize()
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    for change in ("unfreeze", "freeze"):
        model = models.make_model("mlp")
        model[0].weight.requires_grad_(False)
        opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(tau=2, timeout_s=TIMEOUT_S), model)
        _train(rank, opt, model, 3)
        (model[0].weight if change == "unfreeze" else model[2].bias).requires_grad_(change == "unfreeze")
        try:
            _train(rank, opt, model, 2)  # the round end at step 4
            out[change] = None
        except CO2Error as error:
            out[change] = str(error)
    return out


def finalize_after_different_steps(rank: int) -> dict:
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), CO2Config(tau=2, timeout_s=TIMEOUT_S))
    _train(rank, opt, model, 6 if rank == 0 else 4)
    began = time.monotonic()
    try:
        opt.finalize()
        return {"error": None, "elapsed": time.monotonic() - began}
    except CO2Error as error:
        return {"error": str(error), "elapsed": time.monotonic() - began}


HUGE = 1e20  # finite in fp32, but its square (and its half's, 2.5e39) is not


def huge_displacement(rank: int) -> dict:
    """Rank 1's inner step moves one weight by 1e20: finite, so CO2 must average it like any other
    displacement (the fp32 squares of the norms would overflow and report it as NaN)."""
    model = models.make_model("linear")
    config = CO2Config(tau=2, outer_lr=1.0, outer_momentum=0.0, timeout_s=TIMEOUT_S)  # the average, applied as is
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), config)
    before = model.weight.detach().clone()
    try:
        for step in range(2):
            x, y = models.batch(rank, step)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            if rank == 1 and step == 1:  # inside the round: its end averages this displacement
                with torch.no_grad():
                    model.weight[0, 0] += HUGE
            opt.step()
        opt.finalize()
    except CO2Error as error:
        return {"error": str(error)}
    return {"error": None, "before": before, "after": model.weight.detach().clone()}


def round_failures(rank: int, world: int) -> dict:
    return {
        "huge": huge_displacement(rank),
        "skip_overlap": skip_round_with_adam(rank, overlap=True),
        "skip_blocking": skip_round_with_adam(rank, overlap=False),
        **{f"skip_defaults_{c}": skip_round_with_the_defaults(rank, c) for c in ("all_reduce", "reduce_scatter")},
        "frozen": frozen_parameters(rank),
        "finalize": finalize_after_different_steps(rank),  # last: rank 0's extra round stays in flight
    }


@pytest.fixture(scope="module")
def round_results():
    return run_ranks(round_failures, 2, timeout=180)


@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_skip_round_with_adam_resets_the_nonfinite_rank_and_keeps_training(round_results, mode):
    first, second = (r[f"skip_{mode}"] for r in round_results)
    for rank, got in enumerate((first, second)):
        # round 1 is skipped (counted when its result arrives: one round later with overlap); no round after it
        assert got["skipped"] == ([0, 0, 1, 1, 1, 1] if mode == "overlap" else [0, 1, 1, 1, 1, 1]), got["skipped"]
        assert got["adam_finite"], f"rank {rank}: the inner optimizer state is still non-finite"
        assert any("replica(s) [1] held NaN or Inf" in w and "skipped on every replica" in w for w in got["warnings"])
        reset = [w for w in got["warnings"] if "inner optimizer state is reset" in w]
        assert bool(reset) == (rank == 1), got["warnings"]
    for t, (a, b) in enumerate(zip(first["starts"], second["starts"])):
        assert all(torch.isfinite(v).all() and torch.equal(v, b[k]) for k, v in a.items()), f"round {t} start"
    assert not torch.equal(first["starts"][-1]["0.weight"], first["starts"][-2]["0.weight"])  # still training
    assert all(torch.isfinite(v).all() and torch.equal(v, second["final"][k]) for k, v in first["final"].items())


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_skip_round_with_the_defaults_restarts_the_nonfinite_replica_from_the_shared_start(round_results, collective):
    """design §3, "Stand-ins": with the local stand-in a replica whose displacement is non-finite starts
    the next round from the shared start (the round is skipped everywhere, so that is its true next
    start), the others from their stand-ins; a skipped round leaves the outer momentum, and local's copy
    of it (reduce_scatter), as it was. Every replica's every round start and the final against the
    reference with round 1 cut and replica 1 restarted."""
    results = [r[f"skip_defaults_{collective}"] for r in round_results]
    assert results[0]["stand_in"] == "local" and results[0]["skipped"] == [0, 0, 1, 1, 1]
    record: list = []
    step_record: list = []
    finals = simulate(models.make_model, lambda p: torch.optim.Adam(p, lr=0.01), models.batch, models.loss_fn,
                      {"tau": 2}, replicas=2, steps=SKIP_STEPS, record=record, step_record=step_record,
                      schedule=[{0, 1}, None, {0, 1}, {0, 1}, {0, 1}], restarts=[(1, 2)])  # fmt: skip
    expected = replica_round_starts(record, step_record, tau=2)
    for rank, got in enumerate(results):
        assert len(got["starts"]) == len(expected)
        for t, start in enumerate(got["starts"]):
            assert_close(start, expected[t][rank], f"{collective} rank {rank} round-{t} start")
        assert_close(got["final"], finals[rank], f"{collective} rank {rank} final")
    assert not torch.equal(results[0]["starts"][2]["0.weight"], results[1]["starts"][2]["0.weight"])


def test_frozen_parameters_are_broadcast_and_stay_identical(round_results):
    first, second = (r["frozen"] for r in round_results)
    assert torch.equal(first["frozen_after_build"], second["frozen_after_build"])
    assert torch.equal(first["final"]["0.weight"], first["frozen_after_build"])  # frozen: never changed
    for name, value in first["final"].items():
        assert torch.equal(value, second["final"][name]), name


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_changing_requires_grad_after_construction_is_refused_at_the_next_round_end(round_results, change):
    phrase = (
        "0.weight (shape (8, 4)) was frozen and is now trainable"
        if change == "unfreeze"
        else ("2.bias (shape (3,)) was trainable and is now frozen")
    )
    for result in round_results:
        error = result["frozen"][change]
        assert error is not None and "round 1" in error and phrase in error and "reshard=True" in error, error


def test_finalize_after_different_step_counts_fails_on_every_rank_naming_them(round_results):
    for result in round_results:
        got = result["finalize"]
        assert got["error"] is not None and "rank 0: 6" in got["error"] and "rank 1: 4" in got["error"], got
        assert got["elapsed"] < TIMEOUT_S + 3.0, got


def test_a_huge_but_finite_displacement_is_averaged_not_reported_as_nan(round_results):
    first, second = (r["huge"] for r in round_results)
    assert first["error"] is None and second["error"] is None, (first["error"], second["error"])
    assert torch.equal(first["after"], second["after"])  # replicas identical
    moved = first["after"] - first["before"]
    assert torch.isfinite(moved).all()
    # the mean displacement of the two replicas, applied with outer_lr 1 (no gap in the first round)
    assert moved[0, 0].item() == pytest.approx(HUGE / 2, rel=1e-6)
    assert torch.equal(moved.flatten()[1:], torch.zeros_like(moved.flatten()[1:]))


# ---- finalize after step counts two round ends apart --------------------------------------------------------


def finalize_far_apart(rank: int, world: int) -> dict:
    """Rank 0 takes 6 steps and rank 1 takes 10 (tau 2), then both call finalize(): rank 1's round ends at
    8 and 10 run rounds rank 0 never joins (a pipeline, and with BatchNorm a buffer average). Each
    variant must end in a CO2Error naming the counts on both ranks, not in a timeout."""
    out = {}
    for variant in ("overlap", "blocking", "buffers"):
        model = models.make_model("bn" if variant == "buffers" else "mlp")
        config = CO2Config(tau=2, overlap=variant != "blocking", timeout_s=5)  # rank 1 waits it out 3 times
        opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), config, model=model)
        try:
            _train(rank, opt, model, 6 if rank == 0 else 10)
            opt.finalize()
            out[variant] = None
        except CO2Error as error:
            out[variant] = (type(error).__name__, str(error))
        # rank 1's unmatched round ends when its group times out; a gloo thread must not outlive the process
        opt.engine.exchange.worker.close(timeout=3 * config.timeout_s)
        torch.distributed.barrier()  # and the next variant's start-up check waits for nobody
    return out


@pytest.fixture(scope="module")
def far_apart_results():
    return run_ranks(finalize_far_apart, 2, timeout=240)


@pytest.mark.parametrize("variant", ["overlap", "blocking", "buffers"])
def test_finalize_two_round_ends_apart_names_the_counts_instead_of_timing_out(far_apart_results, variant):
    for rank, result in enumerate(far_apart_results):
        got = result[variant]
        assert got is not None and got[0] == "CO2Error", f"rank {rank}: {got}"
        message = got[1]
        assert "different numbers of inner steps" in message and "rank 0: 6" in message, message
        assert "rank 1: 8" in message or "rank 1: 10" in message, message
        assert "Rank(s) [1] had not called finalize()" in message, message
