"""The quality study's own logic (scripts/bench_quality.py), without training anything: which cells it
runs and skips, how a grid's best is picked and confirmed, and the summary's numbers (gap to ddp,
spread over seeds, time to ddp's loss on a link)."""

import json
import math
import sys
from types import SimpleNamespace

import pytest

from scripts import bench_quality as bq

GRID = {"co2": ((0.5, 1.0), (0.0, 0.5)), "diloco": ((0.7,), (0.9,))}
SEEDS = (1, 2, 3)


def _cell_json(cell: bq.Cell, final: float, curve=None, **config) -> dict:
    """A finished cell's JSON as run_cell writes it (the curve: validation points at 0, 500, 1000 tokens)."""
    losses = curve or [5.0, (5.0 + final) / 2, final]
    return {**bq.dataclasses.asdict(cell), "name": cell.name, "tokens": [0, 500, 1000], "val_loss": losses,
            "final_val_loss": final, "wall_s": 120.0, **config}  # fmt: skip


def _finished(cells, losses) -> dict:
    return {c.name: _cell_json(c, x) for c, x in zip(cells, losses)}


def test_cell_names_are_unique_and_say_the_setting():
    assert bq.Cell("ddp", None, None, None, 7).name == "ddp_s7"
    assert bq.Cell("co2", 32, 0.7, 0.5, 1337).name == "co2_tau32_lr0.7_m0.5_s1337"
    cells, _ = bq.planned_cells(["ddp", "co2", "diloco"], [8, 128], SEEDS, GRID, {})
    assert len({c.name for c in cells}) == len(cells) == 3 + 2 * (4 + 1)


def test_the_grid_runs_at_the_first_seed_and_its_best_is_confirmed_at_the_others():
    todo, pending = bq.cells_to_run(["co2"], [8], SEEDS, GRID, {})
    assert [c.name for c in todo] == ["co2_tau8_lr0.5_m0_s1", "co2_tau8_lr0.5_m0.5_s1", "co2_tau8_lr1_m0_s1",
                                      "co2_tau8_lr1_m0.5_s1"]  # fmt: skip
    assert pending == {("co2", 8): 2}  # the confirmations are not known before the grid is done
    partial = _finished(todo[:3], [3.0, 2.0, 2.5])
    assert bq.best_setting(partial, todo) is None
    assert [c.name for c in bq.cells_to_run(["co2"], [8], SEEDS, GRID, partial)[0]] == ["co2_tau8_lr1_m0.5_s1"]
    done = {**partial, **_finished(todo[3:], [2.2])}
    assert bq.best_setting(done, todo) == bq.Cell("co2", 8, 0.5, 0.5, 1)
    todo, pending = bq.cells_to_run(["co2"], [8], SEEDS, GRID, done)
    assert [c.name for c in todo] == ["co2_tau8_lr0.5_m0.5_s2", "co2_tau8_lr0.5_m0.5_s3"] and pending == {}
    done.update(_finished(todo, [2.1, 2.3]))
    assert bq.cells_to_run(["co2"], [8], SEEDS, GRID, done) == ([], {})  # every cell done: nothing is run again


def test_the_stand_in_ablation_runs_only_at_its_own_tau():
    """ABLATION_TAUS's methods get no cell at another τ; the issue's methods get one at every τ."""
    grid = {"co2_local": ((0.5,), (0.8,)), "co2": ((0.5,), (0.0,))}
    todo, pending = bq.cells_to_run(["co2_local", "co2"], [8, 32], SEEDS, grid, {})
    assert [(c.method, c.tau) for c in todo] == [("co2", 8), ("co2_local", 32), ("co2", 32)]
    assert set(pending) == {("co2", 8), ("co2_local", 32), ("co2", 32)}


def test_a_tau_can_have_its_own_grid():
    """METHOD@τ replaces the method's grid at that τ only; --grid METHOD replaces it at every τ; a bad key is
    refused naming what is accepted."""
    grid = {"diloco": ((0.5,), (0.9,)), "diloco@8": ((0.2, 0.3), (0.9,))}
    todo, _ = bq.cells_to_run(["diloco"], [8, 32], SEEDS, grid, {})
    assert [(c.tau, c.outer_lr) for c in todo] == [(8, 0.2), (8, 0.3), (32, 0.5)]
    assert bq.GRIDS["diloco@8"][0][0] < min(bq.GRIDS["diloco"][0])  # the study's own: lower at τ 8
    assert "diloco@8" not in bq.grids(["diloco:0.7:0.9"]) and bq.grids(["diloco:0.7:0.9"])["diloco"] == ((0.7,), (0.9,))
    assert bq.grids(["co2@8:0.3:0.5"])["co2@8"] == ((0.3,), (0.5,)) and "diloco@8" in bq.grids(["co2@8:0.3:0.5"])
    for bad in ("nope@8:0.3:0.5", "co2@x:0.3:0.5", "co2@8:0.3"):
        with pytest.raises(SystemExit, match="METHOD@TAU:LRS:MOMENTA"):
            bq.grids([bad])


def test_cells_of_another_study_are_refused_and_half_written_ones_ignored(tmp_path):
    config = {"steps": 100, "nodes": 4, "model": "m", "extra": "e", "eval_points": 2}
    cell = bq.Cell("ddp", None, None, None, 1)
    (tmp_path / f"{cell.name}.json").write_text(json.dumps(_cell_json(cell, 2.0, **config)))
    (tmp_path / ".co2_tau8_lr1_m0_s1.tmp").write_text("{")  # an interrupted write
    assert list(bq.load_results(tmp_path, config)) == ["ddp_s1"]
    with pytest.raises(SystemExit, match="steps = 100, this study's is 200"):
        bq.load_results(tmp_path, {**config, "steps": 200})


def test_plan_counts_the_cells_left_and_their_hours():
    todo, pending = bq.cells_to_run(["ddp", "co2"], [8], SEEDS, GRID, {})
    text = bq.plan_text(todo, pending, {"w": 6.0}, {"co2_local": "unavailable: needs the stand_in field"})
    assert "7 cells to run now" in text and "2 confirmation cells of co2 τ=8" in text
    assert "total 9 cells × 6.0 min ≈ 0.9 h (w)" in text and "co2_local: unavailable" in text
    done = {"a": {"wall_s": 600.0, "cpu_s": 480.0}, "b": {"wall_s": 1200.0, "cpu_s": 720.0}, "c": {"wall_s": 900.0}}
    assert list(bq.minutes_per_cell(done, 5.0, 2).values()) == [15.0, 5.0]  # medians; CPU over 2 cores
    assert bq.minutes_per_cell({}, 5.0, 2) == {"assumed, no cell run yet": 5.0}


@pytest.mark.parametrize("method", bq.CO2_FAMILY)
def test_every_cell_runs_a_fixed_schedule_and_its_stand_in(method):
    """A cell's trajectory must not depend on the host's timing or on the library's defaults of the day:
    its flags resolve (through train_lm's own parser) to a fixed sync delay and the stand-in it names."""
    from co2_zero.train.args import co2_config, get_args

    config = co2_config(get_args(bq.train_flags(bq.Cell(method, 32, 0.7, 0.9, 5), 640, 2, [])))
    assert not config.measures_sync_delay, config
    assert config.effective_stand_in == bq.STAND_IN.get(method, "shared"), config
    published = method in ("co2", "co2_local")
    assert config.gap_penalty.mode == ("adaptive" if published else "none") and config.nesterov != published


def test_flags_of_each_method():
    common = ["--n_layer", "1"]
    diloco = bq.train_flags(bq.Cell("diloco", 32, 0.7, 0.9, 5), 640, 2, common)
    assert diloco[:6] == ["--tau", "32", "--log_every", "32", "--eval_every", "10"]
    assert diloco[-6:] == ["--method", "diloco", "--outer_lr", "0.7", "--outer_momentum", "0.9"]
    local = bq.train_flags(bq.Cell("co2_local", 8, 1.0, 0.0, 5), 640, 2, common)
    assert local[local.index("--stand_in") + 1] == "local" and "--sync_delay" not in local
    assert local[local.index("--method") + 1] == "co2_published"  # CO2 as published, not today's defaults
    synced = bq.train_flags(bq.Cell("diloco_local_sync", 32, 0.7, 0.9, 5), 640, 2, common)
    assert synced[synced.index("--sync_delay") + 1] == str(bq.SYNC_DELAY) and "local" in synced
    late = bq.train_flags(bq.Cell("diloco_local", 32, 0.7, 0.9, 5), 640, 2, common)
    assert late[late.index("--stand_in") + 1] == "local" and "--overlap" in late
    assert late[late.index("--sync_delay") + 1] == "32"  # a whole round late, never the timing-dependent "auto"
    assert late[late.index("--method") + 1] == "diloco"
    int8 = bq.train_flags(bq.Cell("diloco_local_sync_int8", 32, 0.7, 0.9, 5), 640, 2, common)
    at = int8.index("--comm_dtype")
    assert int8[at + 1 : at + 4] == ["int8", "--topk", "1.0"]
    assert int8[:at] + int8[at + 4 :] == synced  # the defaults' cell, int8 on the wire
    sparse = bq.train_flags(bq.Cell("diloco_local_sync_topk1.5_int2", 32, 0.7, 0.9, 5), 640, 2, common)
    at = sparse.index("--comm_dtype")
    assert (
        sparse[at : at + 4] == ["--comm_dtype", "int2", "--topk", "0.015"] and sparse[:at] + sparse[at + 4 :] == synced
    )
    short = bq.train_flags(bq.Cell("diloco_local_sync", 4, 0.7, 0.9, 5), 640, 2, common)
    assert short[short.index("--sync_delay") + 1] == "4"  # at most τ
    ddp = bq.train_flags(bq.Cell("ddp", None, None, None, 5), 640, 2, common)
    assert ddp[:6] == ["--tau", "1", "--log_every", "320", "--eval_every", "1"] and "--outer_lr" not in ddp
    peer = bq.peer_command(bq.Cell("torchft_streaming", 32, 0.7, 0.9, 5), 640, 2, common, 4, bq.Path("x.jsonl"))
    assert peer[1:7] == ["-m", "scripts.torchft_peer", "--peer", "streaming", "--replicas", "4"]
    assert peer[9:-2] == diloco and peer[-2:] == ["--out_json", "x.jsonl"]  # the diloco cell's flags: its preset


def test_unavailable_methods_say_why(monkeypatch):
    from co2_zero import CO2Config

    if "stand_in" not in {f.name for f in bq.dataclasses.fields(CO2Config)}:  # reported, never run as plain co2
        assert bq.unavailable("co2_local") == "unavailable: needs the stand_in field (CO2Config.stand_in)"
    assert bq.unavailable("co2") is None and bq.unavailable("ddp") is None
    monkeypatch.setattr(bq, "PEER", bq.ROOT / "no_such_peer.py")
    assert bq.unavailable("torchft_diloco") == "unavailable: needs scripts/torchft_peer.py"
    monkeypatch.setattr(bq, "PEER", bq.ROOT / "scripts" / "torchft_peer.py")
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    assert bq.unavailable("torchft_streaming") == "unavailable: needs torchft (pip install torchft==0.2.0)"


def _study() -> dict:
    """ddp and the co2 grid's best (lr 1, m 0) at three seeds; each seed's held-out batches differ."""
    cells = {}
    for seed, ddp, co2 in ((1, 2.00, 2.04), (2, 2.10, 2.10), (3, 1.90, 1.9475)):
        cells.update(_finished([bq.Cell("ddp", None, None, None, seed)], [ddp]))
        cells.update(_finished([bq.Cell("co2", 8, 1.0, 0.0, seed)], [co2]))
    cells.update(_finished([bq.Cell("co2", 8, 0.5, 0.0, 1)], [2.5]))
    return cells


def test_a_run_of_a_part_summarizes_the_whole_study():
    """`--methods X --taus 32` runs X's cells; the summary it writes still covers every method and τ (it
    once wrote a table of X alone over the study's)."""
    part = bq.get_args(["--methods", "diloco_local_sync_int8", "--taus", "32", "--max_cells", "1"])
    whole = bq.whole_study(part)
    assert whole.methods == list(bq.METHODS) and whole.taus == [8, 32, 128]
    assert (whole.max_cells, whole.out_dir, part.methods) == (1, part.out_dir, ["diloco_local_sync_int8"])


def test_summary_gap_to_ddp_and_spread_over_seeds():
    rows = bq.table_rows(_study(), ["ddp", "co2"], [8], {"co2": ((0.5, 1.0), (0.0,))}, 1)
    ddp, co2 = rows
    assert ddp["method"] == "ddp" and ddp["final_val_loss"] == {"mean": 2.0, "min": 1.9, "max": 2.1, "n": 3}
    assert (co2["tau"], co2["outer_lr"], co2["momentum"], co2["seeds"]) == (8, 1.0, 0.0, [1, 2, 3])
    assert co2["final_val_loss"]["min"] == 1.9475 and co2["final_val_loss"]["max"] == 2.1
    assert co2["gap_of_means"] == pytest.approx((2.04 + 2.10 + 1.9475) / 3 / 2.0 - 1)
    assert co2["gap_per_seed"]["mean"] == pytest.approx(0.015) and co2["gap_per_seed"]["max"] == pytest.approx(0.025)
    assert co2["gap_per_seed"]["min"] == pytest.approx(0.0)
    assert co2["at_edge"] == ["outer lr"] and ddp["at_edge"] == []  # lr 1 is the largest tried; one momentum
    assert "(outer lr at the edge of those tried)" in bq._setting(co2)
    inside = {**_study(), **_finished([bq.Cell("co2", 8, 1.4, 0.0, 1)], [2.3])}  # off the grid, tried
    assert bq.table_rows(inside, ["co2"], [8], {"co2": ((0.5, 1.0), (0.0,))}, 1)[0]["at_edge"] == []


def test_time_to_reach_ddps_final_loss_on_each_link():
    results = _study()
    for seed in (1, 2, 3):  # co2's mean curve: 5.0, 2.0, 2.0291..; ddp's mean final loss 2.0
        results[f"co2_tau8_lr1_m0_s{seed}"]["val_loss"][1] = 2.0
    rows = bq.table_rows(results, ["ddp", "co2"], [8], {"co2": ((0.5, 1.0), (0.0,))}, 1)
    p4 = {"ddp": {"tokens_per_s": 50.0}, "co2": {"tokens_per_s": 200.0, "tau": 8}}
    throughput = {"cells": [{"nodes": 2, "tau": 8, "summary": {"co2": {"tokens_per_s": 1.0}}},
                            {"nodes": 4, "tau": 64, "summary": p4}]}  # fmt: skip
    got = bq.time_to_target(results, rows, {"100mbit": throughput}, 4)
    ddp, co2 = got
    assert [t["margin"] for t in co2["targets"]] == list(bq.TARGET_MARGINS)
    ddp_final, co2_final = ddp["targets"][0], co2["targets"][0]
    assert ddp_final["tokens"] == pytest.approx(1000) and ddp_final["seconds"] == pytest.approx(20.0)
    assert co2_final["tokens"] == pytest.approx(500) and co2_final["seconds"] == pytest.approx(2.5)
    assert ddp["budget_seconds"] == pytest.approx(20.0) and co2["budget_seconds"] == pytest.approx(5.0)
    # a loss within a margin above ddp's final is reached earlier: 5.0 -> 2.0 crosses 2.0 * 1.1 at 9/30
    plus10 = next(t for t in co2["targets"] if t["margin"] == 0.10)
    assert plus10["loss"] == pytest.approx(2.2) and plus10["tokens"] == pytest.approx(500 * (5.0 - 2.2) / 3.0)
    assert plus10["seconds"] == pytest.approx(plus10["tokens"] / 200.0)
    assert co2["throughput"] == {"tokens_per_s": 200.0, "label": "co2", "tau": 8}
    # diloco's exchange is blocking local SGD's: its tokens/s stands in where diloco was not measured
    assert bq.link_tokens_per_s({"cells": [{"nodes": 4, "summary": {"localsgd": {"tokens_per_s": 9.0}}}]}, 4,
                                "diloco")["label"] == "localsgd"  # fmt: skip
    assert bq.link_tokens_per_s(throughput, 4, "torchft_diloco") is None
    # a run at a larger τ than the row's would overstate a local-step method's speed; ddp has no τ
    assert bq.link_tokens_per_s(throughput, 4, "co2", 4) is None
    assert bq.link_tokens_per_s(throughput, 4, "co2", 128)["tau"] == 8
    assert bq.link_tokens_per_s(throughput, 4, "ddp", 8)["tokens_per_s"] == 50.0


@pytest.mark.parametrize(
    ("method", "label"), [("diloco_local_sync", "co2"), ("torchft_streaming", "torchft-streaming")]
)
def test_a_method_with_its_own_throughput_run_takes_that_speed_and_no_other(method, label):
    """RATE:METHOD=FILE: METHOD's own bench_throughput run, under its label there (diloco_local_sync: the
    co2 run with its flags, since a sync delay hides the exchange only if it is long enough; torchft: its
    own runs), scaled by blocking DiLoCo beside it; without one such a method has no speed."""
    assert bq.OWN_RUN_LABELS[method] == label
    results = {}
    for name, cell in _study().items():  # the co2 cells, as the method's
        cell = dict(cell, method=method) if cell["method"] == "co2" else cell
        results[name.replace("co2_", f"{method}_")] = cell
    rows = bq.table_rows(results, ["ddp", method], [8], {method: ((0.5, 1.0), (0.0,))}, 1)
    summary = {"diloco": {"tokens_per_s": 100.0}, "ddp": {"tokens_per_s": 50.0}, "co2": {"tokens_per_s": 200.0}}
    main = {"cells": [{"nodes": 4, "tau": 8, "summary": summary}]}
    decoy = "torchft-streaming" if label == "co2" else "co2"  # another run of that file: not this method's
    own_run = {"none": {"tokens_per_s": 400.0}, "diloco": {"tokens_per_s": 300.0}, label: {"tokens_per_s": 360.0},
               decoy: {"tokens_per_s": 390.0}}  # fmt: skip
    own = {"cells": [{"nodes": 4, "tau": 8, "summary": own_run}]}  # a faster host: 1.2 x diloco's beside it
    assert bq.link_rates({"100mbit": main, f"100mbit:{method}": own}) == ["100mbit"]
    got = bq.time_to_target(results, rows, {"100mbit": main, f"100mbit:{method}": own}, 4)
    speeds = [(r["method"], r["throughput"]["tokens_per_s"]) for r in got]
    assert speeds == [("ddp", 50.0), (method, pytest.approx(120.0))]
    assert got[1]["throughput"]["label"] == "its own run: 1.200 × diloco's beside it"
    assert bq.time_to_target(results, rows, {"100mbit": main}, 4)[1]["throughput"] is None


# ---- the torchft cells: real runs (a Lighthouse and 2 replicas) next to train_lm.py's diloco ------------

TINY_STUDY = {"steps": 16, "nodes": 2, "eval_points": 2,
              "model": "--n_layer 1 --n_embd 32 --n_head 2 --block_size 32 --batch_size 8",
              "extra": "--data_bytes 300000 --eval_batches 4 --warmup_steps 5 --lr 1e-2 --min_lr 1e-3 "
                       "--timeout_s 60"}  # fmt: skip


@pytest.mark.slow
def test_torchft_cells_run_on_the_diloco_cells_model_data_tokens_and_eval_points(tmp_path):
    """A tiny study (τ 4, 16 steps, 2 replicas, validation every 2 rounds): each torchft cell's JSON holds
    finite held-out losses at the start, step 8 and the end, at the same tokens as train_lm.py's diloco
    cell; torchft's DiLoCo lands on co2_zero's blocking DiLoCo (same init, streams, inner and outer
    steps), Streaming DiLoCo elsewhere."""
    pytest.importorskip("torchft", reason="the torchft cells need torchft")
    a = SimpleNamespace(**TINY_STUDY)
    (tmp_path / "cells").mkdir()
    cells = {m: bq.Cell(m, 4, 0.7, 0.9, 5) for m in ("diloco", "torchft_diloco", "torchft_streaming")}
    for cell in cells.values():
        bq.run_cell(cell, a, a.steps, tmp_path / "cells", tmp_path / "logs")
    got = bq.load_results(tmp_path / "cells", bq.run_config(a))
    assert sorted(got) == sorted(c.name for c in cells.values())
    for cell in cells.values():
        result = got[cell.name]
        assert result["tokens"] == [0, 4096, 8192], cell  # 2 replicas × 8 × 32 tokens a step: steps 0, 8, 16
        assert len(result["val_loss"]) == 3 and all(math.isfinite(v) for v in result["val_loss"]), result
        assert result["final_val_loss"] == result["val_loss"][-1] < result["val_loss"][0]
    diloco, peer = (got[cells[m].name]["val_loss"] for m in ("diloco", "torchft_diloco"))
    assert peer == pytest.approx(diloco, rel=1e-5)
    assert got[cells["torchft_streaming"].name]["val_loss"][1:] != pytest.approx(diloco[1:], rel=1e-3)


def _peer_job(tmp_path, *flags: str) -> list[str]:
    return ["--replicas", "2", "--tau", "4", "--max_steps", "8", "--out_json", str(tmp_path / "peer.jsonl"),
            *TINY_STUDY["model"].split(), *TINY_STUDY["extra"].split(), *flags]  # fmt: skip


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--data", "no_such_dir"], "replica [01] exited with 1"),  # every replica fails while it starts
        (["--launch_timeout_s", "2"], r"--launch_timeout_s=2: replicas \[0, 1\] still running"),
    ],
)
def test_a_failed_or_late_peer_job_stops_its_lighthouse_and_replicas(tmp_path, monkeypatch, flags, error):
    """The launcher (torchft_peer --replicas) raises at a replica's failure or at its deadline, saying
    which, and leaves none of its processes running."""
    pytest.importorskip("torchft", reason="the torchft cells need torchft")
    from scripts import torchft_peer as tp

    started = []
    popen = tp._popen
    monkeypatch.setattr(tp, "_popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    with pytest.raises((RuntimeError, TimeoutError), match=error):
        tp.main(_peer_job(tmp_path, *flags))
    assert len(started) == 3 and all(p.poll() is not None for p in started)  # the Lighthouse and 2 replicas
    assert not (tmp_path / "peer.jsonl").exists()


def test_peer_job_flags_and_merged_records(tmp_path):
    """One replica (--lighthouse, --replica_id) or a job to launch (--replicas, --out_json), never a mix;
    a compressed --comm_dtype is refused (torchft sends fp32); the job's records: tokens summed over the
    replicas, losses averaged, each replica's held-out loss kept."""
    pytest.importorskip("torchft", reason="the torchft cells need torchft")
    from scripts import torchft_peer as tp

    with pytest.raises(SystemExit):
        tp.get_args(["--replicas", "2"])  # no --out_json to merge into
    with pytest.raises(SystemExit):
        tp.get_args(["--lighthouse", "http://x:1", "--replica_id", "0", "--replicas", "2"])
    refused = "--comm_dtype=int4: torchft's DiLoCo sends fp32; accepted: fp32 or no --comm_dtype"
    assert tp._wire_problem("int4") == refused
    assert tp._wire_problem("fp32") is None and tp._wire_problem(None) is None
    with pytest.raises(SystemExit):
        tp.get_args(_peer_job(tmp_path, "--comm_dtype", "int4"))  # torchft's DiLoCo sends fp32
    assert tp.get_args(_peer_job(tmp_path, "--comm_dtype", "fp32")).comm_dtype == "fp32"
    args = tp.get_args(_peer_job(tmp_path, "--peer", "streaming"))
    assert args.lighthouse is None and args.replicas == 2 and args.fragments == 2
    assert args.replica_argv[-4:-2] == ["--peer=streaming", "--fragments=2"] and "--replicas" not in args.replica_argv
    start = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "loss": None, "val_loss": 5.0}
    a = [start, {"summary": True, "steps": 8, "tokens": 2048, "elapsed_s": 1.0, "tokens_per_s": 2048.0,
                 "val_loss": 3.0, "initial_val_loss": 5.0, "replica_id": 0}]  # fmt: skip
    b = [start, {**a[1], "elapsed_s": 2.0, "tokens_per_s": 1024.0, "val_loss": 3.5, "replica_id": 1}]
    merged = tp.merge_records([a, b])
    assert merged[0] == {**start, "replicas": 2, "val_loss_replicas": [5.0, 5.0]}
    assert merged[1] == {"summary": True, "steps": 8, "tokens": 4096, "elapsed_s": 2.0, "tokens_per_s": 3072.0,
                         "val_loss": 3.25, "initial_val_loss": 5.0, "replicas": 2,
                         "val_loss_replicas": [3.0, 3.5]}  # fmt: skip
    with pytest.raises(ValueError, match="different steps"):
        tp.merge_records([a, [start, {**a[1], "steps": 12}]])


def test_readme_overview_is_one_row_per_method_with_every_tau():
    """overview(): ddp's loss under every τ, a method's best setting where its grid is done, – elsewhere,
    methods in METHODS order whatever the table's order."""
    loss = lambda mean, n: {"mean": mean, "min": mean, "max": mean, "n": n}  # noqa: E731
    result = {"taus": [8, 32], "table": [
        {"method": "diloco", "tau": 32, "final_val_loss": loss(1.02, 3), "gap_of_means": 0.02},
        {"method": "ddp", "tau": None, "final_val_loss": loss(1.0, 3), "gap_of_means": 0.0},
        {"method": "co2", "tau": 8, "final_val_loss": loss(1.1, 1), "gap_of_means": 0.1},
    ]}  # fmt: skip
    assert bq.overview(result) == [
        "| method | τ = 8 | τ = 32 |",
        "|---|---|---|",
        "| ddp | 1.0000 (3) | 1.0000 (3) |",
        "| diloco | – | 1.0200 (+2.0%, 3) |",
        "| co2 | 1.1000 (+10.0%, 1) | – |",
    ]


def test_cells_of_a_retired_method_sort_last():
    """The committed JSON keeps the retired eager stand-in's cells (co2_eager): the summary still orders them."""
    retired = {"method": "co2_eager", "tau": 32, "outer_lr": 0.5, "momentum": 0.8, "seed": 1}
    ddp = {"method": "ddp", "tau": None, "outer_lr": None, "momentum": None, "seed": 1}
    assert [cell["method"] for cell in sorted([retired, ddp], key=bq.cell_order)] == ["ddp", "co2_eager"]
