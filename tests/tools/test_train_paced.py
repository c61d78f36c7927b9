"""The training job with `--replica_tau` (co2_zero/train/pacing.py): replicas of different speeds.

Real launches (one torchrun launch of 2 ranks, each run a process of its own, tests.dist_utils.launch_jobs):
replica 0 trains 2 steps per round, replica 1 the job's tau = 4. What the job counts on the fastest
replica's clock (--max_steps, the log's steps, checkpoints, the LR schedule) and what each replica really
trains (its steps, its tokens), on every engine (DeepSpeed's own scheduler reads the same clock); a
checkpoint resumed mid-run continues the uninterrupted run bit for bit; `"auto"` fixes the τ_r and ends
with one model. The refusals are parsed in process. `JobSteps` itself is checked against `Pace` by hand-counted cases.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from co2_zero.core.pace import Pace
from co2_zero.train import args as train_args
from co2_zero.train.engines import lr_lambda
from co2_zero.train.pacing import JobSteps
from tests.dist_utils import launch_jobs
from tests.tools.test_train_lm_smoke import SCRIPT, TINY, TOKENS, _env, by_step, outcome, write_tokens

TAU, SLOW = 4, 2  # replica 0 trains SLOW steps per round, replica 1 TAU
PACED = ["--tau", str(TAU), "--replica_tau", f"{SLOW},{TAU}", "--max_steps", "16", "--eval_every", "1"]
OTHER_ENGINES = ("deepspeed", "fsdp", "fairscale")  # besides plain; each replica one rank (S = 1)


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """Per job name: (its JSON records, every rank's output, its directory)."""
    root = tmp_path_factory.mktemp("paced")
    # --grad_accum given: DeepSpeed's config (accumulation 2) must not change the tokens per step
    common = [*TINY, *TOKENS, "--data", str(write_tokens(root / "tokens")), "--batch_size", "4", "--grad_accum", "1"]
    planned = {
        "straight": [*PACED, "--save_dir", "ckpt", "--save_every", "8", "--events_jsonl", "events.jsonl"],
        "again": [*PACED, "--resume", "ckpt/step00000008"],
        "resharded": [*PACED, "--resume", "ckpt/step00000008", "--reshard", "--save_dir", "ckpt2", "--save_every", "8"],
        **{engine: [*PACED, "--engine", engine, "--shards_per_replica", "1"] for engine in OTHER_ENGINES},
        "auto": ["--tau", str(TAU), "--replica_tau", "auto", "--max_steps", "24"],
    }
    jobs = [([str(SCRIPT), *common, *flags, "--out_json", str(root / f"{name}.jsonl")], root) for name, flags in
            planned.items()]  # fmt: skip
    (root / "launch").mkdir()
    ended = launch_jobs(jobs, 2, root / "launch", 240, _env())
    return {name: (*outcome(end, root / f"{name}.jsonl"), root) for name, end in zip(planned, ended)}


def expected_lr(step: int) -> float:
    """The schedule's LR after `step` steps of the fastest replica (the job's clock)."""
    args = train_args.get_args([*TINY, *PACED])
    return args.lr * lr_lambda(args)(step)


@pytest.mark.parametrize("name", ["straight", *OTHER_ENGINES])
def test_each_replica_trains_its_own_steps_on_the_fastest_replicas_clock(paced, name):
    """Every log point is a round end on the fastest replica's clock (4, 8, 12, 16); the tokens are what
    the replicas trained (2 + 4 steps a round, not 2 x 4); rank 0, the slow replica, reads the LR schedule
    at the job's step, not at its own (it took half as many): on every engine (DeepSpeed: its own scheduler)."""
    records, _, _ = paced[name]
    points = by_step(records)
    assert sorted(points) == [0, 4, 8, 12, 16], sorted(points)
    per_step = 4 * 32  # --batch_size 4 x --block_size 32, one rank's optimizer step
    for step in (4, 8, 12, 16):
        assert points[step]["tokens"] == (step // TAU) * (SLOW + TAU) * per_step, points[step]
        assert points[step]["lr"] == pytest.approx(expected_lr(step), rel=1e-12), (step, points[step]["lr"])
    summary = records[-1]
    assert (summary["steps"], summary["rounds"], summary["tokens"]) == (16, 4, 4 * (SLOW + TAU) * per_step)


def test_the_slow_replica_takes_its_own_steps(paced):
    """Rank 0 (replica 0, 2 steps a round) took 8 optimizer steps in 4 rounds, each 2 of the job's."""
    root = paced["straight"][2]
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(2, 17, 2)), steps


def test_a_paced_checkpoint_resumes_exactly(paced):
    """Saved at the round end of step 8 (each replica its own steps, data position and LR schedule), the
    run resumed from it continues the uninterrupted one bit for bit."""
    straight, again = by_step(paced["straight"][0]), by_step(paced["again"][0])
    assert sorted(again) == [8, 12, 16] and again[8]["val_loss"] == straight[8]["val_loss"]
    for step in (12, 16):
        assert (again[step]["loss"], again[step]["val_loss"]) == (straight[step]["loss"], straight[step]["val_loss"])
    assert paced["again"][0][-1]["val_loss"] == paced["straight"][0][-1]["val_loss"]
    assert "resumed from ckpt/step00000008 at step 8" in paced["again"][1]


def test_a_paced_checkpoint_resharded_resumes_on_the_jobs_clock(paced):
    """The step-8 checkpoint loaded with --reshard (the same grid: the inner state restarts): the job goes on
    from step 8 of the fastest replica's clock, not from the slow replica's own 4 steps; every replica takes
    the rounds that are left (one model at the end), and the save at step 16 agrees on its step."""
    records, report, root = paced["resharded"]
    assert "resumed from ckpt/step00000008 at step 8 (resharded)" in report, report[-3000:]
    assert sorted(by_step(records)) == [8, 12, 16] and records[-1]["steps"] == 16
    assert (root / "ckpt2" / "latest").read_text() == "step00000016"


def test_auto_fixes_the_steps_and_ends_with_one_model(paced):
    """`--replica_tau auto`: the job measures its first rounds, fixes each replica's steps, and finalize()
    agrees on one model (the job would exit non-zero otherwise); the run learns."""
    records, report, _ = paced["auto"]
    assert "replica_tau fixed at [" in report, report[-3000:]
    assert records[-1]["steps"] == 24 and records[-1]["val_loss"] < records[0]["val_loss"]


# ---- in process ------------------------------------------------------------------------------------------


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        train_args.get_args(argv)
    return capsys.readouterr().err


def test_refused_flags_name_what_to_set(capsys):
    """A save inside a round, a malformed list, and replica_tau with an elastic replica: refused by the
    parser, naming the flags and what is accepted."""
    err = parse_error([*TINY, *PACED, "--save_dir", "d", "--save_every", "6"], capsys)
    assert f"--save_every=6 with replica_tau=[{SLOW}, {TAU}]" in err and f"a multiple of tau={TAU}" in err, err
    err = parse_error([*TINY, "--tau", "4", "--replica_tau", "4,x"], capsys)
    assert "'4,x': accepted: 'auto' or one integer per replica" in err, err
    elastic = ["--lighthouse", "http://localhost:1", "--replica_id", "0", "--tau", "4", "--replica_tau", "auto"]
    err = parse_error([*TINY, *elastic], capsys)
    assert "replica_tau='auto' is not supported with co2-train and an elastic membership" in err, err
    assert train_args.get_args([*TINY, *PACED, "--save_dir", "d", "--save_every", "8"]).save_every == 8


def steps_on(pace: Pace, replica: int, world: int = 2) -> JobSteps:
    steps = JobSteps(tokens_per_rank_step=10, world=world)
    steps.opt = SimpleNamespace(engine=SimpleNamespace(pace=pace, topology=SimpleNamespace(replica_index=replica)))
    return steps


def test_job_steps_count_on_the_fastest_replicas_clock():
    """Replica 1 of τ = (4, 2) is 2 job steps per optimizer step; where `auto` fixed (4, 3) from round 2 (a
    run resumed in its measured round), replica 1's steps 8..11 are rounds 0-1 at 4 and its 3-step rounds after."""
    fixed = steps_on(Pace((4, 2)), replica=1)
    assert [fixed.after(own) for own in range(5)] == [0, 2, 4, 6, 8]
    assert fixed.clock(3) == 6.0 and fixed.own_at(8) == 4
    assert fixed.tokens(8) == 2 * (4 + 2) * 10  # 2 rounds, one rank per replica
    assert steps_on(Pace((4, 2)), replica=1, world=4).tokens(8) == 2 * 2 * (4 + 2) * 10  # S = 2
    measured = steps_on(Pace((4, 3), from_round=2), replica=1)
    assert [measured.after(own) for own in (7, 8, 9, 10, 11)] == [7, 8, 9, 10, 12]
    assert measured.own_at(12) == 11 and measured.tokens(12) == (8 + 4 + 8 + 3) * 10
    uniform = steps_on(Pace((4, 4)), replica=0)
    assert (uniform.after(5), uniform.own_at(5), uniform.tokens(5)) == (5, 5, 5 * 2 * 10)
    none = JobSteps(tokens_per_rank_step=10, world=3)  # ddp / none: no engine
    assert (none.after(7), none.clock(7), none.own_at(7), none.tokens(7)) == (7, 7.0, 7, 210)
