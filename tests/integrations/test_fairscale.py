"""CO2OSS on real gloo processes against the independent single-process reference.

Rank (r, s) = global rank r*S + s trains on `shard_batch(r, s, step)`; the reference trains one model
per replica on the concatenation of its shards' batches with gradients averaged over S. All scenarios
of one world size run in one spawn; each test then checks one property of the recorded results.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from co2_zero import CO2Optimizer, checkpoint
from tests import models
from tests.compare import assert_close
from tests.dist_utils import run_ranks
from tests.reference import replica_round_starts, resolve_config, simulate, stand_in_words
from tests.scenarios import co2

co2_fairscale = pytest.importorskip("co2_zero.fairscale")
CO2OSS = co2_fairscale.CO2OSS
FairScaleSDP = pytest.importorskip("fairscale.nn.data_parallel").ShardedDataParallel


OVERLAP_SGD = dict(config=co2("overlap-heavyball-adaptive-allreduce-t2"), steps=7)

# S = 2 x R = 2 on 4 ranks.
SHARDED = {
    # uneven OSS partitions (262 / 265 elements, different tensor mixes); a train/eval switch mid-round
    # makes ShardedDataParallel rebuild the OSS buckets (the partition's storage moves)
    "sdp-overlap-adam-uneven-clipnorm-reducescatter": dict(
        config=co2("overlap-shared-nesterov-adaptive-clipnorm-reducescatter-t2"),
        steps=9,
        model="uneven",
        optimizer="adam",
        eval_at=4,
        sdp_kwargs={"reduce_buffer_size": 128},
    ),
    "sdp-overlap-sgd": OVERLAP_SGD,
    "sdp-blocking-slowmo-reducescatter": dict(
        config=co2("blocking-heavyball-constant1.5-reducescatter-t3"),
        steps=9,
        model="uneven",
    ),
    # plain torch DDP inside the replica, on a replica group the user built and passed in
    "ddp-overlap-user-group": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t3"),
        steps=7,
        wrapper="ddp",
        user_group=True,
    ),
    # one parameter tensor: the second shard of each replica owns nothing
    "sdp-overlap-empty-partition": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t2"),
        steps=6,
        model="single",
    ),
    # a sync delay: the rebased partition is broadcast by OSS mid-round
    "sdp-syncdelay-reducescatter": dict(
        config=co2("overlap-nesterov-adaptive-reducescatter-t3-d1"),
        steps=8,
        model="uneven",
        optimizer="adam",
    ),
    # built by wrap(); BatchNorm statistics of every rank are averaged at round ends
    "wrap-overlap-batchnorm-buffers": dict(
        config=co2("overlap-heavyball-adaptive-allreduce-t2"),
        steps=6,
        model="bn",
        wrapper="wrap",
    ),
    # torch 2.x's zero_grad(set_to_none=True) under ShardedDataParallel: must NOT match the reference
    "sdp-overlap-sgd-set-to-none": {**OVERLAP_SGD, "set_to_none": True},
    # OSS replaces the bucket tensor on every step when broadcasting in fp16
    "sdp-overlap-broadcast-fp16": {**OVERLAP_SGD, "broadcast_fp16": True},
    # FairScale's own ShardedDataParallel on a replica group: the unbucketed gradient is dropped
    "fairscale-sdp-overlap-empty-partition": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t2"),
        steps=6,
        model="single",
        wrapper="fairscale-sdp",
    ),
}
# buggy variant -> its correct twin
BUGGY = {
    "sdp-overlap-sgd-set-to-none": "sdp-overlap-sgd",
    "fairscale-sdp-overlap-empty-partition": "sdp-overlap-empty-partition",
}
LOSSY = {"sdp-overlap-broadcast-fp16"}  # fp16 broadcasts: close to the reference, not to 1e-5
RESUME_SHARDED = dict(
    config=co2("overlap-nesterov-adaptive-reducescatter-t2"),
    steps=9,
    model="uneven",
    optimizer="adam",
    save_at=5,
    recipient=1,
)

# S = 1 x R = 2 on 2 ranks.
ONE_SHARD = {
    "s1-sdp-overlap-adam-clipnorm-reducescatter": dict(
        config=co2("overlap-shared-nesterov-adaptive-clipnorm-reducescatter-t2"),
        steps=8,
        model="uneven",
        optimizer="adam",
    ),
    "s1-bare-blocking-allreduce": dict(
        config=co2("blocking-heavyball-nopenalty-allreduce-t3"),
        steps=9,
        wrapper="none",
    ),
}
RESUME_ONE_SHARD = dict(
    config=co2("overlap-heavyball-adaptive-allreduce-t3"),
    steps=10,
    save_at=4,
    recipient=-1,
)


# ---- models and data (identical on every rank and in the reference) ----------------------------------


def make_model(kind: str) -> nn.Module:
    if kind == "single":
        torch.manual_seed(1234)
        return nn.Linear(4, 3, bias=False).to(models.DEVICE)
    return models.make_model(kind)


def inner_optimizer(kind: str) -> tuple[type, dict]:
    """The class and hyperparameters of `models.make_optimizer(kind)`, for OSS's `optim=` + defaults."""
    probe = models.make_optimizer(kind, [torch.zeros(1, requires_grad=True)])
    return type(probe), dict(probe.defaults)


def snapshot(model: nn.Module, buffers: bool = False) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    if buffers:
        state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


# ---- the child ---------------------------------------------------------------------------------------


def build(sc: dict, shards: int, rank: int):
    """Model, CO2OSS and the wrapper that reduces gradients inside the replica."""
    model = make_model(sc.get("model", "mlp"))
    optim, defaults = inner_optimizer(sc.get("optimizer", "sgd"))
    group = None
    if sc.get("user_group"):
        world = dist.get_world_size()
        groups = [dist.new_group(list(range(r, r + shards))) for r in range(0, world, shards)]
        group = groups[rank // shards]
    co2 = {**sc["config"], "shards_per_replica": shards}
    wrapper = sc.get("wrapper", "sdp")
    # broadcast_buffers=False: each rank keeps its own BatchNorm statistics, as in the reference
    sdp_kwargs = {"broadcast_buffers": False, **sc.get("sdp_kwargs", {})}
    if wrapper == "wrap":
        net, opt = co2_fairscale.wrap(model, co2, optim, sdp_kwargs=sdp_kwargs, **defaults)
        return model, opt, net
    opt = CO2OSS(
        model.parameters(),
        optim=optim,
        group=group,
        co2=co2,
        broadcast_fp16=sc.get("broadcast_fp16", False),
        **defaults,
    )
    if wrapper == "sdp":
        net = co2_fairscale.ShardedDataParallel(model, opt, process_group=opt.group, **sdp_kwargs)
    elif wrapper == "fairscale-sdp":
        net = FairScaleSDP(model, opt, process_group=opt.group, **sdp_kwargs)
    elif wrapper == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=opt.group)
    else:
        net = model
    return model, opt, net


def train(sc: dict, shards: int, rank: int, model, opt, net, steps: range, starts: list) -> None:
    replica, shard = divmod(rank, shards)
    for step in steps:
        x, y = models.shard_batch(replica, shard, step, shards)
        opt.zero_grad(**({"set_to_none": True} if sc.get("set_to_none") else {}))
        models.loss_fn(net(x), y).backward()
        opt.step()
        if step == sc.get("eval_at"):
            net.eval()
            with torch.no_grad():
                net(x)
            net.train()
        if opt.round_ended:
            starts.append(snapshot(model))


def partition_info(opt: CO2OSS) -> dict:
    """What OSS decided (from its public partition), to check the CO2 partition and footprint against."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"] if p.requires_grad)}
    owned = [
        [index[id(p)] for g in groups for p in g["params"] if p.requires_grad] for groups in opt.partition_parameters()
    ]
    return {
        "owned": owned,
        "numels": [p.numel() for g in opt.param_groups for p in g["params"]],
        "segments": [tuple(s) for s in opt.engine.layout.segments],
        "length": opt.engine.layout.length,
        "strategy": opt.engine.exchange.strategy,
        "group_ranks": dist.get_process_group_ranks(opt.group),
        "outer_ranks": list(opt.topology.outer_ranks),
    }


def run_scenarios(rank: int, world: int, shards: int, scenarios: dict, resume: dict, workdir: str) -> dict:
    results = {}
    for name, sc in scenarios.items():
        model, opt, net = build(sc, shards, rank)
        starts = [snapshot(model)]
        train(sc, shards, rank, model, opt, net, range(sc["steps"]), starts)
        info = partition_info(opt)
        info["bytes"] = opt.co2_state_bytes()
        info["index_bytes"] = opt.engine.exchange.index_bytes
        opt.finalize()
        results[name] = {"starts": starts, "final": snapshot(model, buffers=True), **info}
    results["resume"] = resume_run(rank, shards, resume, workdir)
    results["bad-group"] = bad_group(shards)
    results["clip"] = clip_run(rank, shards)
    if shards == 1:
        results["co2optimizer"] = co2optimizer_run(rank, ONE_SHARD["s1-sdp-overlap-adam-clipnorm-reducescatter"])
    return results


def resume_run(rank: int, shards: int, sc: dict, workdir: str) -> dict:
    """Train to `save_at` and checkpoint it twice: per rank with `co2_zero.checkpoint.save` (own
    shares), and the FairScale way (one consolidated file per replica, by its recipient; recipient -1:
    `state_dict(all_ranks=True)`). Then resume each in a fresh model and optimizer and finish; reshard
    the per-rank files onto S = 1; load a plain OSS state (no CO2 state)."""
    replica, recipient = rank // shards, sc["recipient"]
    model, opt, net = build(sc, shards, rank)
    starts = [snapshot(model)]
    train(sc, shards, rank, model, opt, net, range(sc["save_at"]), starts)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint.save(f"{workdir}/per_rank", model, opt)  # before any consolidation: own shares everywhere
    not_consolidated_error = None
    if recipient == -1:
        state = opt.state_dict(all_ranks=True)  # consolidates on every rank
        saved_by_me = opt.rank == 0
    else:
        opt.consolidate_state_dict(recipient_rank=recipient)
        saved_by_me = opt.rank == recipient
        state = opt.state_dict()  # the consolidated state on the recipient, the own share elsewhere
        not_consolidated_error = "oss_shard" in state
    if saved_by_me:
        torch.save(state, f"{workdir}/optim_replica{replica}.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.finalize()  # the first run ends here (closes its worker)
    dist.barrier()
    saved = torch.load(f"{workdir}/optim_replica{replica}.pt", weights_only=False)
    result = {
        "saved_by_me": saved_by_me,
        "co2_ranks": saved["co2_replica"]["ranks"],
        "co2_states": len(saved["co2_replica"]["states"]),
        "inner_state_entries": len(saved["state"]),
        "own_share_elsewhere": not_consolidated_error,
    }

    # the FairScale way, in the usual order: build, load the weights, load the optimizer state
    model2, opt2, net2 = build(sc, shards, rank)
    model2.load_state_dict(model_state)
    other = (replica + 1) % (dist.get_world_size() // shards)
    try:
        opt2.load_state_dict(torch.load(f"{workdir}/optim_replica{other}.pt", weights_only=False))
    except ValueError as error:
        result["other_replica_error"] = str(error)
    opt2.load_state_dict(saved)
    consolidated = list(starts)
    train(sc, shards, rank, model2, opt2, net2, range(sc["save_at"], sc["steps"]), consolidated)
    opt2.finalize()
    result.update(starts=consolidated, final=snapshot(model2))

    # per-rank files through the library's checkpoint module
    model3, opt3, net3 = build(sc, shards, rank)
    checkpoint.load(f"{workdir}/per_rank", model3, opt3)
    per_rank = list(starts)
    train(sc, shards, rank, model3, opt3, net3, range(sc["save_at"], sc["steps"]), per_rank)
    opt3.finalize()
    result.update(per_rank_starts=per_rank, per_rank_final=snapshot(model3))

    # the same files resharded onto the plain-PyTorch CO2Optimizer (another adapter, S = 1): the
    # saved round start, tensor by tensor
    model4 = make_model(sc.get("model", "mlp"))
    opt4 = CO2Optimizer(models.make_optimizer(sc.get("optimizer", "sgd"), model4.parameters()), sc["config"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(f"{workdir}/per_rank", model4, opt4, reshard=True)
        result["resharded"] = snapshot(model4)
        opt4.finalize()
    result["reshard_warnings"] = [str(w.message) for w in caught]

    # a plain OSS checkpoint (no CO2 state): the inner state loads, CO2 restarts from the parameters,
    # here weights that differ from the initial ones but agree on every replica, as a plain run's do
    model5, opt5, net5 = build(sc, shards, rank)
    with torch.no_grad():
        for p in model5.parameters():
            p.add_(0.25)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt5.load_state_dict({k: v for k, v in saved.items() if k not in ("co2", "co2_replica")})
    length = opt5.engine.layout.length
    result["plain_warnings"] = [str(w.message) for w in caught]
    live = opt5.engine.partition.chunks[0]  # this rank's OSS bucket, holding the shifted weights
    result["plain_restart"] = (opt5.engine.inner_steps, bool(opt5.engine.state.start_point[:length].equal(live)))
    train(sc, shards, rank, model5, opt5, net5, range(sc["save_at"], sc["save_at"] + sc["config"]["tau"]), [])
    result["plain_rounds"] = opt5.engine.rounds
    opt5.finalize()
    result["plain_params"] = snapshot(model5)
    dist.barrier()  # nobody deletes a file another rank still reads
    return result


def clip_run(rank: int, shards: int) -> dict:
    """`clip_grad_norm` after one backward: its norm against the replica's gradient norm computed
    here from scratch (mean of the shards' gradients), then clipping to half of it."""
    replica = rank // shards
    sc = SHARDED["sdp-overlap-adam-uneven-clipnorm-reducescatter"]  # bucketed and direct reductions
    model, opt, net = build(sc, shards, rank)
    x, y = models.shard_batch(replica, rank % shards, 0, shards)
    opt.zero_grad()
    models.loss_fn(net(x), y).backward()
    norm = float(opt.clip_grad_norm(1e9))
    clipped = float(opt.clip_grad_norm(norm / 2))  # the norm before clipping: unchanged
    after = float(opt.clip_grad_norm(1e9))
    fresh = make_model(sc["model"])
    for s in range(shards):
        xs, ys = models.shard_batch(replica, s, 0, shards)
        models.loss_fn(fresh(xs), ys).backward()
    expected = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) / shards for p in fresh.parameters()])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.finalize()
    return {"norm": norm, "clipped": clipped, "after": after, "expected": expected}


def bad_group(shards: int):
    """A group that is not this rank's replica is refused with a clear error (on every rank alike)."""
    model = make_model("mlp")
    try:
        CO2OSS(
            model.parameters(),
            optim=torch.optim.SGD,
            group=dist.group.WORLD,
            lr=0.1,
            co2={"shards_per_replica": shards, "tau": 2},
        )
    except ValueError as error:
        return str(error)
    return None


def co2optimizer_run(rank: int, sc: dict) -> dict:
    """The same S = 1 scenario through the plain-PyTorch CO2Optimizer."""
    model = make_model(sc.get("model", "mlp"))
    opt = CO2Optimizer(models.make_optimizer(sc.get("optimizer", "sgd"), model.parameters()), sc["config"])
    starts = [snapshot(model)]
    for step in range(sc["steps"]):
        x, y = models.shard_batch(rank, 0, step, 1)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        if opt.round_ended:
            starts.append(snapshot(model))
    opt.finalize()
    return {"starts": starts, "final": snapshot(model)}


# ---- the parent --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fairscale_s2"))
    return run_ranks(run_scenarios, 4, 2, SHARDED, RESUME_SHARDED, workdir, timeout=240.0)


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fairscale_s1"))
    return run_ranks(run_scenarios, 2, 1, ONE_SHARD, RESUME_ONE_SHARD, workdir, timeout=180.0)


def reference(sc: dict, replicas: int, shards: int):
    """(per round start, every replica's parameters there; every replica's final model; the shared start
    points). With a stand-in (the defaults' `local`) each replica starts a round from its own point, which
    the library's live model holds; a resharded load resumes at the shared one."""
    shared: list = []
    steps: list = []
    model_kind, opt_kind = sc.get("model", "mlp"), sc.get("optimizer", "sgd")
    finals = simulate(
        lambda: make_model(model_kind),
        lambda params: models.make_optimizer(opt_kind, params),
        lambda r, k: models.shard_batch(r, 0, k, 1),
        models.loss_fn,
        sc["config"],
        replicas=replicas,
        steps=sc["steps"],
        shards=shards,
        shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards),
        record=shared,
        step_record=steps,
    )
    return replica_round_starts(shared, steps, sc["config"]["tau"]), finals, shared


def check_against_reference(results: list, sc: dict, name: str, shards: int, **tol) -> None:
    got_any = results[0][name]
    starts, finals, _ = reference(sc, len(results) // shards, shards)
    assert len(got_any["starts"]) == len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        for t, (a, e) in enumerate(zip(got["starts"], starts)):
            assert_close(a, e[rank // shards], f"{name} rank {rank} round-{t} start", **tol)
        assert_close(got["final"], finals[rank // shards], f"{name} rank {rank} final", **tol)


def max_deviation(results: list, sc: dict, name: str, shards: int) -> float:
    _, finals, _ = reference(sc, len(results) // shards, shards)
    return max(
        float((per_rank[name]["final"][k] - finals[rank // shards][k]).abs().max())
        for rank, per_rank in enumerate(results)
        for k in finals[0]
    )


@pytest.mark.parametrize("name", [n for n in SHARDED if n not in BUGGY and n not in LOSSY])
def test_two_shards_two_replicas_match_reference(sharded, name):
    check_against_reference(sharded, SHARDED[name], name, shards=2)


@pytest.mark.parametrize("name", list(ONE_SHARD))
def test_one_shard_two_replicas_match_reference(one_shard, name):
    check_against_reference(one_shard, ONE_SHARD[name], name, shards=1)


def test_one_shard_matches_co2optimizer(one_shard):
    for rank, per_rank in enumerate(one_shard):
        oss, plain = per_rank["s1-sdp-overlap-adam-clipnorm-reducescatter"], per_rank["co2optimizer"]
        assert len(oss["starts"]) == len(plain["starts"])
        for t, (a, b) in enumerate(zip(oss["starts"], plain["starts"])):
            assert_close(a, b, f"rank {rank} round-{t} start", rtol=1e-6, atol=1e-7)
        assert_close(oss["final"], plain["final"], f"rank {rank} final", rtol=1e-6, atol=1e-7)


def test_broadcast_fp16_stays_close_to_reference(sharded):
    name = "sdp-overlap-broadcast-fp16"
    check_against_reference(sharded, SHARDED[name], name, shards=2, rtol=1e-3, atol=1e-3)


def test_known_sdp_pitfalls_are_caught(sharded):
    """zero_grad(set_to_none=True) and FairScale's own SDP on a replica group give wrong results (far
    from the reference) without an error; their correct twins match it to 1e-5."""
    for buggy, correct in BUGGY.items():
        check_against_reference(sharded, SHARDED[correct], correct, shards=2)
        assert max_deviation(sharded, SHARDED[buggy], buggy, shards=2) > 1e-2, buggy


def test_zero_grad_defaults_to_in_place():
    assert inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default is True
    assert inspect.signature(CO2OSS.zero_grad).parameters["set_to_none"].default is False


def test_all_ranks_identical_at_round_starts(sharded, one_shard):
    """Every rank holds the same parameters after finalize, and at each round start every rank of its
    replica; so does every rank of every replica as published (the shared start; with a stand-in the
    replicas start rounds apart by design, design §3)."""
    for results, scenarios, shards in ((sharded, {**SHARDED, "resume": RESUME_SHARDED}, 2),
                                       (one_shard, {**ONE_SHARD, "resume": RESUME_ONE_SHARD}, 1)):  # fmt: skip
        for name, sc in scenarios.items():
            first = results[0][name]
            shared = resolve_config(sc["config"])["stand_in"] == "shared"
            for rank, other in enumerate((per_rank[name] for per_rank in results[1:]), 1):
                assert len(first["starts"]) == len(other["starts"]), name
                for t, (a, b) in enumerate(zip(first["starts"], other["starts"]) if shared or rank < shards else []):
                    assert all(torch.equal(a[k], b[k]) for k in a), f"{name} rank {rank} round {t}"
                assert all(torch.equal(first["final"][k], v) for k, v in other["final"].items()), (name, rank)


def test_partition_is_the_oss_bucket(sharded, one_shard):
    """Each rank's CO2 partition is exactly the trainable parameters OSS gave it; groups are right."""
    for results, shards, scenarios in ((sharded, 2, SHARDED), (one_shard, 1, ONE_SHARD)):
        for name in scenarios:
            for rank, per_rank in enumerate(results):
                got = per_rank[name]
                replica, shard = divmod(rank, shards)
                owned = got["owned"][shard]
                assert sorted(s[0] for s in got["segments"]) == sorted(owned), (name, rank)
                # a rank that owns nothing hands the engine a 1-element placeholder
                assert got["length"] == max(1, sum(got["numels"][i] for i in owned)), (name, rank)
                assert sorted(i for part in got["owned"] for i in part) == list(range(len(got["numels"])))
                assert got["group_ranks"] == list(range(replica * shards, (replica + 1) * shards))
                assert got["outer_ranks"] == list(range(shard, len(results), shards))
    uneven = sharded[0]["sdp-overlap-adam-uneven-clipnorm-reducescatter"]
    lengths = [sum(uneven["numels"][i] for i in part) for part in uneven["owned"]]
    assert lengths == [262, 265], lengths  # uneven, and one of them not a multiple of R = 2
    assert sharded[1]["sdp-overlap-empty-partition"]["owned"][1] == []  # shard 1 owns nothing


def test_state_bytes_match_memory_formula(sharded, one_shard):
    """docs/design.md §4 for the OSS partition sizes: 2Ψ_s + 2Ψ_s/R words (reduce_scatter) or 3Ψ_s (all_reduce),
    Ψ_s the rank's bucket padded to a multiple of R (at least R), plus one norm per parameter tensor
    and the segment index; a stand-in adds what design §3 says (tests/reference.py: stand_in_words)."""
    for results, shards, scenarios in ((sharded, 2, SHARDED), (one_shard, 1, ONE_SHARD)):
        replicas = len(results) // shards
        for name, sc in scenarios.items():
            for rank, per_rank in enumerate(results):
                got = per_rank[name]
                psi = sum(got["numels"][i] for i in got["owned"][rank % shards])
                padded = max(replicas, math.ceil(psi / replicas) * replicas)
                assert got["strategy"] == sc["config"]["collective"]
                words = 2 * padded + 2 * padded // replicas if got["strategy"] == "reduce_scatter" else 3 * padded
                words += stand_in_words(sc["config"], got["strategy"], padded)
                index = got["index_bytes"]  # the outer step's segment index, sized in test_outer_kernels.py
                assert got["bytes"] == 4 * words + 8 * len(got["numels"]) + index, (name, rank)


@pytest.mark.parametrize("which", ["sharded", "one_shard"])
def test_checkpoint_resume_continues_the_trajectory(which, sharded, one_shard):
    """Both checkpoint styles, saved mid-round with a round in flight, continue the exact trajectory."""
    cases = {"sharded": (sharded, 2, RESUME_SHARDED), "one_shard": (one_shard, 1, RESUME_ONE_SHARD)}
    results, shards, sc = cases[which]
    resume = [r["resume"] for r in results]
    starts, finals, _ = reference(sc, len(results) // shards, shards)
    for rank, got in enumerate(resume):
        replica = rank // shards
        assert got["co2_states"] == shards
        assert got["co2_ranks"] == list(range(replica * shards, (replica + 1) * shards))
        assert got["inner_state_entries"] == len(finals[0])  # the consolidated inner state of the whole model
        assert "each replica loads the file its own recipient saved" in got["other_replica_error"]
        for style in ("", "per_rank_"):
            assert len(got[f"{style}starts"]) == len(starts)
            for t, (a, e) in enumerate(zip(got[f"{style}starts"], starts)):
                assert_close(a, e[replica], f"resume {style} rank {rank} round-{t} start")
            assert_close(got[f"{style}final"], finals[replica], f"resume {style} rank {rank} final")
    if sc["recipient"] != -1:
        for rank, got in enumerate(resume):
            assert got["saved_by_me"] == (rank % shards == sc["recipient"])
            assert got["own_share_elsewhere"] != got["saved_by_me"]


@pytest.mark.parametrize("which", ["sharded", "one_shard"])
def test_checkpoint_reshards_into_co2optimizer(which, sharded, one_shard):
    """co2_zero.checkpoint's resharding reads CO2OSS's per-rank files into CO2Optimizer (S = 1): every
    rank resumes at the saved run's last round start (the partial round is dropped, with a warning), from
    its replica's stand-in there: new replica m continues saved replica m % R (docs/checkpoints.md)."""
    cases = {"sharded": (sharded, 2, RESUME_SHARDED), "one_shard": (one_shard, 1, RESUME_ONE_SHARD)}
    results, shards, sc = cases[which]
    saved_replicas = len(results) // shards
    starts, _, _ = reference(sc, saved_replicas, shards)
    last_starts = starts[sc["save_at"] // sc["config"]["tau"]]
    for rank, per_rank in enumerate(results):
        got = per_rank["resume"]
        assert_close(got["resharded"], last_starts[rank % saved_replicas], f"resharded rank {rank}")
        assert any("dropped" in w for w in got["reshard_warnings"]), got["reshard_warnings"]


def test_plain_oss_state_restarts_co2(sharded):
    """A state without CO2 state loads with a warning; CO2 restarts from the loaded parameters."""
    for per_rank in sharded:
        got = per_rank["resume"]
        assert any("carries no CO2 state" in w for w in got["plain_warnings"]), got["plain_warnings"]
        assert got["plain_restart"] == (0, True)  # a fresh round state whose start point is the loaded weights
        assert got["plain_rounds"] == 1
    for per_rank in sharded[1:]:  # the restarted run is still one CO2 run: all ranks end with one model
        assert all(
            torch.equal(sharded[0]["resume"]["plain_params"][k], v)
            for k, v in per_rank["resume"]["plain_params"].items()
        )


def test_clip_grad_norm_is_the_replica_norm(sharded, one_shard):
    for results, shards in ((sharded, 2), (one_shard, 1)):
        norms = [r["clip"]["norm"] for r in results]
        for rank, per_rank in enumerate(results):
            got = per_rank["clip"]
            assert got["norm"] == pytest.approx(got["expected"], rel=1e-5), (shards, rank)
            assert got["clipped"] == pytest.approx(got["norm"], rel=1e-6)
            assert got["after"] == pytest.approx(got["norm"] / 2, rel=1e-4)
        assert norms[0] != pytest.approx(norms[-1], rel=1e-3)  # replicas see different data


def test_group_must_be_the_replica(sharded):
    for per_rank in sharded:
        assert "pass group=None or a group of exactly those ranks" in per_rank["bad-group"]
