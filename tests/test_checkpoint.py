"""Checkpoints: exact resume mid-round with a round in flight, and resharding to another R."""

from __future__ import annotations

import pytest
import torch

from co2_zero import CO2Error, CO2Optimizer, checkpoint
from co2_zero.checkpoint import consolidate
from tests import models
from tests.dist_utils import run_ranks

CONFIGS = {
    "all_reduce": {"tau": 3, "outer_lr": 0.8, "outer_momentum": 0.5, "collective": "all_reduce",
                   "gap_penalty": {"mode": "adaptive", "strength": 1.5}},
    "reduce_scatter": {"tau": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                       "collective": "reduce_scatter", "clip": {"mode": "norm", "threshold": 0.1}},
}
SAVE_AT, TOTAL = 7, 14  # 7 = mid-round, with round 1's exchange in flight


def _build(config: dict):
    model = models.make_model("mlp")
    return model, CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), config, model=model)


def _train(rank: int, model, opt, first: int, last: int) -> None:
    for step in range(first, last):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def interrupted_and_uninterrupted(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        _train(rank, model, opt, 0, TOTAL)
        opt.finalize()
        out[name] = _params(model)

        model, opt = _build(config)
        _train(rank, model, opt, 0, SAVE_AT)
        out[f"{name}-in-flight"] = opt.engine.pending_round is not None
        checkpoint.save(f"{root}/{name}", model, opt, extra={"step": SAVE_AT})
    return out


def resumed(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        step = checkpoint.load(f"{root}/{name}", model, opt)["step"]
        _train(rank, model, opt, step, TOTAL)
        opt.finalize()
        out[name] = _params(model)
    model, opt = _build({**CONFIGS["all_reduce"], "tau": 4})
    try:
        checkpoint.load(f"{root}/all_reduce", model, opt)
    except CO2Error as error:
        out["wrong-config"] = str(error)
    return out


def resharded(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        with pytest.warns(UserWarning, match="dropped"):
            checkpoint.load(f"{root}/{name}", model, opt, reshard=True)
        out[name] = {"share": consolidate(opt.engine.state_dict()), "live": _params(model)}
        _train(rank, model, opt, SAVE_AT, TOTAL)
        opt.finalize()
        out[f"{name}-final"] = _params(model)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    first = run_ranks(interrupted_and_uninterrupted, 2, root)
    second = run_ranks(resumed, 2, root)
    return root, first, second


def test_resume_mid_round_is_bit_exact(runs):
    _, first, second = runs
    for rank in range(2):
        for name in CONFIGS:
            assert first[rank][f"{name}-in-flight"], "the checkpoint should be taken with a round in flight"
            for key, value in first[rank][name].items():
                assert torch.equal(second[rank][name][key], value), f"{name} rank {rank} {key}"


def test_resume_with_another_config_is_refused(runs):
    _, _, second = runs
    for result in second:
        assert "config_hash" in result["wrong-config"] and "same co2 config" in result["wrong-config"]


def _assemble(shares: list) -> dict:
    """Per (field, tensor): the full flat vector, checking every element is given exactly once."""
    parts: dict = {}
    for share in shares:
        for piece in share["pieces"]:
            for field in ("start_point", "next_start", "momentum"):
                parts.setdefault((field, piece["tensor_id"]), []).append((piece["offset"], piece[field]))
    full = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        offsets = [o for o, _ in pieces]
        ends = [o + t.numel() for o, t in pieces]
        assert offsets[0] == 0 and offsets[1:] == ends[:-1], f"{key}: pieces overlap or leave a gap"
        full[key] = torch.cat([t for _, t in pieces])
    return full


def _saved_files(directory: str) -> list:
    """Every rank's payload of the newest complete checkpoint in `directory`, in rank order."""
    (tag, marker), = checkpoint.complete_checkpoints(directory)[-1:]
    return [checkpoint.load_file(f"{directory}/{tag}/{entry['name']}") for entry in marker["files"]]


def test_reshard_two_replicas_to_four(runs):
    root, first, _ = runs
    results = run_ranks(resharded, 4, root)
    for name in CONFIGS:
        saved = _saved_files(f"{root}/{name}")
        assert len(saved) == 2
        expected = _assemble([consolidate(s["co2"]) for s in saved])
        got = _assemble([r[name]["share"] for r in results])
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{name} {key}"
        model = models.make_model("mlp")
        for rank in range(4):  # every replica resumes from the saved start point
            for i, (pname, _) in enumerate(model.named_parameters()):
                start = expected[("start_point", i)]
                assert torch.equal(results[rank][name]["live"][pname].reshape(-1), start), pname
        for rank in range(1, 4):
            for key, value in results[0][f"{name}-final"].items():
                assert torch.equal(results[rank][f"{name}-final"][key], value)
