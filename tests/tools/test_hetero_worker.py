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
    assert "'4,x': accepted: one integer per replica, comma-separated" in capsys.readouterr().err


class _Engine:
    """CO2's engine as the worker sees it: ends round k after `lengths[k]` steps, with a new pace object
    where the length changes (`replica_tau: "auto"` changes a τ_r at a round end)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.rounds, self.into, self.pace = lengths, 0, 0, object()

    def step(self) -> None:
        self.into += 1
        if self.into == self.lengths[self.rounds]:
            self.rounds, self.into = self.rounds + 1, 0
            if self.rounds < len(self.lengths) and self.lengths[self.rounds] != self.lengths[self.rounds - 1]:
                self.pace = object()


class _CO2:
    """The optimizer: its steps count on the engine."""

    def __init__(self, engine: _Engine) -> None:
        self.engine, self.clock_step = engine, 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        self.engine.step()


def _run(monkeypatch) -> "hetero_worker.Run":
    monkeypatch.setattr(hetero_worker.dist, "get_rank", lambda: 0)
    args = hetero_worker.get_args(["--rounds", "2", "--result", "r.json", "--tau", "4", "--pacing", "auto"])
    model = torch.nn.Linear(1, 1)
    batches = SimpleNamespace(micro_batches=lambda: [(torch.ones(1), torch.ones(()))])
    run = hetero_worker.Run(model, batches, args, steps=8)
    run.forward = lambda x, y: (model(x) - y).square().sum()
    return run


def test_a_round_ends_where_the_engine_ends_it(monkeypatch):
    """The worker's rounds are the engine's: a τ_r raised at a round end (2 steps, then 4) does not carry the
    round before into the next one; each round's last step is timed apart (a round end), the others as steps.
    DDP's steps (no engine) are all steps."""
    run, engine = _run(monkeypatch), _Engine([4, 2, 4, 4])
    inner = torch.optim.SGD(run.model.parameters(), lr=0.1)
    for _ in engine.lengths:
        before = (engine.rounds, engine.into)
        run.train_round(_CO2(engine), inner)
        assert (engine.rounds, engine.into) == (before[0] + 1, 0)
    assert (len(run.round_end_step_s), len(run.step_s)) == (4, 3 + 1 + 3 + 3)
    assert run.inner_step(inner, inner, 0.0) is False and len(run.step_s) == 11
