"""co2_zero.deepspeed on real gloo processes against the independent single-process reference.

One spawn per world size runs every scenario (process start-up and the first DeepSpeed engine dominate
the cost); each test then checks one property of the recorded results. World 4 is S = 2 shards x R = 2
replicas (ZeRO shards the inner optimizer over a replica); world 2 is S = 1 x R = 2. The scenarios start
from the shipped configs in configs/ and override only what the comparison needs. The fp32 scenarios are
compared with the reference after every inner step on every rank, not only at round starts.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests import models
from tests.dist_utils import environment, run_ranks
from tests.reference import resolve_config, simulate
from tests.scenarios import co2

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children
co2_deepspeed = pytest.importorskip("co2_zero.deepspeed")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# The defaults of the co2 section as the README's Configuration table documents them, spelled out for the
# reference (which has defaults of its own): a scenario that gives the library an empty co2 section is
# compared with a reference run on these.
DOCUMENTED_DEFAULTS = {
    "tau": 32,
    "outer_lr": 0.5,
    "outer_momentum": 0.9,
    "nesterov": True,
    "overlap": True,
    "stand_in": "local",
    "sync_delay": None,  # "auto" measures in the first 4 rounds, applying at the round end
    "gap_penalty": {"mode": "none"},
    "clip": {"mode": "none"},
}


def ds_config(
    name: str,
    co2: dict | None = None,
    zero: dict | None = None,
    plain: bool = False,
    drop: tuple[str, ...] = (),
    co2_only: bool = False,
    **top,
) -> dict:
    """A shipped config with test overrides: a faster schedule, the given co2 fields and top-level keys.
    `plain` drops the co2 section, `drop` top-level keys (e.g. "gradient_clipping", "scheduler");
    `co2_only` makes `co2` the whole section (every other field then takes the library's default)."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    config["optimizer"]["params"].update(lr=0.02)
    config["scheduler"]["params"].update(warmup_min_lr=0.002, warmup_max_lr=0.02, warmup_num_steps=4)
    config["zero_optimization"].update(zero or {})
    config.update(top)
    if co2_only:
        config["co2"] = dict(co2 or {})
    else:
        config["co2"].update(co2 or {})
    for key in drop:
        del config[key]
    if plain:
        del config["co2"]
    return config


def _scenarios(shards: int) -> dict:
    """The fp32 scenarios compared with the reference at every step, for S = shards (R = 2 in both spawns).

    Between them, each ZeRO stage runs overlap on and off, `gradient_clipping` absent (no clipping, see
    co2_zero.deepspeed's workaround section), 0 and active, with and without an LR scheduler, and
    with the library's default co2 section (only S given: tau 32, so 65 steps cover two round ends
    and a step of the third round, after the first outer update has landed).
    """
    s = {"shards_per_replica": shards}
    no_clip_key, defaults = ("gradient_clipping", "scheduler"), dict(reference_co2=DOCUMENTED_DEFAULTS, steps=65)
    return {
        # ZeRO-1, overlap as published (the shared start); replica 1 starts from another init (the library
        # must broadcast replica 0's); an active inner gradient clip; WarmupLR; train_batch_size given as the
        # global batch.
        "z1-overlap": dict(
            config=ds_config(
                "ds_zero1_co2",
                {**s, **co2("overlap-shared-heavyball-adaptive-reducescatter-t3")},
                gradient_clipping=0.05,
                train_batch_size=8 * 2 * shards,
            ),
            steps=10,
            perturb=True,
        ),
        # ZeRO-1, blocking, gradient_clipping 0, no LR scheduler.
        "z1-blocking": dict(
            config=ds_config(
                "ds_zero1_co2",
                {**s, **co2("blocking-nesterov-adaptive-allreduce-t2")},
                drop=("scheduler",),
                gradient_clipping=0.0,
            ),
            steps=7,
        ),
        # ZeRO-1, the default co2 section, no gradient_clipping key, no LR scheduler.
        "z1-defaults": dict(config=ds_config("ds_zero1_co2", s, co2_only=True, drop=no_clip_key), **defaults),
        # ZeRO-2 with gradient accumulation 2 (tau counts optimizer steps), WarmupDecayLR, clipping,
        # round-robin gradient partitioning and per-tensor alignment padding on uneven tensors.
        "z2-overlap-accum": dict(
            config=ds_config(
                "ds_zero2_co2",
                {**s, **co2("overlap-shared-heavyball-adaptive-clipnorm-t2")},
                zero={"round_robin_gradients": True, "parameter_alignment": True},
                gradient_clipping=0.05,
            ),
            steps=7,
            model="uneven",
            data=True,
        ),
        # ZeRO-2, blocking, gradient_clipping 0, WarmupDecayLR.
        "z2-blocking": dict(
            config=ds_config(
                "ds_zero2_co2",
                {**s, **co2("blocking-heavyball-adaptive-reducescatter-t3")},
                gradient_accumulation_steps=1,
                gradient_clipping=0.0,
            ),
            steps=9,
        ),
        # ZeRO-2 with a sync delay and the (default) local stand-in: the average is applied one optimizer step
        # into the next round, the rebased masters spread by DeepSpeed's own all-gather mid-round (design §3)
        "z2-sync-delay": dict(
            config=ds_config("ds_zero2_co2", {**s, **co2("overlap-heavyball-adaptive-t3-d1")}),
            steps=8,
        ),
        # ZeRO-2, the default co2 section, no gradient_clipping key, no LR scheduler.
        "z2-defaults": dict(
            config=ds_config("ds_zero2_co2", s, co2_only=True, drop=no_clip_key, gradient_accumulation_steps=1),
            **defaults,
        ),
    }


def _resume_scenario(shards: int) -> dict:
    return dict(
        config=ds_config("ds_zero1_co2", {"shards_per_replica": shards, **co2("overlap-heavyball-adaptive-t3")}),
        steps=8,
        save_at=4,  # one round ended at 3, its exchange in flight
    )


BF16 = dict(config=ds_config("ds_zero2_co2_bf16", {"shards_per_replica": 2, **co2("defaults-t4")}), steps=32)
BF16["config"]["optimizer"]["params"]["lr"] = BF16["config"]["scheduler"]["params"]["warmup_max_lr"] = 0.05
# Plain DeepSpeed through co2_zero's initialize, without a gradient_clipping key (DeepSpeed 0.19.8 would
# clip at 1.0); data of replica 1 (targets offset by 1) gives gradient norms above 1.
PLAIN = dict(config=ds_config("ds_zero1_co2", plain=True, drop=("gradient_clipping",)), steps=4, data_replica=1)


# ---- the children ----------------------------------------------------------------------------------------


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _micro_batches(rank: int, shards: int, step: int, accumulation: int, dtype=torch.float32):
    """Rank (r, s)'s micro-batches of one optimizer step: slices r, m*S + s of replica r's batch."""
    r, s = divmod(rank, shards)
    for m in range(accumulation):
        x, y = models.shard_batch(r, m * shards + s, step, shards * accumulation)
        yield x.to(dtype), y


def _train(
    engine, opt, rank, shards, steps, accumulation, dtype=torch.float32, first_step=0, batches=None, trajectory=None
):
    """Train; returns the parameters at every round start after the first, and the losses. `trajectory`
    (a list) receives the parameters after every optimizer step, as the next step starts from them."""
    starts, losses = [], []
    for step in range(first_step, steps):
        if batches is None:
            micro = _micro_batches(rank, shards, step, accumulation, dtype)
        else:
            micro = [(x.to(dtype), y) for x, y in [batches(*divmod(rank, shards), step, shards)]]
        for x, y in micro:
            loss = models.loss_fn(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if opt.round_ended:
            starts.append(_params(engine.module))
        if trajectory is not None:
            trajectory.append(_params(engine.module))
    return starts, losses


def _run_scenario(rank: int, shards: int, sc: dict) -> dict:
    from co2_zero.deepspeed import initialize

    model = models.make_model(sc.get("model", "mlp"))
    if sc.get("perturb") and rank >= shards:  # replicas other than 0 start elsewhere
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    data = torch.utils.data.TensorDataset(torch.arange(64.0)) if sc.get("data") else None
    engine, opt, loader, _ = initialize(
        model=model, model_parameters=model.parameters(), training_data=data, config=copy.deepcopy(sc["config"])
    )
    # This rank's fp32 master partition as (tensor id, values) pieces, straight after initialize.
    flat = torch.cat([c.detach() for c in opt.engine.partition.chunks])
    pieces = [(seg.tensor_id, seg.offset, flat[seg.start : seg.end].clone()) for seg in opt.engine.partition.segments]
    x0 = _params(engine.module)
    trajectory: list = []
    accumulation = engine.gradient_accumulation_steps()
    starts, losses = _train(engine, opt, rank, shards, sc["steps"], accumulation, trajectory=trajectory)
    out = {
        "pieces": pieces,
        "partition_length": flat.numel(),
        "starts": [x0] + starts,
        "trajectory": trajectory,
        "final": None,
        "losses": losses,
        "train_batch_size": engine.train_batch_size(),
        "first_batch": next(iter(loader))[0].tolist() if loader is not None else None,
    }
    opt.finalize()
    out["final"] = _params(engine.module)
    return out


def _run_resume(rank: int, shards: int, sc: dict, directory: str) -> dict:
    """Straight run to `steps` vs. save at `save_at`, a fresh engine (other init) that loads, then the rest."""
    from co2_zero import CO2Error
    from co2_zero.deepspeed import initialize, load_checkpoint

    model = models.make_model()
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(sc["config"]))
    _train(engine, opt, rank, shards, sc["save_at"], 1)
    saved_dir = engine.save_checkpoint(directory, client_state={"note": rank})  # redirected to co2's save
    _train(engine, opt, rank, shards, sc["steps"], 1, first_step=sc["save_at"])
    straight = _params(engine.module)
    opt.finalize()
    straight_final = _params(engine.module)

    model = models.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(sc["config"]))
    loaded_dir, client = load_checkpoint(engine, directory)
    _train(engine, opt, rank, shards, sc["steps"], 1, first_step=sc["save_at"])
    resumed = _params(engine.module)
    opt.finalize()

    # Another co2 config cannot load it: every rank raises (none is left waiting); no checkpoint: nothing.
    other = copy.deepcopy(sc["config"])
    other["co2"]["tau"] += 1
    model = models.make_model()
    engine3, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=other)
    try:
        load_checkpoint(engine3, directory)
        mismatch = None
    except CO2Error as error:
        mismatch = str(error)
    with pytest.warns(UserWarning, match="nothing loaded"):
        nothing = load_checkpoint(engine3, os.path.join(directory, "nowhere"))
    return {
        "mismatch": mismatch,
        "nothing": nothing,
        "straight": straight,
        "straight_final": straight_final,
        "resumed": resumed,
        "resumed_final": _params(engine.module),
        "client": client,
        "same_dir": str(saved_dir) == str(loaded_dir),
        "global_steps": engine.global_steps,
        "files": sorted(os.listdir(saved_dir)),
    }


def _run_bf16(rank: int, sc: dict) -> dict:
    from co2_zero.deepspeed import initialize

    model = models.make_model()
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(sc["config"]))
    shards = sc["config"]["co2"]["shards_per_replica"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        starts, losses = _train(engine, opt, rank, shards, sc["steps"], 1, torch.bfloat16, batches=models.teacher_batch)
    opt.finalize()
    return {
        "cast_warnings": [str(w.message) for w in caught if "casts none" in str(w.message)],
        "starts": starts,
        "final": _params(engine.module),
        "losses": losses,
        "param_dtypes": {p.dtype for p in engine.module.parameters()},
        "master_dtypes": {c.dtype for c in opt.single_partition_of_fp32_groups},
        "rounds": opt.engine.rounds,
    }


def _run_bf16_uncast(rank: int, sc: dict) -> dict:
    """The bf16 config fed fp32 inputs, as a user who does not cast them: a warning naming the cast,
    then torch's own dtype error."""
    from co2_zero.deepspeed import initialize

    model = models.make_model()
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(sc["config"]))
    x, _ = models.teacher_batch(*divmod(rank, 2), 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine(x.float())
            error = None
        except RuntimeError as raised:
            error = str(raised)
    opt.finalize()
    return {"warnings": [str(w.message) for w in caught if "casts none" in str(w.message)], "error": error}


def _run_refused(rank: int, shards: int) -> str:
    """bf16 + ZeRO-1 + fp32 gradient accumulation makes DeepSpeed build its BF16_Optimizer: refused."""
    from co2_zero.deepspeed import initialize

    config = ds_config(
        "ds_zero2_co2_bf16", {"shards_per_replica": shards}, zero={"stage": 1}, data_types={"grad_accum_dtype": "fp32"}
    )
    model = models.make_model()
    try:
        initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return "not refused"


def _run_plain(rank: int, sc: dict) -> dict:
    from co2_zero.deepspeed import CO2ZeroOptimizer, initialize

    model = models.make_model()
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(sc["config"]))
    world = torch.distributed.get_world_size()
    trajectory = []
    for step in range(sc["steps"]):
        x, y = models.shard_batch(sc["data_replica"], rank, step, world)  # one replica of `world` shards
        engine.backward(models.loss_fn(engine(x), y))
        engine.step()
        trajectory.append(_params(engine.module))
    return {"co2": isinstance(opt, CO2ZeroOptimizer), "dp_world": engine.dp_world_size, "trajectory": trajectory}


def run_all(rank: int, world: int, shards: int, directory: str) -> dict:
    """Child: every scenario of this world size, then what the process looked like."""
    import deepspeed.comm.comm as ds_comm

    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed requires it; torchrun would set it
    results = {name: _run_scenario(rank, shards, sc) for name, sc in _scenarios(shards).items()}
    results["resume"] = _run_resume(rank, shards, _resume_scenario(shards), directory)
    if world == 4:
        results["bf16"] = _run_bf16(rank, BF16)
        results["bf16_uncast"] = _run_bf16_uncast(rank, BF16)
    results["refused"] = _run_refused(rank, shards)
    results["plain"] = _run_plain(rank, PLAIN)  # after the co2 engines: nothing of theirs may leak
    results["shm_comm_op"] = getattr(ds_comm.cdb, "shm_comm_op", "missing")
    results["extensions"] = sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"]))
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: per-rank results}: world 4 = S 2 x R 2, world 2 = S 1 x R 2."""
    with environment(TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions"))):  # the children's JIT
        return {
            world: run_ranks(run_all, world, shards, str(tmp_path_factory.mktemp(f"ckpt{world}")), timeout=240)
            for world, shards in ((4, 2), (2, 1))
        }


# ---- the reference ---------------------------------------------------------------------------------------


class ReferenceInner:
    """What DeepSpeed does around the inner step, for the reference: the config's optimizer (torch
    AdamW), its gradient clipping and its LR scheduler (if any), on one full model. An absent
    `gradient_clipping` means no clipping, as co2_zero.deepspeed.initialize documents (DeepSpeed 0.19.8
    alone would clip at 1.0)."""

    def __init__(self, params, config: dict) -> None:
        from deepspeed.runtime import lr_schedules

        self.params = list(params)
        hyper = {k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}
        assert config["optimizer"]["type"] == "AdamW"
        self.optimizer = torch.optim.AdamW(self.params, **hyper)
        self.clip = config.get("gradient_clipping", 0.0)
        scheduler = config.get("scheduler")
        self.scheduler = scheduler and getattr(lr_schedules, scheduler["type"])(self.optimizer, **scheduler["params"])

    def step(self) -> None:
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        if self.scheduler:
            self.scheduler.step()


def _reference_co2(sc: dict) -> dict:
    return sc.get("reference_co2", sc["config"]["co2"])


def reference(sc: dict, shards: int, replicas: int = 2, exchange=None):
    """Of R replicas of `shards` ranks: the start point of every round, the parameters of every
    replica after every inner step, and the final parameters (`exchange`: the compressed one's
    reference, tests/reference_compress.py)."""
    config = sc["config"]
    micro = shards * config.get("gradient_accumulation_steps", 1)
    starts: list = []
    steps: list = []
    finals = simulate(
        lambda: models.make_model(sc.get("model", "mlp")),
        lambda params: ReferenceInner(params, config),
        lambda r, k: models.shard_batch(r, 0, k, 1),
        models.loss_fn,
        _reference_co2(sc),
        replicas=replicas,
        steps=sc["steps"],
        shards=micro,
        shard_batch=lambda r, j, k: models.shard_batch(r, j, k, micro),
        record=starts,
        step_record=steps,
        exchange=exchange,
    )
    return starts, steps, finals


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    for key, value in expected.items():
        if key in actual:
            where = f"{what}/{key}"
            torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")


# ---- the tests -------------------------------------------------------------------------------------------

FP32 = [(world, name) for world in (4, 2) for name in _scenarios(1)]


@pytest.mark.parametrize(("world", "name"), FP32, ids=[f"w{w}-{n}" for w, n in FP32])
def test_fp32_matches_reference_at_every_step(results, world, name):
    shards = world // 2
    sc = _scenarios(shards)[name]
    starts, steps, finals = reference(sc, shards)
    tau = _reference_co2(sc)["tau"]
    # with a stand-in (the defaults' `local`) replicas start rounds from their own points, not the shared
    # start `starts` records: every inner step (the trajectory) is compared instead
    shared = resolve_config(_reference_co2(sc))["stand_in"] == "shared"
    assert len(steps) == sc["steps"] and len(starts) == 1 + sc["steps"] // tau
    for t, start in enumerate(starts[1:] if shared else []):  # the reference's own records agree
        assert all(torch.equal(start[k], v) for k, v in steps[(t + 1) * tau - 1][0].items())
    for rank, per_rank in enumerate(results[world]):
        got = per_rank[name]
        assert len(got["trajectory"]) == sc["steps"] and len(got["starts"]) == len(starts)
        _assert_close(got["starts"][0], starts[0], f"{name} rank {rank} x0")
        for k, (a, e) in enumerate(zip(got["trajectory"], steps)):
            _assert_close(a, e[rank // shards], f"{name} rank {rank} after inner step {k}")
        for t, (a, e) in enumerate(zip(got["starts"], starts if shared else starts[:1])):
            _assert_close(a, e, f"{name} rank {rank} round-{t} start")
        _assert_close(got["final"], finals[rank // shards], f"{name} rank {rank} final")


@pytest.mark.parametrize("world", [4, 2])
def test_partition_segments_cover_the_model(results, world):
    """Each replica's partitions, cut into tensor pieces by the segments, reassemble the model exactly."""
    shards = world // 2
    for name, sc in _scenarios(shards).items():
        model = models.make_model(sc.get("model", "mlp"))
        expected = [p.detach().reshape(-1) for p in model.parameters()]
        for replica in range(2):
            rebuilt = [torch.full_like(e, float("nan")) for e in expected]
            covered = [0] * len(expected)
            for rank in range(replica * shards, (replica + 1) * shards):
                for tensor_id, offset, values in results[world][rank][name]["pieces"]:
                    rebuilt[tensor_id][offset : offset + values.numel()] = values
                    covered[tensor_id] += values.numel()
            assert covered == [e.numel() for e in expected], (name, replica)
            for i, (a, e) in enumerate(zip(rebuilt, expected)):
                assert torch.equal(a, e), f"{name} replica {replica} tensor {i}"


def test_replicas_identical_at_every_round_start(results):
    """As published (the shared start) every round; with a stand-in the replicas start rounds apart by design
    (design §3) and `finalize()` still ends with one model."""
    for world, per_rank in results.items():
        scenarios = {**_scenarios(world // 2), "bf16": BF16}
        names = list(_scenarios(1)) + (["bf16"] if world == 4 else [])
        for name in names:
            first = per_rank[0][name]
            shared = resolve_config(_reference_co2(scenarios[name]))["stand_in"] == "shared"
            for other in per_rank[1:] if shared else []:
                for a, b in zip(first["starts"], other[name]["starts"]):
                    assert all(torch.equal(a[k], b[k]) for k in a), (world, name)
            for other in per_rank[1:]:
                assert all(torch.equal(first["final"][k], v) for k, v in other[name]["final"].items()), (world, name)


def test_gradient_accumulation_counts_optimizer_steps(results):
    for world, per_rank in results.items():
        sc = _scenarios(world // 2)["z2-overlap-accum"]
        got = per_rank[0]["z2-overlap-accum"]
        assert sc["config"]["gradient_accumulation_steps"] == 2
        assert len(got["losses"]) == 2 * sc["steps"]  # micro-steps
        assert len(got["starts"]) == 1 + sc["steps"] // sc["config"]["co2"]["tau"]


def test_train_batch_size_is_global_and_data_is_sampled_over_all_ranks(results):
    for world, per_rank in results.items():
        # the JSON's train_batch_size counts all ranks; DeepSpeed is told the replica's share
        assert per_rank[0]["z1-overlap"]["train_batch_size"] == 8 * (world // 2)
        batches = [set(r["z2-overlap-accum"]["first_batch"]) for r in per_rank]
        assert all(len(b) == 4 for b in batches)
        assert len(set().union(*batches)) == 4 * world, "every rank must get different samples"


@pytest.mark.parametrize("world", [4, 2])
def test_resume_continues_the_exact_trajectory(results, world):
    for rank, per_rank in enumerate(results[world]):
        got = per_rank["resume"]
        assert got["same_dir"] and got["client"] == {"note": rank}
        assert got["global_steps"] == _resume_scenario(1)["steps"]
        for key in got["straight"]:
            assert torch.equal(got["resumed"][key], got["straight"][key]), (world, rank, key)
            assert torch.equal(got["resumed_final"][key], got["straight_final"][key]), (world, rank, key)
        assert "config_hash" in got["mismatch"] and "failed on rank(s) [" in got["mismatch"], got["mismatch"]
        assert got["nothing"] == (None, {})
    files = results[world][0]["resume"]["files"]
    ranks = [name.split(".")[0] for name in files if name != "co2_complete.json"]
    assert ranks == [f"co2_rank{r:05d}" for r in range(world)], files  # one per rank, no collision


def test_bf16_trains_and_loss_falls(results):
    per_rank = results[4]
    tau = BF16["config"]["co2"]["tau"]
    for rank, got in enumerate(per_rank):
        bf16 = got["bf16"]
        assert bf16["param_dtypes"] == {torch.bfloat16} and bf16["master_dtypes"] == {torch.float32}
        assert bf16["rounds"] == BF16["steps"] // tau
        losses = torch.tensor(bf16["losses"])
        assert torch.isfinite(losses).all()
        first, last = losses[:tau].mean(), losses[-tau:].mean()
        assert last < 0.5 * first, (rank, first.item(), last.item())
        assert bf16["cast_warnings"] == [], bf16["cast_warnings"]  # bf16 inputs: nothing to say


def test_bf16_engine_fed_fp32_inputs_warns_naming_the_cast(results):
    for rank, got in enumerate(results[4]):
        uncast = got["bf16_uncast"]
        assert uncast["error"] is not None and "same dtype" in uncast["error"], (rank, uncast)
        assert len(uncast["warnings"]) == 1, (rank, uncast)
        assert "torch.float32 inputs" in uncast["warnings"][0] and "x.to(torch.bfloat16)" in uncast["warnings"][0]


def test_without_co2_section_it_is_plain_deepspeed_at_every_step(results):
    """One ZeRO group over the world, no gradient_clipping key (so no clipping), every step."""
    data = PLAIN["data_replica"]
    for world, per_rank in results.items():
        steps: list = []
        simulate(
            models.make_model, lambda params: ReferenceInner(params, PLAIN["config"]),
            lambda r, k: models.shard_batch(data, 0, k, 1), models.loss_fn, {"tau": 10**6}, replicas=1,
            steps=PLAIN["steps"], finalize=False, shards=world,
            shard_batch=lambda r, j, k, w=world: models.shard_batch(data, j, k, w), step_record=steps,
        )  # fmt: skip
        for rank, got in enumerate(per_rank):
            assert not got["plain"]["co2"] and got["plain"]["dp_world"] == world
            assert len(got["plain"]["trajectory"]) == len(steps) == PLAIN["steps"]
            for k, (a, e) in enumerate(zip(got["plain"]["trajectory"], steps)):
                _assert_close(a, e[0], f"plain world {world} rank {rank} after step {k}")


def test_optimizers_other_than_deepspeeds_zero_are_refused(results):
    for per_rank in results.values():
        for got in per_rank:
            assert "BF16_Optimizer" in got["refused"] and "not supported" in got["refused"], got["refused"]


def test_no_jit_build_on_cpu(results):
    for per_rank in results.values():
        for got in per_rank:
            assert got["shm_comm_op"] is None  # DeepSpeed's comm backend exists, without the JIT-built op
            assert got["extensions"] == []


# ---- configuration errors (no processes needed: they are caught before any) ------------------------------


def _initialize(config):
    return co2_deepspeed.initialize(model=models.make_model(), config=config)


@pytest.mark.parametrize(
    ("co2", "field"),
    [
        ({"tua": 3}, "co2.tua"),
        ({"tau": 0}, "tau"),
        ({"outer_momentum": 1.5}, "outer_momentum"),
        ({"gap_penalty": {"mode": "bogus"}}, "gap_penalty.mode"),
        ({"clip": {"treshold": 1.0}}, "clip.treshold"),
        ({"overlap": "yes"}, "overlap"),
        ({"shards_per_replica": 0}, "shards_per_replica"),
        (3, "co2"),
    ],
)
def test_bad_co2_section_is_rejected_naming_the_field(co2, field):
    config = ds_config("ds_zero1_co2")
    config["co2"] = co2
    with pytest.raises(ValueError, match=rf"co2 config: {field}="):
        _initialize(config)


def test_bad_co2_section_in_a_json_file_is_rejected(tmp_path):
    config = ds_config("ds_zero2_co2", {"outer_lr": -1})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"co2 config: outer_lr=-1"):
        _initialize(str(path))

    class Args:
        deepspeed_config = str(path)
        local_rank = 0

    with pytest.raises(ValueError, match=r"co2 config: outer_lr=-1"):
        co2_deepspeed.initialize(args=Args(), model=models.make_model())


def test_a_config_given_twice_or_not_at_all_is_refused(tmp_path):
    class Args:
        deepspeed_config = str(tmp_path / "ds.json")

    with pytest.raises(ValueError, match=r"given both as args.deepspeed_config and as config="):
        co2_deepspeed.initialize(args=Args(), model=models.make_model(), config=ds_config("ds_zero1_co2"))
    with pytest.raises(ValueError, match=r"no DeepSpeed config: pass config="):
        co2_deepspeed.initialize(model=models.make_model())


@pytest.mark.parametrize("stage", [3, 0, None])
def test_stages_other_than_1_and_2_are_refused(stage):
    config = ds_config("ds_zero1_co2")
    if stage is None:
        del config["zero_optimization"]
    else:
        config["zero_optimization"]["stage"] = stage
    with pytest.raises(ValueError, match=rf"zero_optimization.stage={stage if stage is not None else 0}.*1 or 2"):
        _initialize(config)


@pytest.mark.parametrize("module", ["co2_zero.deepspeed", "co2_zero.deepspeed.routing"])
def test_missing_deepspeed_names_the_extra(monkeypatch, module):
    """Without DeepSpeed, importing the package or any of its files raises an ImportError naming the extra."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if DeepSpeed were not installed
    for name in [name for name in sys.modules if name.startswith("co2_zero.deepspeed")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[deepspeed\]'"):
        importlib.import_module(module)


def test_shipped_configs_are_valid(monkeypatch):
    import co2_zero.configs
    from co2_zero.core.topology import check_shards

    paths = sorted(CONFIGS.glob("ds_*co2*.json"))
    assert [p.name for p in paths] == co2_zero.configs.names(), "configs/ must be the package's configs"
    for path in paths:
        assert co2_zero.configs.path(path.name).read_bytes() == path.read_bytes(), path
        ds, co2 = co2_deepspeed.split_config(str(path))
        assert co2 is not None and "co2" not in ds, path
        assert ds["optimizer"]["params"]["torch_adam"] is True, f"{path}: FusedAdam would JIT-build on CPU"
        # 4 ranks on one machine (LOCAL_WORLD_SIZE=4) must give CO2 more than one replica to average
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert check_shards(co2.resolve_shards(4), 4) > 1, f"{path}: shards_per_replica gives R = 1 on one machine"


def test_a_config_path_that_names_no_file_says_where_it_looked_and_names_the_shipped_file(tmp_path, monkeypatch):
    """DeepSpeed would read it as base64 ("Expected a string path to an existing deepspeed config")."""
    monkeypatch.chdir(tmp_path)  # no configs/ here: a checkout-relative path names no file
    with pytest.raises(ValueError) as info:
        co2_deepspeed.split_config("configs/ds_zero2_co2.json")
    message = str(info.value)
    assert "config='configs/ds_zero2_co2.json' is no file" in message and str(tmp_path) in message, message
    assert "co2_zero.configs.path('ds_zero2_co2.json')" in message, message
    with pytest.raises(ValueError, match=r"config='mine\.json' is no file") as info:
        co2_deepspeed.split_config("mine.json")
    assert "co2_zero.configs" not in str(info.value)  # not a shipped name: no such hint
    import co2_zero.configs

    assert co2_deepspeed.split_config(co2_zero.configs.path("ds_zero2_co2.json"))[1].tau == 32  # from anywhere


# ---- a misspelt co2 section (DeepSpeed would ignore it and train plain ZeRO) -------------------------------


@pytest.mark.parametrize("key", ["CO2", "Co2", "co_2", "Co-2", "c02"])
def test_a_misspelt_co2_section_is_refused_naming_the_key(key):
    config = ds_config("ds_zero2_co2")
    config[key] = config.pop("co2")
    with pytest.raises(
        ValueError, match=rf"top-level key '{key}' in the DeepSpeed config dict is invalid; accepted: 'co2'"
    ):
        _initialize(config)


def test_a_misspelt_co2_section_in_a_json_file_is_refused_naming_the_file(tmp_path):
    config = ds_config("ds_zero2_co2")
    config["CO2"] = config.pop("co2")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"top-level key 'CO2' in the DeepSpeed config '{path}' is invalid"):
        _initialize(str(path))


@pytest.mark.parametrize("as_path", [False, True])
def test_patched_deepspeed_initialize_refuses_a_misspelt_co2_section(tmp_path, as_path):
    """Under patch() DeepSpeed's own entry point refuses it too (unpatched, DeepSpeed's code runs as shipped
    and cannot check: README, Failures)."""
    import deepspeed

    config = ds_config("ds_zero2_co2")
    config["Co2"] = config.pop("co2")
    if as_path:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        config = str(path)
    with co2_deepspeed.patch(), pytest.raises(ValueError, match=r"top-level key 'Co2' in the DeepSpeed config"):
        deepspeed.initialize(model=models.make_model(), config=config)


def test_no_deepspeed_config_key_is_taken_for_a_misspelt_co2():
    """The top-level keys DeepSpeed's own config class reads (recorded while it parses a shipped config)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from co2_zero.deepspeed.config import _is_near_co2

    class Recording(dict):
        read: set = set()

        def get(self, key, *default):
            self.read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.read.add(key)
            return super().__contains__(key)

    DeepSpeedConfig(Recording(ds_config("ds_zero2_co2", plain=True, train_batch_size=8)))
    assert {"zero_optimization", "gradient_clipping", "optimizer", "comms_logger"} <= Recording.read
    assert "co2" not in Recording.read  # DeepSpeed ignores the section: hence the check
    assert [key for key in sorted(Recording.read) if _is_near_co2(key)] == []


# ---- importing changes nothing in DeepSpeed; patch() does, unpatch() undoes it ---------------------------


def patch_check(route: str) -> dict:
    """tests/workers/patch_check.py in a fresh interpreter (this one imported co2_zero.deepspeed already)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "workers" / "patch_check.py"), route],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


PATCH_CHECK_EXPECTED = {
    "imported": "original",
    "patched": "changed",
    "patched twice, same code": True,
    "unpatched": "original",
    "unpatched twice": "original",
    "in with patch()": "changed",
    "after with patch()": "original",
}


def test_importing_changes_nothing_in_deepspeed_and_unpatch_restores_the_original_code():
    assert patch_check("deepspeed") == PATCH_CHECK_EXPECTED
