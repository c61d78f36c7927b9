"""The library works with nothing but torch and what pyproject.toml declares (no numpy, no pickling).

Runs tests/workers/base_install_check.py under torchrun on 2 ranks with numpy hidden from the
workers; CI also runs it in the base-only venv of the README's first command.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_base_install_check_runs_without_numpy():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(29600 + os.getpid() % 1000), str(ROOT / "tests" / "workers" / "base_install_check.py"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "base install ok" in done.stdout, done.stdout + done.stderr


def test_importing_co2_zero_first_silences_torchs_numpy_warning():
    """Without numpy, `import torch` warns "Failed to initialize NumPy" once per process (five times in a
    4-rank launch); importing co2_zero first, as the training job does, prints nothing."""

    def stderr_of(statement: str) -> str:
        code = f"import sys; sys.modules['numpy'] = None; {statement}"  # as if numpy were not installed
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env["PYTHONPATH"] = str(ROOT)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "Failed to initialize NumPy" in stderr_of("import torch")  # what the base install shows
    assert "Failed to initialize NumPy" not in stderr_of("import co2_zero"), stderr_of("import co2_zero")
