"""Hugging Face Trainer and Accelerate on CO2 (co2_zero.deepspeed.patch, co2_zero.hf.CO2Callback).

One `torchrun --standalone --nproc_per_node 4` launch of this file (as a script) runs every distributed
scenario on S = 2 shards x R = 2 replicas with a tiny randomly initialised GPT-2, in the order of
`worker()`: DeepSpeed unpatched (untouched: no warning, a plain engine), the Trainer refusals, a Trainer run with
`CO2Callback` (which patches; ZeRO-2, gradient accumulation 2, a save at step 3 while a round's exchange is
in flight), the same model, data and config through `co2_zero.deepspeed.initialize` directly, a Trainer
resume from the step-3 checkpoint, a `deepspeed.initialize` bound before co2_zero was imported, and
Accelerate's `prepare()` alone. The tests below check the recorded results:

- Trainer's trajectory equals the direct `co2_zero.deepspeed.initialize` one bit for bit after every
  optimizer step (the direct loop replays the micro-batches each rank saw and computes the loss as Trainer
  does: summed token losses over the tokens of the accumulation window, `scale_wrt_gas=False`);
- the round starts and the final model of the Trainer and Accelerate runs equal the independent
  single-process reference (tests/reference.py) to float tolerance, and the replicas agree exactly;
- the resumed run continues the uninterrupted one bit for bit.
"""

from __future__ import annotations

import copy
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the torchrun worker: bind deepspeed.initialize before co2_zero exists
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed import initialize as early_initialize

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
co2_deepspeed = pytest.importorskip("co2_zero.deepspeed")
from co2_zero.deepspeed import routing as co2_routing  # noqa: E402  (after the importorskip)

ROOT = Path(__file__).resolve().parents[2]
WORLD, SHARDS = 4, 2
VOCAB, LENGTH, SAMPLES = 64, 8, 64
STEPS, SAVE_AT, TAU = 6, 3, 2
# The attention key bias gets an exactly zero gradient up to rounding noise, which Adam with eps=1e-8 turns
# into steps of ~lr/1000: a comparison with the reference (another summation order) would measure that noise.
ADAM_EPS = 1e-6
CO2 = {
    "tau": TAU,
    "shards_per_replica": SHARDS,
    "outer_lr": 0.8,
    "outer_momentum": 0.5,
    "gap_penalty": {"mode": "adaptive", "strength": 1.5},  # explicit: tests/reference.py's default differs
}


def trainer_ds_config(**co2: object) -> dict:
    """What a Trainer user writes: "auto" for everything Trainer knows, explicit values in co2."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",  # DeepSpeed 0.19.8 ZeRO-1/2 needs it set (docs/design.md §8)
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "co2": {**CO2, **co2},
    }


ACCELERATE_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": ADAM_EPS, "weight_decay": 0.1, "torch_adam": True}},
    "co2": {**CO2, "outer_momentum": 0.0, "nesterov": False},
}


def make_model() -> torch.nn.Module:
    """A 1-layer GPT-2, identical on every call: no download, no dropout (so runs are deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    # The class name maps to no loss type, and Trainer 5.23 then counts every label token, not the shifted ones
    # the causal-LM loss averages over (a loss scaled by 7/8 here). Name it, so Trainer's loss is the token mean.
    model.loss_type = "ForCausalLM"
    return model


def token_rows() -> torch.Tensor:
    """The data set: SAMPLES distinct random token rows."""
    return torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(7))


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# ---- the torchrun worker ---------------------------------------------------------------------------------


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = token_rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _recorder():
    """A TrainerCallback recording this rank's parameters after every optimizer step."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: dict[int, dict] = {}
            self.round_ended: dict[int, bool] = {}

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.steps[state.global_step] = params(model)
            self.round_ended[state.global_step] = optimizer.optimizer.round_ended

    return Recorder()


def _record_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every micro-batch's input_ids, in the order the model sees them."""
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    return seen


def _trainer(out: Path, ds_config: dict, callbacks: list, model=None, **overrides):
    from transformers import Trainer, TrainingArguments

    args = dict(
        output_dir=str(out),
        use_cpu=True,
        deepspeed=ds_config,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=0.01,
        warmup_steps=2,
        logging_steps=2,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        seed=0,
        disable_tqdm=True,
        average_tokens_across_devices=False,
        adam_epsilon=ADAM_EPS,
    )  # README: no per-step all-gather over every replica
    args.update(overrides)
    return Trainer(
        model=model or make_model(), args=TrainingArguments(**args), train_dataset=Rows(), callbacks=callbacks
    )


def _error_of(call) -> str:
    try:
        call()
    except Exception as error:  # the scenario records what was raised
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def scenario_unpatched(out: Path) -> dict:
    """Without patch(): DeepSpeed's initialize (bound before co2_zero was imported) is DeepSpeed's own code,
    which ignores the co2 section without a word and builds plain ZeRO; a Trainer whose patch was undone
    refuses to train; "auto" in co2 is refused at construction."""
    from co2_zero.hf import CO2Callback

    ds_config = copy.deepcopy(ACCELERATE_DS_CONFIG)
    model = make_model()
    code = early_initialize.__code__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, zero, _, _ = early_initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.save_checkpoint(str(out / "plain"))  # DeepSpeed's own checkpoint, for the refusal below
    trainer = _trainer(out / "unpatched", trainer_ds_config(), [CO2Callback()])  # CO2Callback() patches
    co2_deepspeed.unpatch()
    return {
        "deepspeeds_code": code.co_filename.endswith(os.path.join("deepspeed", "__init__.py")),
        "restored": early_initialize.__code__ is code,  # by unpatch()
        "warnings": [str(w.message) for w in caught if "co2" in str(w.message)],
        "plain_optimizer": type(zero).__name__,
        "plain_dp_world": engine.dp_world_size,
        "train_unpatched": _error_of(trainer.train),
        "auto": _error_of(lambda: _trainer(out / "auto", trainer_ds_config(collective="auto"), [CO2Callback()])),
        "patched_after": co2_routing._ENTRY.patched,  # the "auto" Trainer's CO2Callback patched again
    }


def scenario_trainer(out: Path) -> dict:
    """Trainer + CO2Callback (which patches): every step's parameters, the micro-batches, logs, checkpoints."""
    from co2_zero.hf import CO2Callback

    co2_deepspeed.unpatch()
    recorder, model = _recorder(), make_model()
    inputs = _record_inputs(model)
    trainer = _trainer(out / "trainer", trainer_ds_config(), [CO2Callback(), recorder], model=model)
    patched_by_callback = co2_routing._ENTRY.patched
    x0 = params(model)
    trainer.train()
    engine = trainer.model_wrapped
    final = params(trainer.model)
    trainer.save_model(str(out / "trainer" / "final"))  # after finalize(): every rank holds this model
    return {
        "x0": x0,
        "steps": recorder.steps,
        "round_ended": recorder.round_ended,
        "final": final,
        "inputs": list(inputs),
        "ds_config": copy.deepcopy(trainer.accelerator.deepspeed_config),
        "log_history": trainer.state.log_history,
        "optimizer": type(engine.optimizer).__name__,
        "patched_by_callback": patched_by_callback,
        "co2_state_bytes": engine.optimizer.co2_state_bytes(),
        "engine_train_batch_size": engine.train_batch_size(),
        "trainer_train_batch_size": trainer.args.world_size * 2 * 2,
        "checkpoint": sorted(p.name for p in (out / "trainer" / f"checkpoint-{SAVE_AT}").iterdir()),
    }


def scenario_direct(ds_config: dict, inputs: list[torch.Tensor]) -> dict:
    """The same model, data and config through co2_zero.deepspeed.initialize, with Trainer's loss."""
    from co2_zero.deepspeed import initialize

    model = make_model()
    engine, zero, _, _ = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(ds_config))
    accumulation = engine.gradient_accumulation_steps()
    steps = {}
    for step in range(STEPS):
        window = inputs[step * accumulation : (step + 1) * accumulation]
        tokens = sum(x[:, 1:].ne(-100).sum() for x in window) / 1  # Trainer's num_items_in_batch (a float)
        for x in window:
            loss = engine(input_ids=x, labels=x, num_items_in_batch=tokens).loss
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        steps[step + 1] = params(engine.module)
    zero.finalize()
    return {"steps": steps, "final": params(engine.module)}


def scenario_resume(out: Path) -> dict:
    """A fresh Trainer (other initial weights) resumed from the step-3 checkpoint."""
    from co2_zero.hf import CO2Callback

    recorder, model = _recorder(), make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    inputs = _record_inputs(model)
    trainer = _trainer(out / "resumed", trainer_ds_config(), [CO2Callback(), recorder], model=model)
    trainer.train(resume_from_checkpoint=str(out / "trainer" / f"checkpoint-{SAVE_AT}"))
    return {"steps": recorder.steps, "final": params(trainer.model), "inputs": list(inputs)}


def scenario_early_bound(out: Path) -> dict:
    """`from deepspeed import initialize` ran before co2_zero was imported: patched, it builds CO2 too.
    Its engine then refuses the resumes that would drop the CO2 state, called as Trainer calls them."""
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    model = make_model()
    engine, zero, _, _ = early_initialize(
        model=model, model_parameters=model.parameters(), config=copy.deepcopy(ACCELERATE_DS_CONFIG)
    )
    checkpoint = str(out / "trainer" / f"checkpoint-{SAVE_AT}")
    result = {
        "optimizer": type(zero).__name__,
        "partial_load": _error_of(lambda: engine.load_checkpoint(checkpoint, load_optimizer_states=False)),
        "plain_checkpoint": _error_of(lambda: deepspeed_load_checkpoint(engine, str(out / "plain"))),
    }
    zero.finalize()
    return result


def scenario_accelerate(out: Path) -> dict:
    """Accelerate's prepare() under `with co2_zero.deepspeed.patch():`, a plain Accelerate loop; at step 3
    (mid-round, an exchange in flight) `save_state` and `load_state` of that state, which must not
    disturb the trajectory."""
    from accelerate import Accelerator, DeepSpeedPlugin, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DummyOptim

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer runs' state
    PartialState(cpu=True)  # on CPU; with GPUs Accelerator() alone
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ACCELERATE_DS_CONFIG)))
    model = make_model()
    inputs = _record_inputs(model)
    loader = torch.utils.data.DataLoader(token_rows(), batch_size=2)
    with co2_deepspeed.patch():
        model, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
    patched_after_exit = co2_routing._ENTRY.patched
    starts = [params(model.module)]
    for step, x in enumerate(loader):
        accelerator.backward(model(input_ids=x, labels=x).loss)
        optimizer.step()
        optimizer.zero_grad()
        if model.optimizer.round_ended:
            starts.append(params(model.module))
        if step + 1 == SAVE_AT:
            accelerator.save_state(str(out / "accelerate_state"))
            accelerator.load_state(str(out / "accelerate_state"))
        if step + 1 == STEPS:
            break
    model.optimizer.finalize()
    return {
        "saved": sorted(p.name for p in (out / "accelerate_state" / "pytorch_model").iterdir()),
        "starts": starts,
        "final": params(model.module),
        "inputs": list(inputs),
        "optimizer": type(model.optimizer).__name__,
        "patched_after_exit": patched_after_exit,
    }


def worker(out: Path) -> None:
    """One rank of the torchrun launch: every scenario in order, results to out/result<rank>.pt."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        co2_deepspeed.init_distributed()  # the process group, without DeepSpeed's JIT build
        results = {"unpatched": scenario_unpatched(out)}
        results["trainer"] = scenario_trainer(out)
        results["direct"] = scenario_direct(results["trainer"]["ds_config"], results["trainer"]["inputs"])
        results["resume"] = scenario_resume(out)
        results["early_bound"] = scenario_early_bound(out)  # patched by the Trainers' CO2Callback
        co2_deepspeed.unpatch()
        results["accelerate"] = scenario_accelerate(out)
        results["extensions"] = sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"]))
        torch.save(results, out / f"result{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)  # do not wait in a collective for peers that will never come
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- the launch and the reference -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """One torchrun launch of `worker` (4 ranks): its output directory and per-rank results."""
    out = tmp_path_factory.mktemp("hf")
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        TORCH_EXTENSIONS_DIR=str(tmp_path_factory.mktemp("torch_extensions")),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        __file__,
        str(out),
    ]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
            proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
    errors = "\n".join(
        f"--- rank {r}:\n{(out / f'error{r}.txt').read_text()}"
        for r in range(WORLD)
        if (out / f"error{r}.txt").exists()
    )
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{errors or output[-6000:]}"
    return {"out": out, "ranks": [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(WORLD)]}


@pytest.fixture(scope="module")
def results(launch) -> list[dict]:
    return launch["ranks"]


def _shard_batch(inputs_per_rank: list[list[torch.Tensor]], accumulation: int):
    """The reference's micro-batch j of replica r at step k: rank (r, j % S)'s micro-batch j // S."""

    def batch(r: int, j: int, k: int):
        x = inputs_per_rank[r * SHARDS + j % SHARDS][k * accumulation + j // SHARDS]
        return x, x

    return batch


def _gpt2_loss(output, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits[:, :-1].reshape(-1, VOCAB)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))


class ReferenceInner:
    """What DeepSpeed does around the inner step, for the reference: torch AdamW, gradient clipping and
    the config's DeepSpeed LR scheduler (if any), on one full model."""

    def __init__(self, model_params, ds_config: dict) -> None:
        from deepspeed.runtime import lr_schedules

        self.params = list(model_params)
        hyper = {k: v for k, v in ds_config["optimizer"]["params"].items() if k != "torch_adam"}
        self.optimizer = torch.optim.AdamW(self.params, **hyper)
        self.clip = ds_config["gradient_clipping"]
        scheduler = ds_config.get("scheduler")
        self.scheduler = scheduler and getattr(lr_schedules, scheduler["type"])(self.optimizer, **scheduler["params"])

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        if self.scheduler:
            self.scheduler.step()


def reference(ds_config: dict, inputs_per_rank: list[list[torch.Tensor]], accumulation: int):
    """Per round start every replica's parameters there (its stand-in's, with the defaults' `local`), and
    the final parameters, of R = 2 replicas in the single-process reference."""
    from tests.reference import replica_round_starts, simulate

    starts: list = []
    steps: list = []
    finals = simulate(
        make_model,
        lambda p: ReferenceInner(p, ds_config),
        None,
        _gpt2_loss,
        ds_config["co2"],
        replicas=WORLD // SHARDS,
        steps=STEPS,
        shards=SHARDS * accumulation,
        shard_batch=_shard_batch(inputs_per_rank, accumulation),
        record=starts,
        step_record=steps,
    )
    return replica_round_starts(starts, steps, ds_config["co2"]["tau"]), finals


def _one_start_everywhere(co2: dict) -> bool:
    """Whether every replica starts each round from the shared start (no stand-in, design §3)."""
    from tests.reference import resolve_config

    return resolve_config(co2)["stand_in"] == "shared"


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    for key, value in expected.items():
        if key in actual:
            torch.testing.assert_close(
                actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{what}/{k}: {m}"
            )


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs (max {float((a[key] - b[key]).abs().max()):.3g})"


# ---- the tests: Trainer ----------------------------------------------------------------------------------


def test_trainer_builds_co2_and_passes_the_global_batch(results):
    for r in results:
        got = r["trainer"]
        assert got["optimizer"] == "CO2ZeroOptimizer" and got["patched_by_callback"]
        # train_batch_size "auto" -> Trainer's global batch over all 4 ranks; DeepSpeed gets one replica's
        assert got["ds_config"]["train_batch_size"] == got["trainer_train_batch_size"] == 16
        assert got["engine_train_batch_size"] == 16 // (WORLD // SHARDS)
        assert got["ds_config"]["co2"] == CO2


def test_trainer_trajectory_equals_co2_zero_deepspeed_initialize_every_step(results):
    for rank, r in enumerate(results):
        trainer, direct = r["trainer"], r["direct"]
        assert sorted(trainer["steps"]) == sorted(direct["steps"]) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            _assert_equal(trainer["steps"][step], direct["steps"][step], f"rank {rank} step {step}")
        _assert_equal(trainer["final"], direct["final"], f"rank {rank} final")


def test_trainer_matches_the_reference_and_replicas_agree(results):
    trainer = [r["trainer"] for r in results]
    assert [step for step, ended in trainer[0]["round_ended"].items() if ended] == list(range(TAU, STEPS + 1, TAU))
    starts, finals = reference(trainer[0]["ds_config"], [t["inputs"] for t in trainer], accumulation=2)
    shared = _one_start_everywhere(trainer[0]["ds_config"]["co2"])
    for rank, got in enumerate(trainer):
        got_starts = [got["x0"]] + [got["steps"][s] for s in range(TAU, STEPS + 1, TAU)]
        assert len(got_starts) == len(starts) == 1 + STEPS // TAU
        for t, (a, e) in enumerate(zip(got_starts, starts)):
            _assert_close(a, e[rank // SHARDS], f"rank {rank} round-{t} start")
            if shared or rank < SHARDS or t == 0:  # a stand-in: the replicas start rounds apart
                _assert_equal(a, trainer[0]["steps"][t * TAU] if t else trainer[0]["x0"], f"rank {rank} round {t}")
        _assert_close(got["final"], finals[0], f"rank {rank} final")
        _assert_equal(got["final"], trainer[0]["final"], f"rank {rank} final vs rank 0")
    mid_round = [got["steps"][SAVE_AT] for got in trainer]  # replicas differ inside a round: CO2 is on
    assert not torch.equal(mid_round[0]["transformer.wte.weight"], mid_round[SHARDS]["transformer.wte.weight"])


def test_trainer_data_covers_all_ranks(results):
    """Trainer shards the data over all 4 ranks (each replica its own data): one epoch is 4 steps of 16
    samples, and every sample appears exactly once in it."""
    rows = {tuple(row.tolist()): i for i, row in enumerate(token_rows())}
    epoch = [rows[tuple(row.tolist())] for r in results for x in r["trainer"]["inputs"][: 4 * 2] for row in x]
    assert sorted(epoch) == list(range(SAMPLES))


def test_trainer_logs_round_figures(results):
    history = results[0]["trainer"]["log_history"]
    logged = [h for h in history if "co2/round" in h]
    assert [h["step"] for h in logged] == [2, 4, 6] and [h["co2/round"] for h in logged] == [0, 1, 2]
    for h in logged:
        assert h["co2/wait_s"] >= 0 and h["co2/round_end_s"] >= h["co2/wait_s"]
        assert 0 < h["co2/state_bytes"] <= results[0]["trainer"]["co2_state_bytes"]


def test_trainer_checkpoint_is_co2s_and_final_model_is_saved_after_finalize(launch):
    from safetensors.torch import load_file

    results = launch["ranks"]
    assert {"global_step3", "latest_co2", "trainer_state.json"} <= set(results[0]["trainer"]["checkpoint"])
    assert "latest" not in results[0]["trainer"]["checkpoint"]  # no plain DeepSpeed checkpoint beside it
    saved = load_file(launch["out"] / "trainer" / "final" / "model.safetensors")
    for r in results:  # every rank holds the finalized model rank 0 saved (lm_head.weight is tied to wte)
        final = r["trainer"]["final"]
        assert final.keys() <= saved.keys()
        _assert_equal(final, {k: saved[k] for k in final}, "saved final model")
        _assert_equal(r["direct"]["final"], final, "finalize()d model")


def test_trainer_resume_continues_exactly(results):
    for rank, r in enumerate(results):
        straight, resumed = r["trainer"], r["resume"]
        assert sorted(resumed["steps"]) == list(range(SAVE_AT + 1, STEPS + 1))
        assert [x.tolist() for x in resumed["inputs"]] == [x.tolist() for x in straight["inputs"][SAVE_AT * 2 :]]
        for step in range(SAVE_AT + 1, STEPS + 1):
            _assert_equal(resumed["steps"][step], straight["steps"][step], f"rank {rank} resumed step {step}")
        _assert_equal(resumed["final"], straight["final"], f"rank {rank} resumed final")


def test_resume_that_would_drop_co2_state_is_refused(results):
    for r in results:
        got = r["early_bound"]
        assert got["partial_load"].startswith("ValueError: co2: load_checkpoint(load_optimizer_states=False)")
        assert got["plain_checkpoint"].startswith("CO2Error: co2:") and "plain DeepSpeed" in got["plain_checkpoint"]


# ---- the tests: without patch(), "auto", a name bound early, Accelerate ----------------------------------


def test_without_patch_deepspeed_is_untouched_and_trainer_refuses(results):
    for r in results:
        got = r["unpatched"]
        assert got["deepspeeds_code"] and got["restored"] and got["warnings"] == []
        assert got["plain_optimizer"] == "DeepSpeedZeroOptimizer" and got["plain_dp_world"] == WORLD
        assert got["train_unpatched"].startswith("CO2Error: co2: Trainer built a plain DeepSpeed engine")
        assert got["patched_after"]


def test_auto_in_the_co2_section_is_refused_naming_the_field(results):
    assert results[0]["unpatched"]["auto"].startswith("ValueError: co2 config: co2.collective='auto' is invalid")


def test_patch_reaches_a_name_bound_before_co2_zero_was_imported(results):
    assert all(r["early_bound"]["optimizer"] == "CO2ZeroOptimizer" for r in results)


def test_accelerate_prepare_trains_co2_like_the_reference(results):
    got = [r["accelerate"] for r in results]
    assert all(g["optimizer"] == "CO2ZeroOptimizer" and not g["patched_after_exit"] for g in got)
    rows = {tuple(row.tolist()): i for i, row in enumerate(token_rows())}
    first_steps = [rows[tuple(row.tolist())] for g in got for x in g["inputs"][:4] for row in x]
    assert sorted(first_steps) == list(range(4 * WORLD * 2)), "each rank must get its own samples"
    saved = got[0]["saved"]  # save_state wrote co2's checkpoint: every rank's file and the completion marker
    assert "co2_complete.json" in saved, saved
    rank_files = sorted(name.split(".")[0] for name in saved if name.startswith("co2_rank"))
    assert rank_files == [f"co2_rank{r:05d}" for r in range(WORLD)], saved
    starts, finals = reference(ACCELERATE_DS_CONFIG, [g["inputs"] for g in got], accumulation=1)
    shared = _one_start_everywhere(ACCELERATE_DS_CONFIG["co2"])
    for rank, g in enumerate(got):
        assert len(g["starts"]) == len(starts)
        for t, (a, e) in enumerate(zip(g["starts"], starts)):
            _assert_close(a, e[rank // SHARDS], f"accelerate rank {rank} round-{t} start")
            if shared or rank < SHARDS or t == 0:  # a stand-in: the replicas start rounds apart
                _assert_equal(a, got[0]["starts"][t], f"accelerate rank {rank} round {t}")
        _assert_close(g["final"], finals[0], f"accelerate rank {rank} final")


def test_nothing_was_jit_compiled(results):
    assert all(r["extensions"] == [] for r in results)


# ---- single-process tests --------------------------------------------------------------------------------


def test_patch_is_idempotent_undoable_and_a_context_manager():
    import importlib

    import deepspeed

    shm = importlib.import_module("deepspeed.comm.torch")
    build, code = shm.build_shm_op, deepspeed.initialize.__code__
    assert not co2_routing._ENTRY.patched
    assert code.co_filename.endswith(os.path.join("deepspeed", "__init__.py"))  # importing co2_zero changed nothing
    co2_deepspeed.patch()
    co2_deepspeed.patch()
    assert co2_routing._ENTRY.patched and shm.build_shm_op() is None and shm.build_shm_op is not build
    assert deepspeed.initialize.__code__ is not code
    with co2_deepspeed.patch():  # already on: leaving the block keeps it on
        pass
    assert co2_routing._ENTRY.patched and deepspeed.initialize.__code__ is not code
    assert "config_params" in inspect.signature(deepspeed.initialize).parameters  # DeepSpeed's signature
    co2_deepspeed.unpatch()
    assert not co2_routing._ENTRY.patched and shm.build_shm_op is build and deepspeed.initialize.__code__ is code
    with co2_deepspeed.patch():
        assert co2_routing._ENTRY.patched and deepspeed.initialize.__code__ is not code
    assert not co2_routing._ENTRY.patched and shm.build_shm_op is build and deepspeed.initialize.__code__ is code


def test_unpatched_deepspeed_runs_its_own_code_without_a_word():
    """The documented behaviour without patch(): DeepSpeed as shipped (co2_zero cannot see the call)."""
    import deepspeed

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match="requires a model"):  # DeepSpeed's own first check
            deepspeed.initialize(model=None, config={"co2": {"tau": 2}})


def test_importing_co2_zero_hf_changes_nothing_in_deepspeed_and_co2_callback_patches():
    from tests.integrations.test_deepspeed import PATCH_CHECK_EXPECTED, patch_check

    assert patch_check("hf") == PATCH_CHECK_EXPECTED


def test_co2_callback_names_a_misspelt_co2_section():
    from types import SimpleNamespace

    from co2_zero.hf import CO2Callback

    ds_config = {**ACCELERATE_DS_CONFIG}
    ds_config["CO2"] = ds_config.pop("co2")
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=ds_config), deepspeed=ds_config)
    try:
        with pytest.raises(ValueError, match=r"top-level key 'CO2' in the DeepSpeed config dict is invalid"):
            CO2Callback().on_init_end(args, None, None)
    finally:
        co2_deepspeed.unpatch()


def test_check_co2_section():
    from co2_zero.hf import check_co2_section

    check_co2_section({"zero_optimization": {"stage": 2}, "co2": {"tau": 4}})
    with pytest.raises(ValueError, match=r"co2\.gap_penalty\.mode='auto' is invalid"):
        check_co2_section({"zero_optimization": {"stage": 2}, "co2": {"gap_penalty": {"mode": "auto"}}})
    with pytest.raises(ValueError, match=r"zero_optimization\.stage=3"):
        check_co2_section({"zero_optimization": {"stage": 3}, "co2": {"tau": 4}})


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "co2_zero.hf", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        import co2_zero.hf  # noqa: F401


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


def test_example_does_not_resume_a_finished_run(tmp_path):
    """examples/hf_trainer.py --resume on a run whose last checkpoint reached --max_steps trains nothing
    and says so (Trainer would train one more step, which finalize() then drops)."""
    out = tmp_path / "run"
    (out / "checkpoint-30").mkdir(parents=True)
    (out / "checkpoint-30" / "trainer_state.json").write_text('{"global_step": 30}')
    command = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--output_dir", str(out), "--max_steps", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"nothing to train: {out} holds a checkpoint at step 30 >= --max_steps 30" in done.stdout, done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-30"]  # no step 31, no final model rewritten


_WITHOUT_USE_CPU = """
import json, os, sys
sys.path.insert(0, {root!r})
from tests.integrations.test_hf import trainer_ds_config, make_model
from transformers import Trainer, TrainingArguments
from co2_zero.hf import CO2Callback

args = TrainingArguments(output_dir="out", deepspeed=trainer_ds_config(), per_device_train_batch_size=2, max_steps=4)
try:
    Trainer(model=make_model(), args=args, train_dataset=[], callbacks=[CO2Callback()])
    outcome = "BUILT"
except ValueError as error:
    outcome = f"REFUSED {{error}}"
with open(f"outcome.{{os.environ['RANK']}}.txt", "w") as f:  # one file per rank: two ranks' prints interleave
    f.write(outcome)
"""


def test_trainer_without_use_cpu_on_cpu_says_what_to_do(tmp_path):
    """On CPU without use_cpu=True Trainer counts one process and DeepSpeed would fail on the batch sizes
    ('4 != 4 * 2 * 1'); the callback says to give use_cpu=True when the Trainer is built."""
    script = tmp_path / "without_use_cpu.py"
    script.write_text(_WITHOUT_USE_CPU.format(root=str(ROOT)))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([*launcher, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        outcome = tmp_path / f"outcome.{rank}.txt"
        assert outcome.exists(), f"rank {rank} wrote no outcome\n" + done.stdout[-3000:] + done.stderr[-3000:]
        refusal = outcome.read_text()
        assert refusal.startswith("REFUSED "), (rank, refusal)
        assert "world_size=1" in refusal and "launch started 2" in refusal and "use_cpu=True" in refusal, refusal
