"""Checkpoints on a user's bad day, with real processes and real files (2 gloo ranks, CO2Optimizer).

Saves that fail on one rank (a full disk as OSError or as torch.save's RuntimeError, a rank killed by
SIGKILL in the middle of its write, an extra that is not plain data, ranks at different steps) must end
with a clear CO2Error on every rank within timeout_s plus a small margin and lose nothing: the previous
complete checkpoint still loads. Loads of damaged, partial, crafted or mismatched checkpoints must be
refused on every rank, naming the rank, the file and the reason, and change nothing (model weights,
inner optimizer state and CO2 state compared before and after).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pathlib
import shutil
import signal
import stat
import time

import pytest
import torch

from co2_zero import CO2Config, CO2Error, CO2Optimizer, checkpoint
from co2_zero.checkpoint import loading
from tests import models
from tests.compare import param_copies, same, torch_save_fails
from tests.dist_utils import launch_ranks, run_ranks

TIMEOUT_S = 4.0
MARGIN_S = 3.0
CONFIG = {"tau": 2, "outer_lr": 0.8, "outer_momentum": 0.5, "timeout_s": TIMEOUT_S}
DISK_FULL = {
    "oserror": OSError(28, "No space left on device"),
    "runtimeerror": RuntimeError(
        "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: PytorchStreamWriter failed "
        "writing file data/0: file write failed"
    ),
}


# ---- the children ----------------------------------------------------------------------------------------


def _build(**overrides):
    model = models.make_model("mlp")
    opt = CO2Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), CO2Config(**{**CONFIG, **overrides}), model=model)
    return model, opt


def _snapshot(model, opt) -> dict:
    """Everything a load could change: weights, inner optimizer state, CO2 state (deep copies)."""
    state = opt.engine.state_dict()
    co2 = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}
    return {"params": param_copies(model), "inner": copy.deepcopy(opt.optimizer.state_dict()), "co2": co2}


def _attempt(action) -> dict:
    began = time.monotonic()
    try:
        action()
        return {"error": None, "elapsed": time.monotonic() - began}
    except (CO2Error, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}", "elapsed": time.monotonic() - began}


def save_scenarios(rank: int, world: int, root: str) -> dict:
    """main/: a complete save at step 4, then saves at step 6 that fail on rank 1 (full disk both ways).
    reused/: tag "fixed" complete at step 6, then a save of the same tag at step 8 failing on rank 1."""
    out = {}
    model, opt = _build()
    models.train_steps(rank, model, opt, 0, 4)
    checkpoint.save(f"{root}/main", model, opt, extra={"step": 4})
    out["params4"] = param_copies(model)
    models.train_steps(rank, model, opt, 4, 6)
    for name, error in DISK_FULL.items():
        with torch_save_fails(error, active=rank == 1):
            out[name] = _attempt(lambda: checkpoint.save(f"{root}/main", model, opt, extra={"step": 6}))
    out["escape"] = _attempt(lambda: checkpoint.save(f"{root}/main", model, opt, tag="../escape"))
    extra = {"sched": {"fn": lambda step: 1.0}} if rank == 1 else {}
    out["not_plain_extra"] = _attempt(lambda: checkpoint.save(f"{root}/bad_extra", model, opt, extra=extra))

    checkpoint.save(f"{root}/reused", model, opt, extra={"step": 6}, tag="fixed")
    out["params6"] = param_copies(model)
    models.train_steps(rank, model, opt, 6, 8)
    with torch_save_fails(DISK_FULL["oserror"], active=rank == 1):
        out["reused_tag"] = _attempt(lambda: checkpoint.save(f"{root}/reused", model, opt, tag="fixed"))
    opt.finalize()

    model, opt = _build()
    models.train_steps(rank, model, opt, 0, 2 + rank)  # rank 1 one step ahead
    out["different_steps"] = _attempt(lambda: checkpoint.save(f"{root}/steps", model, opt))
    return out


def killed_during_save(rank: int, world: int, root: str) -> dict:
    """A complete save at step 4; at step 6 rank 1 is killed (SIGKILL) halfway through writing its file."""
    model, opt = _build()
    models.train_steps(rank, model, opt, 0, 4)
    checkpoint.save(root, model, opt, extra={"step": 4})
    models.train_steps(rank, model, opt, 4, 6)
    if rank == 1:
        original = torch.save

        def killed(obj, f, *args, **kwargs):
            original(obj, f, *args, **kwargs)  # the whole payload reaches the temporary file ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... but never its final name

        torch.save = killed
    return _attempt(lambda: checkpoint.save(root, model, opt, extra={"step": 6}))


def load_scenarios(rank: int, world: int, root: str) -> dict:
    out = {}
    for name in ("main", "kill"):  # the newest complete checkpoint, never the partial one after it
        model, opt = _build()
        extra = checkpoint.load(f"{root}/{name}", model, opt)
        out[name] = {"extra": extra, "steps": opt.engine.inner_steps, "params": param_copies(model)}
    model, opt = _build()
    extra = checkpoint.load(f"{root}/reused", model, opt, tag="fixed")
    out["reused"] = {"extra": extra, "steps": opt.engine.inner_steps, "params": param_copies(model)}

    # Only rank 0 reads latest_co2 and the markers to choose; the others receive its choice.
    choose = loading._choose
    if rank == 1:
        loading._choose = lambda *args: pytest.fail("rank 1 chose a checkpoint itself")
    model, opt = _build()
    out["chosen_by_rank_0"] = checkpoint.load(f"{root}/main", model, opt)
    loading._choose = choose

    refused = {
        "empty": {},
        "truncated": {},
        "missing": {},
        "crafted": {},
        "latest_escape": {},
        "marker_missing": {},
        "partial_tag": {"tag": "step00000006"},
        "another_config": {"config": {"tau": 3}, "directory": "main"},
        "nothing": {},
    }
    for name, case in refused.items():
        model, opt = _build(**case.get("config", {}))
        models.train_steps(rank, model, opt, 0, 1)  # non-trivial inner state to compare
        before = _snapshot(model, opt)
        directory = f"{root}/{case.get('directory', name)}"
        out[name] = _attempt(lambda d=directory, m=model, o=opt, t=case.get("tag"): checkpoint.load(d, m, o, tag=t))
        out[name]["unchanged"] = same(before, _snapshot(model, opt))
    return out


# ---- the parent ------------------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this creates a file: what a crafted checkpoint could do with weights_only=False."""

    def __init__(self, sentinel: pathlib.Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


def _rank1_file(directory: pathlib.Path, tag: str = "step00000004") -> tuple[pathlib.Path, dict, pathlib.Path]:
    marker_path = directory / tag / checkpoint.MARKER
    marker = json.loads(marker_path.read_text())
    return directory / tag / marker["files"][1]["name"], marker, marker_path


def _damage(root: pathlib.Path, sentinel: pathlib.Path) -> None:
    """Copies of main/ with rank 1's step-4 file emptied, truncated, removed or replaced by a crafted
    pickle (with a marker rewritten to match it, as an attacker who can write files would); a copy whose
    latest_co2 points outside; one whose step-4 marker is gone (only partial saves left); an empty one."""
    for name in ("empty", "truncated", "missing", "crafted", "latest_escape", "marker_missing"):
        shutil.copytree(root / "main", root / name)
    shutil.copytree(root / "kill", root / "partial_tag")  # its step00000006 holds rank 0's file only
    path, _, _ = _rank1_file(root / "empty")
    path.write_bytes(b"")
    path, _, _ = _rank1_file(root / "truncated")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    path, _, _ = _rank1_file(root / "missing")
    path.unlink()
    path, marker, marker_path = _rank1_file(root / "crafted")
    torch.save({"identity": {"format": checkpoint.FORMAT}, "payload": _RunsCode(sentinel)}, path)
    data = path.read_bytes()
    marker["files"][1].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    marker_path.write_text(json.dumps(marker))
    (root / "latest_escape" / checkpoint.LATEST).write_text("../main")
    shutil.rmtree(root / "latest_escape" / "step00000004")  # nothing complete left in it but via latest
    (root / "marker_missing" / "step00000004" / checkpoint.MARKER).unlink()
    (root / "nothing").mkdir()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckptfail")
    saved = run_ranks(save_scenarios, 2, str(root), timeout=240)
    killed = launch_ranks(killed_during_save, 2, str(root / "kill"), timeout=120)
    after_kill = sorted(p.name for p in (root / "kill" / "step00000006").iterdir())
    sentinel = root / "code-ran"
    _damage(root, sentinel)
    loaded = run_ranks(load_scenarios, 2, str(root), timeout=240)
    return {
        "root": root,
        "saved": saved,
        "killed": killed,
        "after_kill": after_kill,
        "loaded": loaded,
        "sentinel": sentinel,
    }


def _assert_refused(result: dict, *phrases: str) -> None:
    assert result["error"] is not None, result
    for phrase in phrases:
        assert phrase in result["error"], (phrase, result["error"])
    assert result["elapsed"] < TIMEOUT_S + MARGIN_S, result


@pytest.mark.parametrize("how", list(DISK_FULL))
def test_full_disk_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(runs, how):
    for result in runs["saved"]:
        _assert_refused(
            result[how],
            "CO2Error",
            "failed on rank(s) [1]",
            "rank 1: co2_rank00001.",
            "No space left" if how == "oserror" else "PytorchStreamWriter failed",
            "did not complete",
        )
    step6 = runs["root"] / "main" / "step00000006"
    assert not (step6 / checkpoint.MARKER).exists()
    assert (runs["root"] / "main" / checkpoint.LATEST).read_text() == "step00000004"


def test_a_save_that_reached_only_rank_0_is_never_loaded(runs):
    """Rank 1 was killed while writing its step-6 file, rank 0's is durable (a rank that times out
    cannot know whether the save failed everywhere, so it keeps its file): both ranks resume at step 4,
    identically, and the load removes what no marker names. Saves that failed on every rank's word
    left nothing behind."""
    assert [name[:14] for name in runs["after_kill"]] == [".co2_rank00001", "co2_rank00000."], runs["after_kill"]
    assert not (runs["root"] / "kill" / "step00000006").exists()
    assert not (runs["root"] / "main" / "step00000006").exists()
    for rank, result in enumerate(runs["loaded"]):
        assert result["kill"]["extra"] == {"step": 4} and result["kill"]["steps"] == 4
        got = result["main"]
        assert got["extra"] == {"step": 4} and got["steps"] == 4
        for key, value in runs["saved"][rank]["params4"].items():
            assert torch.equal(got["params"][key], value), key


def test_only_rank_0_chooses_the_checkpoint_the_others_receive_it(runs):
    assert [result["chosen_by_rank_0"] for result in runs["loaded"]] == [{"step": 4}, {"step": 4}]


def test_a_reused_tag_whose_save_failed_keeps_its_previous_complete_state(runs):
    for result in runs["saved"]:
        _assert_refused(result["reused_tag"], "failed on rank(s) [1]", "No space left")
    for rank, result in enumerate(runs["loaded"]):
        got = result["reused"]
        assert got["extra"] == {"step": 6} and got["steps"] == 6
        for key, value in runs["saved"][rank]["params6"].items():
            assert torch.equal(got["params"][key], value), key


def test_sigkill_during_save_fails_the_other_rank_in_time_and_keeps_the_previous_checkpoint(runs):
    survivor, killed = runs["killed"]
    assert killed.exitcode == -signal.SIGKILL, killed
    _assert_refused(survivor.result, "CO2", "save: every file durable", "did not complete")
    temp = [name for name in runs["after_kill"] if name.startswith(".co2_rank00001.") and name.endswith(".tmp")]
    assert temp, runs["after_kill"]  # what the killed write left behind ...
    assert not (runs["root"] / "kill" / "step00000006" / temp[0]).exists()  # ... removed by the next load
    for result in runs["loaded"]:
        assert result["kill"]["extra"] == {"step": 4} and result["kill"]["steps"] == 4


def test_saves_that_cannot_be_made_fail_on_every_rank(runs):
    for result in runs["saved"]:
        assert result["escape"]["error"].startswith("ValueError") and "'../escape'" in result["escape"]["error"]
        _assert_refused(result["not_plain_extra"], "rank 1:", "['extra']['sched']['fn']", "weights_only")
        _assert_refused(result["different_steps"], "rank 0: step 2, rank 1: step 3", "Nothing was written")
    assert not (runs["root"] / "escape").exists() and not (runs["root"].parent / "escape").exists()


DAMAGED = {
    "empty": ("rank 1: co2_rank00001.", "0 bytes", "the marker says"),
    "truncated": ("rank 1: co2_rank00001.", "the marker says", "truncated"),
    "missing": ("rank 1: co2_rank00001.", "missing or unreadable", "No such file"),
    "crafted": ("rank 1: co2_rank00001.", "weights_only=True", "could run code"),
    "another_config": ("failed on rank(s) [0, 1]", "config_hash=", "same co2 config"),
    "partial_tag": ("step00000006 is incomplete",),
    "marker_missing": ("no complete checkpoint",),
    "latest_escape": ("latest_co2 names '../main'", "refused"),
    "nothing": ("no complete checkpoint",),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_refused_load_names_the_rank_and_file_and_changes_nothing(runs, case):
    for result in runs["loaded"]:
        _assert_refused(result[case], "CO2Error", *DAMAGED[case])
        assert result[case]["unchanged"], f"{case}: the refused load changed the model or optimizer state"


def test_a_crafted_file_would_run_code_without_weights_only(runs):
    """The crafted file really is dangerous (so the refusal above means something) and did not run."""
    assert not runs["sentinel"].exists()
    path, _, _ = _rank1_file(runs["root"] / "crafted")
    torch.load(path, weights_only=False)
    assert runs["sentinel"].exists()
    runs["sentinel"].unlink()


def test_checkpoint_files_have_normal_permissions(runs):
    umask = os.umask(0)
    os.umask(umask)
    directory = runs["root"] / "main" / "step00000004"
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
