"""The library works with nothing but torch and tqdm (no numpy, no pickling): numpy is declared only so
that torch does not warn without it (pyproject.toml; tests/project/test_packaging.py checks the launch is quiet).

Runs tests/workers/base_install_check.py under torchrun on 2 ranks with numpy hidden from the
workers; CI also runs it in the base-only venv of the README's first command.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_base_install_check_runs_without_numpy():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(29600 + os.getpid() % 1000), str(ROOT / "tests" / "workers" / "base_install_check.py"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "base install ok" in done.stdout, done.stdout + done.stderr
