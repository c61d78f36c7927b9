"""Checkpoint faults of issue 20, with real processes and real files (2 gloo ranks, CO2Optimizer).

A rank that sees an older save of the chosen tag refuses the load on every rank; failed saves leave no
files behind and a load removes what no marker names; a failed `latest_co2` write says the checkpoint
is complete and loads by tag; a save or load after finalize() or a failure says so at once; a full
disk seen through torch.save's "unexpected pos" is called a full disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from co2_zero import CO2Config, CO2Optimizer, checkpoint
from co2_zero.checkpoint import saving
from tests import models
from tests.compare import clone_state, param_copies, same, torch_save_fails
from tests.dist_utils import run_ranks

TIMEOUT_S = 4.0
CONFIG = {"tau": 2, "outer_lr": 0.8, "outer_momentum": 0.5, "timeout_s": TIMEOUT_S}
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 6592 vs 6492"


def _build():
    model = models.make_model("mlp")
    return model, CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(**CONFIG), model=model)


def _trained(rank: int, steps: int):
    model, opt = _build()
    models.train_steps(rank, model, opt, 0, steps)
    return model, opt


def _snapshot(model, opt) -> dict:
    """Everything a load could change: weights, inner optimizer state, CO2 state."""
    return clone_state(
        {"params": param_copies(model), "inner": opt.optimizer.state_dict(), "co2": opt.engine.state_dict()}
    )


def _attempt(action) -> dict:
    """How `action` ended: the error's type, text and cause (None when it succeeded), and the seconds."""
    began = time.monotonic()
    try:
        action()
        error = None
    except Exception as caught:
        error = caught
    return {
        "type": None if error is None else type(error).__name__,
        "error": None if error is None else str(error),
        "cause": None if error is None or error.__cause__ is None else repr(error.__cause__),
        "elapsed": time.monotonic() - began,
    }


@contextlib.contextmanager
def _text_write_fails(name: str, active: bool):
    """The save's write_text_atomic raises a full disk's OSError for files called `name`, in this process."""
    original = saving.write_text_atomic

    def failing(path, text):
        if str(path).endswith(name):
            raise OSError(28, "No space left on device")
        original(path, text)

    if active:
        saving.write_text_atomic = failing
    try:
        yield
    finally:
        saving.write_text_atomic = original


def _enospc_in_chain() -> RuntimeError:
    error = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    error.__cause__ = OSError(28, "No space left on device")
    return error


DISK_FULL = {"unexpected_pos": lambda: RuntimeError(UNEXPECTED_POS), "enospc_in_chain": _enospc_in_chain}


# ---- the children ----------------------------------------------------------------------------------------


def save_faults(rank: int, world: int, root: str) -> dict:
    """full/: step 2 complete, then saves at step 4 failing on rank 1 (disk full, two ways, and once more).
    marker/, latest/: step 2 complete, then rank 0's marker or latest_co2 write fails at step 4."""
    out = {}
    model, opt = _trained(rank, 2)
    for name in ("full", "marker", "latest"):
        checkpoint.save(f"{root}/{name}", model, opt, extra={"step": 2})
    models.train_steps(rank, model, opt, 2, 4)
    for name, error in [*DISK_FULL.items(), ("again", DISK_FULL["unexpected_pos"])]:
        with torch_save_fails(error(), active=rank == 1):
            out[name] = _attempt(lambda: checkpoint.save(f"{root}/full", model, opt, extra={"step": 4}))
    with _text_write_fails(checkpoint.MARKER, active=rank == 0):
        out["marker"] = _attempt(lambda: checkpoint.save(f"{root}/marker", model, opt, extra={"step": 4}))
    with _text_write_fails(checkpoint.LATEST, active=rank == 0):
        out["latest"] = _attempt(lambda: checkpoint.save(f"{root}/latest", model, opt, extra={"step": 4}))
    for tag in ("step00000004", None):
        fresh, fresh_opt = _build()
        extra = checkpoint.load(f"{root}/latest", fresh, fresh_opt, tag=tag)
        out[f"latest_load_{tag}"] = {"extra": extra, "steps": fresh_opt.engine.inner_steps}
    opt.finalize()
    out["after_finalize"] = _unusable(model, opt, root)

    model, opt = _trained(rank, 2 + rank)  # rank 1 one step ahead: finalize fails and marks the optimizer failed
    out["finalize_failed"] = _attempt(opt.finalize)
    out["after_failure"] = _unusable(model, opt, root)
    return out


def _unusable(model, opt, root: str) -> dict:
    return {
        "save": _attempt(lambda: checkpoint.save(f"{root}/unusable", model, opt)),
        "load": _attempt(lambda: checkpoint.load(f"{root}/latest", model, opt)),
    }


def stale_view(rank: int, world: int, root: str) -> dict:
    """Tag "t" saved at step 6 and again at step 8 in shared/; old/ is a copy taken at step 6 and
    touched/ a copy at step 8 whose marker differs in one byte. Rank 1 loads "t" from old/, then from
    touched/, while rank 0 loads it from shared/; then both load from shared/."""
    out = {}
    model, opt = _trained(rank, 6)
    checkpoint.save(f"{root}/shared", model, opt, tag="t", extra={"step": 6})
    if rank == 0:
        shutil.copytree(f"{root}/shared", f"{root}/old")
    models.train_steps(rank, model, opt, 6, 8)
    checkpoint.save(f"{root}/shared", model, opt, tag="t", extra={"step": 8})
    if rank == 0:
        shutil.copytree(f"{root}/shared", f"{root}/touched")
        marker = f"{root}/touched/t/{checkpoint.MARKER}"
        with open(marker) as f:
            data = json.load(f)
        data["saved_at"] += 1.0
        with open(marker, "w") as f:
            json.dump(data, f, indent=1)
    dist.barrier()
    for view in ("old", "touched"):
        before = _snapshot(model, opt)
        directory = f"{root}/shared" if rank == 0 else f"{root}/{view}"
        out[view] = _attempt(lambda d=directory: checkpoint.load(d, model, opt, tag="t"))
        out[view]["unchanged"] = same(before, _snapshot(model, opt))
    model, opt = _build()
    out["shared"] = checkpoint.load(f"{root}/shared", model, opt, tag="t")
    return out


def load_removes_leftovers(rank: int, world: int, root: str) -> dict:
    """step 2 complete; rank 0 then plants what failed or killed saves leave: files of a save of step 4
    that never got a marker, and a rank-1 file of an earlier save of step00000002's tag. A load follows."""
    model, opt = _trained(rank, 2)
    checkpoint.save(root, model, opt, extra={"step": 2})
    dist.barrier()  # every rank's save has ended, its own tidying included, before rank 0 plants leftovers
    if rank == 0:
        directory = f"{root}/step00000002"
        with open(f"{directory}/{checkpoint.MARKER}") as f:
            files = [entry["name"] for entry in json.load(f)["files"]]
        os.makedirs(f"{root}/step00000004")
        for r, name in enumerate(files):
            shutil.copy(f"{directory}/{name}", f"{root}/step00000004/{checkpoint.rank_file_name(r, 'a' * 16)}")
        shutil.copy(f"{directory}/{files[1]}", f"{directory}/{checkpoint.rank_file_name(1, 'b' * 16)}")
    dist.barrier()
    model, opt = _build()
    return {"extra": checkpoint.load(root, model, opt), "steps": opt.engine.inner_steps}


# ---- the parent ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckptfaults")
    return {"root": root, "out": run_ranks(save_faults, 2, str(root), timeout=240)}


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _marker_files(directory) -> list[str]:
    return sorted(entry["name"] for entry in json.loads((directory / checkpoint.MARKER).read_text())["files"])


def _only_the_complete_checkpoint(root) -> None:
    """root holds latest_co2 and step00000002 with its marker and the files it names, nothing else."""
    assert _names(root) == [checkpoint.LATEST, "step00000002"], _names(root)
    step2 = root / "step00000002"
    assert _names(step2) == sorted([checkpoint.MARKER, *_marker_files(step2)])


def test_a_rank_that_sees_an_older_save_of_the_tag_refuses_the_load_on_every_rank(tmp_path):
    out = run_ranks(stale_view, 2, str(tmp_path), timeout=240)
    new_id = json.loads((tmp_path / "shared" / "t" / checkpoint.MARKER).read_text())["save_id"]
    old_id = json.loads((tmp_path / "old" / "t" / checkpoint.MARKER).read_text())["save_id"]
    for result in out:
        assert result["old"]["type"] == "CO2Error", result["old"]
        for phrase in ("read different saves", f"rank 0: save {new_id} at step 8", f"rank 1: save {old_id} at step 6"):
            assert phrase in result["old"]["error"], (phrase, result["old"]["error"])
        assert "differ in save id, step, marker digest" in result["old"]["error"]
        assert "differ in marker digest." in result["touched"]["error"], result["touched"]
        assert "Nothing was loaded" in result["old"]["error"]
        assert result["old"]["unchanged"] and result["touched"]["unchanged"]
        assert result["shared"] == {"step": 8}


@pytest.mark.parametrize("how", [*DISK_FULL, "again"])
def test_a_failed_save_leaves_no_files_on_any_rank(saved, how):
    for result in saved["out"]:
        assert result[how]["type"] == "CO2Error" and "failed on rank(s) [1]" in result[how]["error"], result[how]
    _only_the_complete_checkpoint(saved["root"] / "full")


def test_a_save_whose_marker_could_not_be_written_leaves_no_files(saved):
    _only_the_complete_checkpoint(saved["root"] / "marker")
    for result in saved["out"]:
        assert "failed on rank(s) [0]" in result["marker"]["error"], result["marker"]
        assert "no space left on the device" in result["marker"]["error"]


def test_a_load_removes_the_files_no_marker_names(tmp_path):
    out = run_ranks(load_removes_leftovers, 2, str(tmp_path), timeout=240)
    assert out == [{"extra": {"step": 2}, "steps": 2}] * 2
    _only_the_complete_checkpoint(tmp_path)


def test_a_failed_latest_write_says_the_checkpoint_is_complete_and_loads_by_tag(saved):
    for result in saved["out"]:
        error = result["latest"]["error"]
        assert result["latest"]["type"] == "CO2Error" and "failed on rank(s) [0]" in error, result["latest"]
        for phrase in ("is complete", "loads with tag='step00000004'", "it still names 'step00000002'"):
            assert phrase in error, (phrase, error)
        assert "incomplete" not in error, error
        assert result["latest_load_step00000004"] == {"extra": {"step": 4}, "steps": 4}
        assert result["latest_load_None"] == {"extra": {"step": 2}, "steps": 2}
    assert (saved["root"] / "latest" / checkpoint.LATEST).read_text() == "step00000002"


@pytest.mark.parametrize("state", ["after_finalize", "after_failure"])
@pytest.mark.parametrize("action", ["save", "load"])
def test_save_and_load_after_finalize_or_a_failure_say_so_on_every_rank(saved, state, action):
    expected = {
        "after_finalize": ("finalize() already ended", "Save the checkpoint before finalize()", "torch.save"),
        "after_failure": ("failed earlier", "the ranks took different numbers of inner steps", "Restart every rank"),
    }[state]
    for result in saved["out"]:
        got = result[state][action]
        assert got["type"] == "CO2Error", got
        for phrase in (f"co2 checkpoint {action}", *expected, "nothing was"):
            assert phrase in got["error"], (phrase, got["error"])
        assert got["elapsed"] < TIMEOUT_S, got  # at once, no collective
    assert not (saved["root"] / "unusable").exists()


@pytest.mark.parametrize("how", list(DISK_FULL))
def test_a_full_disk_through_torch_save_is_named_on_every_rank(saved, how):
    directory = saved["root"] / "full" / "step00000004"
    for rank, result in enumerate(saved["out"]):
        error = result[how]["error"]
        assert "rank 1: co2_rank00001." in error and f"no space left on the device {directory}" in error, error
        assert UNEXPECTED_POS in error if how == "unexpected_pos" else "file write failed" in error
        if rank == 1:  # the failing rank keeps its original error as the cause
            assert "RuntimeError(" in result[how]["cause"], result[how]


def real_full_disk(rank: int, world: int, root: str) -> dict:
    """On a small tmpfs: step 2 saved; rank 0 fills the disk; the save at step 4 fails on a real full
    disk; rank 0 frees the space; the save at step 4 succeeds."""
    model, opt = _trained(rank, 2)
    checkpoint.save(root, model, opt)
    models.train_steps(rank, model, opt, 2, 4)
    filler = f"{root}/filler"
    if rank == 0:
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    dist.barrier()
    out = {"full": _attempt(lambda: checkpoint.save(root, model, opt))}
    if rank == 0:
        os.remove(filler)
    dist.barrier()
    out["freed"] = _attempt(lambda: checkpoint.save(root, model, opt))
    return out


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs (needs root: mount(2)); skipped where it cannot be mounted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here (mount: {mounted.stderr.decode().strip()})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_real_full_disk_is_named_and_the_failed_save_leaves_nothing(small_disk):
    out = run_ranks(real_full_disk, 2, str(small_disk), timeout=240)
    for result in out:
        assert result["full"]["type"] == "CO2Error", result["full"]
        assert f"no space left on the device {small_disk / 'step00000004'}" in result["full"]["error"]
        assert result["freed"]["error"] is None, result["freed"]
    assert _names(small_disk) == [checkpoint.LATEST, "step00000002", "step00000004"]
    for tag in ("step00000002", "step00000004"):
        assert _names(small_disk / tag) == sorted([checkpoint.MARKER, *_marker_files(small_disk / tag)])
