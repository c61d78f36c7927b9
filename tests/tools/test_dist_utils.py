"""The test harness itself: a rank that dies of a signal or hangs is reported with every thread's frames."""

import os
import time

import pytest

from tests.dist_utils import run_ranks


def _abort_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # what a C++ std::terminate does: SIGABRT, no Python traceback
    return rank


def _hang_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(3600)  # a rank stuck for good: killed at the deadline
    return rank


@pytest.mark.parametrize(
    "fn, timeout, how",
    [(_abort_on_rank_one, 60, "exited with code -6"), (_hang_on_rank_one, 15, "still running after 15 s (killed)")],
)
def test_a_dead_or_stuck_rank_is_named_with_its_frames(fn, timeout, how):
    with pytest.raises(AssertionError) as failed:
        run_ranks(fn, 2, timeout=timeout)
    report = str(failed.value)
    assert f"rank 1 {how}; its threads:" in report
    assert fn.__name__ in report  # the frame that aborted or hung, from faulthandler's dump
    assert "rank 0" not in report  # the rank that returned is not blamed
