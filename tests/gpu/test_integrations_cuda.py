"""The three integrations on CUDA against the independent reference (tests/reference.py).

Two layouts (tests/gpu/devices.py): two ranks sharing one GPU over gloo with CUDA tensors (R = 2 on any
GPU machine), and NCCL with one rank per GPU. The scenarios are the CPU suite's own (tests/integrations/test_optim.py,
test_fairscale.py, test_deepspeed.py), run in ranks whose tests.models build on the GPU; the reference
runs here, on the CPU. Includes FairScale and DeepSpeed checkpoints saved and loaded on the GPU
(per rank, consolidated, resharded into CO2Optimizer) and bf16 ZeRO-2.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests import compare
from tests.dist_utils import environment, run_ranks
from tests.gpu.devices import ATOL, DEVICE, LAYOUTS, ON_GPU, RTOL
from tests.integrations import test_deepspeed as cpu_deepspeed
from tests.integrations import test_fairscale as cpu_fairscale
from tests.integrations import test_optim as cpu_optim
from tests.reference import resolve_config

pytestmark = pytest.mark.gpu


def assert_close(actual: dict, expected: dict, what: str) -> None:
    """compare.assert_close at the GPU suite's tolerance (tests/gpu/devices.py)."""
    compare.assert_close(actual, expected, what, rtol=RTOL, atol=ATOL)


def assert_trajectory(got: dict, starts: list, final: dict, what: str) -> None:
    """Every round's start point (this replica's: the shared start, or its stand-in) and the final
    parameters against the reference."""
    assert len(got["starts"]) == len(starts), what
    for t, (a, e) in enumerate(zip(got["starts"], starts)):
        assert_close(a, e, f"{what} round-{t} start")
    assert_close(got["final"], final, f"{what} final")


def starts_at_the_shared_start(config: dict) -> bool:
    """Whether every replica starts each round at the shared start (no stand-in: design §3)."""
    return resolve_config(config)["stand_in"] == "shared"


def assert_replicas_identical(results: list, names, configs: dict) -> None:
    """Every rank holds bit-identical parameters at the end, and at every round start where the replicas
    start rounds at the shared start (`configs`: name -> its CO2 config; with a stand-in they start
    rounds apart by design)."""
    for name in names:
        first = results[0][name]
        shared = starts_at_the_shared_start(configs[name])
        for rank, other in enumerate((r[name] for r in results[1:]), 1):
            for t, (a, b) in enumerate(zip(first["starts"], other["starts"]) if shared else []):
                assert all(torch.equal(a[k], b[k]) for k in a), f"{name} rank {rank} round {t}"
            assert all(torch.equal(first["final"][k], v) for k, v in other["final"].items()), (name, rank)


def configs_of(scenarios: dict) -> dict:
    return {name: sc["config"] for name, sc in scenarios.items()}


# ---- plain PyTorch: CO2Optimizer ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(LAYOUTS))
def plain(request):
    backend, world = LAYOUTS[request.param]
    return run_ranks(cpu_optim.train_scenarios, world, cpu_optim.SCENARIOS_R2, backend=backend, device=DEVICE)


@pytest.mark.parametrize("name", list(cpu_optim.SCENARIOS_R2))
def test_co2optimizer_matches_reference(plain, name):
    sc = cpu_optim.SCENARIOS_R2[name]
    starts, finals = cpu_optim._reference(sc, len(plain))
    assert len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
    for rank, per_rank in enumerate(plain):
        assert_trajectory(per_rank[name], [s[rank] for s in starts], finals[rank], f"{name} rank {rank}")


def test_co2optimizer_replicas_agree_and_live_parameters_wait_for_round_ends(plain):
    assert_replicas_identical(plain, cpu_optim.SCENARIOS_R2, configs_of(cpu_optim.SCENARIOS_R2))
    for per_rank in plain:
        assert per_rank["overlap-slow-collective"]["in_flight"] >= 3  # the exchange really overlapped
        for name in cpu_optim.SCENARIOS_R2:
            assert per_rank[name]["live_changed"] == 0, name


# ---- FairScale: CO2OSS + ShardedDataParallel, and its checkpoints -------------------------------------


@pytest.fixture(scope="module", params=list(LAYOUTS))
def fairscale(request, tmp_path_factory):
    backend, world = LAYOUTS[request.param]
    workdir = str(tmp_path_factory.mktemp("fairscale_gpu"))
    scenarios, resume = cpu_fairscale.ONE_SHARD, cpu_fairscale.RESUME_ONE_SHARD
    return run_ranks(
        cpu_fairscale.run_scenarios, world, 1, scenarios, resume, workdir, backend=backend, device=DEVICE, timeout=300
    )


@pytest.mark.parametrize("name", list(cpu_fairscale.ONE_SHARD))
def test_co2oss_matches_reference(fairscale, name):
    sc = cpu_fairscale.ONE_SHARD[name]
    starts, finals, _ = cpu_fairscale.reference(sc, len(fairscale), 1)
    for rank, per_rank in enumerate(fairscale):
        assert_trajectory(per_rank[name], [s[rank] for s in starts], finals[rank], f"{name} rank {rank}")
    configs = {**configs_of(cpu_fairscale.ONE_SHARD), "resume": cpu_fairscale.RESUME_ONE_SHARD["config"]}
    assert_replicas_identical(fairscale, [*cpu_fairscale.ONE_SHARD, "resume"], configs)


def test_co2oss_checkpoints_resume_and_reshard(fairscale):
    """Saved mid-round with a round in flight: the FairScale-style consolidated file and the per-rank
    files (co2_zero.checkpoint) both continue the reference trajectory; the per-rank files reshard into
    CO2Optimizer at the last round start."""
    sc = cpu_fairscale.RESUME_ONE_SHARD
    starts, finals, _ = cpu_fairscale.reference(sc, len(fairscale), 1)
    for rank, per_rank in enumerate(fairscale):
        got, mine = per_rank["resume"], [s[rank] for s in starts]
        for style in ("", "per_rank_"):
            resumed = {"starts": got[f"{style}starts"], "final": got[f"{style}final"]}
            assert_trajectory(resumed, mine, finals[rank], f"resume {style or 'consolidated'} rank {rank}")
        # a resharded load resumes at the last round start, from its replica's stand-in (replica m continues
        # saved replica m % R; here R is the same)
        assert_close(got["resharded"], mine[sc["save_at"] // sc["config"]["tau"]], f"resharded rank {rank}")


def test_co2oss_clip_norm_and_co2optimizer_agree(fairscale):
    for rank, per_rank in enumerate(fairscale):
        clip = per_rank["clip"]
        assert clip["norm"] == pytest.approx(clip["expected"], rel=RTOL), rank
        assert clip["after"] == pytest.approx(clip["norm"] / 2, rel=1e-4)
        oss, plain = per_rank["s1-sdp-overlap-adam-clipnorm-reducescatter"], per_rank["co2optimizer"]
        assert_trajectory(oss, plain["starts"], plain["final"], f"CO2OSS vs CO2Optimizer rank {rank}")


# ---- DeepSpeed ZeRO-1/2: fp32 against the reference, checkpoints, bf16 ZeRO-2 -------------------------


def deepspeed_child(rank: int, world: int, directory: str) -> dict:
    """S = 1 (every rank a replica): the CPU suite's fp32 scenarios, its resume run and bf16 ZeRO-2."""
    # DeepSpeed puts the engine on cuda:LOCAL_RANK: the GPU dist_utils picked for this rank
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if ON_GPU else rank)
    scenarios = scenarios_for(world)
    out = {name: cpu_deepspeed._run_scenario(rank, 1, sc) for name, sc in scenarios.items()}
    out["resume"] = cpu_deepspeed._run_resume(rank, 1, cpu_deepspeed._resume_scenario(1), directory)
    out["bf16"] = cpu_deepspeed._run_bf16(rank, bf16_scenario())
    return out


def scenarios_for(world: int) -> dict:
    scenarios = cpu_deepspeed._scenarios(1)
    for sc in scenarios.values():
        if world == 1:  # its global train_batch_size assumes R = 2
            sc["config"].pop("train_batch_size", None)
    return scenarios


def bf16_scenario() -> dict:
    """The CPU suite's bf16 ZeRO-2 run at S = 1 (every rank a replica), twice as long: with the defaults
    replica 1's last round's loss is 0.64 of its first's after 32 steps here, 0.45 after 64 (CPU plumbing)."""
    sc = copy.deepcopy(cpu_deepspeed.BF16)
    sc["config"]["co2"]["shards_per_replica"] = 1
    sc["steps"] = 2 * sc["steps"]
    return sc


@pytest.fixture(scope="module", params=list(LAYOUTS))
def deepspeed(request, tmp_path_factory):
    backend, world = LAYOUTS[request.param]
    env = {"DS_ACCELERATOR": DEVICE, "TORCH_EXTENSIONS_DIR": str(tmp_path_factory.mktemp("torch_extensions"))}
    with environment(**env):  # the CPU suite's import sets DS_ACCELERATOR=cpu in this process
        directory = str(tmp_path_factory.mktemp("deepspeed_gpu"))
        return world, run_ranks(deepspeed_child, world, directory, backend=backend, device=DEVICE, timeout=400)


@pytest.mark.parametrize("name", list(cpu_deepspeed._scenarios(1)))
def test_deepspeed_fp32_matches_reference(deepspeed, name):
    world, results = deepspeed
    sc = scenarios_for(world)[name]
    starts, steps, finals = cpu_deepspeed.reference(sc, 1, replicas=world)
    config = cpu_deepspeed._reference_co2(sc)
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert len(got["trajectory"]) == len(steps), name
        for k, (a, e) in enumerate(zip(got["trajectory"], steps)):
            assert_close(a, e[rank], f"{name} rank {rank} after inner step {k}")
        if starts_at_the_shared_start(config):  # else the trajectory holds every round start
            assert_trajectory(got, starts, finals[rank], f"{name} rank {rank}")
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final")
    assert_replicas_identical(results, [name], {name: config})


def test_deepspeed_checkpoint_resumes_exactly(deepspeed):
    """co2_zero.deepspeed's save/load under the layout's backend, saved with an exchange in flight."""
    world, results = deepspeed
    for rank, per_rank in enumerate(results):
        got = per_rank["resume"]
        assert got["same_dir"] and got["client"] == {"note": rank}
        for key in got["straight"]:
            assert torch.equal(got["resumed"][key], got["straight"][key]), (rank, key)
            assert torch.equal(got["resumed_final"][key], got["straight_final"][key]), (rank, key)
        assert "config_hash" in got["mismatch"], got["mismatch"]
        assert got["nothing"] == (None, {})
    files = results[0]["resume"]["files"]
    ranks = [name.split(".")[0] for name in files if name != "co2_complete.json"]
    assert ranks == [f"co2_rank{r:05d}" for r in range(world)], files  # one per rank


def test_deepspeed_bf16_zero2_trains(deepspeed):
    world, results = deepspeed
    sc = bf16_scenario()
    tau = sc["config"]["co2"]["tau"]
    for rank, per_rank in enumerate(results):
        got = per_rank["bf16"]
        assert got["param_dtypes"] == {torch.bfloat16} and got["master_dtypes"] == {torch.float32}
        assert got["rounds"] == sc["steps"] // tau
        losses = torch.tensor(got["losses"])
        assert torch.isfinite(losses).all()
        assert losses[-tau:].mean() < 0.5 * losses[:tau].mean(), (rank, losses[:tau].mean(), losses[-tau:].mean())
    assert_replicas_identical(results, ["bf16"], {"bf16": cpu_deepspeed._reference_co2(sc)})
