"""A resharded load keeps the error-feedback residuals (docs/design.md §7, docs/checkpoints.md).

Saved mid-round (step 5 of tau = 2, an exchange in flight) at top-5% int2 (the sparse exchange) and int8
`reduce_scatter` (which also keeps an owner's residual of the start point's update); loaded with
reshard=True:
- the same R, another S: FSDP2's S x R = 2 x 2 onto a plain CO2Optimizer's 1 x 2: each replica's
  displacement residual, element for element, is what its two shards held;
- the same grid: every residual as saved, bit for bit;
- another R (2 onto 4): every new replica's displacement residual is the mean of the saved replicas' (the
  exchange sends the mean of what the replicas send: the mean of their residuals is what it still owes),
  and the owners' residual is cut element for element like the start point.
The residuals are read from the engines and put together per parameter tensor by the tests themselves.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Optimizer, checkpoint
from tests import models
from tests.core.test_pace_reshard import _fsdp2
from tests.dist_utils import run_ranks

SPARSE = {"tau": 2, "topk": 0.05, "comm_dtype": "int2"}
INT8 = {"tau": 2, "comm_dtype": "int8", "collective": "reduce_scatter"}
SAVED_AT = 5


def per_tensor(engine, name: str) -> dict[int, list]:
    """This rank's residual `name` ("displacement": over its partition; "gathered": its sub-shard) as
    {parameter tensor id: [(element offset, values)]}."""
    state = engine.state_dict()
    values, geometry = state["residuals"][name], state["geometry"]
    lo, hi = (0, geometry["padded"]) if name == "displacement" else geometry["sub_shard"]
    found: dict[int, list] = {}
    for tensor_id, seg_start, seg_end, offset in geometry["segments"]:
        a, b = max(seg_start, lo), min(seg_end, hi)
        if a < b:
            found.setdefault(tensor_id, []).append((offset + a - seg_start, values[a - lo : b - lo].clone()))
    return found


def whole(*parts: dict[int, list]) -> dict[int, torch.Tensor]:
    """Pieces of several ranks put together per tensor, in element order (each element once)."""
    merged: dict[int, list] = {}
    for part in parts:
        for tensor_id, pieces in part.items():
            merged.setdefault(tensor_id, []).extend(pieces)
    out = {}
    for tensor_id, pieces in merged.items():
        pieces.sort(key=lambda piece: piece[0])
        assert all(a[0] + a[1].numel() == b[0] for a, b in zip(pieces, pieces[1:])), tensor_id
        out[tensor_id] = torch.cat([values for _, values in pieces])
    return out


def _plain(config: dict):
    model = models.make_model("mlp")
    return model, CO2Optimizer(models.make_optimizer("sgd", model.parameters()), config, model=model)


def _train(model, opt, replica: int, shard: int, shards: int) -> None:
    for step in range(SAVED_AT):
        x, y = models.shard_batch(replica, shard, step, shards) if shards > 1 else models.batch(replica, step)
        opt.zero_grad()
        models.loss_fn(model(x).float(), y).backward()
        opt.step()


def save(rank: int, world: int, directory: str, config: dict, shards: int) -> dict:
    replica, shard = divmod(rank, shards)
    model, opt = _fsdp2({**config, "shards_per_replica": shards}) if shards > 1 else _plain(config)
    _train(model, opt, replica, shard, shards)
    checkpoint.save(directory, model, opt)
    residuals = opt.engine.state_dict()["residuals"]
    held = {name: per_tensor(opt.engine, name) for name in residuals if residuals[name].numel()}
    opt.engine.close()
    dist.barrier()
    return held


def load(rank: int, world: int, directory: str, config: dict) -> dict:
    model, opt = _plain(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step after the last round end is dropped, and says so
        checkpoint.load(directory, model, opt, reshard=True)
    residuals = opt.engine.state_dict()["residuals"]
    held = {name: per_tensor(opt.engine, name) for name in residuals if residuals[name].numel()}
    opt.engine.close()
    return held


def _equal(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for tensor_id in a:
        assert torch.equal(a[tensor_id], b[tensor_id]), f"{what}: parameter tensor {tensor_id}"


def test_the_same_r_onto_another_s_keeps_each_replicas_residual(tmp_path):
    directory = str(tmp_path / "fsdp")
    saved = run_ranks(save, 4, directory, SPARSE, 2, timeout=300)
    loaded = run_ranks(load, 2, directory, SPARSE, timeout=300)
    for replica in (0, 1):
        expected = whole(*(s["displacement"] for s in saved[2 * replica : 2 * replica + 2]))
        assert any(v.any() for v in expected.values())  # there is something to keep
        _equal(whole(loaded[replica]["displacement"]), expected, f"replica {replica}")


@pytest.mark.parametrize("config", [SPARSE, INT8], ids=["top-k int2", "int8 reduce_scatter"])
def test_the_same_grid_keeps_every_residual_and_another_r_shares_them(tmp_path, config):
    directory = str(tmp_path / "plain")
    saved = run_ranks(save, 2, directory, config, 1, timeout=300)
    same = run_ranks(load, 2, directory, config, timeout=300)
    for rank in (0, 1):
        assert same[rank].keys() == saved[rank].keys()
        for name in saved[rank]:
            _equal(whole(same[rank][name]), whole(saved[rank][name]), f"rank {rank} {name}")
    onto_four = run_ranks(load, 4, directory, config, timeout=300)
    replicas = [whole(s["displacement"]) for s in saved]
    mean = {t: (replicas[0][t] + replicas[1][t]) / 2 for t in replicas[0]}
    for rank, got in enumerate(onto_four):
        for tensor_id, values in whole(got["displacement"]).items():
            torch.testing.assert_close(values, mean[tensor_id], rtol=0, atol=1e-7, msg=f"rank {rank} {tensor_id}")
    if "gathered" in saved[0]:  # the owners' residual: every element once, as saved
        _equal(whole(*(got["gathered"] for got in onto_four)), whole(*(s["gathered"] for s in saved)), "gathered")
