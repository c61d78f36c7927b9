"""Resharding a checkpoint of replicas of different speeds (`replica_tau`, docs/design.md §3, "Replicas of
different speeds"): the shards per replica change, each replica keeps its place.

Saved mid-round by FSDP2 at S x R = 2 x 2 (replica 0 two steps into round 3, replica 1 one step in), with a
given replica_tau and with "auto" after its τ_r were fixed (at tau = 4 at the end of round 0, corrected at the
end of round 1; at tau = 12 at step 5, inside round 0, and saved there before the correction: replica 0 at its
step 10, replica 1 at 5, the resumed run then times round 1 and corrects from round 2); loaded with reshard=True
by a plain CO2Optimizer at S x R = 1 x 2: each replica resumes at its own last round start (its own step
count, its data position), the τ_r come along, and every later inner step matches the independent reference
(`simulate_paced`, a resharded load at that round start: fresh inner optimizers; the given one marked slow).
A change of R is refused, naming replica_tau and R.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Optimizer, checkpoint
from co2_zero.core.pace import Pace
from tests import models
from tests.core.test_pace import _assert_close, _finalize, _params, round_taus
from tests.core.test_pace_auto import _slow_clock
from tests.dist_utils import run_ranks
from tests.reference import simulate_paced

SHARDS, ROUNDS, EXTRA = 2, 5, [3, 1]


@dataclass(frozen=True)
class Case:
    """A checkpoint to reshard: its config, the paces it saved and the resumed run ends with, (from_round,
    τ_r) in order (every replica at tau before the first), and where it is saved (`into`: each replica's steps
    into round `saved_round`)."""

    config: dict
    saved: list
    paces: list
    saved_round: int = 3
    into: tuple = (2, 1)


CASES = {
    "given": Case({"tau": 4, "replica_tau": [4, 2]}, [(0, [4, 2])], [(0, [4, 2])]),
    # at tau = 4 round 0 ends before MEASURED_STEPS timed steps: "auto" decides at its end, from round 1, and
    # round 1 confirms them from round 2
    "auto": Case({"tau": 4, "replica_tau": "auto"}, [(1, [4, 2]), (2, [4, 2])], [(1, [4, 2]), (2, [4, 2])]),
    # at tau = 12 it decides at step 5, inside round 0, from round 0; saved right after, before the correction,
    # which the resharded run, resumed at round 0's start, makes from round 1's times
    "auto within round 0": Case(
        {"tau": 12, "replica_tau": "auto"}, [(0, [12, 6])], [(0, [12, 6]), (2, [12, 6])], saved_round=0, into=(10, 5)
    ),
}


def _fsdp2(config: dict):
    from co2_zero.fsdp import replica_mesh
    from tests.integrations.test_fsdp import make_inner, make_model, shard

    model = shard(make_model("mlp"), replica_mesh(config))
    return model, CO2Optimizer(make_inner("sgd", model.parameters()), config, model=model)


def _save_two_by_two(rank: int, world: int, directory: str, name: str) -> int:
    replica, shard_index = divmod(rank, SHARDS)
    _slow_clock(replica)
    case = CASES[name]
    model, opt = _fsdp2({**case.config, "shards_per_replica": SHARDS})
    while (
        opt.engine.rounds < case.saved_round
        or opt.engine.pace.step_in_round(replica, opt.engine.inner_steps) < case.into[replica]
    ):
        x, y = models.shard_batch(replica, shard_index, opt.engine.inner_steps, SHARDS)
        opt.zero_grad()
        models.loss_fn(model(x).float(), y).backward()
        opt.step()
    checkpoint.save(os.path.join(directory, name), model, opt)
    saved = opt.engine.inner_steps
    opt.engine.close()
    dist.barrier()
    return saved


def _resume_one_by_two(rank: int, world: int, directory: str, name: str) -> dict:
    _slow_clock(rank)  # what a correction still to come times
    config = CASES[name].config
    model = models.make_model("mlp")
    opt = CO2Optimizer(models.make_optimizer("sgd", model.parameters()), config, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(os.path.join(directory, name), model, opt, reshard=True)
    loaded = {"at": opt.engine.inner_steps, "pace": opt.engine.pace, "warned": [str(w.message) for w in caught]}
    record: list = []
    while opt.engine.rounds < ROUNDS:
        _step(rank, model, opt, record)
    extra = EXTRA[rank] % opt.steps_per_round
    for _ in range(extra):
        _step(rank, model, opt, record)
    fixed = opt.engine.schedule.fixed_replica_tau
    _finalize(opt, extra)
    out = {"loaded": loaded, "steps": record, "final": _params(model), "fixed": fixed}
    return {**out, "other_r": _load_as_one_replica(directory, name)}


def _step(replica: int, model, opt, record: list) -> None:
    x, y = models.batch(replica, opt.engine.inner_steps)
    opt.zero_grad()
    models.loss_fn(model(x), y).backward()
    opt.step()
    record.append(_params(model))


def _load_as_one_replica(directory: str, name: str) -> str:
    """The checkpoint (R = 2) loaded at S x R = 2 x 1 (a given replica_tau of R = 2 cannot even be built
    there): refused."""
    if name == "given":
        return "not tried"
    model, opt = _fsdp2({**CASES[name].config, "shards_per_replica": 2})
    try:
        checkpoint.load(os.path.join(directory, name), model, opt, reshard=True)
        return "not refused"
    except Exception as error:  # noqa: BLE001  the refusal's text is the result
        return str(error)
    finally:
        opt.engine.close()


@pytest.fixture(scope="module", params=["auto", "auto within round 0", pytest.param("given", marks=pytest.mark.slow)])
def results(request, tmp_path_factory):
    directory, name = str(tmp_path_factory.mktemp("pace_reshard")), request.param
    saved = run_ranks(_save_two_by_two, 2 * SHARDS, directory, name, timeout=300)
    return name, saved, run_ranks(_resume_one_by_two, 2, directory, name, timeout=300)


def test_each_replica_resumes_at_its_last_round_start_and_matches_the_reference(results):
    name, saved, resumed = results
    case = CASES[name]
    taus = case.paces[-1][1]
    extra = [e % tau for e, tau in zip(EXTRA, taus)]
    per_step: list = []
    each_round = round_taus([{"taus": t, "from_round": r} for r, t in case.paces], ROUNDS, case.config["tau"])
    finals = simulate_paced(lambda: models.make_model("mlp"), lambda p: models.make_optimizer("sgd", p),
                            models.batch, models.loss_fn, {"tau": case.config["tau"]}, taus, ROUNDS, extra,
                            step_record=per_step, round_taus=each_round,
                            fresh_inner_at_round=case.saved_round)  # fmt: skip
    pace = Pace.of_segments(case.saved)
    for replica, run in enumerate(resumed):
        round_start = sum(each_round[t][replica] for t in range(case.saved_round))
        assert saved[replica * SHARDS] == round_start + case.into[replica]
        assert run["loaded"]["at"] == round_start and run["loaded"]["pace"] == pace
        if case.config["replica_tau"] == "auto":
            assert run["fixed"] == [{"taus": t, "from_round": r} for r, t in case.paces], run["fixed"]
        assert any(f"{case.into[replica]} step(s) after" in w for w in run["loaded"]["warned"]), run["loaded"]
        assert len(run["steps"]) == len(per_step[replica]) - round_start
        for k, (actual, expected) in enumerate(zip(run["steps"], per_step[replica][round_start:])):
            _assert_close(actual, expected, f"{name} replica {replica} after its step {round_start + k + 1}")
        _assert_close(run["final"], finals[replica], f"{name} replica {replica} final")
    torch.testing.assert_close(resumed[0]["final"], resumed[1]["final"], rtol=0, atol=0)


def test_a_change_of_r_is_refused_naming_replica_tau_and_r(results):
    if results[0] == "given":
        pytest.skip("tried with the auto checkpoints (a given replica_tau of R = 2 is not built at R = 1)")
    for got in results[2]:
        message = got["other_r"]
        assert "replica_tau='auto' is not supported with a resharded load from R=2 to R=1 replicas" in message, message
        accepted = "null, or resume with the saved run's number of replicas (any number of shards per replica)"
        assert f"accepted: {accepted}" in message, message
