"""Checkpoints: exact resume mid-round with a round in flight, and resharding to another R."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from co2_zero import CO2Error, CO2Optimizer, checkpoint
from co2_zero.checkpoint import consolidate
from co2_zero.core.config import PUBLISHED
from tests import models
from tests.compare import param_copies, same
from tests.dist_utils import run_ranks

CONFIGS = {
    "all_reduce": {
        "tau": 3,
        "outer_lr": 0.8,
        "outer_momentum": 0.5,
        "collective": "all_reduce",
        "gap_penalty": {"mode": "adaptive", "strength": 1.5},
    },
    "reduce_scatter": {
        "tau": 3,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
        "collective": "reduce_scatter",
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "shared",  # clipping: no stand-in is defined with it
    },
    # the local stand-in over a sharded momentum: each rank's own start and its copy of the outer momentum
    # travel with its file (docs/design.md §3)
    "local-copy": {
        "tau": 3,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
        "collective": "reduce_scatter",
        "stand_in": "local",
    },
    # a sync delay: saved at step 7, before round 1's average is applied at step 8 (docs/design.md §3); with
    # the local stand-in, each rank's copy of the outer momentum travels too
    "sync_delay": {"tau": 3, "sync_delay": 2, "outer_lr": 0.8, "outer_momentum": 0.5, "collective": "all_reduce"},
    "sync_delay-local": {
        "tau": 3,
        "sync_delay": 2,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
        "collective": "reduce_scatter",
        "stand_in": "local",
    },
}
SAVE_AT, TOTAL = 7, 14  # 7 = mid-round, with round 1's exchange in flight


def _build(config: dict):
    model = models.make_model("mlp")
    return model, CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), config, model=model)


def interrupted_and_uninterrupted(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        models.train_steps(rank, model, opt, 0, TOTAL)
        opt.finalize()
        out[name] = param_copies(model)

        model, opt = _build(config)
        models.train_steps(rank, model, opt, 0, SAVE_AT)
        out[f"{name}-in-flight"] = opt.engine.pending_round is not None
        checkpoint.save(f"{root}/{name}", model, opt, extra={"step": SAVE_AT})
    return out


def resumed(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        step = checkpoint.load(f"{root}/{name}", model, opt)["step"]
        models.train_steps(rank, model, opt, step, TOTAL)
        opt.finalize()
        out[name] = param_copies(model)
    model, opt = _build({**CONFIGS["all_reduce"], "tau": 4})
    try:
        checkpoint.load(f"{root}/all_reduce", model, opt)
    except CO2Error as error:
        out["wrong-config"] = str(error)
    out.update(_published_under_new_defaults(rank, f"{root}/published"))
    return out


def _published_under_new_defaults(rank: int, directory: str) -> dict:
    """A checkpoint saved under CO2 as published: refused under the defaults with the preset named, and
    loaded under `PUBLISHED`."""
    model, opt = _build(PUBLISHED)
    models.train_steps(rank, model, opt, 0, 2)
    checkpoint.save(directory, model, opt, extra={"step": 2})
    out = {}
    try:
        checkpoint.load(directory, *_build({}))
    except CO2Error as error:
        out["old-defaults"] = str(error)
    out["published-step"] = checkpoint.load(directory, *_build(PUBLISHED))["step"]
    return out


def resharded(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, opt = _build(config)
        with pytest.warns(UserWarning, match="dropped"):
            checkpoint.load(f"{root}/{name}", model, opt, reshard=True)
        own_momentum = opt.engine.state.own_momentum
        out[name] = {
            "share": consolidate(opt.engine.state_dict()),
            "live": param_copies(model),
            "own_momentum": None if own_momentum is None else own_momentum.clone(),
        }
        models.train_steps(rank, model, opt, SAVE_AT, TOTAL)
        opt.finalize()
        out[f"{name}-final"] = param_copies(model)
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


def test_a_checkpoint_of_the_old_defaults_names_the_published_preset(runs):
    """A checkpoint saved under CO2 as published (the defaults of co2_zero 0.1) is refused under the
    defaults, naming the preset that holds it, and loads under it."""
    _, _, second = runs
    for result in second:
        assert "config_hash" in result["old-defaults"] and "co2_zero.core.config.PUBLISHED" in result["old-defaults"]
        assert result["published-step"] == 2


def _assemble(shares: list) -> dict:
    """Per (field, tensor): the full flat vector, checking every element is given exactly once."""
    parts: dict = {}
    for share in shares:
        for piece in share["pieces"]:
            for field in ("start_point", "next_start", "momentum"):
                if piece[field] is not None:  # no next start: none pending
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
    ((tag, marker),) = checkpoint.complete_checkpoints(directory)[-1:]
    return [checkpoint.load_file(f"{directory}/{tag}/{entry['name']}") for entry in marker["files"]]


STAND_IN_KEPT = ("all_reduce", "local-copy")  # no sync delay and a stand-in (all_reduce: the defaults' local)


def test_reshard_two_replicas_to_four(runs):
    """The CO2 state re-cut per tensor is the saved one; with a sync delay the average that arrived is applied
    at once (the start point is the saved next start, none is pending); replica m resumes from saved replica m
    % 2's stand-in (its own start; local's copy of the momentum as of the start point), else from the start
    point. Every step after it is checked against the reference in
    tests/checkpoint/test_checkpoint_phases.py."""
    root, first, _ = runs
    results = run_ranks(resharded, 4, root)
    for name, config in CONFIGS.items():
        saved = _saved_files(f"{root}/{name}")
        assert len(saved) == 2
        expected = _assemble([consolidate(s["co2"]) for s in saved])
        applied = config.get("sync_delay") is not None
        if applied:
            for i in range(len(SIZES)):
                expected[("start_point", i)] = expected.pop(("next_start", i))
        got = _assemble([r[name]["share"] for r in results])
        assert expected.keys() == got.keys(), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{name} {key}"
        momentum = torch.cat([expected[("momentum", i)] for i in range(len(SIZES))])
        start = torch.cat([expected[("start_point", i)] for i in range(len(SIZES))])
        for rank in range(4):
            source = saved[rank % 2]["co2"]
            copy = results[rank][name]["own_momentum"]
            if name == "sync_delay-local":
                assert torch.equal(copy[: momentum.numel()], momentum), (name, rank)
            elif name == "local-copy":
                assert torch.equal(copy, source["own_momentum"]), (name, rank)
            else:
                assert copy is None, name  # no stand-in, or local with all_reduce: it reads the momentum itself
            live = torch.cat([p.reshape(-1) for p in results[rank][name]["live"].values()])
            want = source["own_start"][: start.numel()] if name in STAND_IN_KEPT else start
            assert torch.equal(live, want), (name, rank)
        for rank in range(1, 4):
            for key, value in results[0][f"{name}-final"].items():
                assert torch.equal(results[rank][f"{name}-final"][key], value)


# ---- pure functions and file helpers, without processes -------------------------------------------------


def _geometry(sizes, owned, replicas, replica, strategy="all_reduce", overlap=True, tau=3):
    """A RoundEngine geometry for a partition made of `owned` (tensor id, first element, numel) pieces,
    written down independently of the engine: the partition padded to a multiple of R, sub-shard r."""
    segments, start = [], 0
    for tensor_id, first, numel in owned:
        segments.append([tensor_id, start, start + numel, first])
        start += numel
    padded = max(replicas, -(-start // replicas) * replicas)
    sub = padded // replicas
    sub_shard = [replica * sub, (replica + 1) * sub]
    return {
        "length": start,
        "padded": padded,
        "num_tensors": len(sizes),
        "segments": segments,
        "sub_shard": sub_shard,
        "momentum_range": sub_shard if strategy == "reduce_scatter" else [0, padded],
        "strategy": strategy,
        "overlap": overlap,
        "tau": tau,
    }


def _identity(geometry, rank, replicas, shards):
    return {
        "version": 2,
        "config_hash": "c0ffee",
        "grid": {"replicas": replicas, "shards": shards},
        "rank": rank,
        "signature": "model-sig",
        "geometry": geometry,
    }


def _state_from_truth(identity, truth, inner_steps=8, tau=3, stand_in="shared"):
    """A rank's saved state holding the global truth (per tensor: start point, next start, momentum, norms;
    with the local stand-in its replica's own start, the start point x (2 + its replica), and its
    whole-partition copy of the momentum as of the start point, the momentum x 3: the padding stays 0)."""
    geo = identity["geometry"]
    vectors = {}
    for field in ("start_point", "next_start", "momentum"):
        flat = torch.zeros(geo["padded"])
        for tensor_id, start, end, first in geo["segments"]:
            flat[start:end] = truth[field][tensor_id][first : first + end - start]
        vectors[field] = flat
    lo, hi = geo["momentum_range"]
    norms = truth["norms"][identity["rank"] % len(truth["norms"])]
    local = stand_in == "local"
    replica = identity["rank"] // identity["grid"]["shards"]
    return {
        "stand_in": stand_in,
        "own_start": vectors["start_point"] * (2 + replica) if local else None,
        "own_momentum": vectors["momentum"] * 3 if local else None,
        **identity,
        "run_id": "r",
        "inner_steps": inner_steps,
        "rounds": inner_steps // tau,
        "skipped_rounds": 1,
        "fixed_sync_delay": 2,  # sync_delay "auto" fixed it: the resharded run keeps it
        "applies_at": tau,  # the next start is pending until the round end: resharding re-cuts it as it is
        "start_point": vectors["start_point"],
        "next_start": vectors["next_start"] if geo["overlap"] else None,
        "momentum": vectors["momentum"][lo:hi],
        "previous_update_sq_norms": norms,
    }


SIZES = [32, 8, 24, 3]  # the "mlp" model's tensors


def _truth(world):
    g = torch.Generator().manual_seed(7)
    truth = {f: [torch.randn(n, generator=g) for n in SIZES] for f in ("start_point", "next_start", "momentum")}
    truth["norms"] = [torch.rand(len(SIZES), generator=g) for _ in range(world)]
    return truth


def _whole():
    return [(i, 0, n) for i, n in enumerate(SIZES)]


def _zero_cut(shards):
    """ZeRO-style partitions: the model's tensors back to back, cut into S equal pieces (tensors split)."""
    total = sum(SIZES)
    size = -(-total // shards)
    parts = [[] for _ in range(shards)]
    offset = 0
    for i, n in enumerate(SIZES):
        for s in range(shards):
            lo, hi = max(offset, s * size), min(offset + n, (s + 1) * size)
            if lo < hi:
                parts[s].append((i, lo - offset, hi - lo))
        offset += n
    return parts


SAVED_RUNS = {
    "R2xS1-all_reduce": (2, 1, "all_reduce", lambda s: _whole()),
    "R2xS1-reduce_scatter": (2, 1, "reduce_scatter", lambda s: _whole()),
    "R2xS2-zero-split-tensors": (2, 2, "reduce_scatter", lambda s: _zero_cut(2)[s]),
}
TARGETS = {
    "R4xS1": (4, 1, "reduce_scatter", lambda s: _whole()),
    "R1xS2-oss-whole-tensors": (1, 2, "all_reduce", lambda s: [_whole()[i] for i in ((0, 3), (1, 2))[s]]),
    "R3xS1": (3, 1, "all_reduce", lambda s: _whole()),
}


def _run(replicas, shards, strategy, owned):
    return [
        _identity(_geometry(SIZES, owned(r % shards), replicas, r // shards, strategy), r, replicas, shards)
        for r in range(replicas * shards)
    ]


@pytest.mark.parametrize("stand_in", ["shared", "local"])
@pytest.mark.parametrize("saved_name", list(SAVED_RUNS))
@pytest.mark.parametrize("target_name", list(TARGETS))
def test_reshard_recuts_every_tensor_exactly(saved_name, target_name, stand_in):
    """consolidate + reshard from any saved R x S to any target: each target rank's start points, next
    start points and momentum slice are the global truth at its partition's places, and the local
    stand-in's own start and copy of the momentum those of saved replica (its replica % saved R); the
    staleness-gap partial norms keep their sum; the step falls back to the last round start."""
    saved_identities = _run(*SAVED_RUNS[saved_name])
    truth = _truth(len(saved_identities))
    shares = [consolidate(_state_from_truth(identity, truth, stand_in=stand_in)) for identity in saved_identities]
    norm_sums = []
    for identity in _run(*TARGETS[target_name]):
        state, dropped = checkpoint.reshard(shares, identity)
        assert dropped == 8 - 2 * 3 and state["inner_steps"] == 6 and state["rounds"] == 2
        assert state["skipped_rounds"] == 1 and state["run_id"] == "r" and state["fixed_sync_delay"] == 2
        source = (identity["rank"] // identity["grid"]["shards"]) % saved_identities[0]["grid"]["replicas"]
        expected = _state_from_truth(identity, truth, stand_in=stand_in)
        if stand_in == "local":  # saved replica `source`'s, not this replica's
            expected["own_start"] = expected["start_point"] * (2 + source)
        for field in ("start_point", "next_start", "momentum", "own_momentum", "own_start"):
            assert same(state[field], expected[field]), (identity["rank"], field)
        norm_sums.append(state["previous_update_sq_norms"])
    assert torch.allclose(torch.stack(norm_sums).sum(0), torch.stack(truth["norms"]).sum(0))


def test_a_local_copy_of_the_momentum_that_cannot_be_rebuilt_is_named():
    """The local stand-in's copy of the momentum as of the start point: rebuilt from a saved copy; from a run
    that kept none (all_reduce), for a target that keeps one, a warning text says what it costs."""
    saved = _run(*SAVED_RUNS["R2xS1-all_reduce"])
    truth = _truth(2)
    target = _run(*TARGETS["R4xS1"])[0]
    with_copy = [consolidate(_state_from_truth(identity, truth, stand_in="local")) for identity in saved]
    without = [consolidate({**_state_from_truth(i, truth, stand_in="local"), "own_momentum": None}) for i in saved]
    state, _ = checkpoint.reshard(without, target)
    assert "kept no copy" in checkpoint.stand_in_cost(without, state, keeps_copy=True)
    assert checkpoint.stand_in_cost(without, state, keeps_copy=False) is None  # all_reduce: reads the momentum
    assert checkpoint.stand_in_cost(with_copy, checkpoint.reshard(with_copy, target)[0], keeps_copy=True) is None


def test_reshard_refuses_missing_shares_and_another_config():
    saved = _run(*SAVED_RUNS["R2xS1-reduce_scatter"])
    truth = _truth(2)
    shares = [consolidate(_state_from_truth(identity, truth)) for identity in saved]
    target = _run(*TARGETS["R4xS1"])[0]
    with pytest.raises(ValueError, match="cover"):
        checkpoint.reshard(shares[1:], target)  # rank 0's file missing
    with pytest.raises(ValueError, match="config_hash"):
        checkpoint.reshard(shares, {**target, "config_hash": "other"})
    with pytest.raises(ValueError, match="signature"):
        checkpoint.reshard(shares, {**target, "signature": "another model"})


@pytest.mark.parametrize("tag", ["", ".", "..", "../x", "a/b", "/abs", "a\\b", ".hidden", "x\0y", "t" * 201])
def test_tags_that_could_escape_the_directory_are_refused(tag):
    with pytest.raises(ValueError, match="tag="):
        checkpoint.check_tag(tag)


def test_plain_tags_are_accepted():
    for tag in ("step00000012", "global_step7", "best-ckpt_1", "t" * 200):
        assert checkpoint.check_tag(tag) == tag


def test_only_plain_data_is_saved(tmp_path):
    assert checkpoint.plain_data_problem({"a": [1, 2.0, "x", None, (torch.zeros(2), torch.float32)]}) is None
    problem = checkpoint.plain_data_problem({"extra": {"sched": {"fn": lambda s: s}}})
    assert "state['extra']['sched']['fn']" in problem and "function" in problem
    with pytest.raises(ValueError, match="weights_only"):
        checkpoint.save_atomic({"opt": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)}, tmp_path / "f.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_files_get_the_umask_permissions(tmp_path, umask):
    previous = os.umask(umask)
    try:
        size, digest = checkpoint.save_atomic({"x": torch.arange(3)}, tmp_path / "f.pt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "f.pt").stat().st_mode) == 0o666 & ~umask
    assert (size, digest) == checkpoint.file_digest(tmp_path / "f.pt")


def test_a_failed_write_leaves_the_previous_file_and_no_temp_file(tmp_path):
    target = tmp_path / "f.pt"
    checkpoint.save_atomic({"x": 1}, target)

    def fail(f):
        f.write(b"half a file")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        checkpoint.write_atomic(target, fail)
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"] and checkpoint.load_file(target) == {"x": 1}


def test_each_rank_cleans_only_its_own_temp_files(tmp_path):
    names = [
        ".co2_rank00000.ab.pt.1.tmp",
        ".co2_rank00001.ab.pt.2.tmp",
        ".co2_rank00007.ab.pt.3.tmp",
        ".co2_complete.json.4.tmp",
        ".latest_co2.5.tmp",
        "co2_rank00001.0123456789abcdef.pt",
    ]
    (tmp_path / "t").mkdir()
    for name in names:
        (tmp_path / "t" / name).write_bytes(b"x")
    (tmp_path / ".latest_co2.6.tmp").write_bytes(b"x")
    assert checkpoint.clean_temp_files(tmp_path, rank=1, world_size=2) == 1
    assert not (tmp_path / "t" / names[1]).exists()
    assert checkpoint.clean_temp_files(tmp_path, rank=0, world_size=2) == 5  # its own, marker/latest, rank 7
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["co2_rank00001.0123456789abcdef.pt"]
