"""Smoke tests of the training job, co2_zero.train (scripts/train_lm.py, `python -m co2_zero.train`):
real launches (torchrun with 2 ranks, or one process), tiny models.

The default byte corpus with CO2, and what it prints (header, summary line, no progress bar into a
pipe); a uint16 token file (--data); gradient accumulation against one big batch; checkpoints of every
engine resumed mid-run continue the uninterrupted run exactly and say where they resumed; a resume with
another R x S (--reshard); the model presets, --help's defaults and the precedence of the CO2 settings
(in process, no launch).
"""

from __future__ import annotations

import array
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from co2_zero import CO2Config
from co2_zero.core.config import PUBLISHED
from co2_zero.train import args as train_args
from co2_zero.train import checkpoints as train_checkpoints
from co2_zero.train import data as train_data
from co2_zero.train.model import GPT
from tests.compare import same
from tests.dist_utils import JobOutcome, launch_jobs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_lm.py"
TINY = [
    "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
    "--data_bytes", "300000", "--eval_batches", "4", "--eval_every", "5", "--warmup_steps", "5",
    "--lr", "1e-2", "--min_lr", "1e-3", "--no_progress",
]  # fmt: skip
TOKENS = ["--vocab_size", "400"]  # token ids 300..349 (above a byte: the file really is read as uint16)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def run_job(workdir: Path, flags: list[str], ranks: int = 2, timeout: float = 240, module: bool = False,
            ok: bool = True) -> tuple[list[dict], str]:  # fmt: skip
    """Run the job (torchrun with `ranks` ranks, or one plain process; scripts/train_lm.py, or with
    `module` `-m co2_zero.train`), stderr piped -> (its JSON records, its stderr). `ok`: it must succeed
    (else: it must fail, and the records are [])."""
    out = workdir / f"log{len(list(workdir.glob('log*.jsonl')))}.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    job = ["-m", "co2_zero.train"] if module else [str(SCRIPT)]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), *job, *flags, "--out_json", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert (proc.returncode == 0) == ok, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()] if ok else []
    return records, proc.stderr


def launch(workdir: Path, flags: list[str], ranks: int = 2, timeout: float = 240) -> list[dict]:
    """Run the job (see run_job) -> its JSON records."""
    return run_job(workdir, flags, ranks, timeout)[0]


def summary_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("final val loss"))


def write_tokens(directory: Path) -> Path:
    """train.bin / val.bin of uint16 ids: a cycle through 50 ids above 255, easy to learn."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = [300 + (7 * i) % 50 for i in range(60_000)]
    for name, part in (("train.bin", ids[:50_000]), ("val.bin", ids[50_000:])):
        with open(directory / name, "wb") as f:
            array.array("H", part).tofile(f)
    return directory


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if not r.get("summary")}


# ---- launches -------------------------------------------------------------------------------------------


def test_train_lm_co2_two_ranks(tmp_path):
    with_bar = [f for f in TINY if f != "--no_progress"]  # the bar is on unless stderr is no terminal
    recs, stderr = run_job(tmp_path, ["--method", "co2", "--max_steps", "40", "--tau", "2", *with_bar])
    summary = [r for r in recs if r.get("summary")]
    rounds = [r for r in recs if not r.get("summary") and r["step"] > 0]
    assert len(summary) == 1 and len(rounds) >= 1
    assert all(math.isfinite(r["loss"]) for r in rounds)
    assert all(r["wait_s"] >= 0 and r["round_end_s"] >= r["wait_s"] for r in rounds)
    assert all(r["mfu"] is None and r["max_memory_gib"] is None for r in rounds)  # CPU: no MFU, no GPU memory
    initial, final = recs[0]["val_loss"], summary[0]["val_loss"]
    assert recs[0]["step"] == 0 and math.isfinite(initial)
    assert math.isfinite(final) and final < initial - 0.5, (initial, final)
    assert summary[0]["steps"] == 40 and summary[0]["world_size"] == 2
    assert summary[0]["co2_state_bytes"] > 0
    assert summary[0]["args"]["model"] == "tiny" and summary[0]["args"]["vocab_size"] == 256
    # what it printed: no progress bar into a pipe, the R x S the plain engine really uses (S = 1 although
    # torchrun's LOCAL_WORLD_SIZE = 2 is what the config's shards_per_replica="node" means) and the resolved
    # plan (every auto resolved), the summary
    assert "\r" not in stderr and "it/s" not in stderr, stderr[-2000:]
    head = next(line for line in stderr.splitlines() if line.startswith("method=co2"))
    assert "R x S = 2 x 1" in head and "replicas=2, shards=1" in head, head
    assert "stand_in='local'" in head and "sync_delay='measured'" in head and "collective='all_reduce'" in head, head
    pattern = (r"final val loss [0-9.]+ \(initial [0-9.]+\) \| 40 steps in [0-9.]+s \| [0-9,]+ tok/s \| "
               r"R x S = 2 x 1 \| 20 rounds \| rank 0: [0-9.]+ [kMG]?B sent, [0-9.]+s blocked")  # fmt: skip
    assert re.fullmatch(pattern, summary_line(stderr)), summary_line(stderr)
    s = summary[0]
    assert (s["steps_run"], s["resumed_at"], s["replicas"], s["shards"], s["rounds"]) == (40, None, 2, 1, 20)
    assert s["bytes_sent"] > 0 and s["wait_s"] >= 0


def test_summary_counts_every_exchange(tmp_path):
    """n rounds are n exchanges: the last one, launched at the last round end, finishes in finalize() and is
    counted too (a one-round run sent its average; it is no "0 B sent")."""
    flags = [*TINY, "--method", "co2", "--tau", "2", "--eval_every", "0"]
    (one, stderr), (three, _) = (run_job(tmp_path, [*flags, "--max_steps", str(n)]) for n in (2, 6))
    one, three = one[-1], three[-1]
    assert (one["rounds"], three["rounds"]) == (1, 3)
    assert one["bytes_sent"] >= 4 * one["n_params"]  # fp32 all_reduce over R = 2: 8 (R - 1) / R bytes per element
    assert three["bytes_sent"] == 3 * one["bytes_sent"], (one["bytes_sent"], three["bytes_sent"])
    assert f"| 1 round | rank 0: {one['bytes_sent'] / 1e3:.1f} kB sent" in summary_line(stderr), summary_line(stderr)


def test_one_process_warns_that_there_is_nothing_to_average(tmp_path):
    """Without torchrun the job is R x S = 1 x 1: said, as every other R = 1 grid is."""
    _, stderr = run_job(tmp_path, [*TINY, "--method", "co2", "--tau", "2", "--max_steps", "2"], ranks=1)
    assert "co2-train: one process (world size 1" in stderr and "nothing to average" in stderr, stderr[-3000:]
    _, stderr = run_job(tmp_path, [*TINY, "--method", "co2", "--tau", "2", "--max_steps", "2"])
    assert "nothing to average" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """DDP in one process on the token file: 24 steps of 8 windows (saving at step 8), the same as 2
    micro-batches of 4 (run as `python -m co2_zero.train`), and a run resumed from the step-8 checkpoint
    (no CO2 state: the job's own file)."""
    work = tmp_path_factory.mktemp("one_process")
    data = write_tokens(work / "tokens")
    flags = [*TINY, *TOKENS, "--data", str(data), "--method", "ddp", "--max_steps", "24", "--log_every", "8",
             "--eval_every", "1"]  # fmt: skip
    one = launch(work, [*flags, "--batch_size", "8", "--save_dir", "ckpt", "--save_every", "8"], ranks=1)
    accumulated = run_job(work, [*flags, "--batch_size", "4", "--grad_accum", "2"], ranks=1, module=True)[0]
    again = launch(work, [*flags, "--batch_size", "8", "--resume", "ckpt/step00000008"], ranks=1)
    return one, accumulated, again


def test_grad_accum_matches_one_big_batch(one_process):
    """--batch_size 4 --grad_accum 2 draws the same 8 windows per step as --batch_size 8 and averages
    their gradients (DDP's no_sync on the first micro-batch): the same trajectory up to float rounding.
    (AdamW does not see a constant gradient scale; what this checks is the windows, the direction of
    the gradient and the logged loss.)"""
    one, accumulated, _ = one_process
    one_steps, acc_steps = by_step(one), by_step(accumulated)
    assert sorted(one_steps) == sorted(acc_steps) == [0, 8, 16, 24]
    for step in (8, 16, 24):
        assert acc_steps[step]["loss"] == pytest.approx(one_steps[step]["loss"], rel=1e-5), step
        assert acc_steps[step]["tokens"] == one_steps[step]["tokens"] == step * 8 * 32
    assert accumulated[-1]["args"]["grad_accum"] == 2
    assert one[-1]["val_loss"] < one[0]["val_loss"] - 1.0  # the token file is learned


def test_resume_without_co2_continues_exactly(one_process):
    one, _, again = one_process
    first, rest = by_step(one), by_step(again)
    assert sorted(rest) == [8, 16, 24] and rest[8]["val_loss"] == first[8]["val_loss"]
    assert [rest[s]["loss"] for s in (16, 24)] == [first[s]["loss"] for s in (16, 24)]
    assert rest[16]["val_loss"] == first[16]["val_loss"] is not None
    assert again[-1]["val_loss"] == one[-1]["val_loss"]


RESUME_CASES = {
    "plain-co2": ["--engine", "plain", "--method", "co2"],
    "fairscale-co2": ["--engine", "fairscale", "--method", "co2", "--shards_per_replica", "1"],
    "deepspeed-co2": ["--engine", "deepspeed", "--method", "co2", "--shards_per_replica", "1"],
    "fsdp-co2": ["--engine", "fsdp", "--method", "co2", "--shards_per_replica", "1"],
}


def outcome(result: JobOutcome, out: Path, ok: bool = True) -> tuple[list[dict], str]:
    """A job run by launch_jobs (see run_job) -> (its JSON records, every rank's output). `ok`: it must
    succeed on every rank (else: it must fail on one, and the records are [])."""
    failed = any(code not in (0, None) for code in result.exitcodes)
    assert all(code == 0 for code in result.exitcodes) if ok else failed, result.report
    return ([json.loads(line) for line in out.read_text().splitlines()] if ok else []), result.report


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Per case: an uninterrupted run of 8 steps saving at 4 and 8, and a run resumed from step 4 (plain-co2
    also with --reshard); then fairscale's step-4 checkpoint (R x S = 2 x 1) resumed on R x S = 1 x 2,
    without and with --reshard.
    All in one torchrun launch of 2 ranks (tests.dist_utils.launch_jobs), each run in a process of its
    own -> per job name: (its JobOutcome, its JSON output file, its directory)."""
    root = tmp_path_factory.mktemp("resume")
    data = write_tokens(root / "tokens")
    common = [*TINY, *TOKENS, "--data", str(data), "--batch_size", "4", "--grad_accum", "2", "--tau", "2",
              "--max_steps", "8", "--eval_every", "1"]  # fmt: skip
    other_grid = [*common, "--engine", "fairscale", "--shards_per_replica", "2",
                  "--resume", str(root / "fairscale-co2" / "ckpt" / "step00000004")]  # fmt: skip
    planned = {}  # name -> (flags, directory), in the order they run
    for case, flags in RESUME_CASES.items():
        planned[f"{case}/straight"] = ([*common, *flags, "--save_dir", "ckpt", "--save_every", "4"], root / case)
        planned[f"{case}/again"] = (
            [*common, *flags, "--save_dir", "ckpt2", "--resume", "ckpt/step00000004"],
            root / case,
        )
    # the same checkpoint resharded onto the same 2 ranks: fresh inner state, as onto 4
    resharded = [*common, *RESUME_CASES["plain-co2"], "--resume", "ckpt/step00000004", "--reshard"]
    planned["plain-co2/resharded"] = (resharded, root / "plain-co2")
    planned["reshard/refused"] = (other_grid, root / "reshard")
    planned["reshard/taken"] = ([*other_grid, "--reshard"], root / "reshard")
    jobs = []
    for name, (flags, work) in planned.items():
        work.mkdir(exist_ok=True)
        jobs.append(([str(SCRIPT), *flags, "--out_json", str(work / f"{name.split('/')[1]}.jsonl")], work))
    (root / "launch").mkdir()
    ended = launch_jobs(jobs, 2, root / "launch", 240, _env())
    return {name: (end, Path(argv[-1]), work) for name, end, (argv, work) in zip(planned, ended, jobs)}


@pytest.fixture(scope="module")
def resumed(launched):
    """Per case: (its directory, the uninterrupted run's records, the resumed run's records, its output)."""
    runs = {}
    for case in RESUME_CASES:
        (straight, straight_out, work), (again, again_out, _) = launched[f"{case}/straight"], launched[f"{case}/again"]
        runs[case] = (work, outcome(straight, straight_out)[0], *outcome(again, again_out))
    return runs


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_continues_exactly(resumed, case):
    """Every engine's checkpoint, taken mid-run with a CO2 round in flight, continues the same run bit for
    bit: the data sampler, the LR schedule, the inner optimizer and the CO2 state all come back."""
    work, straight, again, _ = resumed[case]
    assert (work / "ckpt" / "latest").read_text() == "step00000008"
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == ["co2_run", "latest", "step00000004", "step00000008"]
    assert len(list((work / "ckpt" / "step00000004").glob("*rank*"))) == 2  # a file per rank, no nesting
    first, rest = by_step(straight), by_step(again)
    assert min(rest) == 4 and rest[4]["val_loss"] == first[4]["val_loss"]  # the resumed model
    assert [s for s in first if s > 4] == [s for s in rest if s > 4] and max(rest) == 8
    for step in (s for s in rest if s > 4):
        assert rest[step]["loss"] == first[step]["loss"], (case, step)
        assert rest[step]["val_loss"] == first[step]["val_loss"], (case, step)
    assert again[-1]["val_loss"] == straight[-1]["val_loss"]
    assert again[-1]["steps"] == straight[-1]["steps"] == 8
    assert straight[-1]["val_loss"] < straight[0]["val_loss"]


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resumed_summary_counts_only_its_own_steps(resumed, case):
    """A run resumed at step 4 of 8 ran 4 steps: its summary says so, and where it resumed."""
    _, straight, again, stderr = resumed[case]
    assert " | 4 steps (resumed at step 4) in " in summary_line(stderr), summary_line(stderr)
    assert (again[-1]["steps_run"], again[-1]["resumed_at"]) == (4, 4)
    assert (straight[-1]["steps_run"], straight[-1]["resumed_at"]) == (8, None)
    assert again[-1]["tokens_per_s"] > 0


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_the_header_names_the_dtype_it_trains_in(resumed, case):
    """--dtype left to the engine (deepspeed: its config's precision) is named as trained, not as None."""
    head = next(line for line in resumed[case][3].splitlines() if "method=co2 engine=" in line)
    assert " dtype=float32 " in head, head


def test_resume_with_another_grid_needs_and_takes_reshard(resumed, launched):
    """fairscale's checkpoint of R x S = 2 x 1 on R x S = 1 x 2: refused without --reshard (saying which
    flag loads it), loaded with it; training goes on from step 4 and learns."""
    straight = resumed["fairscale-co2"][1]
    _, refused = outcome(*launched["reshard/refused"][:2], ok=False)
    assert "with this job: --reshard" in refused, refused[-3000:]
    records, stderr = outcome(*launched["reshard/taken"][:2])
    assert "at step 4 (resharded)" in stderr and "R x S = 1 x 2" in stderr, stderr[-3000:]
    assert min(by_step(records)) == 4 and records[-1]["steps_run"] == 4 and records[-1]["shards"] == 2
    assert math.isfinite(records[-1]["val_loss"]) and records[-1]["val_loss"] < straight[0]["val_loss"]


@pytest.mark.slow  # a 4-rank launch: about half a minute on 2 loaded cores
def test_a_resharded_resume_onto_more_ranks_gives_the_new_ranks_their_own_data(resumed, launched, tmp_path):
    """plain-co2's step-4 checkpoint of 2 ranks resharded onto 4: ranks 2 and 3 read their own streams, not
    replays of ranks 0 and 1, so the mean loss of the first step logged after it differs from that of the
    same checkpoint resharded onto 2 (with replays every loss was the same); training goes on and learns."""
    work, straight, _, _ = resumed["plain-co2"]
    again = outcome(*launched["plain-co2/resharded"][:2])[0]
    flags = [*TINY, *TOKENS, "--data", str(work.parent / "tokens"), "--batch_size", "4", "--grad_accum", "2",
             "--tau", "2", "--max_steps", "8", "--eval_every", "1", *RESUME_CASES["plain-co2"],
             "--resume", str(work / "ckpt" / "step00000004"), "--reshard"]  # fmt: skip
    records, stderr = run_job(tmp_path, flags, ranks=4, timeout=400)
    assert "at step 4 (resharded)" in stderr and "R x S = 4 x 1" in stderr, stderr[-3000:]
    onto_four, onto_two = by_step(records), by_step(again)
    assert min(onto_four) == 4 and onto_four[4]["val_loss"] == onto_two[4]["val_loss"]  # the same model at step 4
    after = min(s for s in onto_two if s > 4)  # the first step logged after the resume
    assert sorted(onto_four) == sorted(onto_two) and onto_four[after]["loss"] != onto_two[after]["loss"], after
    assert math.isfinite(records[-1]["val_loss"]) and records[-1]["val_loss"] < straight[0]["val_loss"]


def test_a_resharded_resume_puts_each_rank_where_an_uninterrupted_run_reads(tmp_path):
    """In process: 2 ranks' data samplers saved at step 5 and restored on 4 ranks at step 4 (the last round
    start, where a resharded run resumes): every rank reads from there what an uninterrupted 4-rank run
    reads, and ranks 2 and 3 read other batches than ranks 0 and 1. The same world restores the saved
    position itself."""
    args = train_args.get_args([*TINY, *TOKENS, "--data", str(write_tokens(tmp_path / "tokens"))])

    def after(rank: int, steps: int) -> train_data.Batches:
        batches = train_data.Batches(args, rank, torch.device("cpu"))
        for _ in range(steps):
            batches.micro_batches()
        return batches

    saved = [train_checkpoints.rng_state(after(rank, 5).gen) for rank in range(2)]
    read = []
    for rank in range(4):
        resumed = after(rank, 0)
        train_checkpoints.restore_data_position(resumed, saved[rank % 2], 4, resharded=True)
        read.append(resumed.micro_batches())
        assert same(read[-1], after(rank, 4).micro_batches()), rank
    assert not same(read[2], read[0]) and not same(read[3], read[1])
    exact = after(1, 0)
    train_checkpoints.restore_data_position(exact, saved[1], 5, resharded=False)
    assert same(exact.micro_batches(), after(1, 5).micro_batches())


def test_engines_agree_when_every_rank_is_a_replica(resumed):
    """S = 1: plain CO2Optimizer, CO2OSS, DeepSpeed ZeRO and FSDP2 run the same algorithm on the same data."""
    finals = {case: resumed[case][1][-1]["val_loss"] for case in RESUME_CASES if case.endswith("co2")}
    reference = finals["plain-co2"]
    assert all(v == pytest.approx(reference, rel=1e-5) for v in finals.values()), finals


# ---- in process -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from /proc (Linux)")
@pytest.mark.parametrize("method", ["co2", "none"])
def test_no_process_group_outlives_the_job(tmp_path, method):
    """Once the job has returned, none of its gloo groups is alive: one alive then ends with the
    interpreter, where its threads can abort the process (torch._dynamo imported after the world group
    kept that group; reference cycles kept the CO2 groups)."""
    worker = ROOT / "tests" / "workers" / "threads_after_job.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    flags = ["--method", method, "--tau", "2", "--max_steps", "4", *TINY]
    proc = subprocess.run([*launcher, str(worker), str(tmp_path), *flags], check=False, cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    alive = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)}
    assert alive == {0: [], 1: []}


def test_model_presets_and_overrides():
    default = train_args.get_args([])
    shape = (default.model, default.n_layer, default.n_head, default.n_embd, default.block_size, default.vocab_size)
    assert shape == ("tiny", 3, 4, 128, 64, 256)
    assert (default.device, default.dtype, default.grad_accum) == ("cpu", "float32", 1)
    expected = {"gpt2": (12, 768, 12, 124e6), "gpt2-medium": (24, 1024, 16, 355e6),
                "gpt2-large": (36, 1280, 20, 774e6), "gpt2-xl": (48, 1600, 25, 1558e6)}  # fmt: skip
    for name, (layers, width, heads, params) in expected.items():
        args = train_args.get_args(["--model", name, "--data", "somewhere"])
        shape = (args.n_layer, args.n_embd, args.n_head, args.block_size, args.vocab_size)
        assert shape == (layers, width, heads, 1024, 50304), name
        with torch.device("meta"):
            model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01), name
    args = train_args.get_args(["--model", "gpt2", "--n_layer", "2", "--block_size", "128", "--device", "cuda"])
    assert (args.n_layer, args.n_embd, args.block_size, args.vocab_size, args.dtype) == (2, 768, 128, 256, "bfloat16")
    with pytest.raises(SystemExit):
        train_args.get_args(["--n_embd", "30", "--n_head", "4"])
    for refused in (["--reshard"], ["--resume", "x", "--reshard", "--method", "ddp"]):
        with pytest.raises(SystemExit):
            train_args.get_args(refused)


def test_help_shows_every_default():
    """Every flag of --help says its default: the value, or in words where it depends on other flags."""
    parser = train_args.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help" and action.help != "==SUPPRESS==":
            text = formatter._get_help_string(action) % {"default": action.default}
            assert action.help and "default" in text and "default: None" not in text, (action.dest, text)
    assert "(default: 320)" in " ".join(parser.format_help().split())  # --max_steps, as printed


def test_co2_settings_precedence(tmp_path):
    """CO2Config's defaults < the deepspeed config's co2 section < the --method preset < the flags."""
    config = json.loads((ROOT / "configs" / "ds_zero2_co2.json").read_text())
    config["co2"] = {"tau": 5, "outer_momentum": 0.3, "gap_penalty": {"mode": "constant", "value": 2.0}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    ds = ["--engine", "deepspeed", "--deepspeed_config", str(path)]
    c = train_args.co2_config(train_args.get_args(ds))
    assert (c.tau, c.outer_momentum, c.gap_penalty.mode, c.gap_penalty.value, c.timeout_s) == (
        5, 0.3, "constant", 2.0, 600.0
    )  # fmt: skip
    c = train_args.co2_config(train_args.get_args([*ds, "--method", "slowmo", "--gap_value", "3"]))
    assert (c.tau, c.outer_momentum, c.overlap, c.gap_penalty.mode, c.gap_penalty.value) == (5, 0.5, False, "none", 3)
    flags = ["--tau", "7", "--gap_penalty", "adaptive", "--clip", "norm", "--stand_in", "shared"]
    c = train_args.co2_config(train_args.get_args([*ds, *flags]))
    assert (c.tau, c.outer_momentum, c.gap_penalty.mode, c.clip.mode, c.stand_in) == (
        7,
        0.3,
        "adaptive",
        "norm",
        "shared",
    )
    c = train_args.co2_config(train_args.get_args(["--deepspeed_config", str(path)]))  # engine plain: file unused
    assert c == CO2Config()  # CO2Config's defaults
    published = train_args.co2_config(train_args.get_args(["--method", "co2_published", "--comm_dtype", "bf16"]))
    assert published == CO2Config(**PUBLISHED, comm_dtype="bf16")  # the preset, then the flags
    local = train_args.co2_config(train_args.get_args(["--stand_in", "local", "--sync_delay", "3", "--tau", "8"]))
    assert (local.stand_in, local.sync_delay) == ("local", 3)
    assert train_args.co2_config(train_args.get_args(["--sync_delay", "auto"])).sync_delay == "auto"


def test_token_files_are_read_as_uint16(tmp_path):
    data = write_tokens(tmp_path)
    train, val = train_data.load_tokens(data)
    assert train.dtype == torch.uint16 and (len(train), len(val)) == (50_000, 10_000)
    assert train[:4].tolist() == [300, 307, 314, 321] and val[0].item() == 300 + (7 * 50_000) % 50
    x, y = train_data.get_batch(train, 3, 16, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((y - 300) % 50, (x - 300 + 7) % 50)  # the next id of the cycle
    with pytest.raises(ValueError, match="--vocab_size=256 is too small"):
        train_data.check_vocab(x, y, 256)
    (data / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no val.bin"):
        train_data.load_tokens(data)


def test_events_log_and_stop_file(tmp_path):
    """--events_jsonl logs every step, the start and the final parameter digest; --stop_file ends the run
    at the round end it names (how scripts/bench_elastic.py ends every replica at one step)."""
    from co2_zero.train.events import stop_step

    stop, events = tmp_path / "stop", tmp_path / "events.jsonl"
    stop.write_text("8")
    flags = [*TINY, "--tau", "4", "--max_steps", "40", "--events_jsonl", str(events), "--stop_file", str(stop)]
    records, stderr = run_job(tmp_path, flags, ranks=1)
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["start"] + ["step"] * 8 + ["final"]
    assert [e["step"] for e in logged[1:-1]] == list(range(1, 9))
    assert all(e["replicas"] == 1 and e["quorum"] == [0] for e in logged[1:-1])
    assert logged[-1]["step"] == records[-1]["steps"] == 8 and len(logged[-1]["digest"]) == 64
    assert f"--stop_file {stop}: stopping at step 8" in stderr
    assert stop_step(None) is None and stop_step(str(tmp_path / "absent")) is None
    stop.write_text("eight")
    with pytest.raises(ValueError, match="accepted: a step number"):
        stop_step(str(stop))


def test_parameter_digest_needs_no_numpy(monkeypatch):
    """The base install has no numpy: the end-of-run digest must give the same hash without it."""
    from co2_zero.train.events import parameter_digest

    parameters = [torch.randn(3, 5), torch.arange(7, dtype=torch.float64)[2:]]
    with_numpy = parameter_digest(parameters)

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert parameter_digest(parameters) == with_numpy
    assert parameter_digest(parameters[:1]) != with_numpy
