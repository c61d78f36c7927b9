"""co2_zero.lightning.CO2Strategy on 2 real gloo ranks: every step against the independent reference,
resume bit for bit mid-round, the model saved after fit, the round figures in the logger, the refusals.

One spawn runs every scenario (process start-up and Lightning's import dominate); each test then checks
one property of the recorded results.
"""

from __future__ import annotations

import csv
import signal
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="pip install -e '.[lightning]'")

from co2_zero import CO2Config, CO2Optimizer  # noqa: E402
from co2_zero.lightning import CO2Strategy  # noqa: E402
from tests import models  # noqa: E402
from tests.compare import assert_close  # noqa: E402
from tests.dist_utils import busy_host, launch_ranks, run_ranks  # noqa: E402
from tests.lightning_app import Lit, Recorder, as_torchrun, loader, params, trainer  # noqa: E402
from tests.reference import simulate  # noqa: E402
from tests.scenarios import co2  # noqa: E402

SCENARIOS = {
    # CO2Config's defaults but tau; 13 steps: the last one is dropped by finalize (and warned about)
    "defaults": dict(config=co2("defaults-t3"), steps=13),
    "heavyball-adaptive-shared-reducescatter": dict(
        config=co2("overlap-shared-heavyball-adaptive-reducescatter-t2"),
        steps=8,
        optimizer="adam",
    ),
    # Trainer(accumulate_grad_batches=2): tau counts optimizer steps, each the mean of 2 micro-batches
    "accumulate-2": dict(config=co2("overlap-heavyball-t2"), steps=6, accumulate=2),
}
RESUME = dict(config=co2("defaults-t3"), steps=12)  # checkpoints every 2 steps; resumed from steps 4 and 8, mid-round
WORLD = 2


def _fit(rank: int, sc: dict, directory: str) -> dict:
    recorder = Recorder()
    logger_dir = Path(directory) / "logs"
    from lightning.pytorch.loggers import CSVLogger

    run_logger = CSVLogger(str(logger_dir), name="run", version=0)
    accumulate = sc.get("accumulate", 1)
    run = trainer(
        WORLD,
        CO2Strategy(co2=sc["config"]),
        max_steps=sc["steps"],
        accumulate_grad_batches=accumulate,
        callbacks=[recorder],
        logger=run_logger,
    )
    data = loader(lambda i: _micro_batch(rank, i, accumulate), sc["steps"] * accumulate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Lit(optimizer=sc.get("optimizer", "sgd")), data)
    out = {"steps": recorder.steps, "final": params(run.lightning_module)}
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("co2")]
    final = Path(directory) / "final.ckpt"
    run.save_checkpoint(final)  # after fit: one model, Lightning's single file
    out["saved"] = torch.load(final, weights_only=False) if rank == 0 else None
    out["loaded"] = params(Lit.load_from_checkpoint(final))
    metrics = logger_dir / "run" / "version_0" / "metrics.csv"
    out["metrics"] = list(csv.DictReader(metrics.open())) if rank == 0 and metrics.exists() else []
    evaluated = Lit()
    trainer(WORLD, CO2Strategy(co2=sc["config"])).validate(evaluated, data, ckpt_path=final, verbose=False)
    out["validated"] = params(evaluated)
    again = trainer(WORLD, CO2Strategy(co2=sc["config"]), max_steps=2 * sc["steps"])
    out["refit_from_file"] = _error(lambda: again.fit(Lit(), data, ckpt_path=final))
    return out


def _micro_batch(rank: int, index: int, accumulate: int):
    """Loader item `index`: micro-batch `index % accumulate` of optimizer step `index // accumulate`."""
    if accumulate == 1:
        return models.batch(rank, index)
    return models.shard_batch(rank, index % accumulate, index // accumulate, accumulate)


def _error(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _resume(rank: int, directory: str) -> dict:
    """Uninterrupted, saving every 2 steps; then from two saved (mid-round, mid-epoch) checkpoints."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    sc = RESUME
    data = loader(lambda i: torch.zeros(1), 100)  # the batches come from the step (Lit(by_step=...))
    saves = Path(directory) / "saves"
    runs = {}
    for start in (None, "epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"):
        recorder = Recorder()
        callbacks = [recorder]
        if start is None:
            callbacks.append(ModelCheckpoint(dirpath=saves, save_top_k=-1, every_n_train_steps=2))
        run = trainer(
            WORLD,
            CO2Strategy(co2=sc["config"]),
            max_steps=sc["steps"],
            callbacks=callbacks,
            enable_checkpointing=start is None,
        )
        run.fit(Lit(schedule=True, by_step=models.batch), data, ckpt_path=None if start is None else saves / start)
        runs[start] = {"steps": recorder.steps, "final": params(run.lightning_module)}
        runs[start]["lr"] = run.optimizers[0].param_groups[0]["lr"]
    evaluate = trainer(WORLD, CO2Strategy(co2=sc["config"]))
    runs["validate_dir"] = _error(lambda: evaluate.validate(Lit(), data, ckpt_path=saves / "epoch=0-step=4.ckpt"))
    runs["files"] = sorted(p.name for p in (saves / "epoch=0-step=4.ckpt" / "checkpoint").iterdir())
    return runs


def _refusals(rank: int) -> dict:
    data = loader(lambda i: models.batch(rank, i), 3)

    class Wrapped(Lit):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.parallel.DistributedDataParallel(self.net)

    def fit(module: Lit) -> str:
        return _error(lambda: trainer(WORLD, CO2Strategy(co2={"tau": 3}), max_steps=3).fit(module, data))

    def two(lit: Lit):
        return [models.make_optimizer("sgd", lit.parameters()), models.make_optimizer("sgd", lit.parameters())]

    manual = Lit(build=two)
    manual.automatic_optimization = False  # Lightning itself refuses two optimizers otherwise
    return {
        "ddp": fit(Wrapped()),
        "co2": fit(Lit(build=lambda lit: CO2Optimizer(models.make_optimizer("sgd", lit.parameters()), {"tau": 3}))),
        "two": fit(manual),
        "none": fit(Lit(build=lambda lit: None)),
    }


def run_all(rank: int, world: int, directory: str) -> dict:
    as_torchrun(rank, world)
    results = {name: _fit(rank, sc, f"{directory}/{name}") for name, sc in SCENARIOS.items()}
    results["resume"] = _resume(rank, directory)
    results["refusals"] = _refusals(rank)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(run_all, WORLD, str(tmp_path_factory.mktemp("lightning")), timeout=400)


def _reference(sc: dict):
    steps: list = []
    accumulate = sc.get("accumulate", 1)
    finals = simulate(
        lambda: models.make_model("mlp"),
        lambda ps: models.make_optimizer(sc.get("optimizer", "sgd"), ps),
        models.batch,
        models.loss_fn,
        sc["config"],
        replicas=WORLD,
        steps=sc["steps"],
        shards=accumulate,  # the replica's gradient: the mean over its micro-batches
        shard_batch=lambda r, j, k: models.shard_batch(r, j, k, accumulate),
        step_record=steps,
    )
    return steps, finals


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_step_matches_the_reference(results, name):
    sc = SCENARIOS[name]
    steps, finals = _reference(sc)
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert sorted(got["steps"])[-sc["steps"] :] == list(range(1, sc["steps"] + 1))
        for k in range(sc["steps"]):
            assert_close(got["steps"][k + 1], steps[k][rank], f"{name} rank {rank} after step {k + 1}")
        assert_close(got["final"], finals[rank], f"{name} rank {rank} final")


def test_every_rank_ends_with_the_same_model_and_the_saved_file_holds_it(results):
    for name in SCENARIOS:
        first = results[0][name]["final"]
        for per_rank in results:
            assert all(torch.equal(first[k], v) for k, v in per_rank[name]["final"].items()), name
            assert all(torch.equal(first[k], v) for k, v in per_rank[name]["loaded"].items()), name
            assert all(torch.equal(first[k], v) for k, v in per_rank[name]["validated"].items()), name
        saved = results[0][name]["saved"]
        assert "optimizer_states" not in saved and saved["global_step"] == SCENARIOS[name]["steps"]
        assert all(torch.equal(saved["state_dict"][f"net.{k}"], v) for k, v in first.items())


def test_a_run_of_a_partial_round_warns_at_the_start(results):
    warned = results[0]["defaults"]["warnings"]
    assert any("13 optimizer steps" in w and "tau=3" in w and "drops the last 1" in w for w in warned), warned
    assert not any("optimizer steps" in w for w in results[0]["heavyball-adaptive-shared-reducescatter"]["warnings"])


def test_round_figures_reach_the_logger(results):
    rows = results[0]["defaults"]["metrics"]
    rounds = [(int(r["step"]), float(r["co2/round"])) for r in rows if r.get("co2/round")]
    assert rounds == [(3, 0.0), (6, 1.0), (9, 2.0), (12, 3.0)], rounds
    logged = [r for r in rows if r.get("co2/round")]
    assert all(float(r["co2/wait_s"]) >= 0 and float(r["co2/state_bytes"]) > 0 for r in logged)


def test_resume_mid_round_continues_bit_for_bit(results):
    for rank, per_rank in enumerate(results):
        runs = per_rank["resume"]
        whole = runs[None]
        assert sorted(whole["steps"]) == list(range(1, RESUME["steps"] + 1))
        for start, first in (("epoch=0-step=4.ckpt", 5), ("epoch=0-step=8.ckpt", 9)):
            resumed = runs[start]
            assert sorted(resumed["steps"]) == list(range(first, RESUME["steps"] + 1)), start
            for step, values in resumed["steps"].items():
                assert all(torch.equal(whole["steps"][step][k], v) for k, v in values.items()), (rank, start, step)
            assert all(torch.equal(whole["final"][k], v) for k, v in resumed["final"].items()), (rank, start)
            assert resumed["lr"] == whole["lr"]  # the LR schedule came back with Lightning's entries
        assert any(name.startswith(f"co2_rank{rank:05d}.") for name in runs["files"])


def test_the_uninterrupted_resume_run_matches_the_reference(results):
    """The run the resumes are compared with is itself right (its LR schedule aside: SGD at lr(s))."""

    class Scheduled:  # the reference's inner step: tests.models' SGD, then the same per-step LR schedule
        def __init__(self, ps) -> None:
            self.opt = models.make_optimizer("sgd", ps)
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 0.1 * s))

        def step(self) -> None:
            self.opt.step()
            self.sched.step()

    steps: list = []
    simulate(
        lambda: models.make_model("mlp"),
        Scheduled,
        models.batch,
        models.loss_fn,
        RESUME["config"],
        replicas=WORLD,
        steps=RESUME["steps"],
        step_record=steps,
    )
    for rank, per_rank in enumerate(results):
        got = per_rank["resume"][None]["steps"]
        for k in range(RESUME["steps"]):
            assert_close(got[k + 1], steps[k][rank], f"resume run rank {rank} after step {k + 1}")


def test_fit_from_the_file_saved_after_fit_is_refused(results):
    message = results[0]["defaults"]["refit_from_file"]
    assert message.startswith("CO2Error") and "single file" in message and "final.ckpt" in message, message


def test_evaluating_a_per_rank_checkpoint_is_refused(results):
    message = results[1]["resume"]["validate_dir"]
    assert message.startswith("CO2Error") and "each replica's own model" in message and "after fit" in message


def test_refusals_at_fit_start_name_what_is_accepted(results):
    refused = results[0]["refusals"]
    assert refused["ddp"].startswith("ValueError") and "'net'" in refused["ddp"] and "bare module" in refused["ddp"]
    assert refused["co2"].startswith("ValueError") and "returned a CO2Optimizer" in refused["co2"], refused["co2"]
    assert refused["two"].startswith("ValueError") and "exactly one optimizer" in refused["two"], refused["two"]
    assert "got ['SGD', 'SGD']" in refused["two"]
    assert refused["none"].startswith("ValueError") and "got none" in refused["none"], refused["none"]


def test_ddp_options_and_bad_co2_fields_are_refused_when_built():
    with pytest.raises(ValueError, match=r"does not take \['ddp_comm_hook', 'find_unused_parameters'\]"):
        CO2Strategy(ddp_comm_hook=lambda *a: None, find_unused_parameters=True)
    with pytest.raises(ValueError, match="tau"):
        CO2Strategy(co2={"tau": 0})
    assert CO2Strategy().co2 == CO2Config()  # the defaults


def test_missing_lightning_names_the_extra(monkeypatch):
    """Without Lightning, `import co2_zero.lightning` raises an ImportError naming the extra."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as if Lightning were not installed
    for name in [name for name in sys.modules if name.startswith("co2_zero.lightning")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[lightning\]'"):
        importlib.import_module("co2_zero.lightning")


LIGHTNING_COLLECTIVES = {  # what a callback asks at every step, and the name the survivor's error gives it
    "decision": "reduce_boolean_decision",  # ModelCheckpoint's and EarlyStopping's
    "broadcast": "broadcast",  # a checkpoint path, a tuner's choice
    "sync_dist": "reduce (sync_dist)",  # self.log(..., sync_dist=True)
}


def _fit_losing_rank_1(rank: int, world: int, collective: str) -> None:
    """A fit in which every rank issues one of Lightning's own collectives after each optimizer step
    (`collective`, a key of LIGHTNING_COLLECTIVES); rank 1 SIGKILLs itself as it reaches the one of step 3."""
    import os

    from lightning.pytorch.callbacks import Callback

    class Ask(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if rank == 1 and trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if collective == "decision":
                trainer.strategy.reduce_boolean_decision(False, all=False)
            elif collective == "broadcast":
                assert trainer.strategy.broadcast({"step": trainer.global_step, "from": rank}) == {
                    "step": trainer.global_step,
                    "from": 0,
                }
            else:
                pl_module.log("probe", float(rank), on_step=True, on_epoch=False, sync_dist=True)

    as_torchrun(rank, world)
    run = trainer(world, CO2Strategy(co2={"tau": 2, "timeout_s": 30.0}), max_steps=8, callbacks=[Ask()])
    run.fit(Lit(), loader(lambda i: models.batch(rank, i), 8))


def _synced_fit(rank: int, world: int) -> dict:
    """Lightning's collectives through the CO2 strategy give Lightning's answers: a mean logged with
    sync_dist, a sum, a max, an integer mean, and rank 0's object broadcast."""
    from lightning.pytorch.callbacks import Callback

    seen: dict = {}

    class Ask(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            pl_module.log("probe", float(rank + 1), on_step=True, on_epoch=False, sync_dist=True)
            strategy = trainer.strategy
            seen["sum"] = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
            seen["max"] = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="max").item()
            seen["int_mean"] = strategy.reduce(torch.tensor(rank + 2)).item()
            seen["broadcast"] = strategy.broadcast(("path", rank), src=1)

    as_torchrun(rank, world)
    recorder = Ask()
    run = trainer(world, CO2Strategy(co2={"tau": 2, "timeout_s": 30.0}), max_steps=2, callbacks=[recorder])
    run.fit(Lit(), loader(lambda i: models.batch(rank, i), 2))
    return {**seen, "probe": float(run.callback_metrics["probe"])}


def test_lightnings_reduce_and_broadcast_give_lightnings_answers():
    """The CO2 strategy's own `reduce` and `broadcast` (with a deadline) answer as Lightning's DDP ones."""
    for result in run_ranks(_synced_fit, WORLD):
        assert result == {"sum": 3.0, "max": 2.0, "int_mean": 2, "broadcast": ("path", 1), "probe": 1.5}, result


@pytest.mark.parametrize("collective", LIGHTNING_COLLECTIVES)
def test_a_rank_killed_at_a_lightning_collective_fails_the_survivor_with_a_co2_error_naming_it(collective):
    """Issue 66: rank 1 is killed as it reaches one of Lightning's own collectives (a decision, a
    broadcast, a `sync_dist` reduce); rank 0, inside it, raises `CO2Error` naming the collective and
    rank 1 at once (a closed connection is no timeout), not gloo's bare RuntimeError. On a loaded host."""
    with busy_host():
        survivor, killed = launch_ranks(_fit_losing_rank_1, WORLD, collective, timeout=400)
    assert killed.exitcode == -signal.SIGKILL, killed
    assert survivor.exitcode not in (0, None) and survivor.error, f"rank 0 did not fail: {survivor}"
    last = survivor.error.strip().splitlines()[-1]
    name = LIGHTNING_COLLECTIVES[collective]
    assert last.startswith(f"co2_zero.core.errors.CO2Error: co2: Lightning's {name}"), last
    assert "global ranks [0, 1]" in last and "waited for rank 1" in last, last
    assert survivor.ended_at - killed.ended_at < 30.0, (survivor.ended_at, killed.ended_at)
