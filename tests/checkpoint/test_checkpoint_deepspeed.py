"""DeepSpeed checkpoints through co2_zero.checkpoint on real gloo processes (2 ranks, ZeRO-1).

A reused tag whose save failed on one rank (torch.save's RuntimeError: a full disk) keeps loading its
previous complete state on every rank; a refused load (another co2 config, an empty file on one rank)
changes nothing (module, fp32 partition, ZeRO inner state, CO2 state, LR scheduler, step counters);
DeepSpeed checkpoints reshard (S = 1 x R = 2 onto S = 2 x R = 1, and onto CO2Optimizer); frozen
parameters are broadcast at start and a change of requires_grad is refused at the next round end.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Error, CO2Optimizer, checkpoint
from tests import models
from tests.compare import clone_state, param_copies, same
from tests.dist_utils import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children
co2_deepspeed = pytest.importorskip("co2_zero.deepspeed")

TIMEOUT_S = 4.0
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the published shared start: a resharded load resumes every replica at the saved round's shared start, which
# the tests compare with the live model there (with a stand-in, each replica's own start differs from it)
CO2 = {
    "tau": 3,
    "outer_lr": 0.8,
    "outer_momentum": 0.5,
    "stand_in": "shared",
    "timeout_s": TIMEOUT_S,
    "shards_per_replica": 1,
}


def _config(**co2) -> dict:
    config = json.loads((CONFIGS / "ds_zero1_co2.json").read_text())
    config["optimizer"]["params"].update(lr=0.02)
    config["scheduler"]["params"].update(warmup_min_lr=0.002, warmup_max_lr=0.02, warmup_num_steps=4)
    config["co2"].update({**CO2, **co2})
    return config


def _initialize(model=None, **co2):
    model = model if model is not None else models.make_model()
    engine, opt, _, _ = co2_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(**co2)
    )
    return engine, opt


def _train(engine, rank: int, first: int, last: int) -> None:
    shards = engine.optimizer.topology.shards
    for step in range(first, last):
        x, y = models.shard_batch(rank // shards, rank % shards, step, shards)
        engine.backward(models.loss_fn(engine(x), y))
        engine.step()


def _snapshot(engine) -> dict:
    """Everything a DeepSpeed load could change."""
    zero = engine.optimizer
    return {
        "module": clone_state(engine.module.state_dict()),
        "fp32": clone_state(list(zero.single_partition_of_fp32_groups)),
        "zero_inner": clone_state(zero.optimizer.state_dict()),
        "co2": clone_state(zero.engine.state_dict()),
        "scheduler": clone_state(engine.lr_scheduler.state_dict()),
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps),
    }


def _refused(engine, action) -> dict:
    before = _snapshot(engine)
    began = time.monotonic()
    try:
        action()
        error = None
    except CO2Error as caught:
        error = str(caught)
    return {"error": error, "elapsed": time.monotonic() - began, "unchanged": same(before, _snapshot(engine))}


def reused_tag(rank: int, root: str) -> dict:
    """Tag "t" complete at step 4; a save of "t" at step 8 that fails on rank 1 (RuntimeError from
    torch.save, a full disk); a fresh engine loads "t" through latest_co2: step 4 on both ranks."""
    engine, opt = _initialize()
    _train(engine, rank, 0, 4)
    engine.save_checkpoint(root, tag="t", client_state={"step": 4})
    out = {"params4": param_copies(engine.module)}
    _train(engine, rank, 4, 8)
    original = torch.save

    def full_disk(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] PytorchStreamWriter failed writing file")

    torch.save = full_disk if rank == 1 else original
    began = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="t", client_state={"step": 8})
        out["failed_save"] = None
    except CO2Error as error:
        out["failed_save"] = str(error)
    finally:
        torch.save = original
    out["failed_save_s"] = time.monotonic() - began
    opt.finalize()

    engine, opt = _initialize()
    directory, client = co2_deepspeed.load_checkpoint(engine, root)
    out.update(tag=directory.name, client=client, global_steps=engine.global_steps, params=param_copies(engine.module))
    opt.finalize()
    return out


def refused(rank: int, root: str) -> dict:
    """Another co2 config, then an empty file on rank 1: refused on every rank, nothing changed."""
    engine, opt = _initialize()
    _train(engine, rank, 0, 4)
    engine.save_checkpoint(root)
    opt.finalize()
    out = {}
    engine, opt = _initialize(tau=4)
    _train(engine, rank, 0, 1)
    out["another_config"] = _refused(engine, lambda: engine.load_checkpoint(root))
    opt.finalize()

    dist.barrier()
    if rank == 0:
        tag, marker = checkpoint.complete_checkpoints(root)[-1]
        Path(root, tag, marker["files"][1]["name"]).write_bytes(b"")
    dist.barrier()
    engine, opt = _initialize()
    _train(engine, rank, 0, 1)
    out["empty_file"] = _refused(engine, lambda: engine.load_checkpoint(root))
    opt.finalize()
    return out


def resharded(rank: int, root: str) -> dict:
    """Saved at step 7 on S = 1 x R = 2 (the round that ended at step 6 in flight), loaded with
    reshard=True into S = 2 x R = 1 and into CO2Optimizer: every rank resumes at the round-6 start."""
    engine, opt = _initialize()
    _train(engine, rank, 0, 6)
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    out = {"start": flat, "live_at_save": None}
    _train(engine, rank, 6, 7)
    out["live_at_save"] = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    engine.save_checkpoint(root)
    out["steps"] = engine.global_steps
    opt.finalize()

    engine, opt = _initialize(shards_per_replica=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(root, reshard=True)
    out["zero2"] = {
        "params": torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]),
        "warnings": [str(w.message) for w in caught],
        "global_steps": engine.global_steps,
    }
    _train(engine, rank, 6, 9)  # it trains on from there
    out["zero2"]["rounds_after"] = opt.engine.rounds
    opt.finalize()

    model = models.make_model()
    plain = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {k: v for k, v in CO2.items()}, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint.load(root, model, plain, reshard=True)
    out["plain"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    plain.finalize()
    return out


def frozen(rank: int) -> dict:
    model = models.make_model()
    model[0].weight.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    engine, opt = _initialize(model)
    out = {"frozen_after_build": model[0].weight.detach().clone()}
    _train(engine, rank, 0, 4)
    model[0].weight.requires_grad_(True)
    try:
        _train(engine, rank, 4, 6)
        out["unfreeze"] = None
    except CO2Error as error:
        out["unfreeze"] = str(error)
    return out


def run_all(rank: int, world: int, root: str) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
    # The first engine of a process takes seconds more on some ranks (DeepSpeed imports torch.compile's
    # stack): build it with a start-up deadline that allows for that, then use TIMEOUT_S throughout.
    _initialize(timeout_s=120)[1].finalize()
    return {
        "reused": reused_tag(rank, f"{root}/reused"),
        "refused": refused(rank, f"{root}/refused"),
        "resharded": resharded(rank, f"{root}/resharded"),
        "frozen": frozen(rank),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(run_all, 2, str(tmp_path_factory.mktemp("dsckpt")), timeout=300)


def test_a_reused_tag_whose_save_failed_loads_its_previous_state_on_every_rank(results):
    for rank, result in enumerate(results):
        got = result["reused"]
        assert got["failed_save"] is not None and "failed on rank(s) [1]" in got["failed_save"], got["failed_save"]
        assert "PytorchStreamWriter failed" in got["failed_save"] and got["failed_save_s"] < TIMEOUT_S + 3.0
        assert got["tag"] == "t" and got["client"] == {"step": 4} and got["global_steps"] == 4
        for key, value in got["params4"].items():
            assert torch.equal(got["params"][key], value), (rank, key)


@pytest.mark.parametrize("case", ["another_config", "empty_file"])
def test_a_refused_load_changes_nothing(results, case):
    phrases = {
        "another_config": ("failed on rank(s) [0, 1]", "config_hash"),
        "empty_file": ("failed on rank(s) [1]", "rank 1: co2_rank00001.", "0 bytes"),
    }[case]
    for result in results:
        got = result["refused"][case]
        assert got["error"] is not None and all(p in got["error"] for p in phrases), got["error"]
        assert got["elapsed"] < TIMEOUT_S + 3.0, got
        assert got["unchanged"], f"{case}: the refused load changed the engine's state"


def test_deepspeed_checkpoints_reshard(results):
    for result in results:
        got = result["resharded"]
        start = results[0]["resharded"]["start"]  # every replica's start point is the same
        assert torch.equal(got["start"], start) and not torch.equal(got["live_at_save"], start)
        assert torch.equal(got["zero2"]["params"], start), "ZeRO S=2: not the saved round start"
        assert torch.equal(got["plain"], start), "CO2Optimizer: not the saved round start"
        assert any("1 step(s)" in w and "dropped" in w for w in got["zero2"]["warnings"]), got["zero2"]["warnings"]
        assert got["zero2"]["global_steps"] == got["steps"] == 7  # the schedule and counters carry on
        assert got["zero2"]["rounds_after"] == 3


def test_frozen_parameters_are_broadcast_and_unfreezing_is_refused(results):
    first, second = (r["frozen"] for r in results)
    assert torch.equal(first["frozen_after_build"], second["frozen_after_build"])
    for result in (first, second):
        assert result["unfreeze"] is not None and "0.weight" in result["unfreeze"], result["unfreeze"]
        assert "was frozen and is now trainable" in result["unfreeze"], result["unfreeze"]
