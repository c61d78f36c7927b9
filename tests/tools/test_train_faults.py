"""Faults under the training job, co2_zero.train (issue 66): a rank killed (SIGKILL) as it reaches a
collective the job issues itself, the loss average of a log point. The survivor must fail with the
library's CO2Error naming the step, the collective and the lost rank, within the deadline, not with a
bare gloo RuntimeError from the loop.

Real processes (tests/dist_utils.py's `launch_ranks`, gloo, 2 ranks, one thread each), on a loaded host.
"""

from __future__ import annotations

import os
import signal
import socket

import torch.distributed as dist

from tests.dist_utils import busy_host, launch_ranks
from tests.tools.test_train_lm_smoke import TINY

TIMEOUT_S = 20.0  # the job's --timeout_s: the survivor fails well within it (a closed connection is seen at once)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_torchrun(rank: int, world: int, port: int) -> None:
    """Leave the harness's process group: the tool makes its own from the environment, as under torchrun."""
    dist.destroy_process_group()
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "MASTER_PORT": port}
    os.environ.update({key: str(value) for key, value in env.items()}, MASTER_ADDR="127.0.0.1")


def train_losing_rank_1(rank: int, world: int, port: int, workdir: str, method: str) -> None:
    """`co2_zero.train.main` on this rank, in a process group of its own (the job makes it from the
    environment, as under torchrun); rank 1 SIGKILLs itself as it reaches its second loss average."""
    from co2_zero.train import loop

    _as_torchrun(rank, world, port)
    original, calls = loop.mean_loss_and_stop, []

    def dying(*args):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args)

    loop.mean_loss_and_stop = dying
    flags = ["--method", method, "--max_steps", "16", "--tau", "2", "--log_every", "2", "--eval_every", "0",
             "--timeout_s", str(TIMEOUT_S), "--threads", "1"]  # fmt: skip
    os.chdir(workdir)
    loop.main([*flags, *TINY])


def _survivor_names_the_lost_rank(survivor, killed, what: str) -> None:
    """Rank 1 was killed; rank 0 failed at once (well within the deadline) with the CO2Error naming `what`,
    the group and rank 1."""
    assert killed.exitcode == -signal.SIGKILL, killed
    assert survivor.exitcode not in (0, None) and survivor.error, f"rank 0 did not fail: {survivor}"
    last = survivor.error.strip().splitlines()[-1]
    assert last.startswith(f"co2_zero.core.errors.CO2Error: co2: {what}"), last
    assert "global ranks [0, 1]" in last and "waited for rank 1" in last, last
    assert survivor.ended_at - killed.ended_at < TIMEOUT_S, (survivor.ended_at, killed.ended_at)


def test_a_rank_killed_at_the_loss_average_fails_the_survivor_with_a_co2_error_naming_it(tmp_path):
    """Rank 1 is killed as it reaches the loss average of a log point: rank 0, inside that all-reduce,
    raises `CO2Error` naming the step, the loss average and rank 1, at once (a closed connection is no
    timeout), on a loaded host."""
    with busy_host():
        survivor, killed = launch_ranks(train_losing_rank_1, 2, _free_port(), str(tmp_path), "co2", timeout=240)
    _survivor_names_the_lost_rank(survivor, killed, "step 4: the loss average")


def tune_losing_rank_1(rank: int, world: int, port: int) -> None:
    """`co2-tune-tau`'s `tune` on this rank, in a process group of its own; rank 1 SIGKILLs itself as it
    reaches the tuner's first collective, the slowest rank's step time."""
    from co2_zero.train import tune_measure, tune_tau

    _as_torchrun(rank, world, port)
    original = tune_measure.slowest_rank

    def dying(*args, **kwargs):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    tune_measure.slowest_rank = dying
    tune_tau.tune(["--steps", "2", "--reps", "1", "--verify_rounds", "0", "--timeout_s", str(TIMEOUT_S), *TINY])


def test_a_rank_killed_in_the_tuner_fails_the_survivor_with_a_co2_error_naming_it():
    """Rank 1 of `co2-tune-tau` is killed as it reaches the tuner's first collective (the slowest rank's step
    time): rank 0, inside that all-reduce, raises `CO2Error` naming it and rank 1, not gloo's bare error."""
    with busy_host():
        survivor, killed = launch_ranks(tune_losing_rank_1, 2, _free_port(), timeout=240)
    _survivor_names_the_lost_rank(survivor, killed, "the tuner's slowest-rank time")
