"""The training job elastic (docs/elastic-job.md, "The training job"): `python -m co2_zero.train --lighthouse`.

Real processes: a torchft Lighthouse (tests/elastic/test_elastic.py's) and one `python -m co2_zero.train` per
replica, each its own world (one rank, or a torchrun of 2 ranks with --engine fsdp), a tiny model. Two
replicas train together and end on one model (plain, and FSDP2 with S = 2); a replica that leaves is
reported as a membership change; an elastic job of 2 replicas saves, stops, and a job of 3 replicas
resumes from that checkpoint with identical round starts. Flags that cannot run elastically are refused
at parsing (in process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from co2_zero.train import args as train_args
from co2_zero.train import checkpoints as train_checkpoints
from co2_zero.train import data as train_data
from co2_zero.train import engines as train_engines
from co2_zero.train import loop as train_loop
from co2_zero.train import state as train_state
from tests.elastic.test_elastic import _lighthouse
from tests.tools.test_train_lm_smoke import ROOT, TINY

pytest.importorskip("torchft", reason="the elastic extra (torchft) is not installed")

# the defaults (--method co2: the local stand-in), at a short round
ELASTIC = [*TINY, "--method", "co2", "--tau", "4", "--timeout_s", "120", "--eval_every", "1"]


class Replicas:
    """A Lighthouse and `python -m co2_zero.train` replicas in a work directory; all killed at the end."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.lighthouse, self.address = _lighthouse()
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, replica: int, flags: list[str], name: str = "", ranks: int = 1) -> str:
        """Launch replica `replica` with `flags` (one plain process, or torchrun with `ranks` ranks: the
        replica's own world); returns its name (its log files' stem)."""
        name = name or f"replica{replica}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.pop("WORLD_SIZE", None)  # a world of its own
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        cmd = [*(torchrun if ranks > 1 else [sys.executable]), "-m", "co2_zero.train", *ELASTIC, *flags,
               "--lighthouse", self.address, "--replica_id", str(replica),
               "--out_json", str(self.work / f"{name}.jsonl")]  # fmt: skip
        with open(self.work / f"{name}.err", "w") as err:
            self.running[name] = subprocess.Popen(cmd, cwd=self.work, env=env, stdout=subprocess.DEVNULL, stderr=err)
        return name

    def wait(self, timeout: float = 400) -> dict[str, tuple[list[dict], str]]:
        """Wait for every replica started; each must succeed -> {name: (its JSON records, its stderr)}."""
        results = {}
        for name, process in self.running.items():
            process.wait(timeout=timeout)
            stderr = (self.work / f"{name}.err").read_text()
            assert process.returncode == 0, f"{name} failed:\n{stderr[-4000:]}"
            records = [json.loads(line) for line in (self.work / f"{name}.jsonl").read_text().splitlines()]
            results[name] = (records, stderr)
        self.running = {}
        return results

    def close(self) -> None:
        for process in self.running.values():
            process.kill()
            process.wait()
        self.lighthouse.kill()
        self.lighthouse.wait()


@pytest.fixture
def replicas(tmp_path):
    made: list[Replicas] = []

    def make() -> Replicas:
        made.append(Replicas(tmp_path))
        return made[-1]

    yield make
    for job in made:
        job.close()


def _summary(records: list[dict]) -> dict:
    return next(r for r in records if r.get("summary"))


def _by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if not r.get("summary")}


def test_two_replicas_train_together_and_end_on_one_model(replicas):  # the default run's elastic job
    """Two replicas of the job, each its own launch, start together (--start_replicas 2), read their own
    data (their inner losses differ) and end on one model: the same final val loss, no membership change."""
    job = replicas()
    names = [job.start(r, ["--max_steps", "16", "--start_replicas", "2"]) for r in (0, 1)]
    results = job.wait()
    (records0, stderr0), (records1, stderr1) = (results[n] for n in names)
    s0, s1 = _summary(records0), _summary(records1)
    assert s0["val_loss"] == s1["val_loss"] and s0["val_loss"] < s0["initial_val_loss"]
    assert (s0["steps"], s0["replicas"], s0["membership_changes"], s0["joined_at"]) == (16, 2, [], None)
    assert (s1["replica_id"], s1["membership_changes"]) == (1, [])
    losses0 = [r["loss"] for s, r in sorted(_by_step(records0).items()) if s > 0]
    losses1 = [r["loss"] for s, r in sorted(_by_step(records1).items()) if s > 0]
    assert len(losses0) == 4 and losses0 != losses1  # each replica its own stream
    assert "elastic: replica 0 of the job at http://" in stderr0
    assert stderr0.rstrip().endswith("| membership: no changes"), stderr0[-500:]
    for stderr in (stderr0, stderr1):  # torchft's noise on CPU (co2_zero/elastic/quiet.py): none of it shown
        noise = [line for line in stderr.splitlines() if any(n in line for n in TORCHFT_NOISE)]
        assert not noise, noise


TORCHFT_NOISE = ("Unable to reset NCCL flight recorder", '"GET /checkpoint/', "The given buffer is not writable")


@pytest.mark.slow
def test_a_replica_that_leaves_is_reported_as_it_happens(replicas):
    """Replica 1 stops after 2 rounds: its finalize() meets replica 0's round-2 quorum (contributing
    nothing), then leaves. Replica 0 goes on alone from round 3, prints the change when that round
    end's quorum has one replica, and lists it in the summary line and record. torchft's per-round INFO
    logs stay off the console (they were written piecemeal into its lines)."""
    job = replicas()
    r0 = job.start(0, ["--max_steps", "24", "--start_replicas", "2"])
    job.start(1, ["--max_steps", "8", "--start_replicas", "2"])
    records, stderr = job.wait()[r0]
    summary = _summary(records)
    assert summary["membership_changes"] == ["replicas 2 -> 1 at round 3"], summary["membership_changes"]
    assert summary["replicas"] == 1 and summary["steps"] == 24
    lines = stderr.splitlines()
    assert not [line for line in lines if "[INFO] [torchft" in line], "torchft's INFO logs cut into the job's lines"
    change = lines.index("replicas 2 -> 1 at round 3")
    assert any(line.startswith("step 24 |") for line in lines[change:]), "the change was not printed as it happened"
    assert lines[-1].endswith("| membership: replicas 2 -> 1 at round 3"), lines[-1]


@pytest.mark.slow
def test_two_fsdp2_replicas_of_two_ranks_train_together_and_end_on_one_model(replicas):
    """--engine fsdp runs elastically: two replicas, each a torchrun of 2 ranks (S = 2, one FSDP2 mesh),
    start together and end on one model."""
    job = replicas()
    flags = ["--engine", "fsdp", "--max_steps", "8", "--start_replicas", "2"]
    names = [job.start(r, flags, ranks=2) for r in (0, 1)]
    results = job.wait()
    (records0, stderr0), (records1, _) = (results[n] for n in names)
    s0, s1 = _summary(records0), _summary(records1)
    assert s0["val_loss"] == s1["val_loss"] and s0["val_loss"] < s0["initial_val_loss"]
    assert (s0["steps"], s0["replicas"], s0["shards"], s0["membership_changes"]) == (8, 2, 2, []), s0
    assert "elastic: replica 0 of the job at http://" in stderr0


def _co2_file(directory: Path) -> dict:
    """The one rank file of a launch's checkpoint directory (a world of one rank)."""
    (path,) = directory.glob("co2_rank00000.*.pt")
    return torch.load(path, weights_only=True)


def test_a_second_elastic_job_in_another_jobs_save_dir_is_refused_and_its_checkpoints_stay(replicas):
    """Issue 66, elastic: the replicas of a job share one run id (drawn by one, spread by the start's heal)
    and claim --save_dir with it, so a second job (another seed, fresh) given the same directory is refused
    on every replica, naming the first job's run, and not one file of the first job's changes."""
    save = ["--save_dir", "ckpt", "--save_every", "4", "--max_steps", "8", "--start_replicas", "2"]
    first = replicas()
    for r in (0, 1):
        first.start(r, save)
    first.wait()
    ckpt = first.work / "ckpt"
    owner = (ckpt / "co2_run").read_text().strip()
    assert {_co2_file(ckpt / f"replica{r}" / "step00000008")["co2"]["run_id"] for r in (0, 1)} == {owner}
    before = {path: path.read_bytes() for path in ckpt.rglob("*") if path.is_file()}
    first.close()

    second = replicas()
    names = [second.start(r, [*save, "--seed", "7"], name=f"other{r}") for r in (0, 1)]
    for name in names:
        process = second.running.pop(name)
        process.wait(timeout=400)
        stderr = (second.work / f"{name}.err").read_text()
        assert process.returncode == 2 and f"holds the checkpoints of run {owner}" in stderr, stderr[-3000:]
        assert "latest: replica0/step00000008)" in stderr and "--resume ckpt/replica<N>/step<k>" in stderr, stderr
    assert {path: path.read_bytes() for path in ckpt.rglob("*") if path.is_file()} == before


@pytest.mark.slow
def test_a_job_of_three_replicas_resumes_from_a_job_of_two(replicas):
    """An elastic job of 2 replicas saves at step 8 (a round boundary; each replica into its own
    subdirectory) and ends. A new job of 3 replicas with --resume loads the newest checkpoint any
    replica completed (replica 0's, the lowest id among equal steps) on every replica, starts where
    replica 0 was (the same val loss as its at step 8) and trains on: at step 12 the
    three replicas' checkpoints hold the identical shared CO2 state (each its own stand-in as its
    parameters), and they end on one model."""
    first = replicas()
    save = ["--save_dir", "ckpt", "--save_every", "8"]
    names = [first.start(r, ["--max_steps", "12", "--start_replicas", "2", *save]) for r in (0, 1)]
    before = first.wait()
    val_at_8 = _by_step(before[names[0]][0])[8]["val_loss"]
    assert _by_step(before[names[1]][0])[8]["val_loss"] != val_at_8  # each replica's own stand-in is evaluated
    ckpt = first.work / "ckpt"
    assert [(ckpt / f"replica{r}" / "latest").read_text() for r in (0, 1)] == ["step00000008"] * 2
    first.close()

    second = replicas()
    resume = ["--max_steps", "16", "--start_replicas", "3", "--save_dir", "ckpt", "--save_every", "12", "--resume"]
    names = [second.start(r, resume, name=f"again{r}") for r in (0, 1, 2)]
    after = second.wait()
    for name in names:
        records, stderr = after[name]
        assert f"resumed from {Path('ckpt', 'replica0', 'step00000008')} at step 8" in stderr, stderr[-2000:]
        assert _by_step(records)[8]["val_loss"] == val_at_8, name
        assert _summary(records)["replicas"] == 3 and _summary(records)["membership_changes"] == []
    assert len({_summary(after[name][0])["val_loss"] for name in names}) == 1
    saved = [_co2_file(ckpt / f"replica{r}" / "step00000012") for r in (0, 1, 2)]
    for r, state in enumerate(saved[1:], 1):
        for key in ("start_point", "next_start", "momentum"):
            assert torch.equal(state["co2"][key], saved[0]["co2"][key]), f"replica {r}: {key} differs"
        assert state["co2"]["stand_in"] == "local" and not torch.equal(
            state["co2"]["own_start"], saved[0]["co2"]["own_start"]
        )
        assert state["co2"]["inner_steps"] == 12 and state["co2"]["rounds"] == 3


# ---- in process: the flags, the data stream, the checkpoint choice ------------------------------------------


ELASTIC_FLAGS = ["--lighthouse", "http://localhost:29510", "--replica_id", "0"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--engine", "deepspeed", *ELASTIC_FLAGS], "--engine deepspeed"),
        (["--engine", "fairscale", *ELASTIC_FLAGS], "--engine fairscale"),
        (["--method", "ddp", *ELASTIC_FLAGS], "--method ddp"),
        (["--method", "none", *ELASTIC_FLAGS], "--method none"),
        (["--method", "diloco", *ELASTIC_FLAGS], "--method diloco (overlap off)"),
        (["--no-overlap", *ELASTIC_FLAGS], "--method co2 (overlap off)"),
    ],
)
def test_flags_that_cannot_run_elastically_are_refused_naming_what_is_supported(capsys, flags, named):
    with pytest.raises(SystemExit):
        train_args.get_args(flags)
    err = capsys.readouterr().err
    assert f"--lighthouse with {named} is not supported" in err, err
    assert "--engine plain" in err and "--engine fsdp" in err and "--method co2" in err, err
    assert "FairScale and DeepSpeed take no membership" in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lighthouse", "http://localhost:1"], "--lighthouse needs --replica_id"),
        (["--replica_id", "3"], "--replica_id: elastic training's; accepted: together with --lighthouse"),
        (["--start_replicas", "2"], "--start_replicas: elastic training's"),
        ([*ELASTIC_FLAGS, "--start_replicas", "0"], "--start_replicas=0 is invalid"),
    ],
)
def test_elastic_flags_without_their_partner_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        train_args.get_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["plain", "fsdp"])
def test_elastic_flags_that_can_run_are_accepted(engine):
    flags = ["--engine", engine, *ELASTIC_FLAGS, "--start_replicas", "3"]  # the defaults, --method co2
    args = train_args.get_args(flags)
    assert (args.engine, args.lighthouse, args.replica_id, args.start_replicas) == (
        engine,
        "http://localhost:29510",
        0,
        3,
    )


def test_a_stream_sought_to_a_step_reads_what_it_would_have_read(tmp_path):
    """Batches.seek(k) puts a replica's stream (by replica id) where k steps of training leave it."""
    args = train_args.get_args([*TINY, "--data_bytes", "20000"])
    stream = train_data.elastic_stream(replica_id=2, rank=0, world=1)
    cpu = torch.device("cpu")
    trained = train_data.Batches(args, stream, cpu)
    for _ in range(3):
        trained.micro_batches()
    sought = train_data.Batches(args, stream, cpu)
    sought.seek(3)
    for (x, y), (x2, y2) in zip(trained.micro_batches(), sought.micro_batches()):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    other = train_data.Batches(args, train_data.elastic_stream(1, 0, 1), cpu)
    assert not torch.equal(other.micro_batches()[0][0], train_data.Batches(args, stream, cpu).micro_batches()[0][0])


def test_a_restart_resumes_from_the_newest_checkpoint_of_any_replica(tmp_path):
    for replica, steps in ((0, [8]), (1, [8, 16]), (2, [16]), (3, [4])):
        for step in steps:
            (tmp_path / f"replica{replica}" / f"step{step:08d}").mkdir(parents=True)
        (tmp_path / f"replica{replica}" / "latest").write_text(f"step{steps[-1]:08d}")
    assert train_checkpoints.newest_replica_checkpoint(tmp_path) == tmp_path / "replica1" / "step00000016"
    with pytest.raises(FileNotFoundError, match="replica<N>/latest"):
        train_checkpoints.newest_replica_checkpoint(tmp_path / "nothing")


def test_a_joined_replica_starts_at_the_jobs_step_with_its_lr_schedule():
    """A replica that received the job's state (inner_steps = 12) starts at step 12, and its LR schedule
    is where 12 steps put it; a fresh replica (inner_steps = 0) starts at 0 and loads --resume."""
    args = train_args.get_args([*TINY, *ELASTIC_FLAGS, "--max_steps", "40"])
    model = torch.nn.Linear(2, 2)
    stepped = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched, _ = train_engines._scheduled(args, stepped, float)
    for _ in range(12):
        stepped.step()
        sched.step()
    jumped, _ = train_engines._scheduled(args, torch.optim.AdamW(model.parameters(), lr=args.lr), float)
    train_engines._fast_forward(jumped, 12)
    assert jumped.get_last_lr() == sched.get_last_lr() and jumped.last_epoch == 12
    console = train_state.Console(master=False, out_json=None, progress=False)
    for inner_steps, expected in ((12, 12), (0, None)):
        trainer = SimpleNamespace(
            membership=object(), opt=SimpleNamespace(engine=SimpleNamespace(inner_steps=inner_steps))
        )
        assert train_loop.joined_step(args, trainer, console) == expected


_HEAL_READ = """
import io, warnings, torch
from torch.distributed._serialization import _streaming_save, _streaming_load
buf = io.BytesIO()
_streaming_save({"x": torch.ones(3)}, buf)
if QUIET:
    from co2_zero.elastic.quiet import quiet_torchft
    quiet_torchft(object())
with warnings.catch_warnings(record=True) as caught:
    _streaming_load(io.BytesIO(buf.getvalue()))  # how a heal's receiver reads what the peer sent
print([str(w.message) for w in caught])
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_a_heals_read_warns_about_no_read_only_buffer(quiet):
    """torch warns once per process, so each case runs in a fresh one; without the filter it does warn."""
    code = f"QUIET = {quiet}\n{_HEAL_READ}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert ("The given buffer is not writable" in done.stdout) != quiet, done.stdout
