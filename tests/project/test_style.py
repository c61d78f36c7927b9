"""The code style gate: `ruff check` and `ruff format --check` over the repository (pyproject.toml [tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # the test venv's own ruff (the `test` extra)
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return [found]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(args):
    done = subprocess.run([*_ruff(), *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
