"""Run a function on N real processes joined by a process group (torch.multiprocessing spawn).

`run_ranks(fn, world_size, *args)` returns what each rank's `fn(rank, world_size, *args)` returned
(anything torch.save can pickle; tensors come back on the CPU). A rank that raises fails the call with
its traceback; a run that outlives `timeout` is killed and fails, so a hang is a test failure, not a
stuck suite. gloo on the CPU by default; the GPU suite passes `backend="nccl"` (one GPU per rank) or
`device="cuda"` with gloo (ranks sharing a GPU), and `tests.models` then builds on that device.
A rank that dies of a signal (a native abort) or hangs is reported with faulthandler's dump of its threads.
`launch_jobs(jobs, ranks, ...)` runs whole scripts under one torchrun launch, one after the other; `busy_host()`
loads the host with a busy loop while a fault test runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import torch
import torch._dynamo  # noqa: F401  before any process group: imported after, it keeps the group (design §8)
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    fn: Callable, rank: int, world_size: int, workdir: str, args: tuple, backend: str, device: str, dump_after: float
) -> None:
    from tests import models

    fault_log = open(_rank_file(workdir, "fault", rank), "w")  # noqa: SIM115  open until the process ends
    faulthandler.enable(file=fault_log, all_threads=True)  # a native abort leaves every thread's frames
    faulthandler.dump_traceback_later(dump_after, file=fault_log)  # and so does a hang, before it is killed
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    if device == "cuda":  # NCCL: a GPU per rank; gloo: ranks share them round-robin
        torch.cuda.set_device(rank % torch.cuda.device_count())
        models.set_device(torch.device("cuda", torch.cuda.current_device()))
    dist.init_process_group(
        backend,
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, _rank_file(workdir, "result", rank))
    except BaseException:
        _rank_file(workdir, "error", rank).write_text(traceback.format_exc())
        os._exit(1)  # do not wait on peers that may be stuck in a collective with us
    dist.destroy_process_group()
    gc.collect()  # groups kept by reference cycles end now, not with the interpreter (design §8)


@contextlib.contextmanager
def environment(**extra: str) -> Iterator[None]:
    """os.environ with `extra` set (a spawned child inherits it), restored afterwards."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def busy_host() -> Iterator[None]:
    """A busy loop beside the ranks for as long as the block runs: a loaded host, as a shared machine is."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


class Outcome(NamedTuple):
    exitcode: Optional[int]  # None: still running at the deadline (then killed)
    result: Any  # what fn returned (None if it did not return)
    error: Optional[str]  # the traceback if fn raised
    ended_at: float  # time.monotonic() when the process was seen to end
    fault: str = ""  # faulthandler's dump of every thread: if it died of a signal (SIGABRT, ...) or hung


def _rank_file(workdir: str, kind: str, rank: int) -> Path:
    """What a rank leaves in the work directory: its "result" (torch.save), "error" (a traceback) or "fault"."""
    return Path(workdir, f"{kind}{rank}.{'pt' if kind == 'result' else 'txt'}")


def launch_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    device: str = "cpu",
    rank_env: Sequence[Mapping[str, str]] = (),
) -> list[Outcome]:
    """Run fn on world_size ranks and report how each one ended, whatever happened. `rank_env[r]`: extra
    environment variables rank r starts with (e.g. PYTHONHASHSEED, read only at interpreter start)."""
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"backend='nccl' needs device='cuda', got device={device!r}")
    dump_after = max(0.9 * timeout - 5.0, timeout / 2)  # a rank's own clock starts after its start-up
    with tempfile.TemporaryDirectory(prefix="co2test") as workdir:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, workdir, args, backend, device, dump_after))
            for r in range(world_size)
        ]
        for r, p in enumerate(procs):
            with environment(**(rank_env[r] if r < len(rank_env) else {})):
                p.start()
        ended_at: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended_at) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended_at and not p.is_alive():
                    ended_at[r] = time.monotonic()
            time.sleep(0.05)
        outcomes = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
            p.join()
            err, res, fault = (_rank_file(workdir, kind, r) for kind in ("error", "result", "fault"))
            outcomes.append(
                Outcome(
                    exitcode=p.exitcode if r in ended_at else None,
                    result=torch.load(res, weights_only=False, map_location="cpu") if res.exists() else None,
                    error=err.read_text() if err.exists() else None,
                    ended_at=ended_at.get(r, float("inf")),
                    fault=fault.read_text() if fault.exists() else "",
                )
            )
        return outcomes


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    allow_exit: tuple = (),
    backend: str = "gloo",
    device: str = "cpu",
    rank_env: Sequence[Mapping[str, str]] = (),
) -> list[Any]:
    """Run fn on world_size ranks and return their results; any failure or hang fails the call.

    Ranks in `allow_exit` may exit without a result (None); `rank_env` as in `launch_ranks`."""
    outcomes = launch_ranks(fn, world_size, *args, timeout=timeout, backend=backend, device=device, rank_env=rank_env)
    errors = []
    for r, o in enumerate(outcomes):
        if o.error is not None:
            errors.append(f"--- rank {r} raised:\n{o.error}")
        elif o.exitcode is None:
            errors.append(f"--- rank {r} still running after {timeout:.0f} s (killed){_threads(o)}")
        elif o.exitcode != 0 and r not in allow_exit:
            errors.append(f"--- rank {r} exited with code {o.exitcode}{_threads(o)}")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [o.result for o in outcomes]


def _threads(outcome: Outcome) -> str:
    return f"; its threads:\n{outcome.fault}" if outcome.fault else ""


class JobOutcome(NamedTuple):
    exitcodes: tuple  # per rank; None: stopped (a peer failed, the deadline passed, or it never ran)
    report: str  # per rank: how it ended, after how long, and its output (stdout and stderr)


def launch_jobs(
    jobs: Sequence[tuple[Sequence[str], Path]], ranks: int, control: Path, timeout_s: float, env: Mapping[str, str]
) -> list[JobOutcome]:
    """Run python scripts `(argv, cwd)` one after the other on `ranks` torchrun ranks, in ONE launch
    (tests/workers/one_launch.py: each job in a process forked for it from ranks that imported torch
    and the frameworks once, with its own process group; a job that fails on one rank or outlives
    `timeout_s` is stopped on every rank and the next one runs) -> how each job ended. `control`: an
    empty directory for the manifest and the outputs."""
    manifest = control / "manifest.json"
    listed = [{"argv": [str(a) for a in argv], "cwd": str(cwd)} for argv, cwd in jobs]
    manifest.write_text(json.dumps({"jobs": listed, "timeout_s": timeout_s}))
    worker = Path(__file__).resolve().parent / "workers" / "one_launch.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone"]
    limit = timeout_s * len(jobs) + 120
    try:
        done = subprocess.run(
            [*launcher, str(worker), str(manifest)], cwd=control, env=dict(env), capture_output=True, text=True,
            timeout=limit,
        )  # fmt: skip
        launch = f"the launch exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    except subprocess.TimeoutExpired as err:
        launch = f"the launch was still running after {limit:g} s:\n{err.stdout}\n{err.stderr}"
    return [_job_outcome(control, f"job{i}", ranks, launch) for i in range(len(jobs))]


def _job_outcome(control: Path, name: str, ranks: int, launch: str) -> JobOutcome:
    files = [control / f"{name}.rank{r}.json" for r in range(ranks)]
    if not all(f.exists() for f in files):
        return JobOutcome((None,) * ranks, f"not run to its end on every rank; {launch}")
    ended = [json.loads(f.read_text()) for f in files]
    report = []
    for r, e in enumerate(ended):
        report.append(f"--- rank {r}: {e['stopped'] or 'exit ' + str(e['exitcode'])} after {e['seconds']} s:")
        output = control / f"{name}.rank{r}.out"
        report.append(output.read_text()[-6000:] if output.exists() else "(no output)")
    return JobOutcome(tuple(e["exitcode"] for e in ended), "\n".join(report))
