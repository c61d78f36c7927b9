"""A --save_dir belongs to one run (co2_zero/train/ownership.py): real launches of the training job, one
process each (a world of one: the checkpoints and their run id are what matters here, not the averaging).

Run A saves steps 4 and 8; run B (another seed) launched into the same directory refuses before it trains,
naming both runs and the flags that would do what it meant, and leaves A's checkpoints and `latest` as
they were; A's --resume continues A and saves there again. Two runs launched into one empty directory at
the same time: one of them refuses, the other's checkpoints are whole and `latest` names its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tools.test_train_lm_smoke import SCRIPT, TINY, _env, run_job

RUN = [*TINY, "--tau", "2", "--max_steps", "8", "--save_every", "4", "--save_dir", "ckpt", "--eval_every", "4"]


def _marker(directory: Path) -> dict:
    return json.loads((directory / "co2_complete.json").read_text())


def _saved(ckpt: Path) -> dict[str, tuple]:
    """Per checkpoint directory: (its run id, its save id, its files' names)."""
    return {
        d.name: (_marker(d)["run_id"], _marker(d)["save_id"], sorted(p.name for p in d.iterdir()))
        for d in sorted(ckpt.glob("step*"))
    }


def test_another_run_in_a_used_save_dir_refuses_and_changes_nothing(tmp_path):
    run_job(tmp_path, [*RUN, "--seed", "1"], ranks=1)
    ckpt = tmp_path / "ckpt"
    before, latest = _saved(ckpt), (ckpt / "latest").read_text()
    (owner,) = {run_id for run_id, _, _ in before.values()}
    _, stderr = run_job(tmp_path, [*RUN, "--seed", "2"], ranks=1, ok=False)
    assert f"--save_dir {Path('ckpt')} holds the checkpoints of run {owner}" in stderr, stderr[-3000:]
    assert "this launch is run " in stderr and "--resume" in stderr and "a new --save_dir" in stderr, stderr[-3000:]
    assert "error: --save_dir" in stderr and "Traceback" not in stderr, stderr[-3000:]  # one line, an operator's
    assert _saved(ckpt) == before and (ckpt / "latest").read_text() == latest == "step00000008"
    # A itself continues there: a resumed run keeps its run id
    records, stderr = run_job(tmp_path, [*RUN, "--seed", "1", "--resume", "--max_steps", "12"], ranks=1)
    assert records[-1]["steps"] == 12 and (ckpt / "latest").read_text() == "step00000012", stderr[-3000:]
    assert {run_id for run_id, _, _ in _saved(ckpt).values()} == {owner}


def test_two_runs_launched_into_one_directory_cannot_both_succeed(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *RUN, "--seed", str(seed), "--out_json", f"out{seed}.jsonl"],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in (1, 2)
    ]
    ended = [(proc.wait(timeout=240), proc.communicate()[1]) for proc in procs]
    codes = sorted(code for code, _ in ended)
    assert codes[0] == 0 and codes[1] != 0, [err[-2000:] for _, err in ended]
    refused = next(err for code, err in ended if code != 0)
    assert "holds the checkpoints of run" in refused, refused[-3000:]
    saved = _saved(tmp_path / "ckpt")
    assert sorted(saved) == ["step00000004", "step00000008"] and len({r for r, _, _ in saved.values()}) == 1
    assert (tmp_path / "ckpt" / "latest").read_text() == "step00000008"
