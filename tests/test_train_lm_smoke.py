"""Smoke test of scripts/train_lm.py: 2 ranks under torchrun, CO2 with tau=2, a tiny model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
    "--data_bytes", "300000", "--eval_batches", "4", "--eval_every", "5", "--warmup_steps", "5",
    "--lr", "1e-2", "--min_lr", "1e-3", "--no_progress",
]  # fmt: skip


def test_train_lm_co2_two_ranks(tmp_path):
    out = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "scripts" / "train_lm.py"), "--method", "co2", "--max_steps", "40", "--tau", "2",
        "--out_json", str(out), *TINY,
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    recs = [json.loads(line) for line in out.read_text().splitlines()]
    summary = [r for r in recs if r.get("summary")]
    rounds = [r for r in recs if not r.get("summary") and r["step"] > 0]
    assert len(summary) == 1 and len(rounds) >= 1
    assert all(math.isfinite(r["loss"]) for r in rounds)
    assert all(r["wait_s"] >= 0 and r["round_end_s"] >= r["wait_s"] for r in rounds)
    initial, final = recs[0]["val_loss"], summary[0]["val_loss"]
    assert recs[0]["step"] == 0 and math.isfinite(initial)
    assert math.isfinite(final) and final < initial - 0.5, (initial, final)
    assert summary[0]["steps"] == 40 and summary[0]["world_size"] == 2
    assert summary[0]["co2_state_bytes"] > 0
