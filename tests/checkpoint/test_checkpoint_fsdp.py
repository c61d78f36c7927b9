"""Resharding checkpoints of FSDP2 models (co2_zero.checkpoint, reshard=True) on real gloo processes.

An FSDP2 run of S = 2 x R = 2 loads as FSDP2 S = 1 x R = 2, as plain CO2Optimizer (R = 2) and as
DeepSpeed ZeRO-1 (S = 1 x R = 2), and as FSDP2 S = 1 x R = 4; a plain and a DeepSpeed run of R = 2 load
as FSDP2 S = 2 x R = 2. The model has uneven shards at S = 2 (a dim 0 of 5, and of 1: an empty shard)
and a frozen parameter; every target starts from scrambled weights. Each run saves at step 7, with the
round that ended at step 6 in flight, so every load resumes at step 6 with a fresh inner optimizer.

Checked: the files hold plain tensors only (the rows an FSDP2 rank holds); after a load the live
weights are the saved start point and the CO2 state re-cut per tensor equals the saved one, exactly;
with R = 2 every further step and the final model match the independent reference (tests/reference.py)
run straight through with its inner optimizers rebuilt at step 6; a refused load changes nothing.

A replica's batch is the same 8 rows whatever S is (rank (r, s) takes its 8 / S rows), so the
reference is one run of R = 2 replicas for every layout.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Error, CO2Optimizer, checkpoint, fsdp
from co2_zero.checkpoint import consolidate, cut_rows
from co2_zero.integration import local_optimizer_state
from tests import models
from tests.checkpoint.test_checkpoint import _assemble, _saved_files
from tests.compare import same
from tests.dist_utils import run_ranks
from tests.integrations.test_fsdp import _assert_close, make_model, shard
from tests.reference import simulate

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children

# the published shared start, so that the reference is a straight run with fresh_inner_at (inner state
# rebuilt, nothing else); stand-ins rebuilt by a resharded load: tests/checkpoint/test_checkpoint_phases.py
CO2 = {
    "tau": 3,
    "outer_lr": 0.8,
    "outer_momentum": 0.5,
    "stand_in": "shared",
    "gap_penalty": {"mode": "adaptive", "strength": 1.5},
    "collective": "reduce_scatter",
}
ADAMW = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
FROZEN = ("0.bias",)  # 5 rows: 3 and 2 at S = 2
ROWS = 8  # a replica's batch
SAVE_AT, RESUME_AT, TOTAL = 7, 6, 12
CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# target name: (saved run, world, built as). Those with R = 2 are compared with the reference.
TARGETS = {
    "fsdp22-to-fsdp12": ("fsdp", 2, "fsdp"),
    "fsdp22-to-plain2": ("fsdp", 2, "plain"),
    "fsdp22-to-ds12": ("fsdp", 2, "deepspeed"),
    "plain2-to-fsdp22": ("plain", 4, "fsdp"),
    "ds12-to-fsdp22": ("ds", 4, "fsdp"),
    "fsdp22-to-fsdp14": ("fsdp", 4, "fsdp-r4"),
}
REPLICAS = {name: 4 if built == "fsdp-r4" else 2 for name, (_, _, built) in TARGETS.items()}


def _batch(rank: int, step: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank (r, s)'s rows of replica r's batch at `step`: the replica's batch does not depend on S."""
    r, s = divmod(rank, shards)
    x, y = models.batch(r, step, rows=ROWS)
    n = ROWS // shards
    return x[n * s : n * (s + 1)], y[n * s : n * (s + 1)]


def _model() -> torch.nn.Module:
    return make_model("uneven", FROZEN)


# ---- the three integrations, as the children build and train them ----------------------------------------


class Run:
    """One model and CO2 optimizer of one integration: build, train, read the full weights."""

    def __init__(self, kind: str, rank: int, world: int, model: torch.nn.Module | None = None) -> None:
        self.kind, self.rank = kind, rank
        if kind in ("fsdp", "fsdp-r4"):
            from co2_zero.fsdp import replica_mesh

            self.shards = 1 if kind == "fsdp-r4" or world == 2 else 2
            config = {**CO2, "shards_per_replica": self.shards}
            self.model = shard(model if model is not None else _model(), replica_mesh(config))
            self.opt = CO2Optimizer(torch.optim.AdamW(self.model.parameters(), **ADAMW), config, model=self.model)
            self.engine = self.opt.engine
        elif kind == "plain":
            self.shards, self.model = 1, _model()
            self.opt = CO2Optimizer(torch.optim.AdamW(self.model.parameters(), **ADAMW), CO2, model=self.model)
            self.engine = self.opt.engine
        else:
            self._build_deepspeed(rank)

    def _build_deepspeed(self, rank: int) -> None:
        import co2_zero.deepspeed as co2_deepspeed

        os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
        config = json.loads((CONFIGS / "ds_zero1_co2.json").read_text())
        config["optimizer"]["params"].update({**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True})
        del config["scheduler"]
        config["gradient_clipping"] = 0.0  # set, so DeepSpeed's gradients are exact (docs/design.md §8)
        config["co2"].update({**CO2, "shards_per_replica": 1})
        self.shards, self.model = 1, _model()
        self.ds, self.opt, _, _ = co2_deepspeed.initialize(
            model=self.model, model_parameters=self.model.parameters(), config=config
        )
        self.engine = self.opt.engine

    def train(self, first: int, last: int, record: list | None = None) -> None:
        forward = self.ds if self.kind == "deepspeed" else self.model
        for step in range(first, last):
            x, y = _batch(self.rank, step, self.shards)
            loss = models.loss_fn(forward(x), y)
            if self.kind == "deepspeed":
                self.ds.backward(loss)
                self.ds.step()
            else:
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            if record is not None:
                record.append(self.full())

    def full(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (FSDP2: gathered over the replica, collective)."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        return out

    def scramble(self) -> None:
        """Every parameter elsewhere (in place): all of it must come from the checkpoint."""
        with torch.no_grad():
            for p in self.model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).mul_(-3.0).add_(0.5)

    def save(self, directory: str) -> None:
        if self.kind == "deepspeed":
            self.ds.save_checkpoint(directory)
        else:
            checkpoint.save(directory, self.model, self.opt)

    def load(self, directory: str) -> list[str]:
        """reshard=True; returns the warnings it gave."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.kind == "deepspeed":
                self.ds.load_checkpoint(directory, reshard=True)
            else:
                checkpoint.load(directory, self.model, self.opt, reshard=True)
        return [str(w.message) for w in caught]

    def snapshot(self) -> dict:
        """Everything a load could change: local weights, inner optimizer state, CO2 state (copies)."""
        inner = local_optimizer_state(self.opt.optimizer.state_dict(), fsdp.DTENSOR_ROWS)[0]
        co2 = self.engine.state_dict()
        return copy.deepcopy(
            {
                "params": {
                    n: (p.to_local() if hasattr(p, "to_local") else p).detach()
                    for n, p in self.model.named_parameters()
                },
                "inner": inner["state"],
                "co2": co2,
            }
        )


def _source(kind: str, rank: int, world: int, directory: str) -> list:
    """Train 0..SAVE_AT from the common init and save; the full weights after every step."""
    run = Run(kind, rank, world)
    steps: list = []
    run.train(0, SAVE_AT, record=steps)
    run.save(directory)
    run.opt.finalize()
    return steps


def _target(kind: str, rank: int, world: int, directory: str, last: int) -> dict:
    """Build, scramble, load with reshard=True, then train RESUME_AT..last and finalize."""
    run = Run(kind, rank, world)
    run.scramble()
    out = {"warnings": run.load(directory), "loaded": run.full(), "share": consolidate(run.engine.state_dict())}
    out["steps"] = []
    run.train(RESUME_AT, last, record=out["steps"])
    run.opt.finalize()
    out["final"] = run.full()
    return out


def _refused(run: Run, directory: str) -> dict:
    before = run.snapshot()
    try:
        run.load(directory)
        error = None
    except CO2Error as caught:
        error = str(caught)
    return {"error": error, "unchanged": same(before, run.snapshot())}


def _refusals(rank: int, world: int, root: str) -> dict:
    """FSDP2 S = 2 x R = 2 mid-round (inner state present): a saved file missing, a model with a buffer
    the checkpoint lacks. Refused on every rank, nothing changed."""
    if rank == 0:
        shutil.copytree(f"{root}/fsdp", f"{root}/missing")
        ((tag, marker),) = checkpoint.complete_checkpoints(f"{root}/missing")
        os.remove(f"{root}/missing/{tag}/{marker['files'][3]['name']}")
    dist.barrier()
    run = Run("fsdp", rank, world)
    run.train(0, 2)
    out = {"missing": _refused(run, f"{root}/missing")}
    run.opt.finalize()

    model = _model()
    model[4].register_buffer("scale", torch.ones(3))
    run = Run("fsdp", rank, world, model)
    run.train(0, 2)
    out["extra_buffer"] = _refused(run, f"{root}/fsdp")
    run.opt.finalize()
    return out


def sources_w2(rank: int, world: int, root: str) -> dict:
    return {
        "plain": _source("plain", rank, world, f"{root}/plain"),
        "ds": _source("deepspeed", rank, world, f"{root}/ds"),
    }


def fsdp_w4(rank: int, world: int, root: str) -> dict:
    out = {"fsdp": _source("fsdp", rank, world, f"{root}/fsdp")}
    for name, (saved, target_world, kind) in TARGETS.items():
        if target_world == world:
            last = TOTAL if REPLICAS[name] == 2 else RESUME_AT + CO2["tau"]  # R = 4: through one round end
            out[name] = _target(kind, rank, world, f"{root}/{saved}", last)
    out["refusals"] = _refusals(rank, world, root)
    return out


def targets_w2(rank: int, world: int, root: str) -> dict:
    return {
        name: _target(kind, rank, world, f"{root}/{saved}", TOTAL)
        for name, (saved, target_world, kind) in TARGETS.items()
        if target_world == world
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = str(tmp_path_factory.mktemp("fsdpckpt"))
    first = run_ranks(sources_w2, 2, root, timeout=300)
    second = run_ranks(fsdp_w4, 4, root, timeout=300)
    third = run_ranks(targets_w2, 2, root, timeout=300)
    per_rank = {name: [r[name] for r in (second if TARGETS[name][1] == 4 else third)] for name in TARGETS}
    sources = {
        "plain": [r["plain"] for r in first],
        "ds": [r["ds"] for r in first],
        "fsdp": [r["fsdp"] for r in second],
    }
    return {"root": root, "sources": sources, "targets": per_rank, "refusals": [r["refusals"] for r in second]}


# ---- the reference ---------------------------------------------------------------------------------------


def _reference(steps: int, finalize: bool, fresh_inner_at=None, step_record=None) -> list:
    return simulate(
        _model,
        lambda params: torch.optim.AdamW(params, **ADAMW),
        lambda r, k: models.batch(r, k, rows=ROWS),
        models.loss_fn,
        CO2,
        replicas=2,
        steps=steps,
        finalize=finalize,
        step_record=step_record,
        fresh_inner_at=fresh_inner_at,
    )


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("saved", ["fsdp", "plain", "ds"])
def test_saved_runs_match_the_reference(results, saved):
    """The premise: every saved run trained as the reference says up to its save."""
    expected: list = []
    _reference(SAVE_AT, False, step_record=expected)
    shards = 2 if saved == "fsdp" else 1
    for rank, steps in enumerate(results["sources"][saved]):
        assert len(steps) == SAVE_AT
        for k, got in enumerate(steps):
            _assert_close(got, expected[k][rank // shards], f"{saved} rank {rank} after step {k + 1}")


def test_fsdp_files_hold_the_rows_of_every_parameter_as_plain_tensors(results):
    """Read without any process group: each rank's rows, placed by `module_rows`, rebuild every
    parameter (frozen and uneven ones included) as it was at the save; the Adam moments are plain
    tensors of the rows' shapes."""
    files = _saved_files(f"{results['root']}/fsdp")
    at_save = results["sources"]["fsdp"]
    for replica in range(2):
        for name, whole in at_save[2 * replica][-1].items():
            pieces = []
            for payload in files[2 * replica : 2 * replica + 2]:
                first, shape = payload["module_rows"][name]
                assert shape == list(whole.shape) and type(payload["module"][name]) is torch.Tensor
                pieces.append((first, payload["module"][name]))
            assert torch.equal(cut_rows(pieces, 0, whole.shape[0]), whole), (replica, name)
    for payload in files:
        inner = payload["framework"]["inner_optimizer"]["state"]
        assert payload["framework"]["sharded_state"], "no Adam moment recorded as sharded"
        for index, key in payload["framework"]["sharded_state"]:
            assert type(inner[index][key]) is torch.Tensor
        assert payload["identity"]["integration"] == "fsdp2"


@pytest.mark.parametrize("name", list(TARGETS))
def test_resharded_load_restores_the_saved_state_exactly(results, name):
    """Live weights = the saved run's last round start, the frozen parameter = the saved one, and the
    CO2 state (start points, next start points, momentum) re-cut per tensor = the saved one; the
    staleness-gap norms keep their sum."""
    saved_name, _, _ = TARGETS[name]
    saved = _saved_files(f"{results['root']}/{saved_name}")
    saved_shares = [consolidate(s["co2"]) for s in saved]
    expected = _assemble(saved_shares)
    got = results["targets"][name]
    assert len(got) == TARGETS[name][1]
    assert _assemble([r["share"] for r in got]).keys() == expected.keys()
    for key, value in _assemble([r["share"] for r in got]).items():
        assert torch.equal(value, expected[key]), (name, key)
    norms = [s["update_sq_norms_partial"] for s in saved_shares]
    loaded_norms = [r["share"]["update_sq_norms_partial"] for r in got]
    torch.testing.assert_close(torch.stack(loaded_norms).sum(0), torch.stack(norms).sum(0))
    trainable = [n for n, p in _model().named_parameters() if p.requires_grad]
    frozen = {n: p.detach() for n, p in _model().named_parameters() if not p.requires_grad}
    for rank, per_rank in enumerate(got):
        assert any("dropped" in w and "step 6" in w for w in per_rank["warnings"]), per_rank["warnings"]
        for i, pname in enumerate(trainable):
            live = per_rank["loaded"][pname].reshape(-1)
            assert torch.equal(live, expected[("start_point", i)]), (name, rank, pname)
        for pname, value in frozen.items():
            assert torch.equal(per_rank["loaded"][pname], value), (name, rank, pname)


@pytest.mark.parametrize("name", [n for n in TARGETS if REPLICAS[n] == 2])
def test_training_continues_as_the_reference_predicts(results, name):
    """Steps 7..12 after the load and the final model: the reference run straight through, its inner
    optimizers rebuilt at step 6 (where the load resumes, with fresh inner state)."""
    expected: list = []
    _reference(TOTAL, False, fresh_inner_at=RESUME_AT, step_record=expected)
    finals = _reference(TOTAL, True, fresh_inner_at=RESUME_AT)
    got = results["targets"][name]
    shards = len(got) // 2
    for rank, per_rank in enumerate(got):
        assert len(per_rank["steps"]) == TOTAL - RESUME_AT
        for k, step in enumerate(per_rank["steps"]):
            _assert_close(
                step, expected[RESUME_AT + k][rank // shards], f"{name} rank {rank} after step {RESUME_AT + k + 1}"
            )
        _assert_close(per_rank["final"], finals[rank // shards], f"{name} rank {rank} final")


def test_another_replica_count_trains_on_to_one_model(results):
    """S = 1 x R = 4 from S = 2 x R = 2: trains on through a round end; finalize gives one model."""
    got = results["targets"]["fsdp22-to-fsdp14"]
    for per_rank in got[1:]:
        assert same(per_rank["final"], got[0]["final"])
    assert not same(got[0]["final"], got[0]["loaded"])


@pytest.mark.parametrize("case", ["missing", "extra_buffer"])
def test_a_refused_load_changes_nothing(results, case):
    phrase = {"missing": "missing or unreadable", "extra_buffer": "lacks ['4.scale']"}[case]
    for rank, per_rank in enumerate(results["refusals"]):
        got = per_rank[case]
        assert got["error"] is not None and phrase in got["error"], (rank, got["error"])
        assert "failed on rank(s) [0, 1, 2, 3]" in got["error"], got["error"]
        assert got["unchanged"], f"{case}: the refused load changed rank {rank}'s state"


def test_cut_rows_from_pieces():
    """Pure: rows from overlapping pieces; a gap is named."""
    whole = torch.arange(20.0).reshape(5, 4)
    pieces = [(0, whole[:3]), (3, whole[3:]), (0, whole)]
    assert torch.equal(cut_rows(pieces, 2, 3), whole[2:5])
    assert torch.equal(cut_rows(pieces[:2], 0, 5), whole)
    assert cut_rows(pieces, 5, 0).shape == (0, 4)
    with pytest.raises(ValueError, match="rows 3..4"):
        cut_rows([(0, whole[:3])], 0, 5)
