"""The test harness itself: a rank that dies of a signal or hangs is reported with every thread's frames."""

import os
import time

import pytest

from tests.dist_utils import run_ranks


def _abort_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # what a C++ std::terminate does: SIGABRT, no Python traceback
    return rank


def test_a_native_abort_names_the_rank_and_its_frames():
    with pytest.raises(AssertionError) as failed:
        run_ranks(_abort_on_rank_one, 2, timeout=60)
    report = str(failed.value)
    assert "rank 1 exited with code -6; its threads:" in report
    assert "_abort_on_rank_one" in report  # the frame that aborted, from faulthandler's dump
    assert "rank 0" not in report  # the rank that returned is not blamed


def _hang_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(3600)  # a rank stuck for good: killed at the deadline
    return rank


def test_a_hang_names_the_rank_and_its_frames_before_the_kill():
    with pytest.raises(AssertionError) as failed:
        run_ranks(_hang_on_rank_one, 2, timeout=15)
    report = str(failed.value)
    assert "rank 1 still running after 15 s (killed); its threads:" in report
    assert "_hang_on_rank_one" in report  # where it hung, dumped before the kill
    assert "rank 0" not in report
