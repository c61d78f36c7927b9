"""Documentation that cannot rot: the site builds strictly, and what the docs say runs, runs.

- `mkdocs build --strict` (mkdocs.yml: `validation: anchors: warn`): a broken link, a missing anchor, an
  unresolved API reference or a failing generator hook fails the build.
- Every fenced block of README.md and docs/*.md preceded by `<!-- run[: KIND] -->` (one process) or
  `<!-- run: N ranks[, KIND] -->` (torchrun, N gloo ranks) is executed, after a preamble that fills in
  what the snippet leaves to the reader (`MyModel`, `model`, `batches`, `loader`, `loss_fn`, a
  `ds_config.json`, ...: `PREAMBLES`), in a fresh directory holding the repository's `examples/` (not its
  `configs/`: a snippet must run from any directory). Identical snippets (the README's examples are
  copies of the pages') run once. The torchrun snippets share one launch (tests.dist_utils.launch_jobs:
  the launch and the heavy imports once, then each snippet in a process forked for it, with its own
  process group; a failed or hung snippet is stopped on every rank and reported by its file:line,
  and the next one runs).
- Every ```bash / ```sh block is either run (`<!-- run -->`), run by CI (`<!-- main-command -->`,
  `<!-- test-command -->`: .ci/run), or says what it needs that a test machine lacks
  (`<!-- needs: gpu -->`, `cluster`, `root`, `minutes`); an unmarked command block fails.
- The README's results table is the one docs/hooks/benchmarks.py generates from benchmarks/*/*.json; the
  pages' tables are its markers.
- The pages' length and figures: tests/project/test_docs_pages.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.dist_utils import launch_jobs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>[\w+-]*)\n(?P<code>.*?)^```$", re.M | re.S)
RUN = re.compile(r"^run(?:: (?:(?P<ranks>\d+) ranks?(?:, )?)?(?P<kind>[a-z][\w-]*)?)?$")
NEEDS = ("gpu", "cluster", "root", "minutes")
SHELL = ("bash", "sh", "shell", "console")
SNIPPET_TIMEOUT_S = 300


class Block(NamedTuple):
    where: str  # file:line
    marker: str
    lang: str
    code: str


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            found.append(Block(f"{page.relative_to(ROOT)}:{line}", m["marker"] or "", m["lang"], m["code"]))
    return found


def runnable() -> list[Block]:
    seen, out = set(), []
    for b in blocks():
        if RUN.match(b.marker) and (b.marker, b.code) not in seen:
            seen.add((b.marker, b.code))
            out.append(b)
    return out


# ---- preambles: what a snippet leaves to the reader ---------------------------------------------------------

_TINY = """
import torch
import torch.distributed as dist

torch.manual_seed(0)  # the same model on every rank
torch.set_num_threads(1)


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))


model = MyModel()
loss_fn = torch.nn.functional.mse_loss
batches = loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(24)]
"""

_RANKS = "\nif 'init_process_group' not in SNIPPET:\n    dist.init_process_group('gloo')\n"

_TRAINED = """
from co2_zero import CO2Config, CO2Optimizer

opt = CO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), CO2Config(tau=2), model=model)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
for x, y in batches[:3]:  # mid-round: a save waits for the exchange in flight
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    sched.step()
"""

_GPT2 = """
import json
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
rows = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(7))
train_data = [{"input_ids": r, "labels": r} for r in rows]
"""

_HF = _GPT2 + "\nimport shutil\nshutil.copy('examples/ds_zero2_co2_hf.json', 'ds_config.json')\n"

_ACCELERATE = (
    _GPT2
    + """
from accelerate.utils import DummyOptim

ds_config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "co2": {"tau": 3, "shards_per_replica": 1},
}
open("ds_config.json", "w").write(json.dumps(ds_config))
optimizer = DummyOptim(model.parameters())
loader = torch.utils.data.DataLoader(train_data[:24], batch_size=2)
"""
)

_LIGHTNING = """
import torch
import lightning.pytorch as L

torch.manual_seed(0)  # the same model on every rank
torch.set_num_threads(1)


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 2))
train_loader = torch.utils.data.DataLoader(data, batch_size=4)
"""

_CORPUS = """
import pathlib

pathlib.Path("corpus").mkdir()
for name in ("a", "b"):
    pathlib.Path(f"corpus/{name}.txt").write_text("the quick brown fox jumps over the lazy dog\\n" * 200)
"""

PREAMBLES = {  # (kind, multi-rank) -> preamble
    (None, False): _TINY,
    (None, True): _TINY + _RANKS,
    ("trained", True): _TINY + _RANKS + _TRAINED,
    ("hf", True): _HF,
    ("accelerate", True): _ACCELERATE,
    ("lightning", True): _LIGHTNING,
    ("corpus", False): _CORPUS,
}


def _workdir(tmp_path: Path) -> Path:
    """A fresh directory with the checkout's examples/ and no configs/: the shipped DeepSpeed configs are read
    from the package (`co2_zero.configs.path`), so a snippet that works only inside a checkout fails here."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return tmp_path


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return env


def _run(command: list[str], cwd: Path, where: str) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{where}: still running after {SNIPPET_TIMEOUT_S} s\n{err.stdout}\n{err.stderr}")
    assert done.returncode == 0, (
        f"{where} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


def _ranks(block: Block) -> int | None:
    """How many torchrun ranks a python `run` block runs on; None: one plain process (or a shell block)."""
    m = RUN.match(block.marker)
    return None if block.lang in SHELL or m["ranks"] is None else int(m["ranks"])


def write_script(block: Block, cwd: Path) -> Path:
    """The block after its preamble, as cwd/snippet.py."""
    m = RUN.match(block.marker)
    assert block.lang == "python", f"{block.where}: a `run` block must be python or shell, not {block.lang!r}"
    key = (m["kind"], m["ranks"] is not None)
    assert key in PREAMBLES, f"{block.where}: no preamble for {block.marker!r}; known: {sorted(map(str, PREAMBLES))}"
    script = cwd / "snippet.py"
    script.write_text(f"SNIPPET = {block.code!r}\n" + textwrap.dedent(PREAMBLES[key]) + "\n" + block.code)
    return script


def run_block(block: Block, cwd: Path) -> None:
    """Run one marked block on one process: python after its preamble, shell as is."""
    if block.lang in SHELL:
        _run(["bash", "-euo", "pipefail", "-c", block.code], cwd, block.where)
    else:
        _run([sys.executable, str(write_script(block, cwd))], cwd, block.where)


def run_on_ranks(blocks: list[Block], ranks: int, root: Path) -> dict[str, str | None]:
    """Run the blocks in one torchrun launch of `ranks` ranks (tests.dist_utils.launch_jobs: each in a
    process of its own, in its own directory) -> per block's `where`: None if it passed on every rank,
    else how each rank ended, with its output."""
    scripts = [write_script(b, _workdir(root / f"snippet{i}")) for i, b in enumerate(blocks)]
    control = root / "launch"
    control.mkdir()
    outcomes = launch_jobs([([s], s.parent) for s in scripts], ranks, control, SNIPPET_TIMEOUT_S, _env())
    return {
        b.where: None if all(c == 0 for c in o.exitcodes) else f"{b.where} failed on {ranks} ranks:\n{o.report}"
        for b, o in zip(blocks, outcomes)
    }


@pytest.fixture(scope="module")
def multi_rank_verdicts(request, tmp_path_factory) -> dict[str, str | None]:
    """The verdicts of the selected multi-rank blocks: one launch per rank count, not one per block."""
    selected = [item.callspec.params["block"] for item in request.session.items if _is_snippet_test(item)]
    by_ranks: dict[int, list[Block]] = {}
    for block in selected:
        if _ranks(block) is not None:
            by_ranks.setdefault(_ranks(block), []).append(block)
    verdicts = {}
    for ranks, group in by_ranks.items():
        verdicts.update(run_on_ranks(group, ranks, tmp_path_factory.mktemp(f"ranks{ranks}")))
    return verdicts


def _is_snippet_test(item: pytest.Item) -> bool:
    return getattr(item, "originalname", None) == "test_documented_code_runs" and item.module.__name__ == __name__


# ---- the tests -----------------------------------------------------------------------------------------


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' (mkdocs, mkdocs-material, mkdocstrings)")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").read_text().count("<tr>") > 10


@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.where)
def test_documented_code_runs(block, request, tmp_path):
    if _ranks(block) is None:
        run_block(block, _workdir(tmp_path))
        return
    verdict = request.getfixturevalue("multi_rank_verdicts")[block.where]
    if verdict is not None:
        pytest.fail(verdict, pytrace=False)


AVERAGING_EXAMPLES = {  # a README example (by a line of its code) -> its CO2 optimizer's name
    "co2_zero.deepspeed.initialize": "optimizer",
    "fully_shard(model, mesh=mesh)": "opt",
    "CO2OSS(": "opt",
}


@pytest.mark.parametrize("example", list(AVERAGING_EXAMPLES))
def test_readme_examples_average_two_replicas_on_the_ranks_they_name(example, tmp_path):
    """An example that names its ranks averages R = 2 replicas there, not one (R = 1 averages nothing)."""
    (block,) = [b for b in runnable() if b.where.startswith("README.md") and example in b.code]
    opt = AVERAGING_EXAMPLES[example]
    checked = block._replace(code=block.code + f"\nassert {opt}.topology.replicas == 2, {opt}.topology\n")
    verdict = run_on_ranks([checked], _ranks(block), tmp_path)[block.where]
    assert verdict is None, verdict


def test_every_command_block_is_run_or_says_what_it_needs():
    unmarked = []
    for b in blocks():
        if b.lang not in SHELL:
            continue
        needs = b.marker.startswith("needs: ") and b.marker.split()[1].rstrip(",") in NEEDS
        if not (RUN.match(b.marker) or needs or b.marker in ("main-command", "test-command")):
            unmarked.append(f"{b.where}: {b.code.splitlines()[0]!r} (marker: {b.marker!r})")
    assert not unmarked, (
        "command blocks that no test runs and that do not say what they need "
        f"(<!-- run --> or <!-- needs: {' | '.join(NEEDS)} -->):\n" + "\n".join(unmarked)
    )


def _hook():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import benchmarks

    return benchmarks


def test_readme_results_table_is_generated_from_the_benchmark_json():
    readme = (ROOT / "README.md").read_text()
    assert _hook().readme_results() in readme, (
        "README.md's results table differs from benchmarks/throughput/*.json; paste the output of "
        "`python docs/hooks/benchmarks.py`"
    )
    assert len(re.findall(r"^\|---", readme, re.M)) == 1, "README.md: one results table; the others live in docs/"


def test_the_pages_results_tables_are_generated_from_the_benchmark_json():
    """The throughput, elastic and quality tables are on the pages as markers the hook fills, not as copies."""
    pages = {
        "benchmarks.md": ("throughput", "elastic", "quality"),
        "elastic-job.md": ("elastic",),
        "wire-formats.md": ("wire_tuner",),
        "configuration.md": ("presets",),
    }
    missing = [
        f"docs/{page}: <!-- benchmark: {name} -->"
        for page, names in pages.items()
        for name in names
        if f"<!-- benchmark: {name} -->" not in (ROOT / "docs" / page).read_text()
    ]
    assert not missing and set(_hook().TABLES) >= {n for names in pages.values() for n in names}, missing


def test_install_commands_install_from_the_clone_and_the_extras_list_is_pyprojects():
    """co2_zero is installed from its checkout (`pip install -e '.[extra]'`), not by name from an index;
    every extra a page installs exists, and the index page's list of extras is pyproject.toml's."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    sources = [*PAGES, *sorted((ROOT / "co2_zero").rglob("*.py"))]
    by_name = [f"{p.relative_to(ROOT)}: {m}" for p in sources for m in re.findall(r"co2_zero\[\w+\]", p.read_text())]
    assert not by_name, f"installs co2_zero by name from an index, where it is not: {by_name}"
    installed = {e for p in PAGES for group in re.findall(r"pip install -e '\.\[([\w,]+)\]'", p.read_text())
                 for e in group.split(",")}  # fmt: skip
    assert installed and installed <= extras, installed - extras
    (listed,) = re.findall(r"^Extras: (.*?)\n\n", (ROOT / "docs" / "index.md").read_text(), re.M | re.S)
    assert set(re.findall(r"`(\w+)`", listed.split(": `pip install")[0])) == extras, listed


def test_no_page_says_the_default_applies_each_average_a_round_late():
    """With the defaults the average is applied as soon as its exchange is hidden (`sync_delay: "auto"`,
    design §3); a round late is CO2 as published. The pages, the package docstring and the `overlap`
    field's help (the generated reference) must not state the published schedule as what always happens."""
    import dataclasses

    import co2_zero
    from co2_zero import CO2Config

    texts = {str(p.relative_to(ROOT)): p.read_text() for p in PAGES}
    texts["co2_zero/__init__.py"] = co2_zero.__doc__
    texts["CO2Config.overlap"] = next(f for f in dataclasses.fields(CO2Config) if f.name == "overlap").metadata["doc"]
    stale = {name for name, text in texts.items() if re.search(r"appl(?:ied|ies it)\s+one\s+round\s+later?\b", text)}
    assert not stale, stale


def test_readme_links_resolve():
    """The README is not part of the site: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"


def test_the_wire_recipe_states_each_formats_measured_ratio():
    """One format, one ratio: docs/wire-formats.md's table of bytes per round says, at R = 2 and 4, what
    benchmarks/wire/wire.json measured from the wire (to the digits it shows), as benchmarks.md's generated
    table does."""
    measured = {(r["wire"], r["replicas"]): r["ratio_to_fp32"] for r in _hook()._load("wire/wire.json")["wire"]}
    section = (ROOT / "docs" / "wire-formats.md").read_text().split("## Choosing a wire format", 1)[1]
    rows = [line for line in section.split("\n\n", 2)[2].splitlines() if line.startswith("| ") and "×" not in line]
    wrong = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name, at2, at4 = cells[0], cells[4], cells[5]  # the wire bytes' ratios (after the payload's columns)
        topk = re.search(r"`topk` ([\d.]+)", name)
        dtype = name.split()[0].rstrip(",")
        label = f"top{100 * float(topk[1]):g}%-{dtype}" if topk else dtype
        for written, replicas in ((at2, 2), (at4, 4)):
            digits = len(written.partition(".")[2])
            if abs(float(written) - measured[(label, replicas)]) > 0.5 * 10**-digits + 1e-9:
                wrong.append(f"{label} at R = {replicas}: {written}, measured {measured[(label, replicas)]:.2f}")
    assert len(rows) > 5 and not wrong, wrong
