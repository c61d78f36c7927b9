"""The oldest torch co2_zero runs on: one bound (co2_zero.version.TORCH_MIN) that pyproject.toml declares
and `import co2_zero` enforces with a message naming it; and a plain CO2Optimizer that loads no FSDP2
machinery (co2_zero.fsdp imports torch.distributed.device_mesh and torch.distributed.tensor)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from co2_zero.version import TORCH_MIN, torch_too_old

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("found", ["2.1.0", "2.5.1+cu121", "1.13.1"])
def test_an_older_torch_is_refused_naming_the_torch_needed(found):
    message = torch_too_old(found)
    assert message is not None and "co2_zero needs torch >= 2.6" in message and f"found torch {found}" in message


@pytest.mark.parametrize("found", ["2.6.0", "2.13.0+cpu", "3.0.0a0", torch.__version__])
def test_the_bound_and_newer_are_accepted(found):
    assert torch_too_old(found) is None


def test_pyproject_declares_the_same_bound():
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert declared is not None and (int(declared[1]), int(declared[2])) == TORCH_MIN


def test_import_refuses_an_older_torch_with_that_message():
    """`import co2_zero` under a torch reporting 2.1.0 raises ImportError before importing anything else."""
    code = (
        "import torch; torch.__version__ = '2.1.0'\n"
        "try:\n    import co2_zero\nexcept ImportError as error:\n    print('REFUSED', error)\n"
        "import sys; print('OPTIM', 'co2_zero.optim' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "REFUSED co2_zero needs torch >= 2.6, found torch 2.1.0" in out and "OPTIM False" in out, out


def test_a_plain_co2_optimizer_imports_no_fsdp2_machinery():
    """Built and stepped over plain parameters (world 1), CO2Optimizer never imports co2_zero.fsdp."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "from co2_zero import CO2Optimizer\n"
        "model = torch.nn.Linear(2, 2)\n"
        "opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {'tau': 2}, model=model)\n"
        "for _ in range(2):\n    model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "opt.finalize(); print('FSDP', 'co2_zero.fsdp' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "FSDP False" in done.stdout, done.stdout + done.stderr[-3000:]
