"""The training job's --resume --reshard with `--replica_tau` onto another S (docs/checkpoints.md): real
launches, the checkpoints written by one torchrun launch of 4 ranks (R x S = 2 x 2), resumed by one of 2
ranks (R x S = 2 x 1, each replica keeps its place): replica_tau given (replica 0 trains 2 steps a round,
replica 1 the job's tau = 4) on FairScale, "auto" on FSDP2, and FSDP2's checkpoint resumed by the plain
engine. Each resumed run
goes on from step 8 of the fastest replica's clock (where the checkpoint was taken, a round end), every
replica takes the rounds that are left, the save at the end agrees on its step, and the job ends with one
model (finalize() would exit non-zero otherwise).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import launch_jobs
from tests.tools.test_train_lm_smoke import SCRIPT, TINY, TOKENS, _env, by_step, outcome, write_tokens
from tests.tools.test_train_paced import PACED, TAU

SAVED = ["--save_dir", "ckpt", "--save_every", "8"]
AUTO = ["--tau", str(TAU), "--replica_tau", "auto", "--max_steps", "24"]
CASES = {  # name -> (the saving run's flags, the resumed run's, its last step)
    "given": (
        [*PACED, "--engine", "fairscale", "--shards_per_replica", "2"],
        [*PACED, "--engine", "fairscale", "--shards_per_replica", "1"],
        16,
    ),
    "auto": (
        [*AUTO, "--engine", "fsdp", "--shards_per_replica", "2"],
        [*AUTO, "--engine", "fsdp", "--shards_per_replica", "1"],
        24,
    ),
    "fsdp onto plain": ([*PACED, "--engine", "fsdp", "--shards_per_replica", "2"], [*PACED, "--engine", "plain"], 16),
}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Per case: (the saving run's records, the resumed run's records, every rank's output of the resumed
    run, its directory)."""
    root = tmp_path_factory.mktemp("paced_reshard")
    common = [*TINY, *TOKENS, "--data", str(write_tokens(root / "tokens")), "--batch_size", "4", "--eval_every", "1"]
    works = [root / name.replace(" ", "_") for name in CASES]
    planned = {"saved": [], "resumed": []}  # the jobs of each launch, in the order of CASES
    for work, (saving, resuming, _) in zip(works, CASES.values()):
        work.mkdir()
        resumed = [*resuming, "--resume", "ckpt/step00000008", "--reshard", "--save_dir", "ckpt2", "--save_every", "8"]
        for part, flags in (("saved", [*saving, *SAVED]), ("resumed", resumed)):
            planned[part].append(([str(SCRIPT), *common, *flags, "--out_json", str(work / f"{part}.jsonl")], work))
    ended = {}
    for part, ranks in (("saved", 4), ("resumed", 2)):
        (root / part).mkdir()
        ended[part] = launch_jobs(planned[part], ranks, root / part, 300, _env())
    return {
        name: (
            outcome(ended["saved"][i], work / "saved.jsonl")[0],
            *outcome(ended["resumed"][i], work / "resumed.jsonl"),
            work,
        )
        for i, (name, work) in enumerate(zip(CASES, works))
    }


@pytest.mark.slow  # a 4-rank launch and a 2-rank one: a few minutes on 2 loaded cores
@pytest.mark.parametrize("name", list(CASES))
def test_replica_tau_resharded_onto_another_s_goes_on_from_the_jobs_step(resharded, name):
    saved, resumed, report, work = resharded[name]
    last = CASES[name][2]
    assert "resumed from ckpt/step00000008 at step 8 (resharded)" in report, report[-3000:]
    steps = sorted(by_step(resumed))
    assert steps[0] == 8 and steps[-1] == last and all(s % TAU == 0 for s in steps), steps
    assert resumed[-1]["steps"] == last and resumed[-1]["shards"] == 1 and saved[-1]["shards"] == 2
    assert (work / "ckpt2" / "latest").read_text() == f"step{last:08d}"
    assert resumed[-1]["val_loss"] < saved[0]["val_loss"]  # it trained on from the saved model
