"""A torchrun worker that runs many scripts, one after the other, in one launch (tests.dist_utils.launch_jobs).

`torchrun --nproc_per_node N one_launch.py MANIFEST`: MANIFEST (JSON) lists the jobs (a script with its
arguments, and the directory it runs in) and the per-job deadline. The launch and the heavy imports
(torch and the frameworks, preloaded here, never co2_zero) are paid once; every job still runs as if
launched alone: in a child forked for it, with a fresh namespace, its directory as cwd, and a process
group of its own (rank 0 picks a fresh port for the job's TCPStore, so no key of an earlier job is
seen). A job whose child fails on one rank, or outlives the deadline, is stopped on every rank; the next
one runs. Next to MANIFEST, each rank writes job<i>.rank<r>.out (the child's stdout and stderr) and
job<i>.rank<r>.json (exit code, how it was stopped, seconds): the test reads the outcome there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "deepspeed", "transformers", "accelerate", "fairscale")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _agree_on_port(port_file: Path, rank: int, deadline: float) -> str | None:
    """Rank 0 picks a free port for the job's store and writes it; the others read it."""
    if rank == 0:
        port_file.with_suffix(".tmp").write_text(str(_free_port()))
        os.replace(port_file.with_suffix(".tmp"), port_file)
    while not port_file.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return port_file.read_text()


def _child(argv: list[str], cwd: str, output: Path, port: str) -> None:
    """In the forked child: run the script as __main__ with the job's own store; never returns."""
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(cwd)
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")
    sys.argv = list(argv)
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _supervise(pid: int, failed: dict[int, Path], deadline: float, timeout_s: float) -> tuple:
    """Wait for the child -> (exit code, None); kill it when another rank's child failed or at the
    deadline -> (None, why)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), None
        peers = [r for r, path in failed.items() if path.exists()]
        stopped = f"stopped: rank {peers[0]} failed" if peers else None
        if stopped is None and time.monotonic() > deadline:
            stopped = f"still running after {timeout_s:g} s"
        if stopped is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, stopped
        time.sleep(0.05)


def run_job(control: Path, index: int, job: dict, rank: int, world: int, timeout_s: float) -> None:
    began = time.monotonic()
    deadline, name = began + timeout_s, f"job{index}"
    port = _agree_on_port(control / f"{name}.port", rank, deadline)
    exitcode, stopped = None, "stopped: rank 0 gave no port"
    if port is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job["argv"], job["cwd"], control / f"{name}.rank{rank}.out", port)
        failed = {r: control / f"{name}.rank{r}.failed" for r in range(world) if r != rank}
        exitcode, stopped = _supervise(pid, failed, deadline, timeout_s)
    if exitcode != 0:
        (control / f"{name}.rank{rank}.failed").touch()
    outcome = {"exitcode": exitcode, "stopped": stopped, "seconds": round(time.monotonic() - began, 1)}
    (control / f"{name}.rank{rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    manifest_path = Path(sys.argv[1])
    manifest = json.loads(manifest_path.read_text())
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for index, job in enumerate(manifest["jobs"]):
        run_job(manifest_path.parent, index, job, rank, world, manifest["timeout_s"])


if __name__ == "__main__":
    main()
