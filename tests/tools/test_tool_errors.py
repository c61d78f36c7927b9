"""A user's mistake on the command line ends in one line, printed once (rank 0), and exit status 2: a refused
flag or CO2 setting, a --max_steps shorter than a round, a --resume that names nothing, a damaged checkpoint, a
resume with another co2 config (naming the fields that differ, both values); one process and torchrun with 2
ranks; a traceback only with --debug (co2_zero/train/cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from co2_zero.core.errors import CO2Error, refusal
from co2_zero.train import args as train_args
from co2_zero.train import cli, ds_config
from tests.tools.test_train_lm_smoke import SCRIPT, TINY, _env

LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
OUR_FRAME = "co2_zero/"  # a traceback frame of our code names its file: File ".../co2_zero/..."


def job(workdir: Path, flags: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    """The training job, one process or torchrun with 2 ranks, output captured."""
    cmd = [*(LAUNCH if ranks > 1 else [sys.executable]), str(SCRIPT), *TINY, *flags]
    return subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=240, check=False)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "train_lm.py: error:" in line]


def assert_one_line(proc: subprocess.CompletedProcess, *words: str, ranks: int = 1) -> str:
    """Exactly one error line (naming `words`), no frame of our code, exit status 2 (torchrun: the rank's)."""
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr[-6000:]
    assert not any(f"{OUR_FRAME}" in line and "File " in line for line in proc.stderr.splitlines()), proc.stderr
    assert all(word in lines[0] for word in words), lines[0]
    if ranks == 1:
        assert proc.returncode == 2, proc.stderr[-3000:]
    else:  # torchrun exits 1 for any failed child; the child's own status is in its summary
        assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    return lines[0]


FLAG_CASES = {
    "comm_dtype": (["--comm_dtype", "int3"], ("comm_dtype='int3'", "accepted:")),
    "topk": (["--topk", "0"], ("topk=0.0", "accepted:")),
    "short_run": (["--tau", "64", "--max_steps", "32"], ("--max_steps=32", "accepted:")),
    "resume_missing": (["--resume", "ck_missing"], ("--resume ck_missing", "accepted:")),
    "bad_choice": (["--method", "nope"], ("--method", "nope")),
    "deepspeed_config": (["--engine", "deepspeed", "--deepspeed_config", "nope.json"], ("nope.json", "accepted:")),
}


@pytest.mark.parametrize("case", FLAG_CASES)
def test_a_refused_flag_is_one_line_from_one_process(tmp_path, case):
    flags, words = FLAG_CASES[case]
    proc = job(tmp_path, flags)
    assert_one_line(proc, *words)
    assert "usage:" not in proc.stderr  # the usage is --help's, not every error's


@pytest.mark.parametrize("case", ["comm_dtype", "short_run"])
def test_a_refused_flag_is_one_line_under_torchrun(tmp_path, case):
    flags, words = FLAG_CASES[case]
    assert_one_line(job(tmp_path, flags, ranks=2), *words, ranks=2)


def test_a_setting_refused_after_the_process_group_is_one_line_under_torchrun(tmp_path):
    """replica_tau's length is checked against R, known once the group exists: still one line."""
    proc = job(tmp_path, ["--replica_tau", "16,8,4", "--tau", "16", "--max_steps", "16"], ranks=2)
    assert_one_line(proc, "replica_tau=[16, 8, 4]", "accepted:", ranks=2)


def test_debug_shows_the_traceback(tmp_path):
    proc = job(tmp_path, ["--comm_dtype", "int3", "--debug"])
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "comm_dtype='int3'" in proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank run of 8 steps (tau 4) that saved checkpoints at steps 4 and 8."""
    work = tmp_path_factory.mktemp("saved")
    flags = ["--tau", "4", "--max_steps", "8", "--save_dir", "ckpt", "--save_every", "4"]
    proc = job(work, flags, ranks=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work


def test_a_resume_with_another_config_names_the_fields_and_both_values(saved):
    flags = ["--tau", "4", "--outer_lr", "0.3", "--max_steps", "12", "--resume", "ckpt/step00000004"]
    line = assert_one_line(job(saved, flags, ranks=2), ranks=2)
    assert "co2 config fields differ (checkpoint -> here): outer_lr 0.5 -> 0.3;" in line, line  # only that one


def test_a_resharded_resume_with_another_config_names_the_fields_too(saved):
    flags = ["--tau", "4", "--outer_lr", "0.3", "--max_steps", "12", "--resume", "ckpt/step00000004", "--reshard"]
    line = assert_one_line(job(saved, flags, ranks=2), ranks=2)
    assert "co2 config fields differ (checkpoint -> here): outer_lr 0.5 -> 0.3;" in line, line
    assert "resharding needs the same co2 config" in line, line


def test_a_damaged_checkpoint_is_one_line_under_torchrun(saved, tmp_path):
    damaged = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(saved / "ckpt"), str(damaged)], check=True)
    rank_file = next((damaged / "step00000004").glob("co2_rank00001.*.pt"))
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    flags = ["--tau", "4", "--max_steps", "12", "--resume", str(damaged / "step00000004")]
    assert_one_line(job(tmp_path, flags, ranks=2), "rank 1", "damaged", ranks=2)


# ---- --engine deepspeed keeps what its config says (co2_zero/train/ds_config.py) ------------------------------

SHIPPED = {"batch_size": 4, "grad_accum": 2, "grad_clip": 1.0, "lr": 0.001, "weight_decay": 0.1, "beta2": 0.95}


def test_the_deepspeed_config_settles_every_flag_left_at_its_default():
    """The shipped config (micro-batch 4, accumulation 2, lr 0.001, WarmupDecayLR) runs as written."""
    args = train_args.get_args(["--engine", "deepspeed"])
    assert {name: getattr(args, name) for name in SHIPPED} == SHIPPED
    config = ds_config.deepspeed_config(args, None, {"lr": args.lr})
    assert config["scheduler"]["type"] == "WarmupDecayLR" and config["gradient_accumulation_steps"] == 2
    assert config["optimizer"]["params"]["lr"] == 0.001


def test_a_flag_given_replaces_the_config_value_and_says_so(recwarn):
    args = train_args.get_args(["--engine", "deepspeed", "--lr", "0.003", "--batch_size", "8"])
    said = " ".join(str(w.message) for w in recwarn)
    assert "--lr 0.003 replaces the config's optimizer.params.lr=0.001" in said, said
    assert "--batch_size 8 replaces the config's train_micro_batch_size_per_gpu=4" in said, said
    assert "scheduler (WarmupDecayLR)" in said, said
    assert (args.lr, args.batch_size, args.grad_accum) == (0.003, 8, 2)  # --grad_accum not given: the config's
    config = ds_config.deepspeed_config(args, None, {"lr": args.lr})
    assert "scheduler" not in config and config["train_micro_batch_size_per_gpu"] == 8


def test_given_flags_are_those_on_the_command_line():
    parser = train_args.build_parser()
    assert train_args.given_flags(parser, ["--lr", "0.003", "--no-overlap", "--stand_in", "local"]) == [
        "lr",
        "overlap",
        "stand_in",
    ]
    assert train_args.given_flags(parser, []) == []


@pytest.mark.parametrize("script", ["bench_wire", "bench_throughput"])
def test_a_benchmark_script_refuses_a_flag_in_one_line(tmp_path, script):
    cmd = [sys.executable, "-m", f"scripts.{script}", "--no_such_flag"]
    proc = subprocess.run(cmd, cwd=SCRIPT.parents[1], env=_env(), capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}.py: error: unrecognized arguments: --no_such_flag"), lines[0]


def _refuse(argv):
    raise ValueError("comm_dtype='int3' is invalid; accepted: 'fp32' | 'int8'")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_rank_0_prints_at_once_another_rank_only_when_still_running(rank, monkeypatch, capsys):
    """Rank 0's line ends the launch (torchrun ends the others); a rank still running after the wait names itself:
    the refusal was its own, and without its line the launch would end with no word on why."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "RANK_0_FIRST_S", 0.0)
    assert cli.run_tool("co2-train", _refuse, []) == 2
    err = capsys.readouterr().err
    who = "error" if rank == "0" else "error (rank 1)"
    assert err == f"co2-train: {who}: comm_dtype='int3' is invalid; accepted: 'fp32' | 'int8'\n", err


def test_debug_lets_the_error_through(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="int3"):
        cli.run_tool("co2-train", _refuse, ["--debug"])


def test_a_refused_load_is_the_users_a_failed_exchange_is_not(monkeypatch, capsys):
    """A checkpoint load that refused (`CO2Error.refused`) is one line; a CO2Error of a failure keeps its traceback."""
    monkeypatch.setenv("RANK", "0")

    def refused(argv):
        raise refusal("co2 checkpoint load from ckpt refused: nothing there")

    def failed(argv):
        raise CO2Error("co2: round 2: the background exchange failed")

    assert cli.run_tool("co2-train", refused, []) == 2
    assert capsys.readouterr().err == "co2-train: error: co2 checkpoint load from ckpt refused: nothing there\n"
    with pytest.raises(CO2Error, match="round 2"):
        cli.run_tool("co2-train", failed, [])
