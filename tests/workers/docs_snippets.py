"""A torchrun worker that runs many multi-rank docs snippets in one launch (tests/test_docs.py).

`torchrun --nproc_per_node N docs_snippets.py MANIFEST`: MANIFEST (JSON) lists the snippets, each a
script in its own directory, and the per-snippet deadline. The launch and the heavy imports (torch and
the frameworks, preloaded here, never co2_zero) are paid once; every snippet still runs as if launched
alone: in a child forked for it, with a fresh namespace, its directory as cwd, its output in
`out<rank>.txt`, and a process group of its own (rank 0 picks a fresh port for its TCPStore, so no key
of an earlier snippet is seen). A snippet whose child fails on one rank, or outlives the deadline, is
stopped on every rank; the next one runs. Each rank writes `done<rank>.json` (exit code, how it was
stopped, seconds) into the snippet's directory: the test reads its verdicts there.
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


def _wait_for(path: Path, deadline: float) -> bool:
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _agree_on_port(directory: Path, rank: int, deadline: float) -> str | None:
    """Rank 0 picks a free port for the snippet's store and writes it; the others read it."""
    path = directory / "port"
    if rank == 0:
        (directory / "port.tmp").write_text(str(_free_port()))
        os.replace(directory / "port.tmp", path)
    return path.read_text() if _wait_for(path, deadline) else None


def _child(script: Path, rank: int, port: str) -> None:
    """In the forked child: run the script as __main__ with the snippet's own store; never returns."""
    out = os.open(script.parent / f"out{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(script.parent)
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")
    sys.argv = [str(script)]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _supervise(pid: int, directory: Path, rank: int, world: int, deadline: float, timeout_s: float) -> tuple:
    """Wait for the child; kill it when another rank's child failed or at the deadline."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), None
        failed = [r for r in range(world) if r != rank and (directory / f"failed{r}").exists()]
        stopped = f"rank {failed[0]} failed" if failed else None
        if stopped is None and time.monotonic() > deadline:
            stopped = f"still running after {timeout_s:g} s"
        if stopped is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, stopped
        time.sleep(0.05)


def run_snippet(script: Path, rank: int, world: int, timeout_s: float) -> None:
    directory, began = script.parent, time.monotonic()
    deadline = began + timeout_s
    port = _agree_on_port(directory, rank, deadline)
    exitcode, stopped = None, "rank 0 gave no port"
    if port is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script, rank, port)
        exitcode, stopped = _supervise(pid, directory, rank, world, deadline, timeout_s)
    if exitcode != 0:
        (directory / f"failed{rank}").touch()
    verdict = {"exitcode": exitcode, "stopped": stopped, "seconds": round(time.monotonic() - began, 1)}
    (directory / f"done{rank}.json").write_text(json.dumps(verdict))


def main() -> None:
    manifest = json.loads(Path(sys.argv[1]).read_text())
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for script in manifest["scripts"]:
        run_snippet(Path(script), rank, world, manifest["timeout_s"])


if __name__ == "__main__":
    main()
