"""The distribution: `python -m build` makes an sdist, and a wheel from that sdist, that install and run
in a fresh venv holding nothing but torch and what pyproject.toml declares.

One module-scoped build and one venv (torch first, as the README says, then the wheel) serve every test.
The build uses the running interpreter's setuptools (`--no-isolation`, no index needed) when it is new
enough for pyproject.toml, else an isolated build env. The venv runs from a directory outside the
checkout with no PYTHONPATH, so everything it imports is the installed wheel's. The main job
(`co2-train`) runs on 2 ranks, and reads its default DeepSpeed config from the installed package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from co2_zero.version import TORCH_MIN

pytestmark = pytest.mark.slow  # about 1.5-3 minutes: a build, a venv with torch, a 2-rank run

ROOT = Path(__file__).resolve().parents[2]
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "co2_zero" / "version.py").read_text()).group(1)
TORCH = f"torch=={torch.__version__.split('+')[0]}"  # the local-version-free pin: 2.13.0 matches 2.13.0+cpu
SCRIPTS = {"co2-train": "co2_zero.train:main", "co2-tune-tau": "co2_zero.train.tune_tau:main"}
SDIST_MUST_HOLD = [
    "CHANGELOG.md", "LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in", "co2_zero/py.typed",
    "co2_zero/configs/ds_zero2_co2.json", "configs/ds_zero1_co2.json", "configs/ds_zero2_co2.json",
    "configs/ds_zero2_co2_bf16.json", "tests/reference.py", "tests/compare.py", "tests/dist_utils.py",
    "scripts/train_lm.py", "scripts/tune_tau.py", "examples/hf_trainer.py", "examples/ds_zero2_co2_hf.json",
    "docs/design.md",
]  # fmt: skip
NOT_SOURCE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".venv", "venv*", "runs", "out", "*.pt",
    ".pytest_cache", ".ruff_cache", "benchmarks", ".ci", ".whl",
)  # fmt: skip


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; a non-zero exit fails the test with the end of its output."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def _build_isolation_flags() -> list[str]:
    """--no-isolation when this interpreter has the build backend pyproject.toml asks for (setuptools>=77)."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: pip install -e '.[test]'")
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """`python -m build` on a copy of the checkout: the sdist, then the wheel built from that sdist."""
    work = tmp_path_factory.mktemp("packaging")
    source, out = work / "source", work / "dist"
    shutil.copytree(ROOT, source, symlinks=True, ignore=NOT_SOURCE)  # the checkout itself stays untouched
    run([sys.executable, "-m", "build", *_build_isolation_flags(), "--outdir", str(out), str(source)], timeout=600)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "work": work}


@pytest.fixture(scope="module")
def venv(dist) -> dict[str, Path]:
    """A fresh venv: torch first (the README's order), then the wheel and its declared dependencies."""
    where = dist["work"] / "venv"
    outside = dist["work"] / "elsewhere"  # no checkout on sys.path: imports come from the venv
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS", "VIRTUAL_ENV")}
    env = {**env, "OMP_NUM_THREADS": "1"}  # also for pip: a checkout on PYTHONPATH would read as installed
    run([sys.executable, "-m", "venv", str(where)], timeout=300)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    run([*pip, TORCH], timeout=600, cwd=outside, env=env)
    run([*pip, str(dist["wheel"])], timeout=600, cwd=outside, env=env)
    return {"bin": where / "bin", "cwd": outside, "env": env}


def in_venv(venv: dict, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return run(command, timeout, cwd=venv["cwd"], env=venv["env"])


def test_wheel_holds_the_package_configs_and_py_typed_only(dist):
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    assert all(n.startswith(("co2_zero/", f"co2_zero-{VERSION}.dist-info/")) for n in names), names
    for required in ("co2_zero/py.typed", "co2_zero/configs/ds_zero2_co2.json", "co2_zero/configs/__init__.py"):
        assert required in names, required
    assert "co2_zero/train/__init__.py" in names and "co2_zero/train/tune_tau.py" in names, (
        "the jobs are not in the wheel"
    )
    metadata = zipfile.ZipFile(dist["wheel"]).read(f"co2_zero-{VERSION}.dist-info/METADATA").decode()
    torch_min = ".".join(map(str, TORCH_MIN))
    assert "License-Expression: BSD-3-Clause" in metadata and f"Requires-Dist: torch>={torch_min}" in metadata
    assert "Requires-Dist: numpy" in metadata  # torch warns in every process without it
    assert "# co2_zero" in metadata  # the README is the long description


def test_sdist_holds_the_checkout(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        top = f"co2_zero-{VERSION}/"
        names = {m.name[len(top) :] for m in sdist.getmembers() if m.isfile()}
    missing = [n for n in SDIST_MUST_HOLD if n not in names]
    assert not missing, f"the sdist lacks {missing}"


def test_installed_package_imports_quietly_with_typing_and_configs(venv):
    check = (
        "import importlib.resources as r, json, co2_zero, co2_zero.configs as c; "
        "assert (r.files('co2_zero') / 'py.typed').is_file(); "
        "section = json.loads((r.files('co2_zero.configs') / 'ds_zero2_co2.json').read_text())['co2']; "
        "assert c.path('ds_zero2_co2_bf16.json').is_file() and 'site-packages' in str(c.path('ds_zero1_co2.json')); "
        "print(co2_zero.__version__, section['shards_per_replica'], c.names())"
    )
    done = in_venv(venv, [str(venv["bin"] / "python"), "-c", check])
    assert done.stdout.split()[:2] == [VERSION, "2"], done.stdout
    # numpy is a declared dependency: torch finds it (without it, every process torch starts warns
    # "Failed to initialize NumPy", torchrun's launcher included)
    assert "Failed to initialize NumPy" not in done.stderr, done.stderr
    bare = in_venv(venv, [str(venv["bin"] / "python"), "-c", "import torch, numpy; print(numpy.__file__)"])
    assert "Failed to initialize NumPy" not in bare.stderr and str(venv["bin"].parent) in bare.stdout, bare


def test_console_scripts_are_declared(venv):
    listing = (
        "from importlib.metadata import entry_points; "
        "print({e.name: e.value for e in entry_points(group='console_scripts') if e.name.startswith('co2-')})"
    )
    done = in_venv(venv, [str(venv["bin"] / "python"), "-c", listing])
    assert done.stdout.strip() == repr(SCRIPTS), done.stdout
    assert all((venv["bin"] / name).is_file() for name in SCRIPTS)


def test_co2_train_runs_the_main_job_on_two_ranks(venv):
    tiny = [
        "--max_steps", "6", "--tau", "3", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32",
        "--batch_size", "8", "--data_bytes", "300000", "--eval_batches", "2", "--no_progress",
    ]  # fmt: skip
    launch = [str(venv["bin"] / "torchrun"), "--standalone", "--nproc_per_node", "2", "--no-python"]
    done = in_venv(venv, [*launch, str(venv["bin"] / "co2-train"), *tiny], timeout=400)
    assert "final val loss" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Failed to initialize NumPy" not in done.stdout + done.stderr, done.stderr[-3000:]  # the launcher too


def test_co2_tune_tau_starts(venv):
    done = in_venv(venv, [str(venv["bin"] / "co2-tune-tau"), "--help"])
    assert "usage" in done.stdout.lower(), done.stdout


def test_co2_train_finds_its_default_deepspeed_config_in_the_installed_package(venv):
    probe = (
        "from co2_zero.train.args import get_args, deepspeed_config_path; "
        "p = deepspeed_config_path(get_args(['--engine', 'deepspeed'])); print(p.resolve(), p.is_file())"
    )
    done = in_venv(venv, [str(venv["bin"] / "python"), "-c", probe])
    path, exists = done.stdout.split()
    assert exists == "True" and "site-packages" in path and path.endswith("co2_zero/configs/ds_zero2_co2.json"), path
