"""Replicas of different speeds (`replica_tau`) with the compressed exchanges (docs/design.md §3, "Replicas of
different speeds", and §5): replica r quantizes or sparsifies its scaled displacement R·w_r·D_r plus its
residual, and the residual keeps what was not sent of that scaled value.

CO2Optimizer (R = 2), FairScale OSS and FSDP2 (S x R = 2 x 2) on real gloo processes against the
independent reference (`reference.simulate_paced` with `reference_compress.CompressedExchange`, each
replica's displacement weighted) at every inner step of every replica: at R = 2 int8 with the defaults,
int4 with reduce_scatter (the local stand-in's momentum copy follows the quantized starts), int2, fp8 in
blocking rounds, and top-k with int2 and with fp32 values and a feedback decay; int8 and top-k int2 on
FairScale OSS; int8 on FSDP2. A mid-round checkpoint resumes each replica's count and residuals bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Optimizer, checkpoint
from tests import models
from tests.core.test_pace import EXTRA, PACED, ROUNDS, TAU, _assert_close, _extra, _finalize, _params, _train
from tests.dist_utils import run_ranks
from tests.reference import simulate_paced
from tests.reference_compress import CompressedExchange, feedback_decay

MODEL = "uneven"  # 527 parameters: sub-shards of 264 elements, a full block and a short one
SCENARIOS = {
    "int8-defaults": {"tau": TAU, "replica_tau": PACED, "comm_dtype": "int8"},  # all_reduce on gloo, local
    "int4-reduce-scatter": {"tau": TAU, "replica_tau": PACED, "comm_dtype": "int4", "collective": "reduce_scatter"},
    "int2-defaults": {"tau": TAU, "replica_tau": PACED, "comm_dtype": "int2"},
    "fp8-blocking": {"tau": TAU, "replica_tau": PACED, "comm_dtype": "fp8", "overlap": False, "outer_lr": 0.7},
    "topk-int2-defaults": {"tau": TAU, "replica_tau": PACED, "topk": 0.1, "comm_dtype": "int2"},
    "topk-fp32-decay": {"tau": TAU, "replica_tau": PACED, "topk": 0.25, "feedback_decay": 0.8},
}
RESUMED = "int4-reduce-scatter"
SHARDED = ("int8-defaults", "topk-int2-defaults")  # S x R = 2 x 2 on FairScale OSS
SHARDS = 2


def _build(config: dict) -> tuple[torch.nn.Module, CO2Optimizer]:
    model = models.make_model(MODEL)
    return model, CO2Optimizer(models.make_optimizer("sgd", model.parameters()), config, model=model)


def _run(rank: int, config: dict) -> dict:
    model, opt = _build(config)
    steps: list = []
    extra = _extra(config)[rank]
    _train(rank, model, opt, ROUNDS * opt.steps_per_round + extra, steps)
    out = {"steps": steps, "rounds": opt.engine.rounds, "strategy": opt.engine.exchange.strategy}
    _finalize(opt, extra)
    return {**out, "final": _params(model)}


def _resume(rank: int, directory: str) -> dict:
    """int4 with reduce_scatter (both residuals) saved mid-round (replica 0 after 6 steps, replica 1 after 3),
    loaded into a fresh run that goes on."""
    config = SCENARIOS[RESUMED]
    model, opt = _build(config)
    _train(rank, model, opt, opt.steps_per_round + opt.steps_per_round // 2, [])
    checkpoint.save(directory, model, opt)
    opt.engine.close()
    model, opt = _build(config)
    checkpoint.load(directory, model, opt)
    loaded_at, resumed, extra = opt.engine.inner_steps, [], _extra(config)[rank]
    _train(rank, model, opt, ROUNDS * opt.steps_per_round + extra - loaded_at, resumed)
    _finalize(opt, extra)
    return {"loaded_at": loaded_at, "resumed": resumed, "final": _params(model)}


def _children(rank: int, world: int, directory: str) -> dict:
    out = {name: _run(rank, config) for name, config in SCENARIOS.items()}
    out["resume"] = _resume(rank, directory)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_children, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def _reference(
    config: dict, strategy: str, partitions: list | None = None, shards: int = 1, kind: str = MODEL
) -> tuple[list, list]:
    """Per replica, its parameters after each of its inner steps; and after finalize(); the exchange the
    reference's, on the library's resolved collective and (S > 1) its partitions."""
    taus = config["replica_tau"]
    exchange = CompressedExchange(config.get("comm_dtype", "fp32"), strategy, len(taus), partitions,
                                  topk=config.get("topk", 1.0), decay=feedback_decay(config))  # fmt: skip
    per_step: list = []
    finals = simulate_paced(lambda: models.make_model(kind), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, config, taus, ROUNDS, _extra(config), shards=shards,
                            shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards), step_record=per_step,
                            exchange=exchange)  # fmt: skip
    return per_step, finals


def _check(got: dict, per_step: list, finals: list, replica: int, what: str) -> None:
    assert len(got["steps"]) == len(per_step[replica]) == ROUNDS * PACED[replica] + EXTRA[replica] % PACED[replica]
    for k, (actual, expected) in enumerate(zip(got["steps"], per_step[replica])):
        _assert_close(actual, expected, f"{what} after its step {k + 1}")
    _assert_close(got["final"], finals[replica], f"{what} final")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_inner_step_matches_the_reference(results, name):
    config = SCENARIOS[name]
    strategy = results[0][name]["strategy"]
    assert strategy == config.get("collective", "all_gather" if "topk" in config else "all_reduce")
    per_step, finals = _reference(config, strategy)
    for rank, got in enumerate(results):
        assert got[name]["rounds"] == ROUNDS
        _check(got[name], per_step, finals, rank, f"{name} replica {rank}")
    torch.testing.assert_close(results[0][name]["final"], results[1][name]["final"], rtol=0, atol=0)


def test_a_checkpoint_resumes_each_replica_and_its_residuals_bit_for_bit(results):
    for rank, got in enumerate(results):
        run, straight = got["resume"], got[RESUMED]
        assert run["loaded_at"] == PACED[rank] + PACED[rank] // 2  # its own count
        assert len(run["resumed"]) == len(straight["steps"]) - run["loaded_at"]
        for k, (a, b) in enumerate(zip(run["resumed"], straight["steps"][run["loaded_at"] :])):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=f"rank {rank} step {k}": f"{w}: {m}")
        torch.testing.assert_close(run["final"], straight["final"], rtol=0, atol=0)


def test_the_comparison_tells_an_unweighted_exchange_apart(results):
    """The reference whose replicas send their displacement unscaled (the plain mean) ends far from the
    library: the weights are seen through the quantizer."""
    config = SCENARIOS["int8-defaults"]

    class Unweighted(CompressedExchange):
        def average(self, starts, xs, weights=None):
            return super().average(starts, xs)

    per_step: list = []
    simulate_paced(lambda: models.make_model(MODEL), lambda p: models.make_optimizer("sgd", p), models.batch,
                   models.loss_fn, config, PACED, ROUNDS, step_record=per_step,
                   exchange=Unweighted("int8", "all_reduce", 2))  # fmt: skip
    last = results[0]["int8-defaults"]["steps"][ROUNDS * PACED[0] - 1]
    assert max(float((last[n] - v).abs().max()) for n, v in per_step[0][-1].items()) > 1e-3


# ---- S x R = 2 x 2 on FairScale OSS -----------------------------------------------------------------------


def _fairscale_child(rank: int, world: int) -> dict:
    from co2_zero.fairscale import CO2OSS, ShardedDataParallel

    replica, shard = divmod(rank, SHARDS)
    out = {}
    for name in SHARDED:
        config = {**SCENARIOS[name], "shards_per_replica": SHARDS}
        model = models.make_model(MODEL)
        probe = models.make_optimizer("sgd", [torch.zeros(1, requires_grad=True)])
        opt = CO2OSS(model.parameters(), optim=type(probe), co2=config, **probe.defaults)
        net = ShardedDataParallel(model, opt, process_group=opt.group, broadcast_buffers=False)
        record: list = []
        for _ in range(ROUNDS * opt.steps_per_round + EXTRA[replica] % PACED[replica]):
            x, y = models.shard_batch(replica, shard, opt.engine.inner_steps, SHARDS)
            opt.zero_grad()
            models.loss_fn(net(x), y).backward()
            opt.step()
            record.append(_params(model))
        got = {
            "steps": record,
            "strategy": opt.engine.exchange.strategy,
            "grid": (opt.topology.replicas, opt.topology.shards),
        }
        got["segments"] = [tuple(s) for s in opt.engine.layout.segments]
        _finalize(opt, EXTRA[replica] % PACED[replica])
        out[name] = {**got, "final": _params(model)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results_sharded():
    pytest.importorskip("co2_zero.fairscale")
    return run_ranks(_fairscale_child, 4, timeout=300)


def _partitions(results_sharded: list, name: str, kind: str = MODEL) -> list:
    """Replica 0's ranks' partitions as (parameter name, first, last + 1) pieces, in partition order (every
    replica lays its partition out alike)."""
    names = [n for n, _ in models.make_model(kind).named_parameters()]
    return [
        [
            (names[tensor_id], offset, offset + end - start)
            for tensor_id, start, end, offset in per_rank[name]["segments"]
        ]
        for per_rank in results_sharded[:SHARDS]
    ]


@pytest.mark.parametrize("name", SHARDED)
def test_fairscale_two_by_two_matches_the_reference_at_every_step(results_sharded, name):
    strategy = results_sharded[0][name]["strategy"]
    per_step, finals = _reference(SCENARIOS[name], strategy, _partitions(results_sharded, name), SHARDS)
    for rank, got in enumerate(results_sharded):
        assert got[name]["grid"] == (2, SHARDS) and got[name]["strategy"] == strategy
        _check(got[name], per_step, finals, rank // SHARDS, f"fairscale {name} rank {rank}")


# ---- S x R = 2 x 2 on FSDP2 (the mlp: FSDP2's tests' "uneven" model is another one) ----------------------


def _fsdp_child(rank: int, world: int) -> dict:
    from co2_zero.fsdp import replica_mesh
    from tests.integrations.test_fsdp import _full, make_inner, make_model, shard

    config = {**SCENARIOS["int8-defaults"], "shards_per_replica": SHARDS}
    mesh = replica_mesh(config)
    replica, shard_index = divmod(rank, SHARDS)
    model = shard(make_model("mlp"), mesh)
    opt = CO2Optimizer(make_inner("sgd", model.parameters()), config, model=model)
    record: list = []
    for _ in range(ROUNDS * opt.steps_per_round + EXTRA[replica] % PACED[replica]):
        x, y = models.shard_batch(replica, shard_index, opt.engine.inner_steps, SHARDS)
        opt.zero_grad()
        models.loss_fn(model(x).float(), y).backward()
        opt.step()
        record.append(_full(model))
    got = {"steps": record, "strategy": opt.engine.exchange.strategy}
    got["segments"] = [tuple(s) for s in opt.engine.layout.segments]
    _finalize(opt, EXTRA[replica] % PACED[replica])
    out = {"int8-defaults": {**got, "final": _full(model)}}
    dist.barrier()
    return out


def test_fsdp2_two_by_two_matches_the_reference_at_every_step():
    results_fsdp = run_ranks(_fsdp_child, 2 * SHARDS, timeout=300)
    strategy = results_fsdp[0]["int8-defaults"]["strategy"]
    partitions = _partitions(results_fsdp, "int8-defaults", "mlp")
    per_step, finals = _reference(SCENARIOS["int8-defaults"], strategy, partitions, SHARDS, "mlp")
    for rank, got in enumerate(results_fsdp):
        _check(got["int8-defaults"], per_step, finals, rank // SHARDS, f"fsdp2 int8-defaults rank {rank}")
