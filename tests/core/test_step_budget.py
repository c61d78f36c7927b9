"""A run whose known length does not fit CO2's rounds is said when it is built, not at its end: co2-train
refuses a --max_steps shorter than one round and warns when it rounds one up; Hugging Face Trainer's
callback warns for its max_steps; `finalize()` says when no round ended (docs/configuration.md, tau)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from co2_zero.core.step_budget import step_budget_problem
from co2_zero.train import args as train_args
from co2_zero.train import preflight
from tests import models
from tests.dist_utils import run_ranks


def test_the_problem_names_both_numbers_and_what_fits():
    assert step_budget_problem(64, 32) is None and step_budget_problem(32, 32) is None
    short = step_budget_problem(40, 100)
    assert "max_steps=40 is shorter than one CO2 round (tau=100)" in short and "started from" in short
    assert "accepted: tau <= 40" in short
    partial = step_budget_problem(100, 32, "--max_steps", "--tau")
    assert "--max_steps=100 is not a multiple of --tau=32" in partial and "last 4 step(s)" in partial
    assert "accepted: --max_steps 96 or 128" in partial


def test_co2_train_refuses_max_steps_shorter_than_a_round(capsys):
    with pytest.raises(SystemExit):
        train_args.get_args(["--max_steps", "20", "--tau", "64"])
    err = capsys.readouterr().err
    assert "--max_steps=20 is shorter than one CO2 round (--tau=64)" in err and "--tau <= 20" in err, err
    assert train_args.get_args(["--max_steps", "20", "--tau", "64", "--method", "ddp"]).max_steps == 20
    with pytest.raises(SystemExit):  # the default tau (32) counts too
        train_args.get_args(["--max_steps", "20"])


def test_co2_train_rounds_up_to_whole_rounds_and_says_so():
    args = types.SimpleNamespace(max_steps=100)
    config = train_args.co2_config(train_args.get_args(["--tau", "32"]))
    with pytest.warns(UserWarning, match=r"--max_steps 100 is not a multiple of tau=32: training 128 steps"):
        preflight.fit_to_whole_rounds(args, config, rank=0)
    assert args.max_steps == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight.fit_to_whole_rounds(args, config, rank=0)  # whole rounds already: nothing to say
        args.max_steps = 100
        preflight.fit_to_whole_rounds(args, config, rank=1)  # rank 0 says it
    assert args.max_steps == 128


def test_hf_callback_warns_when_max_steps_is_not_whole_rounds(monkeypatch):
    hf = pytest.importorskip("co2_zero.hf")
    import co2_zero.deepspeed as co2_deepspeed

    with co2_deepspeed.patch():  # CO2Callback() patches DeepSpeed; leaving the block puts it back as it was
        _warns_on_train_begin(hf, monkeypatch)


def _warns_on_train_begin(hf, monkeypatch) -> None:
    callback = hf.CO2Callback()
    stub = types.SimpleNamespace(config=types.SimpleNamespace(tau=6))
    monkeypatch.setattr(hf, "_co2_optimizer", lambda optimizer: stub)
    args = types.SimpleNamespace(save_strategy="no", save_only_model=False)
    with pytest.warns(UserWarning, match=r"max_steps=4 is shorter than one CO2 round \(co2.tau=6\)"):
        callback.on_train_begin(args, types.SimpleNamespace(max_steps=4), None, optimizer=object())
    with pytest.warns(UserWarning, match=r"max_steps=20 is not a multiple of co2.tau=6"):
        callback.on_train_begin(args, types.SimpleNamespace(max_steps=20), None, optimizer=object())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_train_begin(args, types.SimpleNamespace(max_steps=12), None, optimizer=object())


def _no_round(rank: int, world: int) -> dict:
    from co2_zero import CO2Config, CO2Optimizer

    model = models.make_model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), CO2Config(tau=4), model=model)
    for step in range(3):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.finalize()
    same = all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    return {"warnings": [str(w.message) for w in caught], "back_at_start": same}


def test_finalize_says_when_no_round_ended():
    for got in run_ranks(_no_round, 2):
        assert got["back_at_start"]
        assert any("no round ended (tau=4)" in w and "the 3 inner step(s)" in w for w in got["warnings"]), got
