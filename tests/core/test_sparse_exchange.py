"""The sparse exchange (`topk` < 1, all-gathered, docs/design.md §5) on real gloo processes.

CO2Optimizer (R = 2) and CO2OSS (S x R = 2 x 2) against `reference.simulate` with the compressed
reference exchange at every round start of every replica, the defaults included (the local stand-in,
sync_delay "auto"); the shared start bit-identical across replicas; finalize() ending with one model;
the bytes a round sends and the state a rank holds against their formulas; the residuals resumed bit
for bit; a NaN round skipped; and the combinations refused when the optimizer is built.
"""

from __future__ import annotations

import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from co2_zero import CO2Error, CO2Optimizer, checkpoint
from co2_zero.core.config import CO2Config
from co2_zero.core.sparse import SparseLayout
from tests import models
from tests.compare import assert_close
from tests.core.test_compress import (
    ADAPTIVE,
    HEAVY_BALL,
    NESTEROV,
    _model,
    _norm_bytes,
    _shared_start,
    _snapshot,
    _wide_model,
    assert_resumed_exactly,
    check_sharded,
    resume_run,
    run_scenario,
    train_sharded,
    two_rounds_on_the_wide_model,
)
from tests.dist_utils import environment, run_ranks
from tests.reference import replica_round_starts, simulate
from tests.reference_compress import CompressedExchange, feedback_decay

# "uneven" has 527 parameters: one short chunk per partition, k = 16 of 528 at 3%, 8 at 1.5%
SCENARIOS = {
    "topk-int2-defaults": dict(config={"tau": 3, "topk": 0.03, "comm_dtype": "int2"}, steps=13, model="uneven"),
    "topk-int4-defaults": dict(
        config={"tau": 3, "topk": 0.015, "comm_dtype": "int4"}, steps=13, model="uneven", optimizer="adam"
    ),
    "topk-int2-shared-adaptive": dict(
        config={**NESTEROV, "tau": 2, "gap_penalty": ADAPTIVE, "topk": 0.05, "comm_dtype": "int2"},
        steps=8, model="uneven",
    ),
    "topk-fp32-blocking": dict(
        config={**HEAVY_BALL, "overlap": False, "tau": 2, "topk": 0.1, "comm_dtype": "fp32"}, steps=8,
    ),
    # the local stand-in with a clip: every rank holds the whole momentum, as with all_reduce. (Not Adam with
    # "bn": the bias before the batch norm has a zero gradient up to rounding, which Adam's normalisation
    # turns into steps of lr in a direction set by the rounding, in the reference as in any run.)
    "topk-bf16-defaults-clipnorm": dict(
        config={"tau": 2, "clip": {"mode": "norm", "threshold": 0.1}, "topk": 0.2, "comm_dtype": "bf16"},
        steps=8, model="bn",
    ),
    # SparseLoCo's decaying residual, with the defaults otherwise, and with its plain outer step
    "topk-int2-defaults-decay": dict(
        config={"tau": 3, "topk": 0.03, "comm_dtype": "int2", "feedback_decay": 0.9}, steps=13, model="uneven",
    ),
    "topk-int2-sparseloco": dict(
        config={"tau": 2, "topk": 0.03, "comm_dtype": "int2", "feedback_decay": 0.95, "outer_lr": 1.0,
                "outer_momentum": 0.0}, steps=10, model="uneven", optimizer="adam",
    ),
}  # fmt: skip
NAN_ROUND = dict(
    config={**HEAVY_BALL, "tau": 2, "topk": 0.03, "comm_dtype": "int2", "nonfinite": "skip_round"},
    steps=10, poison_step=5, model="uneven",
)  # fmt: skip
RESUME = dict(
    config={"tau": 3, "topk": 0.03, "comm_dtype": "int2"}, steps=14, save_at=7, model="uneven", optimizer="adam"
)
SHARDED = {  # CO2OSS, S x R = 2 x 2
    "oss-topk-int2-defaults": dict(config={"tau": 2, "topk": 0.03, "comm_dtype": "int2"}, steps=8, model="uneven"),
    "oss-topk-int4-defaults": dict(
        config={"tau": 2, "topk": 0.015, "comm_dtype": "int4"}, steps=8, model="uneven", optimizer="adam"
    ),
    "oss-topk-int2-shared": dict(config={**NESTEROV, "tau": 2, "topk": 0.05, "comm_dtype": "int2"}, steps=8,
                                 model="uneven"),
    "oss-topk-int2-defaults-decay": dict(
        config={"tau": 2, "topk": 0.03, "comm_dtype": "int2", "feedback_decay": 0.9}, steps=8, model="uneven"
    ),
}  # fmt: skip
WIDE = {**HEAVY_BALL, "tau": 1, "overlap": False, "gap_penalty": ADAPTIVE}
WIRE = {"fp32": {"comm_dtype": "fp32", "collective": "all_reduce"}, "int2-1.5%": {"comm_dtype": "int2", "topk": 0.015}}


def bytes_run(rank: int) -> dict:
    """bytes_sent of two rounds and co2_state_bytes on the wide model, dense fp32 and sparse int2."""
    out = {}
    for name, wire in WIRE.items():
        out[name] = two_rounds_on_the_wide_model(rank, {"config": {**WIDE, **wire}, "model": "wide"})
    return out


def train_all(rank: int, world: int) -> dict:
    results = {name: run_scenario(rank, sc) for name, sc in SCENARIOS.items()}
    results["nan"] = run_scenario(rank, NAN_ROUND)
    results["resume"] = resume_run(rank, RESUME)
    results["bytes"] = bytes_run(rank)
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(train_all, 2, timeout=400.0)


def _reference(sc: dict, replicas: int, partitions=None, shards: int = 1, **variant):
    """[round][replica] starts and [replica] finals of the reference with `sc`'s sparse exchange (`variant`:
    the reference's guard and chunks, when not the library's)."""
    config = sc["config"]
    exchange = CompressedExchange(
        config["comm_dtype"], "all_gather", replicas, partitions, topk=config["topk"],
        decay=feedback_decay(config), **variant,
    )  # fmt: skip
    starts: list = []
    step_record: list = []
    kind, opt_kind = sc.get("model", "mlp"), sc.get("optimizer", "sgd")
    sharded = {"shards": shards, "shard_batch": lambda r, s, k: models.shard_batch(r, s, k, shards)}
    finals = simulate(
        lambda: _model(kind), lambda params: models.make_optimizer(opt_kind, params), models.batch, models.loss_fn,
        config, replicas=replicas, steps=sc["steps"], record=starts, step_record=step_record, exchange=exchange,
        **({} if shards == 1 else sharded),
    )  # fmt: skip
    return replica_round_starts(starts, step_record, config["tau"]), finals


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_round_start_matches_the_reference(results, name):
    sc = SCENARIOS[name]
    starts, finals = _reference(sc, len(results))
    assert len(starts) == 1 + sc["steps"] // sc["config"]["tau"]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["strategy"] == "all_gather" and len(got["starts"]) == len(starts)
        for t, (a, e) in enumerate(zip(got["starts"], starts)):
            assert_close(a, e[rank], f"{name} rank {rank} round-{t} start")
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final")


@pytest.fixture(scope="module")
def results_sharded():
    pytest.importorskip("co2_zero.fairscale")
    return run_ranks(train_sharded, 4, 2, SHARDED, timeout=300.0)


@pytest.mark.parametrize("name", list(SHARDED))
def test_fairscale_two_shards_match_reference(results_sharded, name):
    check_sharded(results_sharded, name, SHARDED[name], _reference)


def test_a_dense_reference_would_not_match(results):
    """The comparison can tell: the reference with the dense int2 exchange ends far from the sparse run."""
    sc = SCENARIOS["topk-int2-defaults"]
    starts: list = []
    dense = CompressedExchange("int2", "all_reduce", 2)
    simulate(lambda: _model("uneven"), lambda p: models.make_optimizer("sgd", p), models.batch, models.loss_fn,
             sc["config"], 2, sc["steps"], record=starts, exchange=dense)  # fmt: skip
    last = results[0]["topk-int2-defaults"]["starts"][-1]
    assert max(float((last[k] - v).abs().max()) for k, v in starts[-1].items()) > 1e-3


@pytest.mark.parametrize("variant", [{"guard": False}, {"chunks": "tensor"}])
def test_an_unguarded_or_tensor_chunk_reference_would_not_match(results, variant):
    """The comparison can tell the outlier guard and the chunks apart (R = 2: the larger payload is clipped
    to the mean norm; tensor chunks would send the model's biases whole)."""
    sc = SCENARIOS["topk-int2-defaults"]
    starts, _ = _reference(sc, len(results), **variant)
    last = results[0]["topk-int2-defaults"]["starts"][-1]
    assert max(float((last[k] - v).abs().max()) for k, v in starts[-1][0].items()) > 1e-4


def test_shared_part_is_bit_identical_and_finalize_ends_with_one_model(results):
    for name, sc in {**SCENARIOS, "nan": NAN_ROUND}.items():
        first, other = results[0][name], results[1][name]
        assert all(torch.equal(first["final"][k], v) for k, v in other["final"].items()), name
        if _shared_start(sc):
            for a, b in zip(first["starts"], other["starts"]):
                assert all(torch.equal(a[k], b[k]) for k in a), name


def test_resume_restores_the_residuals_bit_for_bit(results):
    for per_rank in results:
        runs = per_rank["resume"]
        assert min(runs["saved_residual_norms"][:1]) > 0  # the displacement residual holds what was not sent
        assert_resumed_exactly(runs)


def test_nan_round_is_skipped_and_residuals_restart(results):
    tau = NAN_ROUND["config"]["tau"]
    for per_rank in results:
        got = per_rank["nan"]
        assert got["residuals_finite"]
        assert all(bool(v.isfinite().all()) for start in got["starts"] for v in start.values())
        skipped = NAN_ROUND["poison_step"] // tau
        a, b = got["starts"][skipped + 2], got["starts"][skipped + 1]  # overlap: applied one round later
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(got["starts"][skipped + 3][k], a[k]) for k in a)


def test_bytes_and_state_match_the_formulas(results):
    """One all-gather of R payloads: (R-1) payloads leave each rank, plus the norms' all-reduce; the state
    is the all_reduce layout's 3Ψ/S fp32 words plus the displacement residual, Ψ/S."""
    model, replicas = _wide_model(), len(results)
    padded = math.ceil(sum(p.numel() for p in model.parameters()) / replicas) * replicas
    payload = SparseLayout.for_length(padded, 0.015, "int2").nbytes
    tensors = len(list(model.parameters()))
    for per_rank in results:
        got = per_rank["bytes"]
        assert got["int2-1.5%"]["sent"] == [(replicas - 1) * payload + _norm_bytes(model, replicas)] * 2
        assert got["fp32"]["sent"][-1] / got["int2-1.5%"]["sent"][-1] > 100
        assert got["int2-1.5%"]["state"] == 4 * 4 * padded + 8 * tensors + got["int2-1.5%"]["index_bytes"]


@pytest.mark.parametrize(
    "co2,field",
    [
        ({"topk": 0.03, "collective": "reduce_scatter"}, "collective"),
        ({"topk": 0.03, "collective": "all_reduce"}, "collective"),
        ({"collective": "all_gather"}, "collective"),
        ({"topk": 0.0}, "topk"),
        ({"topk": 1.5}, "topk"),
        ({"topk": float("nan")}, "topk"),
    ],
)
def test_impossible_combinations_are_refused_with_what_to_set(co2, field):
    with pytest.raises(ValueError, match=rf"co2 config: {field}=.*accepted") as info:
        CO2Config.from_dict(co2)
    assert "topk" in str(info.value)


@pytest.mark.parametrize(
    "co2,accepted",
    [
        ({"feedback_decay": 0.9}, r"1.0 or 'auto', or topk < 1"),
        ({"topk": 0.03, "feedback_decay": 0.0}, r"\(0, 1\]"),
        ({"topk": 0.03, "feedback_decay": 1.5}, r"\(0, 1\]"),
        ({"topk": 0.03, "feedback_decay": float("nan")}, r"\(0, 1\]"),
        ({"topk": 0.03, "feedback_decay": "0.9"}, r"\(0, 1\]"),
    ],
)
def test_feedback_decay_is_refused_outside_the_sparse_exchange(co2, accepted):
    with pytest.raises(ValueError, match=rf"co2 config: feedback_decay=.*accepted: .*{accepted}"):
        CO2Config.from_dict(co2)


def test_a_deepspeed_co2_section_takes_topk():
    from co2_zero.deepspeed.config import split_config

    _, config = split_config(
        {"train_batch_size": 8, "zero_optimization": {"stage": 1},
         "co2": {"topk": 0.015, "comm_dtype": "int2", "feedback_decay": 0.95}}
    )  # fmt: skip
    assert (config.topk, config.comm_dtype, config.sparse, config.feedback_decay) == (0.015, "int2", True, 0.95)


def test_elastic_membership_refuses_the_sparse_exchange():
    """The compressed exchanges run on the job's fixed set of replicas, not on each round's quorum."""
    from co2_zero.core.plan import resolve

    topology = SimpleNamespace(replicas=1, shards=1, outer_group=None)
    for dtype in ("int2", "fp32"):
        with pytest.raises(CO2Error, match=r"topk=0\.03 is not supported with an elastic membership.*accepted: 1\.0"):
            resolve(CO2Config(topk=0.03, comm_dtype=dtype), topology, elastic=True, backend="gloo")


def test_existing_config_identities_survive_the_new_field():
    """`topk` at 1.0 leaves every existing config's hash (and so its checkpoints) as it was."""
    assert CO2Config().math_hash() == CO2Config(topk=1.0).math_hash() == "60dcf12d30d96517"
    assert CO2Config(topk=0.5).math_hash() != CO2Config().math_hash()
    assert CO2Config(topk=0.5, feedback_decay=0.95).math_hash() == CO2Config(topk=0.5).math_hash()  # its auto
    assert CO2Config(topk=0.5, feedback_decay=0.9).math_hash() != CO2Config(topk=0.5).math_hash()
    assert CO2Config(feedback_decay=1.0).math_hash() == CO2Config().math_hash()  # dense: 1.0 is its auto


# ---- FSDP2, S x R = 2 x 2: every inner step ------------------------------------------------------------

FSDP = {
    "fsdp-topk-int2-defaults": dict(config={"tau": 2, "topk": 0.1, "comm_dtype": "int2"}, steps=7),
    "fsdp-topk-int4-shared-adaptive": dict(
        config={**NESTEROV, "tau": 3, "gap_penalty": ADAPTIVE, "topk": 0.2, "comm_dtype": "int4"}, steps=7,
        optimizer="adam",
    ),
    "fsdp-topk-int2-defaults-decay": dict(
        config={"tau": 2, "topk": 0.1, "comm_dtype": "int2", "feedback_decay": 0.8}, steps=7
    ),
}  # fmt: skip


def fsdp_run(rank: int, world: int, shards: int) -> dict:
    from co2_zero.fsdp import replica_mesh
    from tests.integrations.test_fsdp import _run_scenario

    mesh = replica_mesh({"shards_per_replica": shards})
    return {name: _run_scenario(rank, shards, mesh, sc) for name, sc in FSDP.items()}


@pytest.fixture(scope="module")
def results_fsdp():
    return run_ranks(fsdp_run, 4, 2, timeout=300.0)


def _fsdp_partitions(results_fsdp: list, name: str, shards: int) -> list:
    """Replica 0's ranks' partitions as (parameter name, first, last + 1) pieces, in partition order."""
    names = [n for n, _ in models.make_model("mlp").named_parameters()]
    return [
        [(names[tensor_id], offset, offset + values.numel()) for tensor_id, offset, values in per_rank[name]["pieces"]]
        for per_rank in results_fsdp[:shards]
    ]


@pytest.mark.parametrize("name", list(FSDP))
def test_fsdp_every_inner_step_matches_the_reference(results_fsdp, name):
    sc, shards = FSDP[name], 2
    partitions = _fsdp_partitions(results_fsdp, name, shards)

    def reference(steps: int, finalize: bool) -> list:
        config = sc["config"]
        exchange = CompressedExchange(
            config["comm_dtype"], "all_gather", 2, partitions, config["topk"], feedback_decay(config)
        )
        return simulate(
            lambda: models.make_model("mlp"), lambda p: models.make_optimizer(sc.get("optimizer", "sgd"), p),
            models.batch, models.loss_fn, sc["config"], replicas=2, steps=steps, finalize=finalize,
            exchange=exchange, shards=shards, shard_batch=lambda r, j, k: models.shard_batch(r, j, k, shards),
        )  # fmt: skip

    per_step = [reference(k, False) for k in range(sc["steps"] + 1)]
    finals = reference(sc["steps"], True)
    for rank, per_rank in enumerate(results_fsdp):
        got = per_rank[name]
        assert got["strategy"] == "all_gather" and len(got["steps"]) == sc["steps"] + 1
        for k, (actual, expected) in enumerate(zip(got["steps"], per_step)):
            assert_close(actual, expected[rank // shards], f"{name} rank {rank} after step {k}")
        assert_close(got["final"], finals[rank // shards], f"{name} rank {rank} final")
    for a, b in zip(results_fsdp[0][name]["shared"], results_fsdp[2][name]["shared"]):
        assert torch.equal(a, b)  # shard 0 of both replicas: the same shared start, bit for bit


# ---- DeepSpeed ZeRO-1, S x R = 2 x 2, a "co2" section in the JSON config: every inner step ------------------


def _deepspeed_scenario() -> dict:
    from tests.integrations.test_deepspeed import ds_config

    co2 = {"shards_per_replica": 2, "tau": 2, "topk": 0.1, "comm_dtype": "int2"}  # the defaults otherwise
    return dict(config=ds_config("ds_zero1_co2", co2, co2_only=True, drop=("gradient_clipping", "scheduler")), steps=5)


def deepspeed_run(rank: int, world: int) -> dict:
    from tests.integrations.test_deepspeed import _run_scenario

    os.environ.setdefault("LOCAL_RANK", str(rank))
    return _run_scenario(rank, 2, _deepspeed_scenario())


@pytest.fixture(scope="module")
def results_deepspeed(tmp_path_factory):
    pytest.importorskip("deepspeed")
    with environment(TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions"))):  # the children's JIT
        return run_ranks(deepspeed_run, 4, timeout=300.0)


def test_deepspeed_every_inner_step_matches_the_reference(results_deepspeed):
    from tests.integrations.test_deepspeed import reference

    sc, shards = _deepspeed_scenario(), 2
    names = [n for n, _ in models.make_model("mlp").named_parameters()]
    partitions = [
        [(names[tensor_id], offset, offset + values.numel()) for tensor_id, offset, values in per_rank["pieces"]]
        for per_rank in results_deepspeed[:shards]
    ]
    exchange = CompressedExchange(
        "int2", "all_gather", 2, partitions, topk=0.1, decay=feedback_decay(sc["config"]["co2"])
    )
    _, steps, finals = reference(sc, shards, exchange=exchange)
    for rank, got in enumerate(results_deepspeed):
        assert len(got["trajectory"]) == sc["steps"]
        for k, (a, e) in enumerate(zip(got["trajectory"], steps)):
            assert_close(a, e[rank // shards], f"deepspeed rank {rank} after inner step {k}")
        assert_close(got["final"], finals[rank // shards], f"deepspeed rank {rank} final")


# ---- checkpoints: resumed from files bit for bit, resharded to R = 4 ----------------------------------------

CKPT = {"tau": 2, "topk": 0.05, "comm_dtype": "int2"}


def _ckpt_build():
    model = models.make_model("uneven")
    return model, CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CKPT, model=model)


def save_sparse(rank: int, world: int, directory: str) -> dict:
    model, opt = _ckpt_build()
    models.train_steps(rank, model, opt, 0, 5)  # mid-round, an exchange in flight
    checkpoint.save(directory, model, opt, extra={"step": 5})
    models.train_steps(rank, model, opt, 5, 9)
    opt.finalize()
    straight = _snapshot(model)
    model, opt = _ckpt_build()
    step = checkpoint.load(directory, model, opt)["step"]
    models.train_steps(rank, model, opt, step, 9)
    opt.finalize()
    return {"straight": straight, "resumed": _snapshot(model)}


def reshard_sparse(rank: int, world: int, directory: str) -> dict:
    model, opt = _ckpt_build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the steps after the last round end are dropped, and say so
        checkpoint.load(directory, model, opt, reshard=True)
    residual_zero = not opt.engine.exchange.residuals.displacement.any()
    models.train_steps(rank, model, opt, 4, 9)
    opt.finalize()
    return {"residual_zero": residual_zero, "final": _snapshot(model)}


def test_checkpoint_resumes_bit_for_bit_and_reshards(tmp_path):
    directory = str(tmp_path / "sparse")
    saved = run_ranks(save_sparse, 2, directory, timeout=240.0)
    for per_rank in saved:
        assert all(torch.equal(per_rank["straight"][k], v) for k, v in per_rank["resumed"].items())
    resharded = run_ranks(reshard_sparse, 4, directory, timeout=240.0)
    assert not any(r["residual_zero"] for r in resharded)  # kept (their values: checkpoint/test_reshard_residuals.py)
    for other in resharded[1:]:  # finalize() ends with one model on every rank
        assert all(torch.equal(resharded[0]["final"][k], v) for k, v in other["final"].items())
