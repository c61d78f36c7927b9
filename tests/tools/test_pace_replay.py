"""scripts/pace_replay.py: the readings, their errors and each rule's share of the replicas' own speeds, by
hand on a run of known timings; the command on a study folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts import pace_replay

RUN = {"method": "auto", "case": "half", "rep": 0, "paces": [[0, [8, 4]], [2, [8, 3]]],
       "own_tokens_per_s": [1000.0, 400.0], "decision_step_ms": [[1.0, 2.0], [1.0, 3.2]]}  # fmt: skip


def test_both_readings_are_the_geometric_mean_and_errors_are_against_the_run():
    times = pace_replay.readings(RUN["decision_step_ms"])
    assert times["both"] == pytest.approx([1.0, 2.5298], abs=1e-4)  # √(2 · 3.2)
    errors = pace_replay.relative_errors(times["first"], RUN["own_tokens_per_s"])
    assert errors == pytest.approx([0.0, 0.5 / 0.4 - 1])  # read at half the fastest's speed, trained at 0.4


def test_a_rule_shares_what_its_slowest_round_allows():
    # [8, 3] at 1000 and 400 tokens/s of steps: rounds of max(8 / 1000, 3 / 400) = 8 ms, 11 steps in them
    assert pace_replay.share_of_own([8, 3], [1000.0, 400.0]) == pytest.approx(11 / 0.008 / 1400)
    # [8, 4]: the slow replica's 10 ms set the round
    assert pace_replay.share_of_own([8, 4], [1000.0, 400.0]) == pytest.approx(12 / 0.010 / 1400)
    rules = pace_replay.replay(RUN, 8)["rules"]
    assert rules["timed round"]["taus"] == [8, 2] and rules["both"]["taus"] == [8, 3]


def test_the_command_writes_its_json_and_refuses_a_study_without_auto(tmp_path):
    (tmp_path / "runs.json").write_text(json.dumps({"meta": {}, "runs": [RUN, {**RUN, "method": "uniform"}]}))
    command = [sys.executable, "-m", "scripts.pace_replay", str(tmp_path), "--tau", "8"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "timed round, hedged (now)" in done.stdout
    written = json.loads((tmp_path / "pace_replay.json").read_text())
    assert [r["case"] for r in written["runs"]] == ["half"] and written["within_speed_error"]["first"] == [1, 2]
    (tmp_path / "runs.json").write_text(json.dumps({"meta": {}, "runs": [{**RUN, "method": "uniform"}]}))
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode != 0 and "no 'auto' run" in refused.stderr
