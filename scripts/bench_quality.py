"""Quality at speed (issue 22): the validation loss each method pays for local steps, at τ ∈ {8, 32, 128}.

P = 4 ranks on gloo over loopback (plain `torchrun --standalone`: the link does not change the loss,
τ does), one tiny byte-level GPT, the same inner steps, batch and data streams for every method
(so the same tokens), --rounds rounds at the largest τ. Methods:

  ddp                 all-reduce every step (no τ, no outer step: one run per seed serves every τ)
  diloco              blocking DiLoCo: overlap off, Nesterov outer momentum, no gap penalty (train_lm's preset)
  co2                 CO2 as published (train_lm's co2_published: co2_zero 0.1's defaults, `stand_in: shared`,
                      adaptive gap penalty, applied at the round end) at the outer lr / momentum of the cell
  co2_local           co2 with `stand_in: local` (below)
  diloco_local        DiLoCo's outer step overlapped a whole round late with `stand_in: local`: diloco_local_sync
                      without its sync delay, what that setting becomes where the link needs the whole round
  diloco_local_sync   DiLoCo's outer step (Nesterov 0.9, no penalty), overlapped with `stand_in: local` (each
                      replica starts a round from the outer step the average will take, on its own
                      displacement instead) and `sync_delay: SYNC_DELAY`: the average is applied that many
                      steps into the next round, not at its end, the replicas' progress rebased on it: the
                      defaults since 0.2 with the sync delay fixed (`"auto"` measures it on the job)
  diloco_local_sync_int8  the same with `comm_dtype: int8` (0.254× the bytes a round)
  diloco_local_sync_int4, _int2, _topk3_int2, _topk1.5_int2, _topk1_int2, _topk0.9_int2  the same with
                      `comm_dtype` int4 or int2, and with `topk` 3%, 1.5%, 1% or 0.9% of each chunk in int2 (the
                      sparse exchange), every --taus, the fp32 defaults' outer lr; each
                      cell records the bytes its rank 0 sent
  diloco_local_sync_topk3_int2_decay, _topk1.5_int2_decay, _topk0.9_int2_decay  the same with SparseLoCo's
                      decaying residual, `feedback_decay` 0.95 (its plain outer step: --grid METHOD:1:0)
  torchft_diloco      torchft's DiLoCo and Streaming DiLoCo (2 fragments), driven by scripts/torchft_peer.py
  torchft_streaming   --replicas P: a Lighthouse and P replicas of one rank, the diloco preset's outer
                      optimizer (Nesterov) at the cell's outer lr / momentum, fp32 (unavailable without torchft)

Tuning: per method and τ, every (outer lr, momentum) of the method's grid with the first seed; the
best is then confirmed with the other seeds. co2_local and diloco_local, the stand-in ablation, run at
τ 32 only (ABLATION_TAUS). The retired eager stand-in's cells (co2_eager, diloco_eager) stay in the
committed JSON; they are no longer run. Each run is one cell, (method, τ, outer lr, momentum,
seed), written to <out_dir>/cells/<name>.json when it finishes; a cell whose JSON exists is skipped,
so the study resumes where it stopped. The summary (also alone: --summary) writes

  <out_dir>/quality.json           every cell (the whole grid), the table, time-to-target, what is missing
  <out_dir>/quality.md             method × τ: best setting, final val loss (mean, min–max over seeds),
                                   gap to ddp next to the published gaps; the grid; the wall-clock to ddp's
                                   final loss and to within 2/5/10% of it, from the study model's tokens/s
  <out_dir>/quality_tau<τ>.png     validation loss vs tokens, one picture per τ
  <out_dir>/quality_<rate>.png     validation loss vs wall-clock on that link, from bench_throughput's tokens/s

    python -m scripts.bench_quality --plan         # the cells left and the hours they need
    python -m scripts.bench_quality                # run them (resumable), then the summary
    python -m scripts.bench_quality --summary      # only the summary from the cells there are
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

from co2_zero.train.cli import ToolParser, run_tool
from scripts import bench_compression as bcomp
from scripts import bench_convergence as bc

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "scripts" / "torchft_peer.py"
# the defaults on a compressed wire: method -> (comm_dtype, topk)
WIRE = {"diloco_local_sync_int8": ("int8", 1.0), "diloco_local_sync_int4": ("int4", 1.0),
        "diloco_local_sync_int2": ("int2", 1.0), "diloco_local_sync_topk3_int2": ("int2", 0.03),
        "diloco_local_sync_topk1.5_int2": ("int2", 0.015), "diloco_local_sync_topk1_int2": ("int2", 0.01),
        "diloco_local_sync_topk0.9_int2": ("int2", 0.009), "diloco_local_sync_topk1.5_int2_decay": ("int2", 0.015),
        "diloco_local_sync_topk0.9_int2_decay": ("int2", 0.009),
        "diloco_local_sync_topk3_int2_decay": ("int2", 0.03)}  # fmt: skip
# SparseLoCo's decaying error feedback (`feedback_decay`) where a wire method sets one
DECAY = {"diloco_local_sync_topk1.5_int2_decay": 0.95, "diloco_local_sync_topk0.9_int2_decay": 0.95,
         "diloco_local_sync_topk3_int2_decay": 0.95}  # fmt: skip
CO2_FAMILY = ("diloco", "co2", "co2_local", "diloco_local", "diloco_local_sync", *WIRE)
STAND_IN = {"co2_local": "local", "diloco_local": "local", "diloco_local_sync": "local", **{m: "local" for m in WIRE}}
# with the config field `sync_delay`: min(SYNC_DELAY, τ) steps, what the study model's exchange needs at 100 Mbit/s
# (its blocking DiLoCo runs 18% slower than CO2 at τ 32 there: the exchange takes about 6 of its steps)
SYNCED = ("diloco_local_sync", *WIRE)
SYNC_DELAY = 8
# the diloco preset's outer step
DILOCO_STEP = ("diloco", "diloco_local", "diloco_local_sync", *WIRE)
PEERS = {"torchft_diloco": "diloco", "torchft_streaming": "streaming"}  # method -> the peer's algorithm
METHODS = ("ddp", *CO2_FAMILY, *PEERS)
# (outer lrs, outer momenta) tried per method at every τ. The DiLoCo family keeps Nesterov 0.9 and
# tunes the outer lr, as the issue and Charles et al. (2503.09799) do; CO2 tunes its momentum as well
# (0.8 too: at τ 32 its loss fell with the momentum up to the old grid's edge, 0.5), and so does
# diloco_local: a one-round-late Nesterov step may overshoot at 0.9, so it gets the lower momentum a
# delayed update needs as well.
NESTEROV_GRID = ((0.5, 0.7, 1.0), (0.9,))
CO2_GRID = ((0.5, 0.7, 1.0), (0.0, 0.5, 0.8))
GRIDS = {
    "diloco": NESTEROV_GRID,
    "co2": CO2_GRID,
    "diloco_local": ((0.5, 0.7, 1.0), (0.5, 0.9)),  # a round late, 0.9 may overshoot
    "co2_local": ((0.5, 0.7, 1.0), (0.8,)),  # 0.5 lost on the device (1.56 vs 1.47)
    "diloco_local_sync": NESTEROV_GRID,
    **{m: ((0.5,), (0.9,)) for m in WIRE},  # the fp32 defaults' best at τ 32: the wire format alone
    "torchft_diloco": NESTEROV_GRID,
    "torchft_streaming": NESTEROV_GRID,
}
# "METHOD@τ": that τ's own grid, where the best setting moves off GRIDS[METHOD]. The best outer lr rises with
# H (Charles et al.), so it falls at small τ: blocking DiLoCo at τ 8 was best at 0.5, NESTEROV_GRID's edge
# (1.363 at seed 1337, against 1.388 at 0.7 and 1.434 at 1.0), then at 0.2 (1.342; 0.3: 1.347), so the grid
# reaches 0.1 (the cells off it stay in the JSON)
GRIDS.update({f"{m}@8": ((0.1, 0.2, 0.3, 0.5), (0.9,)) for m, g in GRIDS.items() if g == NESTEROV_GRID})
# and rises at large τ: at τ 128 blocking DiLoCo, Streaming DiLoCo and diloco_local_sync were all best at 1.0,
# NESTEROV_GRID's top, so their τ 128 grid goes on to 1.4
GRIDS.update({f"{m}@128": ((0.5, 0.7, 1.0, 1.4), (0.9,)) for m, g in GRIDS.items() if g == NESTEROV_GRID})
# At τ 32 the defaults (diloco_local_sync), Streaming DiLoCo and diloco_local were best at 0.5, the grid's
# bottom, so their τ 32 grid goes down to 0.3; diloco_local (a whole round late) was best there again
# (1.342 against 1.356 at 0.5, seed 1337), so its grid goes on to 0.2
GRIDS.update(
    {f"{m}@32": ((0.3, *GRIDS[m][0]), GRIDS[m][1]) for m in ("diloco_local_sync", "torchft_streaming", "diloco_local")}
)
GRIDS["diloco_local@32"] = ((0.2, *GRIDS["diloco_local@32"][0]), GRIDS["diloco_local@32"][1])
# the stand-in ablation's own methods run at these τ only (every other method at every --taus): which
# stand-in a one-round-late average needs is asked once, where the study's comparison is closest
ABLATION_TAUS = {
    "co2_local": (32,),
    "diloco_local": (32,),
    **{m: (8, 32, 128) for m in WIRE},
}
# method -> bench_throughput run labels whose tokens/s it has on a link, first found wins: blocking
# DiLoCo exchanges exactly what blocking Local SGD does (the outer step differs only in its math)
THROUGHPUT_LABELS = {
    "ddp": ("ddp",),
    "diloco": ("diloco", "localsgd"),
    "co2": ("co2",),
    "diloco_local": ("co2",),
    "co2_local": ("co2",),
    "diloco_local_sync": (),  # applied after SYNC_DELAY steps: only its own run says whether that hides the exchange
    **{m: () for m in WIRE},
    "torchft_diloco": (),  # torchft's own runs (bench_throughput's torchft labels): OWN_RUN_LABELS
    "torchft_streaming": (),
}
# method -> the bench_throughput run label of its own run (--throughput RATE:METHOD=FILE)
OWN_RUN_LABELS = {"diloco_local_sync": "co2", "torchft_diloco": "torchft-diloco",
                  "torchft_streaming": "torchft-streaming"}  # fmt: skip
PUBLISHED = {
    "ddp": "–",
    "diloco": "+2.0% (35M, M=4, H=30), +0.3% (2.4B, M=4): Charles et al. 2503.09799",
    "co2": "ours before (benchmarks, compressed exchange): +16–20% at τ 27–64 with 12–27 rounds",
    "diloco_local": "–",
    "co2_local": "–",
    "diloco_local_sync": "a sync overlapped by a few steps costs about nothing: Douillard et al. 2501.18512",
    **{m: "4-bit exchange at similar quality: Douillard et al. 2501.18512" for m in WIRE},
    "diloco_local_sync_topk3_int2": "top-k 1–3% + 2 bits, better than DiLoCo: SparseLoCo 2508.15706",
    "diloco_local_sync_topk1.5_int2": "1.56%, 2 bits: Covenant-72B 2603.08163, SparseLoCo 2508.15706",
    "diloco_local_sync_topk1_int2": "top-k 1–3% + 2 bits, better than DiLoCo: SparseLoCo 2508.15706",
    "diloco_local_sync_topk0.9_int2": "top-k 1–3% + 2 bits, better than DiLoCo: SparseLoCo 2508.15706",
    **{m: "decaying error feedback as the outer momentum: SparseLoCo 2508.15706" for m in DECAY},
    "torchft_diloco": "as diloco",
    "torchft_streaming": "similar to DiLoCo at ~100× less bandwidth: Douillard et al. 2501.18512",
}
# the study model's own tokens/s on each link (bench_throughput.py at P = 4, τ 32; docs/benchmarks.md has the command)
THROUGHPUT_DIR = ROOT / "benchmarks" / "quality"
PEER_TIMEOUT_S = 3600  # a torchft cell's own deadline (torchft_peer --launch_timeout_s): it stops its processes


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training run of the study. ddp has no τ and no outer step (tau, outer_lr, momentum: None)."""

    method: str
    tau: Optional[int]
    outer_lr: Optional[float]
    momentum: Optional[float]
    seed: int

    @property
    def name(self) -> str:
        """The cell's file stem, unique per cell: ddp_s1337, co2_tau32_lr0.7_m0.5_s1337."""
        if self.tau is None:
            return f"{self.method}_s{self.seed}"
        return f"{self.method}_tau{self.tau}_lr{self.outer_lr:g}_m{self.momentum:g}_s{self.seed}"

    @property
    def setting(self) -> tuple:
        """The (method, τ, outer lr, momentum) its seeds repeat."""
        return self.method, self.tau, self.outer_lr, self.momentum


def get_args(argv: Optional[Sequence[str]] = None):
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--taus", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339],
                   help="the first tunes the grid, all of them confirm its best")  # fmt: skip
    p.add_argument("--steps", type=int, default=12_800, help="inner steps per rank of every run (100 rounds at τ 128)")
    p.add_argument("--eval_points", type=int, default=20, help="validations per run besides the start")
    p.add_argument("--nodes", type=int, default=4, help="ranks, one replica each")
    p.add_argument("--grid", action="append", default=[], metavar="METHOD[@TAU]:LRS:MOMENTA",
                   help="replace a method's grid (at one τ: @TAU), e.g. diloco:0.5,0.7:0.9 (repeatable)")  # fmt: skip
    p.add_argument("--model", default="--n_layer 2 --n_embd 64 --n_head 2 --block_size 32 --batch_size 8",
                   help="train_lm.py model/batch flags (118k parameters, 1,024 tokens per step at P = 4)")  # fmt: skip
    p.add_argument("--extra", default="--lr 3e-3 --min_lr 3e-4 --warmup_steps 200 --eval_batches 256",
                   help="more train_lm.py flags of every run")  # fmt: skip
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "quality"))
    p.add_argument("--throughput", nargs="+", metavar="RATE=FILE",
                   default=[f"100mbit={THROUGHPUT_DIR / 'throughput_P4_100mbit_study.json'}",
                            f"1gbit={THROUGHPUT_DIR / 'throughput_P4_1gbit_study.json'}",
                            f"100mbit:diloco_local_sync={THROUGHPUT_DIR / 'throughput_P4_100mbit_study_sync8.json'}",
                            f"1gbit:diloco_local_sync={THROUGHPUT_DIR / 'throughput_P4_1gbit_study_sync8.json'}",
                            *(f"{rate}:{method}={THROUGHPUT_DIR / f'throughput_P4_{rate}_study_torchft.json'}"
                              for rate in ("100mbit", "1gbit") for method in PEERS)],
                   help="bench_throughput.py results whose P = --nodes cell gives each method's tokens/s; "
                        "RATE:METHOD=FILE: METHOD's own run, labelled OWN_RUN_LABELS[METHOD] there")  # fmt: skip
    p.add_argument("--max_cells", type=int, default=0, help="stop after this many runs (0: all)")
    p.add_argument("--plan", action="store_true", help="print the cells left and an estimate of their hours")
    p.add_argument("--summary", action="store_true", help="only build the summary from the cells there are")
    p.add_argument("--cells_only", action="store_true",
                   help="run the cells only (the summary needs matplotlib)")  # fmt: skip
    p.add_argument("--minutes_per_cell", type=float, default=5.0, help="--plan's estimate before any cell ran")
    return p.parse_args(argv)


def grids(overrides: Sequence[str]) -> dict:
    """GRIDS with the --grid overrides applied: METHOD replaces the method's grid at every τ (its τ's own
    grids too), METHOD@τ at that τ only."""
    out = dict(GRIDS)
    for spec in overrides:
        key, _, rest = spec.partition(":")
        lrs, _, moms = rest.partition(":")
        method, at, tau = key.partition("@")
        if method not in GRIDS or "@" in method or (at and not tau.isdigit()) or not lrs or not moms:
            names = [m for m in GRIDS if "@" not in m]
            raise SystemExit(f"--grid {spec!r}: accepted METHOD:LRS:MOMENTA or METHOD@TAU:LRS:MOMENTA, METHOD in "
                             f"{names}, e.g. diloco:0.5,0.7:0.9 or co2@8:0.3:0.5")  # fmt: skip
        if not at:
            out = {k: v for k, v in out.items() if not k.startswith(f"{method}@")}
        out[key] = (tuple(map(float, lrs.split(","))), tuple(map(float, moms.split(","))))
    return out


def method_grid(grid: dict, method: str, tau: int) -> tuple:
    """(outer lrs, momenta) tried for `method` at τ `tau`: that τ's own grid where `grid` has one."""
    return grid.get(f"{method}@{tau}", grid[method])


# ---- availability and commands -----------------------------------------------------------------------


def unavailable(method: str) -> Optional[str]:
    """Why `method` cannot run in this tree, or None."""
    if method in STAND_IN:
        from co2_zero import CO2Config
        from co2_zero.train.args import CO2_FLAGS

        if "stand_in" not in {f.name for f in dataclasses.fields(CO2Config)}:
            return "unavailable: needs the stand_in field (CO2Config.stand_in)"
        if "stand_in" not in CO2_FLAGS:
            return "unavailable: needs train_lm.py's --stand_in flag"
    if method in SYNCED:
        from co2_zero import CO2Config
        from co2_zero.train.args import CO2_FLAGS

        if "sync_delay" not in {f.name for f in dataclasses.fields(CO2Config)} or "sync_delay" not in CO2_FLAGS:
            return "unavailable: needs the sync_delay field (CO2Config.sync_delay) and train_lm.py's --sync_delay"
    if method in PEERS:
        if not PEER.is_file():
            return "unavailable: needs scripts/torchft_peer.py"
        try:
            import torchft  # noqa: F401
        except ImportError:
            return "unavailable: needs torchft (pip install torchft==0.2.0)"
    return None


def train_flags(cell: Cell, steps: int, eval_points: int, common: Sequence[str]) -> list[str]:
    """train_lm.py flags of a cell, --out_json left to the caller (torchft's: the diloco preset's, which
    scripts/torchft_peer.py reads its outer optimizer from, and round-end log points as CO2's)."""
    label = "ddp" if cell.method == "ddp" else "co2"
    flags = [*bcomp.schedule(label, cell.tau or 1, steps, eval_points), "--max_steps", str(steps),
             "--seed", str(cell.seed), "--no_progress", *common]  # fmt: skip
    if cell.method == "ddp":
        return [*flags, "--method", "ddp"]
    method = ["--method", "diloco"] if cell.method in (*DILOCO_STEP, *PEERS) else ["--method", "co2_published"]
    schedule = ["--stand_in", STAND_IN[cell.method]] if cell.method in STAND_IN else []
    if cell.method in WIRE:
        schedule += ["--comm_dtype", WIRE[cell.method][0], "--topk", str(WIRE[cell.method][1])]
        schedule += ["--feedback_decay", str(DECAY[cell.method])] if cell.method in DECAY else []
    # the diloco preset blocks; its overlapped variants overlap, a whole round late unless SYNCED (never
    # "auto": a cell's trajectory must not depend on the host's timing)
    if cell.method in DILOCO_STEP and cell.method != "diloco":
        delay = min(SYNC_DELAY, cell.tau) if cell.method in SYNCED else cell.tau
        schedule += ["--overlap", "--sync_delay", str(delay)]
    return [*flags, *method, *schedule, "--outer_lr", str(cell.outer_lr), "--outer_momentum", str(cell.momentum)]


def peer_command(cell: Cell, steps: int, eval_points: int, common: Sequence[str], nodes: int,
                 out_json: Path) -> list[str]:  # fmt: skip
    """scripts/torchft_peer.py's command for a torchft cell: `nodes` replicas on the same model, data,
    seeds, steps, τ, outer lr / momentum and validation points as train_lm.py's cells, --out_json in
    train_lm.py's JSON-lines format."""
    return [sys.executable, "-m", "scripts.torchft_peer", "--peer", PEERS[cell.method], "--replicas", str(nodes),
            "--launch_timeout_s", str(PEER_TIMEOUT_S), *train_flags(cell, steps, eval_points, common),
            "--out_json", str(out_json)]  # fmt: skip


# ---- which cells ---------------------------------------------------------------------------------------


def grid_cells(method: str, tau: int, grid: tuple, seed: int) -> list[Cell]:
    """Every (outer lr, momentum) of `grid` at one seed."""
    lrs, moms = grid
    return [Cell(method, tau, lr, m, seed) for lr in lrs for m in moms]


def best_setting(results: dict[str, dict], cells: Sequence[Cell]) -> Optional[Cell]:
    """The grid cell with the lowest final validation loss, once every cell of the grid is done
    (results: cell name -> its JSON); None before. Ties: the first in grid order."""
    if not cells or any(c.name not in results for c in cells):
        return None
    return min(cells, key=lambda c: results[c.name]["final_val_loss"])


def planned_cells(methods: Sequence[str], taus: Sequence[int], seeds: Sequence[int], grid: dict,
                  results: dict[str, dict]) -> tuple[list[Cell], dict[tuple, int]]:  # fmt: skip
    """(every cell known so far, in run order; (method, τ) -> confirmation cells not known yet).
    ddp: one cell per seed. Others, per τ (ABLATION_TAUS's methods: only at theirs): the grid at the
    first seed, then the grid's best at the other seeds (known only once the grid is complete)."""
    cells = [Cell("ddp", None, None, None, s) for s in seeds] if "ddp" in methods else []
    pending = {}
    for tau in taus:
        for method in (m for m in methods if m != "ddp" and tau in ABLATION_TAUS.get(m, (tau,))):
            tried = grid_cells(method, tau, method_grid(grid, method, tau), seeds[0])
            cells += tried
            best = best_setting(results, tried)
            if best is None:
                pending[(method, tau)] = len(seeds) - 1
            else:
                cells += [dataclasses.replace(best, seed=s) for s in seeds[1:]]
    return cells, pending


def run_config(a) -> dict:
    """What every cell of one study shares; a cell of another study must not be mixed in."""
    return {"steps": a.steps, "nodes": a.nodes, "model": a.model, "extra": a.extra, "eval_points": a.eval_points}


def cells_to_run(methods: Sequence[str], taus: Sequence[int], seeds: Sequence[int], grid: dict,
                 results: dict[str, dict]) -> tuple[list[Cell], dict[tuple, int]]:  # fmt: skip
    """planned_cells without the cells whose JSON exists (they are skipped, not run again)."""
    cells, pending = planned_cells(methods, taus, seeds, grid, results)
    return [c for c in cells if c.name not in results], pending


def load_results(cells_dir: Path, config: dict) -> dict[str, dict]:
    """cell name -> its JSON, for every finished cell under `cells_dir`. Raises SystemExit, naming the
    file and the field, for a cell of another study (other steps, ranks, model or flags)."""
    results = {}
    for path in sorted(cells_dir.glob("*.json")):
        cell = json.loads(path.read_text())
        for key, value in config.items():
            if cell.get(key) != value:
                raise SystemExit(f"{path}: {key} = {cell.get(key)!r}, this study's is {value!r}; accepted: the "
                                 "same study's cells (another --out_dir for another study)")  # fmt: skip
        results[path.stem] = cell
    return results


def plan_text(todo: Sequence[Cell], pending: dict[tuple, int], minutes: dict[str, float],
              skipped: dict[str, str]) -> str:  # fmt: skip
    """What --plan prints: the cells left, the confirmations still unknown, the hours (one estimate
    per entry of `minutes`: name -> minutes per cell)."""
    n = len(todo) + sum(pending.values())
    lines = [f"{len(todo)} cells to run now" + "".join(f"\n  {c.name}" for c in todo)]
    lines += [f"{k} confirmation cells of {m} τ={t} once its grid is done" for (m, t), k in pending.items()]
    lines += [f"{m}: {why}" for m, why in skipped.items()]
    lines += [f"total {n} cells × {x:.1f} min ≈ {n * x / 60:.1f} h ({name})" for name, x in minutes.items()]
    return "\n".join(lines)


def minutes_per_cell(results: dict[str, dict], default: float, cores: int) -> dict[str, float]:
    """Minutes per cell: the median wall-clock of the cells run so far, and the median of their CPU
    seconds spread over `cores` (what a quiet host of that many cores needs: on a shared host the
    wall-clock is inflated, the CPU seconds much less); `default` before any cell ran."""
    walls = [r["wall_s"] for r in results.values() if r.get("wall_s")]
    cpus = [r["cpu_s"] for r in results.values() if r.get("cpu_s")]
    if not walls:
        return {"assumed, no cell run yet": default}
    out = {"median wall-clock of the cells run": statistics.median(walls) / 60}
    if cpus:
        out[f"their median CPU seconds over {cores} quiet cores"] = statistics.median(cpus) / cores / 60
    return out


# ---- one cell ------------------------------------------------------------------------------------------


def run_cell(cell: Cell, a, steps: int, cells_dir: Path, log_root: Path) -> dict:
    """Train one cell and write its JSON (atomically: a half-written file would count as done)."""
    log_dir = log_root / cell.name
    log_dir.mkdir(parents=True, exist_ok=True)
    out_json = log_dir / "train.jsonl"
    common = [*a.model.split(), *a.extra.split()]
    load_before = os.getloadavg()
    began, cpu_before = time.time(), _children_cpu_s()
    if cell.method in PEERS:
        cmd = peer_command(cell, steps, a.eval_points, common, a.nodes, out_json)
        with open(log_dir / "peer.log", "w") as log:
            subprocess.run(
                cmd, check=True, cwd=ROOT, timeout=PEER_TIMEOUT_S + 120, stdout=log, stderr=subprocess.STDOUT
            )
        command = shlex.join(cmd[1:-2])
    else:
        flags = [*train_flags(cell, steps, a.eval_points, common), "--out_json", str(out_json)]
        bcomp.run_unshaped(a.nodes, flags, log_dir)
        command = shlex.join(["torchrun", "--standalone", "--nproc_per_node", str(a.nodes), "scripts/train_lm.py",
                              *flags[:-2]])  # fmt: skip
    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    result = {**dataclasses.asdict(cell), "name": cell.name, "command": command, **run_config(a),
              "wall_s": round(time.time() - began, 1), "cpu_s": round(_children_cpu_s() - cpu_before, 1),
              "host": {"cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
                       "python": platform.python_version(), "torch": metadata.version("torch")},
              "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **bc.curve(records), **wire_record(records)}  # fmt: skip
    tmp = cells_dir / f".{cell.name}.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(cells_dir / f"{cell.name}.json")
    return result


def wire_record(records: Sequence[dict]) -> dict:
    """The bytes rank 0 sent over the run, its rounds, the payload ratio and the sparse overlap per round (train_lm's
    summary record; ddp: none)."""
    end = next((r for r in records if r.get("summary")), {})
    if not end.get("rounds"):
        return {}
    overlap = end.get("senders_per_sent") or []
    return {
        "bytes_sent": end["bytes_sent"],
        "rounds": end["rounds"],
        "bytes_per_round": end["bytes_sent"] / end["rounds"],
        "payload_ratio": end.get("payload_ratio"),  # fp32 bytes over one replica's payload (the field's measure)
        "senders_per_sent": overlap,  # the sparse exchange's, per round (1: no two replicas sent a coordinate)
    }


def _children_cpu_s() -> float:
    """User + system CPU seconds of every finished child process so far (torchrun waits for its ranks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---- summary -------------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict:
    """mean, min, max and n of a few numbers (the seeds of one setting)."""
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "n": len(values)}


def seed_runs(results: dict[str, dict], setting: tuple) -> list[dict]:
    """The finished cells of one (method, τ, outer lr, momentum), by seed."""
    runs = [r for r in results.values() if row_setting(r) == setting]
    return sorted(runs, key=lambda r: r["seed"])


def cell_order(cell: dict) -> tuple:
    """Sort key of cells' JSON: method (as METHODS lists them; a retired one's cells last), τ, outer lr,
    momentum, seed."""
    method = METHODS.index(cell["method"]) if cell["method"] in METHODS else len(METHODS)
    return method, cell["tau"] or 0, cell["outer_lr"] or 0, cell["momentum"] or 0, cell["seed"]


def row_setting(row: dict) -> tuple:
    """The (method, τ, outer lr, momentum) of a table row or a cell's JSON."""
    return row["method"], row["tau"], row["outer_lr"], row["momentum"]


def mean_curve(runs: Sequence[dict]) -> tuple[list[float], list[float]]:
    """(tokens, validation loss averaged over the runs) at their common validation points."""
    n = min(len(r["val_loss"]) for r in runs)
    return runs[0]["tokens"][:n], [statistics.mean(r["val_loss"][i] for r in runs) for i in range(n)]


def table_rows(results: dict[str, dict], methods: Sequence[str], taus: Sequence[int], grid: dict,
               first_seed: int) -> list[dict]:  # fmt: skip
    """One row per (method, τ) with a finished grid (ddp: one row): the best setting, its final
    validation loss over seeds, and the gap to ddp: of the means, and per seed (same seed = same
    held-out batches and data), mean and min–max."""
    ddp = {r["seed"]: r["final_val_loss"] for r in seed_runs(results, ("ddp", None, None, None))}
    rows = []
    for method in methods:
        for tau in [None] if method == "ddp" else taus:
            if method == "ddp":
                best = Cell("ddp", None, None, None, first_seed) if ddp else None
            else:
                best = best_setting(results, grid_cells(method, tau, method_grid(grid, method, tau), first_seed))
            if best is None:
                continue
            runs = seed_runs(results, best.setting)
            row = {"method": method, "tau": tau, "outer_lr": best.outer_lr, "momentum": best.momentum,
                   "final_val_loss": spread([r["final_val_loss"] for r in runs]), "seeds": [r["seed"] for r in runs],
                   "published": PUBLISHED[method], "at_edge": at_edge(results, best)}  # fmt: skip
            if ddp:
                row["gap_of_means"] = row["final_val_loss"]["mean"] / statistics.mean(ddp.values()) - 1
                paired = [r["final_val_loss"] / ddp[r["seed"]] - 1 for r in runs if r["seed"] in ddp]
                row["gap_per_seed"] = spread(paired) if paired else None
            rows.append(row)
    return rows


def at_edge(results: dict[str, dict], best: Cell) -> list[str]:
    """Which of the best setting's outer lr and momentum is the largest or smallest value tried for its
    method and τ (any cell at its seed, on the grid or off it): a better one may lie beyond. [] for ddp."""
    if best.tau is None:
        return []
    tried = [r for r in results.values() if (r["method"], r["tau"], r["seed"]) == (best.method, best.tau, best.seed)]
    edges = []
    for name, key, value in (("outer lr", "outer_lr", best.outer_lr), ("momentum", "momentum", best.momentum)):
        values = {r[key] for r in tried}
        if len(values) > 1 and value in (min(values), max(values)):
            edges.append(name)
    return edges


def link_tokens_per_s(throughput: dict, nodes: int, method: str, tau: Optional[int] = None,
                      labels: Optional[Sequence[str]] = None) -> Optional[dict]:  # fmt: skip
    """The measured steady-state tokens/s of `method` in a bench_throughput.py result's P = `nodes`
    cell: {tokens_per_s, label, tau} of the first of `labels` (default THROUGHPUT_LABELS[method]) it has,
    or None. A local-step method run at τ `tau` takes only a run at that τ or below: a larger τ exchanges
    less often, so a run at a smaller τ is a lower bound of its speed, one at a larger τ would overstate it."""
    for cell in throughput["cells"]:
        if cell["nodes"] != nodes:
            continue
        for label in labels if labels is not None else THROUGHPUT_LABELS.get(method, ()):
            if label in cell["summary"]:
                row = cell["summary"][label]
                measured_tau = row.get("tau", cell.get("tau"))
                if method != "ddp" and tau is not None and measured_tau is not None and measured_tau > tau:
                    continue
                return {"tokens_per_s": row["tokens_per_s"], "label": label, "tau": measured_tau}
    return None


def own_run_tokens_per_s(own: dict, main: dict, nodes: int, tau: Optional[int], label: str) -> Optional[dict]:
    """A method's own bench_throughput run (labelled `label` there), on the scale of the `main` file: its speed
    relative to a run both files have, side by side in its own file (blocking DiLoCo, else compute-only),
    times that run's tokens/s in `main`. The files ran at other times, on a host whose speed and
    contention drift; every other method's tokens/s comes from `main`."""
    ran = link_tokens_per_s(own, nodes, label, tau, labels=(label,))
    for anchor in ("diloco", "none"):
        there = link_tokens_per_s(own, nodes, anchor, None, labels=(anchor,))
        here = link_tokens_per_s(main, nodes, anchor, None, labels=(anchor,))
        if ran is not None and there is not None and here is not None:
            ratio = ran["tokens_per_s"] / there["tokens_per_s"]
            label = f"its own run: {ratio:.3f} × {anchor}'s beside it"
            return {**ran, "tokens_per_s": ratio * here["tokens_per_s"], "label": label}
    return None


# the losses the wall-clock table asks each method to reach: ddp's mean final loss, then that plus a margin
# (the local-step methods rarely reach ddp's own loss within the budget; a user still asks how long to within 5%)
TARGET_MARGINS = (0.0, 0.02, 0.05, 0.10)


def time_to_target(results: dict[str, dict], rows: Sequence[dict], throughputs: dict[str, dict],
                   nodes: int, margins: Sequence[float] = TARGET_MARGINS) -> list[dict]:  # fmt: skip
    """Per row and link rate: for each margin m, the tokens its mean curve needs to reach ddp's mean final
    loss × (1 + m) (linear between validation points; None: not within the budget) and the seconds that
    takes at the method's measured tokens/s on that link; and the seconds of the whole budget there."""
    ddp_rows = [r for r in rows if r["method"] == "ddp"]
    if not ddp_rows:
        return []
    ddp_final = ddp_rows[0]["final_val_loss"]["mean"]
    out = []
    for row in rows:
        curve = mean_curve(seed_runs(results, row_setting(row)))
        tokens = [bcomp.seconds_to_reach(curve, ddp_final * (1 + m)) for m in margins]
        for rate in link_rates(throughputs):
            own = throughputs.get(f"{rate}:{row['method']}")  # the method's own run
            if own is not None:
                speed = own_run_tokens_per_s(own, throughputs[rate], nodes, row["tau"], OWN_RUN_LABELS[row["method"]])
            else:
                speed = link_tokens_per_s(throughputs[rate], nodes, row["method"], row["tau"])
            per_s = speed["tokens_per_s"] if speed else None
            targets = [{"margin": m, "loss": ddp_final * (1 + m), "tokens": t,
                        "seconds": t / per_s if t is not None and per_s else None}
                       for m, t in zip(margins, tokens)]  # fmt: skip
            out.append({"method": row["method"], "tau": row["tau"], "rate": rate, "throughput": speed,
                        "targets": targets, "budget_seconds": curve[0][-1] / per_s if per_s else None})  # fmt: skip
    return out


def link_rates(throughputs: dict) -> list[str]:
    """The link rates of --throughput's files (RATE=FILE; not a method's own RATE:METHOD=FILE)."""
    return [key for key in throughputs if ":" not in key]


def summary(a, results: dict[str, dict], steps: int, out_dir: Path) -> dict:
    """quality.json, quality.md and the plots from the finished cells."""
    grid = grids(a.grid)
    skipped = {m: why for m in a.methods if (why := unavailable(m))}
    throughputs = {rate: json.loads(Path(path).read_text())
                   for rate, _, path in (x.partition("=") for x in a.throughput)}  # fmt: skip
    rows = table_rows(results, a.methods, a.taus, grid, a.seeds[0])
    todo, pending = cells_to_run([m for m in a.methods if m not in skipped], a.taus, a.seeds, grid, results)
    result = {
        "command": "python -m scripts.bench_quality " + shlex.join(sys.argv[1:]),
        "nodes": a.nodes, "taus": a.taus, "seeds": a.seeds, "steps": steps, "model": a.model, "extra": a.extra,
        "grids": {k: g for k, g in grid.items() if k.partition("@")[0] in a.methods}, "unavailable": skipped,
        "throughput_models": {rate: t.get("model") for rate, t in throughputs.items()},
        "throughput_files": {rate: _relative(path) for rate, _, path in (x.partition("=") for x in a.throughput)},
        "remaining_cells": len(todo) + sum(pending.values()),
        "table": rows, "time_to_target": time_to_target(results, rows, throughputs, a.nodes),
        "cells": sorted(results.values(), key=cell_order),
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quality.json").write_text(json.dumps(result, indent=1))
    (out_dir / "quality.md").write_text(markdown(result))
    if rows:
        plots(result, results, out_dir)
    return result


def _relative(path: str) -> str:
    """`path` relative to the checkout where it lies inside it (the JSON stays the same on any machine)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:+.2f}%"


def _setting(row: dict) -> str:
    if row["outer_lr"] is None:
        return "–"
    edge = f" ({' and '.join(row['at_edge'])} at the edge of those tried)" if row.get("at_edge") else ""
    return f"lr {row['outer_lr']:g}, m {row['momentum']:g}{edge}"


def overview(result: dict) -> list[str]:
    """The README's table: per method (in METHODS order) and τ, its best setting's mean final validation
    loss, the gap of the means to ddp and the seeds run; ddp's one row under every τ, – where a grid is
    not done. The full table (settings, ranges, published gaps) is markdown()'s."""
    taus, rows = result["taus"], {(r["method"], r["tau"]): r for r in result["table"]}
    lines = ["| method | " + " | ".join(f"τ = {t}" for t in taus) + " |", "|---" * (len(taus) + 1) + "|"]
    for method in (m for m in METHODS if any(key[0] == m for key in rows)):
        cells = []
        for tau in taus:
            row = rows.get((method, None if method == "ddp" else tau))
            if row is None:
                cells.append("–")
                continue
            v, gap = row["final_val_loss"], "" if method == "ddp" else f"{100 * row['gap_of_means']:+.1f}%, "
            cells.append(f"{v['mean']:.4f} ({gap}{v['n']})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    lines = [
        "# Quality at speed: validation loss of local-step methods against DDP (issue 22)",
        "",
        f"P = {result['nodes']} ranks on gloo over loopback (no link shaping), {result['steps']:,} inner steps per "
        f"rank for every run (the same tokens and data streams), model/batch `{result['model']}`, `{result['extra']}`. "
        f"Best outer setting per method and τ from the grid at seed {result['seeds'][0]}, confirmed on seeds "
        f"{result['seeds']}. Final validation loss: mean [min–max] over seeds; gap: of the means, and per seed "
        "(each seed's own ddp run: same held-out batches) mean [min–max].",
        "",
        "| method | τ | best setting | final val loss | gap to ddp | gap per seed | published gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["table"]:
        v, g = row["final_val_loss"], row.get("gap_per_seed")
        per_seed = f"{_pct(g['mean'])} [{_pct(g['min'])}, {_pct(g['max'])}]" if g else ""
        lines.append(f"| {row['method']} | {row['tau'] or '–'} | {_setting(row)} | {v['mean']:.4f} "
                     f"[{v['min']:.4f}–{v['max']:.4f}] ({v['n']}) | {_pct(row.get('gap_of_means'))} | {per_seed} | "
                     f"{row['published']} |")  # fmt: skip
    lines += ["", "Unavailable here: " + ("; ".join(f"{m}: {w}" for m, w in result["unavailable"].items()) or "none"),
              f"Cells left: {result['remaining_cells']} (`python -m scripts.bench_quality --plan`).", "",
              *_time_lines(result), "", "The whole grid (first seed):", "",
              "| method | τ | outer lr | momentum | final val loss |", "|---|---|---|---|---|"]  # fmt: skip
    for c in result["cells"]:
        if c["tau"] is not None and c["seed"] == result["seeds"][0]:
            lines.append(f"| {c['method']} | {c['tau']} | {c['outer_lr']:g} | {c['momentum']:g} | "
                         f"{c['final_val_loss']:.4f} |")  # fmt: skip
    lines += ["", "Command:", "", f"    {result['command']}", ""]
    return "\n".join(lines)


def _time_lines(result: dict) -> list[str]:
    rows = result["time_to_target"]
    if not rows:
        return []
    models = "; ".join(f"{rate}: `{m}`" for rate, m in result["throughput_models"].items())
    targets = rows[0]["targets"]
    heads = " | ".join("ddp's final" if t["margin"] == 0 else f"+{100 * t['margin']:g}%" for t in targets)
    lines = [f"Wall-clock to reach ddp's final loss ({targets[0]['loss']:.4f}) and that loss plus a margin: tokens "
             "needed (mean curve over seeds) / the method's steady-state tokens/s at P = 4 on that link, from "
             f"bench_throughput.py ({result['throughput_files']}), measured at the τ named and on its own model "
             f"({models}); a row at a larger τ runs at least that fast, a row at a smaller τ than any run has no "
             "figure (–). \"not reached\": not within the budget.", "",
             f"| method | τ | link | tokens/s (run, its τ) | {heads} | whole budget |",
             "|---|---|---|---|" + "---|" * len(targets) + "---|"]  # fmt: skip
    for r in rows:
        t = r["throughput"]
        speed = f"{t['tokens_per_s']:,.0f} ({t['label']}" + (f", τ {t['tau']})" if r["tau"] else ")") if t else "–"
        reach = " | ".join("not reached" if x["tokens"] is None else _minutes(x["seconds"]) for x in r["targets"])
        lines.append(f"| {r['method']} | {r['tau'] or '–'} | {r['rate']} | {speed} | {reach} | "
                     f"{_minutes(r['budget_seconds'])} |")  # fmt: skip
    return lines


def _minutes(seconds: Optional[float]) -> str:
    return "–" if seconds is None else f"{seconds / 60:,.1f} min"


def plots(result: dict, results: dict[str, dict], out_dir: Path) -> None:
    """Validation loss vs tokens per τ, and vs wall-clock on each link: each row's mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {(r["method"], r["tau"]): mean_curve(seed_runs(results, row_setting(r))) for r in result["table"]}
    for tau in result["taus"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        mine = {m: c for (m, t), c in curves.items() if t in (tau, None)}
        for method, (x, y) in mine.items():
            ax.plot(x, y, marker=".", label=method, lw=2 if method in ("ddp", "co2") else 1)
        _finish(ax, "tokens (global)", f"τ = {tau}, P = {result['nodes']}, mean over seeds", mine.values())
        fig.tight_layout()
        fig.savefig(out_dir / f"quality_tau{tau}.png", dpi=110)
        plt.close(fig)
    for rate in link_rates(result["throughput_files"]):
        speeds = {(r["method"], r["tau"]): r["throughput"] for r in result["time_to_target"] if r["rate"] == rate}
        fig, ax = plt.subplots(figsize=(7, 4.5))
        shown = []
        for (method, tau), (x, y) in curves.items():
            if speeds.get((method, tau)):
                seconds = [t / speeds[(method, tau)]["tokens_per_s"] for t in x]
                ax.plot(seconds[1:], y[1:], marker=".", label=f"{method}" + (f" τ={tau}" if tau else ""))
                shown.append((x, y))
        ax.set_xscale("log")  # the start (0 s) is off a log axis
        title = f"{rate} link, P = {result['nodes']}, mean over seeds"
        _finish(ax, "seconds on the link (log; tokens / the method's measured tokens/s there)", title, shown)
        fig.tight_layout()
        fig.savefig(out_dir / f"quality_{rate}.png", dpi=110)
        plt.close(fig)


def _finish(ax, xlabel: str, title: str, curves) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Validation loss — {title}", fontsize=9)
    bc._zoom(ax, [{"val_loss": y} for _, y in curves])
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a link no method has a tokens/s for draws no curve
        ax.legend(fontsize=8)


# ---- main ----------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    grid = grids(a.grid)
    steps = a.steps
    if any(steps % (t * a.eval_points) for t in a.taus):
        raise SystemExit(f"--steps {steps}: accepted only a multiple of every τ × --eval_points ({a.eval_points}), "
                         f"so that every method validates at the same tokens; τ: {a.taus}")  # fmt: skip
    out_dir = Path(a.out_dir)
    cells_dir = out_dir / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    skipped = {m: why for m in a.methods if (why := unavailable(m))}
    runnable = [m for m in a.methods if m not in skipped]
    results = load_results(cells_dir, run_config(a))
    if a.plan:
        todo, pending = cells_to_run(runnable, a.taus, a.seeds, grid, results)
        print(plan_text(todo, pending, minutes_per_cell(results, a.minutes_per_cell, os.cpu_count() or 1), skipped))
        return 0
    if not a.summary:
        if not a.cells_only:
            bc.require_matplotlib()
        run_cells(a, runnable, grid, steps, results, cells_dir)
    if a.cells_only:
        return 0
    print(markdown(summary(whole_study(a), results, steps, out_dir)))
    return 0


def whole_study(a: argparse.Namespace) -> argparse.Namespace:
    """`a` widened to every method and τ of the study: a run of a part (--methods, --taus) still writes
    the summary of all the cells there are, not a table of that part over the whole one."""
    taus = sorted({*get_args([]).taus, *a.taus})
    return argparse.Namespace(**{**vars(a), "methods": list(METHODS), "taus": taus})


def run_cells(a, methods: Sequence[str], grid: dict, steps: int, results: dict, cells_dir: Path) -> None:
    """Run the cells not done yet, one at a time, re-planning after each (a finished grid adds its
    confirmation cells); stop after --max_cells."""
    log_root = Path(tempfile.mkdtemp(prefix="c2z-quality-"))  # one per invocation: two may run side by side
    ran = 0
    while not a.max_cells or ran < a.max_cells:
        todo = cells_to_run(methods, a.taus, a.seeds, grid, results)[0]
        if not todo:
            break
        cell = todo[0]
        print(f"[{len(results)} done, {len(todo)} known left] {cell.name} (load {os.getloadavg()[0]:.1f})",
              file=sys.stderr, flush=True)  # fmt: skip
        results[cell.name] = run_cell(cell, a, steps, cells_dir, log_root)
        r = results[cell.name]
        print(f"   final val {r['final_val_loss']:.4f}, {r['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
        ran += 1


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
