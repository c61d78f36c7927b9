"""Replicas of different speeds (`replica_tau`, docs/design.md §3, "Replicas of different speeds"): each
replica its own inner steps per round, the exchange weighted by the tokens each trained.

CO2Optimizer on real gloo processes against the independent reference (`reference.simulate_paced`) at
every inner step of every replica: R = 2 (plain) and S x R = 2 x 2 (FSDP2 and FairScale OSS), with the defaults and with
the other collective, the shared stand-in with the adaptive gap, and blocking rounds. Then what follows
the clock: finalize()'s agreement on rounds, a checkpoint resumed bit for bit mid-round (each replica's
own step count and data position), resharded on the same grid, the learning-rate clock; and the refusals.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer, checkpoint
from co2_zero.core.errors import CO2Error
from co2_zero.core.pace import Pace
from co2_zero.core.parameter_order import steps_mismatch
from co2_zero.core.plan import check_given
from tests import models
from tests.dist_utils import run_ranks
from tests.reference import simulate, simulate_paced

TAU = 4
PACED = [4, 2]  # replica 1 at half speed
ROUNDS, EXTRA = 4, [3, 1]  # then a partial round (of at most tau_r - 1 steps), dropped by finalize()
SCENARIOS = {
    "defaults": {"tau": TAU, "replica_tau": PACED},  # local stand-in, sync_delay auto (the round end), all_reduce
    "local-reduce-scatter": {"tau": TAU, "replica_tau": PACED, "collective": "reduce_scatter"},
    "shared-adaptive": {
        "tau": TAU,
        "replica_tau": PACED,
        "stand_in": "shared",
        "outer_lr": 0.8,
        "outer_momentum": 0.5,
        "nesterov": False,
        "gap_penalty": {"mode": "adaptive"},
    },  # fmt: skip
    "blocking": {"tau": TAU, "replica_tau": PACED, "overlap": False, "outer_lr": 0.7},
    "four-to-one": {"tau": TAU, "replica_tau": [1, 4]},  # replica 0 the slow one, a round of one step
}
NOT_MATH = ("collective", "shards_per_replica")


def _extra(config: dict) -> list[int]:
    """Each replica's steps after the last round end."""
    return [extra % tau for extra, tau in zip(EXTRA, config["replica_tau"])]


def _finalize(opt, extra: int) -> None:
    """finalize(), which warns that it drops this replica's partial round (and only then)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.finalize()
    dropped = [w for w in caught if "dropped" in str(w.message)]
    assert len(dropped) == (1 if extra else 0), [str(w.message) for w in caught]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(replica: int, model, opt, steps: int, record: list, clock: list | None = None) -> None:
    """`steps` inner steps on the replica's own batches, from its own inner step on (its data position)."""
    for _ in range(steps):
        x, y = models.batch(replica, opt.engine.inner_steps)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
        record.append(_params(model))
        if clock is not None and opt.round_ended:
            clock.append(opt.clock_step)


def _build(config: dict) -> tuple[torch.nn.Module, CO2Optimizer]:
    model = models.make_model("mlp")
    return model, CO2Optimizer(models.make_optimizer("sgd", model.parameters()), config, model=model)


def _run(rank: int, config: dict) -> dict:
    model, opt = _build(config)
    steps: list = []
    clock: list = []
    extra = _extra(config)[rank]
    _train(rank, model, opt, ROUNDS * opt.steps_per_round + extra, steps, clock)
    rounds = opt.engine.rounds
    _finalize(opt, extra)
    return {"steps": steps, "final": _params(model), "rounds": rounds, "clock": clock,
            "steps_per_round": opt.steps_per_round}  # fmt: skip


def _resume(rank: int, directory: str) -> dict:
    """Straight through, and saved mid-round (replica 0 after 6 steps, replica 1 after 3), loaded into a
    scrambled fresh run that goes on; then the same checkpoint loaded with reshard=True (its step count)."""
    config = SCENARIOS["defaults"]
    straight = _run(rank, config)
    model, opt = _build(config)
    _train(rank, model, opt, opt.steps_per_round + opt.steps_per_round // 2, [])
    checkpoint.save(directory, model, opt)
    saved_at = opt.engine.inner_steps
    opt.engine.close()
    model, opt = _build(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    checkpoint.load(directory, model, opt)
    loaded_at = opt.engine.inner_steps
    resumed: list = []
    _train(rank, model, opt, ROUNDS * opt.steps_per_round + EXTRA[rank] - loaded_at, resumed)
    _finalize(opt, EXTRA[rank])
    model2, opt2 = _build(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the steps after the last round end are dropped
        checkpoint.load(directory, model2, opt2, reshard=True)
    reshard = opt2.engine.inner_steps
    opt2.engine.close()
    return {"straight": straight, "resumed": resumed, "final": _params(model), "saved_at": saved_at,
            "loaded_at": loaded_at, "reshard": reshard}  # fmt: skip


SKIP = {"tau": TAU, "replica_tau": PACED, "nonfinite": "skip_round"}
NAN_AT = (1, 4)  # replica 1's inner step 4 (the first of its round 2) gets a NaN gradient
RESTARTS = [(1, 3)]  # so round 2 is skipped everywhere and replica 1 restarts round 3 from the shared start


def _skip_round(rank: int) -> dict:
    """skip_round: a NaN gradient on replica 1 in round 2; every step recorded, NaN or not."""
    model, opt = _build(SKIP)
    steps: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(ROUNDS * opt.steps_per_round + _extra(SKIP)[rank]):
            x, y = models.batch(rank, opt.engine.inner_steps)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            if (rank, opt.engine.inner_steps) == NAN_AT:
                for p in model.parameters():
                    p.grad.fill_(float("nan"))
            opt.step()
            steps.append(_params(model))
        skipped = opt.engine.skipped_rounds
        opt.finalize()
    warned = [str(w.message) for w in caught]
    return {"steps": steps, "final": _params(model), "skipped": skipped, "warned": warned}


def _short_replica(rank: int) -> str:
    """Replica 1 stops a round early and finalizes: every rank must raise, naming the rounds."""
    model, opt = _build({**SCENARIOS["defaults"], "timeout_s": 60})
    rounds = ROUNDS - rank
    _train(rank, model, opt, rounds * opt.steps_per_round, [])
    try:
        opt.finalize()
    except CO2Error as error:
        return str(error)
    return "no error"


def _wrong_length(rank: int) -> str:
    try:
        _build({"tau": TAU, "replica_tau": [4, 2, 2]})
    except ValueError as error:
        return str(error)
    return "no error"


def _children(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    out = {name: _run(rank, config) for name, config in SCENARIOS.items()}
    out["resume"] = _resume(rank, os.path.join(directory, "ckpt"))
    out["wrong_length"] = _wrong_length(rank)
    out["skip"] = _skip_round(rank)
    out["short"] = _short_replica(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_children, 2, str(tmp_path_factory.mktemp("pace")), timeout=300)


def _reference(config: dict, shards: int = 1) -> tuple[list, list]:
    """Per replica, its parameters after each of its inner steps; and after finalize()."""
    math = {k: v for k, v in config.items() if k not in (*NOT_MATH, "replica_tau")}
    per_step: list = []
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, math, config["replica_tau"], ROUNDS, _extra(config),
                            shards=shards, shard_batch=lambda r, s, k: models.shard_batch(r, s, k, shards),
                            step_record=per_step)  # fmt: skip
    return per_step, finals


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    for name, value in actual.items():
        where = f"{what}/{name}"
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")


# ---- the reference and the bookkeeping, in one process ---------------------------------------------------


def round_taus(fixed: list[dict], rounds: int, tau: int) -> list[list[int]]:
    """Each round's inner steps per replica under a checkpoint's `fixed_replica_tau` (every replica at tau
    before its first pace): the reference's `round_taus`."""
    replicas = len(fixed[0]["taus"])
    return [next((p["taus"] for p in reversed(fixed) if p["from_round"] <= t), [tau] * replicas) for t in range(rounds)]


def test_reference_with_equal_steps_is_the_uniform_reference():
    """simulate_paced with every replica at tau is `simulate`: the weights are 1/R, the rounds the same."""
    config = {"tau": TAU}
    args = (lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p), models.batch, models.loss_fn)
    uniform = simulate(*args, config, replicas=2, steps=3 * TAU)
    paced = simulate_paced(*args, config, [TAU, TAU], 3)
    for a, b in zip(uniform, paced):
        _assert_close(a, b, "uniform")


def test_weights_are_the_token_shares():
    pace = Pace((4, 4, 2, 1))
    assert [pace.weight(r) for r in range(4)] == [4 / 11, 4 / 11, 2 / 11, 1 / 11]
    assert pace.displacement_scale(2) == pytest.approx(4 * 2 / 11)
    assert Pace((4, 4)).displacement_scale(1) == 1.0
    assert [Pace((4, 1)).clock_step(r, s) for r, s in ((0, 8), (1, 2))] == [8.0, 8.0]


def test_steps_per_round_from_speeds():
    from co2_zero.core.pace import taus_for_speeds

    assert taus_for_speeds([1, 1, 0.5, 0.25], 32) == [32, 32, 16, 8]
    assert taus_for_speeds([2.0, 1.0, 0.01], 8) == [8, 4, 1]  # never below one step
    # the steps it completes in the fastest's round: 15.6 is 15, as 16 would make the other three wait
    assert taus_for_speeds([1, 1, 1, 0.487], 32) == [32, 32, 32, 15]
    assert taus_for_speeds([1, 1, 0.5, 0.24], 32) == [32, 32, 16, 7]
    # a hair slower than the fastest: a round 0.3% longer trains 3 more steps, worth the fastest's wait
    assert taus_for_speeds([1, 0.999, 0.998, 0.997], 32) == [32] * 4
    # one step more for the slow replica is worth the round 0.2% longer; never more than tau for the fastest
    assert taus_for_speeds([1, 0.499], 4) == [4, 2]
    assert taus_for_speeds([1, 1 - 1e-12], 1) == [1, 1]
    with pytest.raises(ValueError, match="speeds="):
        taus_for_speeds([1.0, 0.0], 8)


def test_the_default_config_keeps_its_identity():
    """replica_tau at its neutral null stays out of the config hash: every existing checkpoint still loads."""
    assert CO2Config().math_hash() == "60dcf12d30d96517"
    assert CO2Config(tau=4, replica_tau=[4, 2]).math_hash() != CO2Config(tau=4).math_hash()
    assert CO2Config(tau=4, replica_tau=[4, 2]).math_hash() != CO2Config(tau=4, replica_tau=[4, 1]).math_hash()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"replica_tau": [3, 2]}, "replica_tau=[3, 2]"),  # the largest is not tau
        ({"replica_tau": [4, 0]}, "replica_tau=[4, 0]"),
        ({"replica_tau": [4, 2.0]}, "replica_tau=[4, 2.0]"),
        ({"replica_tau": []}, "replica_tau=[]"),
        ({"replica_tau": [4, 2], "sync_delay": 2}, "sync_delay=2"),
        ({"replica_tau": [4, 2], "comm_dtype": "bf16"}, "comm_dtype='bf16'"),
    ],
)
def test_bad_or_untested_settings_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match="co2 config: " + named.replace("[", r"\[").replace("]", r"\]")):
        CO2Config(tau=TAU, **fields)


def test_drivers_that_run_the_same_steps_on_every_replica_refuse_it():
    with pytest.raises(ValueError, match=r"replica_tau=\[4, 2\] is not supported with Hugging Face Trainer"):
        check_given(CO2Config(tau=TAU, replica_tau=[4, 2]), driver="hf-trainer")
    check_given(CO2Config(tau=TAU), driver="hf-trainer")  # null: nothing to refuse
    for integration in ("fairscale", "deepspeed"):  # it runs there (below; tests/integrations/test_deepspeed_pace.py)
        check_given(CO2Config(tau=TAU, replica_tau=[4, 2]), integration=integration)


def test_lightning_refuses_it_when_built():
    """Both of its strategies, before any process group is touched."""
    from co2_zero.lightning import CO2DeepSpeedStrategy, CO2Strategy
    from tests.integrations.test_deepspeed import ds_config

    paced = {"tau": TAU, "replica_tau": [4, 2]}

    with pytest.raises(ValueError, match=r"replica_tau=\[4, 2\] is not supported with Lightning"):
        CO2Strategy(co2=paced)
    with pytest.raises(ValueError, match=r"replica_tau=\[4, 2\] is not supported with Lightning"):
        CO2DeepSpeedStrategy(config=ds_config("ds_zero2_co2", paced))


def test_an_elastic_membership_is_refused_before_anything_is_built():
    """The engine refuses first (a membership's quorums change who is averaged every round)."""
    from types import SimpleNamespace

    from co2_zero.core.engine import RoundEngine

    partition = SimpleNamespace(check_views=lambda: None)
    with pytest.raises(ValueError, match=r"replica_tau=\[4, 2\] is not supported with an elastic membership"):
        RoundEngine(partition, CO2Config(tau=TAU, replica_tau=[4, 2]), topology=None, membership=object())


def test_finalize_agreement_compares_rounds():
    pace = Pace((4, 2))
    assert steps_mismatch([[8, 1, 0], [4, 1, 0]], 0, 8, pace) is None  # 2 rounds each
    assert steps_mismatch([[11, 1, 0], [5, 1, 0]], 0, 11, pace) is None  # partial rounds are dropped
    problem = steps_mismatch([[8, 1, 0], [2, 1, 0]], 0, 8, pace)
    assert "rank 1: 2 (round 1 at tau 2)" in problem and "same number of rounds" in problem
    assert steps_mismatch([[8, 1, 0], [4, 1, 0]], 0, 8) is not None  # uniform: steps, as before


# ---- real processes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_inner_step_matches_the_reference(results, name):
    config = SCENARIOS[name]
    per_step, finals = _reference(config)
    for rank, got in enumerate(results):
        run = got[name]
        assert run["steps_per_round"] == config["replica_tau"][rank]
        assert run["rounds"] == ROUNDS
        assert len(run["steps"]) == len(per_step[rank]) == ROUNDS * config["replica_tau"][rank] + _extra(config)[rank]
        for k, (actual, expected) in enumerate(zip(run["steps"], per_step[rank])):
            _assert_close(actual, expected, f"{name} replica {rank} after its step {k + 1}")
        _assert_close(run["final"], finals[rank], f"{name} replica {rank} final")
    torch.testing.assert_close(results[0][name]["final"], results[1][name]["final"], rtol=0, atol=0)


def test_learning_rate_clock_agrees_at_every_round_end(results):
    """`clock_step` (inner steps on the fastest replica's clock) is the same on every replica at every round end."""
    clocks = [got["defaults"]["clock"] for got in results]
    assert clocks[0] == clocks[1] == [float(TAU * (t + 1)) for t in range(ROUNDS)]


def test_checkpoint_resumes_each_replica_bit_for_bit(results):
    for rank, got in enumerate(results):
        run = got["resume"]
        assert run["saved_at"] == run["loaded_at"] == PACED[rank] + PACED[rank] // 2  # its own count
        straight = run["straight"]["steps"][run["saved_at"] :]
        assert len(run["resumed"]) == len(straight)
        for k, (a, b) in enumerate(zip(run["resumed"], straight)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=f"rank {rank} step {k}": f"{w}: {m}")
        torch.testing.assert_close(run["final"], run["straight"]["final"], rtol=0, atol=0)


def test_resharding_on_the_same_grid_resumes_each_replica_at_its_last_round_start(results):
    """(tests/core/test_pace_reshard.py: S changed, and every later step against the reference.)"""
    for rank, got in enumerate(results):
        assert got["resume"]["reshard"] == PACED[rank]


def test_skip_round_skips_the_round_everywhere_and_restarts_the_replica_that_had_the_nan(results):
    """Round 2 is skipped on both replicas (counted once each); replica 1, whose displacement was NaN, restarts
    round 3 from the shared start with a fresh inner optimizer; every finite step matches the reference, and
    the only NaN one is replica 1's step inside round 2."""
    per_step: list = []
    math = {k: v for k, v in SKIP.items() if k not in ("replica_tau", "nonfinite")}
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, math, PACED, ROUNDS, _extra(SKIP), step_record=per_step,
                            restarts=RESTARTS)  # fmt: skip
    for rank, got in enumerate(results):
        run = got["skip"]
        assert run["skipped"] == 1 and any("skipped" in w for w in run["warned"]), run["warned"]
        nan_steps = [k for k, p in enumerate(run["steps"]) if not all(bool(v.isfinite().all()) for v in p.values())]
        assert nan_steps == ([NAN_AT[1]] if rank == NAN_AT[0] else [])
        assert len(run["steps"]) == len(per_step[rank])
        for k, (actual, expected) in enumerate(zip(run["steps"], per_step[rank])):
            if k not in nan_steps:
                _assert_close(actual, expected, f"skip_round replica {rank} after its step {k + 1}")
        _assert_close(run["final"], finals[rank], f"skip_round replica {rank} final")


def test_a_replica_a_round_short_makes_every_rank_raise_naming_the_rounds(results):
    for got in results:
        assert "different numbers of rounds" in got["short"], got["short"]
        assert "rank 1: 6" in got["short"] or "rank 1: 6 or more" in got["short"], got["short"]


def test_replica_tau_of_another_length_is_refused_at_build(results):
    for got in results:
        assert "replica_tau=[4, 2, 2] is invalid for this job of R=2 replicas" in got["wrong_length"]


# ---- S x R = 2 x 2 on FSDP2 and FairScale OSS -------------------------------------------------------------

SHARDS = 2


def _fsdp2(config: dict):
    """FSDP2's model, CO2Optimizer, the network to call and how to read the whole parameters."""
    from co2_zero.fsdp import replica_mesh
    from tests.integrations.test_fsdp import _full, make_inner, make_model, shard

    model = shard(make_model("mlp"), replica_mesh(config))
    opt = CO2Optimizer(make_inner("sgd", model.parameters()), config, model=model)
    return opt, lambda x: model(x).float(), lambda: _full(model)


def _fairscale(config: dict):
    """CO2OSS with FairScale's ShardedDataParallel (the fixed one) around the model."""
    from co2_zero.fairscale import CO2OSS, ShardedDataParallel

    model = models.make_model("mlp")
    probe = models.make_optimizer("sgd", [torch.zeros(1, requires_grad=True)])
    opt = CO2OSS(model.parameters(), optim=type(probe), co2=config, **probe.defaults)
    net = ShardedDataParallel(model, opt, process_group=opt.group, broadcast_buffers=False)
    return opt, net, lambda: _params(model)


SHARDED = {"fsdp2": _fsdp2, "fairscale": _fairscale}


def _sharded_child(rank: int, world: int, integration: str) -> dict:
    replica, shard_index = divmod(rank, SHARDS)
    opt, net, whole = SHARDED[integration]({**SCENARIOS["defaults"], "shards_per_replica": SHARDS})
    record: list = []
    for _ in range(ROUNDS * opt.steps_per_round + EXTRA[replica]):
        x, y = models.shard_batch(replica, shard_index, opt.engine.inner_steps, SHARDS)
        opt.zero_grad()
        models.loss_fn(net(x), y).backward()
        opt.step()
        record.append(whole())
    _finalize(opt, EXTRA[replica])
    out = {"steps": record, "final": whole(), "grid": (opt.topology.replicas, opt.topology.shards)}
    dist.barrier()
    return out


# FSDP2 by default; FairScale's 2 x 2 (another layout of the same grid) among the slow extras
@pytest.mark.parametrize("integration", ["fsdp2", pytest.param("fairscale", marks=pytest.mark.slow)])
def test_two_by_two_matches_the_reference_at_every_step(integration):
    results = run_ranks(_sharded_child, 4, integration, timeout=300)
    per_step, finals = _reference(SCENARIOS["defaults"], shards=SHARDS)
    for rank, got in enumerate(results):
        replica = rank // SHARDS
        assert got["grid"] == (2, SHARDS)
        assert len(got["steps"]) == len(per_step[replica])
        for k, (actual, expected) in enumerate(zip(got["steps"], per_step[replica])):
            _assert_close(actual, expected, f"{integration} rank {rank} after its step {k + 1}")
        _assert_close(got["final"], finals[replica], f"{integration} rank {rank} final")
