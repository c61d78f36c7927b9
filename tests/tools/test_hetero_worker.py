"""scripts/hetero_worker.py's speed measurement: the speeds `replica_tau` is built from in the benchmark."""

import time
from argparse import Namespace
from types import SimpleNamespace

import torch

from scripts import hetero_worker


class _FirstStepSlow(torch.nn.Module):
    """A loss whose first forward takes 0.5 s and every later one 0.02 s: a one-off start-up cost."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.calls = torch.nn.Parameter(torch.ones(())), 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.5 if self.calls == 1 else 0.02)
        return self.w * 1.0


def test_calibration_leaves_out_the_first_step_and_times_at_least_four(monkeypatch):
    monkeypatch.setattr(hetero_worker.dist, "get_rank", lambda: 0)
    model, tokens_per_step = _FirstStepSlow(), 2 * 4
    args = Namespace(seed=0, batch_size=2, block_size=4, calibrate_s=0.0)
    tokens_per_s = hetero_worker.calibrate(model, SimpleNamespace(train=torch.arange(64)), args)
    assert model.calls == 1 + hetero_worker.CALIBRATION_STEPS
    # 0.02 s a step gives 400 tokens/s; the first step timed would give at most 8 · 5 / 0.58 = 69
    assert tokens_per_s > tokens_per_step / 0.06, tokens_per_s
    assert model.w.grad is None  # the measurement leaves no gradient behind


def test_pinned_pacing_takes_its_taus_and_only_it(capsys):
    """--pacing pinned runs the τ_r given by --pinned_taus (an auto run's); --pinned_taus with another pacing,
    or pinned without them, is refused naming both (and the job's --tau is not read as an abbreviation)."""
    import pytest

    tiny = ["--rounds", "2", "--result", "r.json", "--tau", "4"]
    assert hetero_worker.get_args([*tiny, "--pacing", "pinned", "--pinned_taus", "4,2"]).pinned_taus == [4, 2]
    for flags in (["--pacing", "pinned"], ["--pacing", "auto", "--pinned_taus", "4,2"]):
        with pytest.raises(SystemExit):
            hetero_worker.get_args([*tiny, *flags])
        assert "accepted: --pinned_taus with --pacing pinned only" in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        hetero_worker.get_args([*tiny, "--pacing", "pinned", "--pinned_taus", "4,x"])
    assert "'4,x': accepted: integers separated by commas" in capsys.readouterr().err
