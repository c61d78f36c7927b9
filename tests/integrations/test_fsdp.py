"""CO2Optimizer over FSDP2 (`fully_shard` on `replica_mesh`) on real gloo processes, against the reference.

Rank (r, s) = global rank r*S + s trains on `shard_batch(r, s, step)`; the reference trains one model
per replica on the concatenation of its shards' batches (FSDP2 averages the gradients over the S ranks
of the replica mesh). World 4 is S = 2 shards x R = 2 replicas, world 2 is S = 1 x R = 2. One spawn
per world size runs every scenario; each test then checks one property of the recorded results.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from co2_zero import CO2Optimizer, checkpoint
from co2_zero.fsdp import replica_mesh
from tests import models
from tests.dist_utils import run_ranks
from tests.reference import resolve_config, simulate, stand_in_words
from tests.scenarios import co2

SCENARIOS = {
    # replica 1 starts from another init: CO2 must start every replica from replica 0's
    "overlap-heavyball-reducescatter-adamw": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t3"),
        steps=10,
        optimizer="adamw",
        perturb=True,
    ),
    # uneven shards (dim 0 of 5, 1 and 3 over S = 2: padding rows, and a shard that is empty) and a
    # frozen parameter (not in the partition; stays where it started)
    "overlap-nesterov-allreduce-uneven-frozen": dict(
        config=co2("overlap-shared-nesterov-adaptive-clipnorm-allreduce-t2"),
        steps=7,
        model="uneven",
        frozen=("0.bias",),
    ),
    "blocking-heavyball-reducescatter-uneven": dict(
        config=co2("blocking-heavyball-adaptive-reducescatter-t2"),
        steps=6,
        model="uneven",
        optimizer="adam",
    ),
    # CPUOffloadPolicy on a CPU mesh is FSDP2's no-op case: accepted
    "blocking-diloco-allreduce-cpu-offload": dict(
        config=co2("blocking-nesterov-nopenalty-allreduce-t3"),
        steps=7,
        offload=True,
    ),
    # the local stand-in: the outer step on the replica's own displacement, with the outer momentum that
    # each rank follows from the applied steps (sharded with reduce_scatter); at the round end and mid-round
    "local-nesterov-adaptive-reducescatter": dict(
        config=co2("overlap-local-nesterov-adaptive-reducescatter-t2"),
        steps=9,
        model="uneven",
    ),
    "syncdelay-local-nesterov-none-reducescatter": dict(
        config=co2("overlap-local-nesterov-nopenalty-reducescatter-t4-d1"),
        steps=13,
        optimizer="adam",
    ),
    # the local stand-in's norm clip spans the replica's model: its S shards add up their partial norms
    "local-nesterov-adaptive-clipnorm-allreduce-uneven": dict(
        config=co2("overlap-local-nesterov-adaptive-clipnorm-allreduce-t2"),
        steps=7,
        model="uneven",
    ),
    # skip_round with the local stand-in and a norm clip: only replica 1's first shard holds a NaN (its
    # gradient, in round 1's last step); every shard of replica 1 agrees and starts round 2 from the shared
    # start (none takes the clip's collective alone), the other replica from its stand-in; round 1 skipped.
    # The inner SGD keeps no state: a reset clears only the rank that saw the NaN
    "skip-local-clipnorm-allreduce": dict(
        config=co2("overlap-local-nesterov-clipnorm-allreduce-t2-skipround"),
        steps=8,
        optimizer="sgd_no_state",
        poison_step=3,
        reference={"schedule": [{0, 1}, None, {0, 1}, {0, 1}], "restarts": [(1, 2)]},
    ),
    "syncdelay-local-heavyball-adaptive-allreduce": dict(
        config=co2("overlap-local-heavyball-adaptive-allreduce-t3-d2"),
        steps=11,
    ),
    "syncdelay-heavyball-adaptive-reducescatter": dict(
        config=co2("overlap-heavyball-adaptive-reducescatter-t3-d2"),
        steps=11,
    ),
}
RESUME = dict(config=co2("overlap-heavyball-adaptive-t3"), steps=8, save_at=4, model="uneven")
MIXED = dict(config=co2("defaults-t4"), steps=32)


# ---- models, shared by the children and the reference ----------------------------------------------------


def make_model(kind: str = "mlp", frozen: tuple = ()) -> nn.Module:
    """Identically initialised on every call; `frozen` names parameters that do not train."""
    if kind == "uneven":
        torch.manual_seed(1234)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1), nn.Tanh(), nn.Linear(1, 3))
    else:
        model = models.make_model(kind)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def make_inner(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "sgd_no_state":  # nothing for a reset to clear
        return torch.optim.SGD(params, lr=0.05)
    return models.make_optimizer(kind, params)


def shard(model: nn.Module, mesh, **kwargs) -> nn.Module:
    """fully_shard every layer with parameters, then the root, as FSDP2 users do."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def local_rows(shape: torch.Size, shards: int, shard_index: int) -> int:
    """Rows of dim 0 that shard `shard_index` holds: torch.chunk's split, which FSDP2 documents."""
    chunks = torch.chunk(torch.empty(shape[0]), shards)
    return chunks[shard_index].numel() if shard_index < len(chunks) else 0


# ---- the children ---------------------------------------------------------------------------------------


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered from the replica's shards (collective over the replica mesh)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train(model, opt, rank, shards, first, last, batches=models.shard_batch, record=None, losses=None, poison=None):
    """Inner steps `first`..`last`; `poison` (step, rank): that rank's first local gradient element is NaN
    at that step."""
    r, s = divmod(rank, shards)
    for step in range(first, last):
        x, y = batches(r, s, step, shards)
        opt.zero_grad()
        loss = models.loss_fn(model(x).float(), y)
        loss.backward()
        if poison == (step, rank):
            grad = next(model.parameters()).grad
            with torch.no_grad():
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
        opt.step()
        if losses is not None:
            losses.append(loss.item())
        if record is not None:
            record.append(_full(model))


def _build(rank, shards, mesh, sc, perturb=0.0, **fsdp_kwargs):
    config = {**sc["config"], "shards_per_replica": shards}
    model = make_model(sc.get("model", "mlp"), sc.get("frozen", ()))
    if perturb and rank >= shards:  # replicas other than 0 start elsewhere
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb)
    shard(model, mesh, **fsdp_kwargs)
    opt = CO2Optimizer(make_inner(sc.get("optimizer", "sgd"), model.parameters()), config, model=model)
    return model, opt


def _run_scenario(rank: int, shards: int, mesh, sc: dict) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if sc.get("offload") else {}
    model, opt = _build(rank, shards, mesh, sc, perturb=1.0 if sc.get("perturb") else 0.0, **offload)
    flat = torch.cat([c.detach() for c in opt.engine.partition.chunks])
    pieces = [(seg.tensor_id, seg.offset, flat[seg.start : seg.end].clone()) for seg in opt.engine.partition.segments]
    steps = [_full(model)]  # x_0, then after every inner step
    round_ended = []
    shared = [opt.engine.state.start_point.clone()]  # the shared start point B at every round start

    timings = []  # (wait_s, round_end_s) of every round end

    def after_step(optimizer, args, kwargs):
        round_ended.append(opt.round_ended)
        if opt.round_ended:
            shared.append(opt.engine.state.start_point.clone())
            timings.append((opt.last_round["wait_s"], opt.last_round["round_end_s"]))

    opt.register_step_post_hook(after_step)
    poison = (sc["poison_step"], shards) if "poison_step" in sc else None  # replica 1's first shard
    _train(model, opt, rank, shards, 0, sc["steps"], record=steps, poison=poison)
    out = {
        "pieces": pieces,
        "partition_length": flat.numel(),
        "steps": steps,
        "round_ended": round_ended,
        "timings": timings,
        "shared": shared,
        "bytes": opt.co2_state_bytes(),
        "index_bytes": opt.engine.exchange.index_bytes,
        "strategy": opt.engine.exchange.strategy,
        "grid": (opt.topology.replicas, opt.topology.shards),
        "inner_group": sorted(dist.get_process_group_ranks(opt.topology.inner_group)),
    }
    opt.finalize()
    out["final"] = _full(model)
    return out


def _run_resume(rank: int, shards: int, mesh, sc: dict, directory: str) -> dict:
    """A straight run, saved mid-round two ways (co2_zero.checkpoint; DCP for the model and inner
    optimizer + the CO2 state per rank), against fresh runs from another init that load and go on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    replica_dir = os.path.join(directory, "dcp", f"replica{rank // shards}")
    co2_file = os.path.join(directory, "dcp", f"co2_rank{rank:05d}.pt")

    def dcp_state(model, opt):
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt.optimizer)}

    model, opt = _build(rank, shards, mesh, sc)
    _train(model, opt, rank, shards, 0, sc["save_at"])
    checkpoint.save(os.path.join(directory, "co2"), model, opt, extra={"step": sc["save_at"]})
    # Mid-round the replicas' models differ: one DCP checkpoint per replica, over the replica's group.
    dcp.save(dcp_state(model, opt), checkpoint_id=replica_dir, process_group=opt.topology.inner_group)
    torch.save(opt.engine.state_dict(), co2_file)
    straight = []
    _train(model, opt, rank, shards, sc["save_at"], sc["steps"], record=straight)
    opt.finalize()
    out = {"straight": straight, "straight_final": _full(model)}
    # After finalize() every replica holds the same model: one DCP checkpoint over the world (DCP keeps
    # one copy of the replicas' identical shards), readable into an unsharded model.
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(directory, "final"))
    plain = make_model(sc.get("model", "mlp")).state_dict()
    dcp.load(plain, checkpoint_id=os.path.join(directory, "final"), no_dist=True)
    out["final_unsharded"] = plain

    for how in ("co2", "dcp"):
        model, opt = _build(rank, shards, mesh, sc, perturb=-2.0)
        with torch.no_grad():  # every rank starts elsewhere: all of it must come from the checkpoint
            for p in model.parameters():
                p.to_local().mul_(-3.0)
        if how == "co2":
            out["extra"] = checkpoint.load(os.path.join(directory, "co2"), model, opt)
        else:
            state = dcp_state(model, opt)
            dcp.load(state, checkpoint_id=replica_dir, process_group=opt.topology.inner_group)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt.optimizer, state["optim"])
            opt.engine.load_state_dict(torch.load(co2_file, weights_only=True))
        resumed = []
        _train(model, opt, rank, shards, sc["save_at"], sc["steps"], record=resumed)
        opt.finalize()
        out[how] = {"resumed": resumed, "final": _full(model)}
    return out


def _run_mixed_precision(rank: int, shards: int, mesh, sc: dict) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    config = {**sc["config"], "shards_per_replica": shards}
    model = shard(make_model(), mesh, mp_policy=policy)
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.05), config, model=model)
    losses, steps = [], []
    _train(model, opt, rank, shards, 0, sc["steps"], batches=models.teacher_batch, record=steps, losses=losses)
    out_dtype = model(torch.zeros(1, 4)).dtype
    opt.finalize()
    return {
        "losses": losses,
        "starts": steps[sc["config"]["tau"] - 1 :: sc["config"]["tau"]],
        "out_dtype": out_dtype,
        "param_dtypes": {p.to_local().dtype for p in model.parameters()},
        "rounds": opt.engine.rounds,
        "final": _full(model),
    }


def _refusal(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "not refused"


def _run_refusals(rank: int, shards: int, world: int) -> dict:
    """What CO2Optimizer says to models it cannot train. Every rank refuses before any CO2 group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    config = {"tau": 2, "shards_per_replica": shards}

    def opt_for(model):
        return CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)

    world_mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    mesh = replica_mesh(config)
    offloaded = nn.Module()  # what CPU offload under a CUDA mesh looks like: the shard off the mesh's device
    offloaded.weight = nn.Parameter(DTensor.from_local(torch.empty(2, 4, device="meta"), mesh, [Shard(0)]))
    out = {
        "world_mesh": _refusal(lambda: opt_for(shard(make_model(), world_mesh))),
        "hsdp_mesh": _refusal(lambda: opt_for(shard(make_model(), hsdp_mesh))),
        "bf16": _refusal(lambda: opt_for(shard(make_model().to(torch.bfloat16), mesh))),
        "offload_elsewhere": _refusal(lambda: opt_for(offloaded)),
        "half_sharded": _refusal(lambda: opt_for(nn.Sequential(shard(make_model("linear"), mesh), nn.Linear(3, 3)))),
        "plain_params_s": _refusal(lambda: opt_for(make_model())) if shards > 1 else None,
    }
    # The slice of a 2-D (R, S) mesh along S is this rank's replica too: accepted.
    opt = opt_for(shard(make_model(), hsdp_mesh["shard"]))
    out["hsdp_slice_accepted"] = sorted(dist.get_process_group_ranks(opt.topology.inner_group))
    opt.finalize()
    out["moved_shard"] = _moved_shard(rank, shards, mesh, config)
    return out


def _moved_shard(rank: int, shards: int, mesh, config: dict) -> str:
    """A local shard re-allocated under CO2 (as FSDP2 does when a parameter is swapped under it) is
    caught at the next round end instead of CO2 silently training a copy."""
    from co2_zero import CO2Error

    model = shard(make_model(), mesh)
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
    weight = model[0].weight
    weight._local_tensor = weight._local_tensor.clone()
    try:
        _train(model, opt, rank, shards, 0, config["tau"])
    except CO2Error as error:
        return str(error)
    finally:
        opt.engine.close()
    return "not caught"


def run_all(rank: int, world: int, shards: int, directory: str) -> dict:
    """Child: every scenario of this world size on one replica mesh."""
    mesh = replica_mesh({"shards_per_replica": shards})
    results = {"mesh": (mesh.device_type, mesh.mesh.tolist())}
    results.update({name: _run_scenario(rank, shards, mesh, sc) for name, sc in SCENARIOS.items()})
    results["resume"] = _run_resume(rank, shards, mesh, RESUME, directory)
    results["mixed"] = _run_mixed_precision(rank, shards, mesh, MIXED)
    results["refusals"] = _run_refusals(rank, shards, world)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: per-rank results}: world 4 = S 2 x R 2, world 2 = S 1 x R 2."""
    return {
        world: run_ranks(run_all, world, shards, str(tmp_path_factory.mktemp(f"ckpt{world}")), timeout=300)
        for world, shards in ((4, 2), (2, 1))
    }


# ---- the reference ---------------------------------------------------------------------------------------


def reference_steps(sc: dict, shards: int) -> tuple[list, list]:
    """Per inner step k = 0..steps, each of the R = 2 replicas' parameters after k steps; and the
    parameters after finalize()."""
    model_kind, frozen = sc.get("model", "mlp"), sc.get("frozen", ())

    def run(steps: int, finalize: bool):
        return simulate(
            lambda: make_model(model_kind, frozen),
            lambda params: make_inner(sc.get("optimizer", "sgd"), params),
            lambda r, k: models.shard_batch(r, 0, k, 1),
            models.loss_fn,
            sc["config"],
            replicas=2,
            steps=steps,
            finalize=finalize,
            shards=shards,
            shard_batch=lambda r, j, k: models.shard_batch(r, j, k, shards),
            **sc.get("reference", {}),
        )

    return [run(k, False) for k in range(sc["steps"] + 1)], run(sc["steps"], True)


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) <= set(expected), what
    for key, value in actual.items():
        where = f"{what}/{key}"
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")


WORLDS = [4, 2]
CASES = [(world, name) for world in WORLDS for name in SCENARIOS]


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "name"), CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_every_inner_step_matches_reference(results, world, name):
    shards = world // 2
    sc = SCENARIOS[name]
    per_step, finals = reference_steps(sc, shards)
    for rank, per_rank in enumerate(results[world]):
        got = per_rank[name]
        assert len(got["steps"]) == sc["steps"] + 1
        for k, (actual, expected) in enumerate(zip(got["steps"], per_step)):
            _assert_close(actual, expected[rank // shards], f"{name} rank {rank} after step {k}")
        _assert_close(got["final"], finals[rank // shards], f"{name} rank {rank} final")
        tau = sc["config"]["tau"]
        assert got["round_ended"] == [(k + 1) % tau == 0 for k in range(sc["steps"])]
        # the time blocked is part of the time taken, the apply point's too (a sync delay)
        assert all(0 <= wait <= took for wait, took in got["timings"]), got["timings"]


@pytest.mark.parametrize("world", WORLDS)
def test_replica_mesh_and_topology_are_the_same_groups(results, world):
    shards = world // 2
    for rank, per_rank in enumerate(results[world]):
        replica = list(range(rank // shards * shards, (rank // shards + 1) * shards))
        assert per_rank["mesh"] == ("cpu", replica)
        for name in SCENARIOS:
            assert per_rank[name]["grid"] == (2, shards)
            assert per_rank[name]["inner_group"] == replica


@pytest.mark.parametrize("world", WORLDS)
def test_partition_is_the_local_shards_of_every_parameter(results, world):
    """Each replica's partitions, cut into tensor pieces by the segments, reassemble x_0 as FSDP2's
    full_tensor() gathers it: every element once, padding rows nowhere."""
    shards = world // 2
    for name, sc in SCENARIOS.items():
        x0 = results[world][0][name]["steps"][0]
        trainable = [
            n for n, p in make_model(sc.get("model", "mlp"), sc.get("frozen", ())).named_parameters() if p.requires_grad
        ]
        expected = [x0[n].reshape(-1) for n in trainable]
        for replica in range(2):
            rebuilt = [torch.full_like(e, float("nan")) for e in expected]
            covered = [0] * len(expected)
            for rank in range(replica * shards, (replica + 1) * shards):
                for tensor_id, offset, values in results[world][rank][name]["pieces"]:
                    rebuilt[tensor_id][offset : offset + values.numel()] = values
                    covered[tensor_id] += values.numel()
            assert covered == [e.numel() for e in expected], (name, replica)
            for i, (a, e) in enumerate(zip(rebuilt, expected)):
                assert torch.equal(a, e), f"{name} replica {replica} tensor {trainable[i]}"


def test_uneven_scenario_has_padding_and_an_empty_shard():
    """The uneven model really exercises FSDP2's padding at S = 2 (guards the scenario, not the code)."""
    shapes = [p.shape for p in make_model("uneven").parameters()]
    assert any(s[0] % 2 for s in shapes)
    assert any(local_rows(s, 2, 1) == 0 for s in shapes)


def test_frozen_parameter_stays_put(results):
    name = "overlap-nesterov-allreduce-uneven-frozen"
    for per_rank in results.values():
        for got in per_rank:
            first = got[name]["steps"][0]["0.bias"]
            assert all(torch.equal(step["0.bias"], first) for step in got[name]["steps"])
            assert torch.equal(got[name]["final"]["0.bias"], first)


def test_replicas_identical_at_every_round_start(results):
    """Bit for bit: the shared start point B on the ranks of each outer group; the live parameters too,
    except with a stand-in, where each replica starts from its own (docs/design.md §3)."""
    for world, per_rank in results.items():
        shards = world // 2
        for name, sc in SCENARIOS.items():
            tau, own_starts = sc["config"]["tau"], resolve_config(sc["config"])["stand_in"] != "shared"
            for rank in range(shards, world):
                peer = per_rank[rank % shards][name]["shared"]
                assert all(torch.equal(a, b) for a, b in zip(per_rank[rank][name]["shared"], peer)), (world, name)
            for k in [0] + [k for k in range(1, sc["steps"] + 1) if k % tau == 0]:
                first = per_rank[0][name]["steps"][k]
                for other in per_rank[1:]:
                    same = all(torch.equal(first[n], other[name]["steps"][k][n]) for n in first)
                    assert same or (own_starts and k > 0), (world, name, k)
            for other in per_rank[1:]:
                assert all(torch.equal(per_rank[0][name]["final"][n], v) for n, v in other[name]["final"].items())


@pytest.mark.parametrize("world", WORLDS)
def test_state_bytes_match_memory_formula(results, world):
    """2Ψ_s + 2Ψ_s/R fp32 words with reduce_scatter (Ψ_s ≈ Ψ/S: 2Ψ/S + 2Ψ/N), 3Ψ_s with all_reduce,
    plus one float64 per parameter tensor and the segment index, and a stand-in's words (design §3);
    Ψ_s = this rank's share of FSDP2's dim-0 sharding."""
    shards, replicas = world // 2, 2
    for name, sc in SCENARIOS.items():
        params = [p for p in make_model(sc.get("model", "mlp"), sc.get("frozen", ())).parameters() if p.requires_grad]
        for rank, per_rank in enumerate(results[world]):
            got = per_rank[name]
            psi_s = sum(local_rows(p.shape, shards, rank % shards) * p[0].numel() for p in params)
            assert got["partition_length"] == psi_s, (name, rank)
            padded = max(replicas, math.ceil(psi_s / replicas) * replicas)
            if got["strategy"] == "reduce_scatter":
                words = 2 * padded + 2 * padded // replicas
            else:
                words = 3 * padded
            words += stand_in_words(sc["config"], got["strategy"], padded)
            # plus the outer step's segment index (its size is tested in test_outer_kernels.py)
            assert got["bytes"] == 4 * words + 8 * len(params) + got["index_bytes"], (name, rank)


@pytest.mark.parametrize("world", WORLDS)
def test_resume_continues_the_exact_trajectory(results, world):
    for rank, per_rank in enumerate(results[world]):
        got = per_rank["resume"]
        assert got["extra"] == {"step": RESUME["save_at"]}
        assert len(got["straight"]) == RESUME["steps"] - RESUME["save_at"]
        for how in ("co2", "dcp"):
            for k, (a, b) in enumerate(zip(got[how]["resumed"], got["straight"])):
                assert all(torch.equal(a[n], b[n]) for n in b), (how, rank, RESUME["save_at"] + k + 1)
            assert all(torch.equal(got[how]["final"][n], v) for n, v in got["straight_final"].items()), (how, rank)
        assert all(torch.equal(got["final_unsharded"][n], v) for n, v in got["straight_final"].items()), rank


@pytest.mark.parametrize("world", WORLDS)
def test_mixed_precision_trains_and_loss_falls(results, world):
    """With the defaults (their `local` stand-in: replicas start rounds apart, design §3) the ranks of each
    replica agree at every round start and every rank ends with one model."""
    tau, shards = MIXED["config"]["tau"], world // 2
    for rank, per_rank in enumerate(results[world]):
        got = per_rank["mixed"]
        assert got["out_dtype"] == torch.bfloat16 and got["param_dtypes"] == {torch.float32}
        assert got["rounds"] == MIXED["steps"] // tau
        losses = torch.tensor(got["losses"])
        assert torch.isfinite(losses).all()
        first, last = losses[:tau].mean(), losses[-tau:].mean()
        assert last < 0.5 * first, (rank, first.item(), last.item())
        for other in results[world][rank // shards * shards : (rank // shards + 1) * shards]:
            for a, b in zip(got["starts"], other["mixed"]["starts"]):
                assert all(torch.equal(a[n], b[n]) for n in a), (world, rank)
        assert all(torch.equal(got["final"][n], v) for n, v in results[world][0]["mixed"]["final"].items())


@pytest.mark.parametrize("world", WORLDS)
def test_models_it_cannot_train_are_refused_with_what_to_do(results, world):
    shards = world // 2
    for rank, per_rank in enumerate(results[world]):
        got = per_rank["refusals"]
        assert "mesh of global ranks" in got["world_mesh"] and "replica_mesh" in got["world_mesh"], got["world_mesh"]
        assert "2-D mesh" in got["hsdp_mesh"] and "HSDP" in got["hsdp_mesh"], got["hsdp_mesh"]
        assert "torch.bfloat16" in got["bf16"] and "MixedPrecisionPolicy" in got["bf16"], got["bf16"]
        assert "CPU offload is not supported" in got["offload_elsewhere"], got["offload_elsewhere"]
        assert "plain tensors" in got["half_sharded"], got["half_sharded"]
        if shards > 1:
            refused = "shards_per_replica=2 is not supported with a plain CO2Optimizer"
            assert refused in got["plain_params_s"], got["plain_params_s"]
        assert "parameter 0 (shape (8, 4)) moved" in got["moved_shard"], got["moved_shard"]
        replica = rank // shards
        assert got["hsdp_slice_accepted"] == list(range(replica * shards, (replica + 1) * shards))
