"""co2-tune-tau aimed at a link it is not on (--link_mbit, --latency_ms, --replicas: τ from the wire format's
bytes, no network), its figures in units that show them, an efficiency above 1.0 reported as noise, and its
advice monotone in τ (co2_zero/train/tune_tau.py, link.py, tune_report.py)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from co2_zero.train import link, tune_report, tune_tau
from scripts import bench_wire
from tests.tools.test_train_lm_smoke import _env

MODEL = ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "4"]


def test_the_closed_form_bytes_are_what_the_exchange_sends():
    """link.round_bytes (design §5) against `last_round["bytes_sent"]` of real 2-rank rounds, every format."""
    rows = bench_wire.measure_wire(argparse.Namespace(replicas=[2], params=3000))
    assert {r["wire"] for r in rows} == set(bench_wire.WIRES)
    for r in rows:
        assert r["closed_form"] == r["bytes_sent"], r


def test_tau_for_a_link_the_tuner_is_not_on(tmp_path):
    """One process, no network: t_comm is the format's bytes at the link's rate plus its latency per message."""
    out = tmp_path / "tune.json"
    flags = ["--link_mbit", "10", "--latency_ms", "2", "--replicas", "4", "--comm_dtype", "int8"]
    cmd = [sys.executable, "-m", "co2_zero.train.tune_tau", *MODEL, *flags, "--tune_json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    comm, rec = result["comm"], result["recommendation"]
    sent = link.round_bytes(result["params"], 4, "int8")
    assert comm["bytes_sent"] == sent > 0
    assert comm["t_comm"] == pytest.approx(sent * 8 / 10e6 + 6 * 2e-3)  # 2(R-1) messages of 2 ms
    assert rec["tau_comm"] == math.ceil(1.5 * comm["t_comm"] / result["compute"]["t_step"])
    assert "verify" not in result and "not measured" in proc.stdout and "10 Mbit/s link" in proc.stdout


def test_a_bad_link_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "co2_zero.train.tune_tau", "--link_mbit", "0"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
    assert "--link_mbit=0" in proc.stderr and "Traceback" not in proc.stderr


def test_small_payloads_and_rates_are_printed_in_units_that_show_them():
    measured = {"comm_dtype": "int8", "collective": "all_to_all", "outer_group_size": 2, "bytes_sent": 17_000,
                "sent_bits_per_s": 1.36e6}  # fmt: skip
    words = tune_report.exchange_words(measured)
    assert "17.0 kB sent per rank" in words and "1.36 Mbit/s" in words, words


def _check(tau: int, efficiency: float, verdict: str) -> dict:
    return {"tau": tau, "efficiency": efficiency, "verdict": verdict, "passes": verdict == "pass"}


def test_an_efficiency_above_one_is_noise_not_a_pass():
    measured = {"efficiency": 1.225, "book_fraction": 0.0, "hidden": True}
    assert tune_tau.verdict(measured, 0.95, 0.02) == "noise"
    assert tune_tau.verdict({**measured, "efficiency": 0.97}, 0.95, 0.02) == "pass"
    assert tune_tau.verdict({**measured, "efficiency": 0.596}, 0.95, 0.02) == "fail"
    line = tune_report.noise_line([{**_check(4, 1.225, "noise"), "noise": 0.31}])
    assert "31.0%" in line and "noise, not a pass" in line, line


def test_the_advice_is_monotone_in_tau():
    """A τ that passed below one that failed is not advised: the smallest τ at and above which all passed."""
    checks = [_check(3, 0.596, "fail"), _check(4, 1.225, "noise"), _check(6, 0.97, "pass"), _check(8, 0.98, "pass")]
    assert tune_tau.choose_tau(checks) == {"tau": 6, "verified": True}
    bumpy = [_check(4, 0.96, "pass"), _check(6, 0.90, "fail"), _check(8, 0.97, "pass")]
    assert tune_tau.choose_tau(bumpy) == {"tau": 8, "verified": True}
    none = [_check(3, 0.596, "fail"), _check(4, 1.225, "noise")]
    assert tune_tau.choose_tau(none) == {"tau": 3, "verified": False, "best_efficiency": 0.596}
