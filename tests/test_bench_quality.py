"""The quality study's own logic (scripts/bench_quality.py), without training anything: which cells it
runs and skips, how a grid's best is picked and confirmed, and the summary's numbers (gap to ddp,
spread over seeds, time to ddp's loss on a link)."""

import json

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
    text = bq.plan_text(todo, pending, {"w": 6.0}, {"co2_eager": "unavailable: needs the eager field"})
    assert "7 cells to run now" in text and "2 confirmation cells of co2 τ=8" in text
    assert "total 9 cells × 6.0 min ≈ 0.9 h (w)" in text and "co2_eager: unavailable" in text
    done = {"a": {"wall_s": 600.0, "cpu_s": 480.0}, "b": {"wall_s": 1200.0, "cpu_s": 720.0}, "c": {"wall_s": 900.0}}
    assert list(bq.minutes_per_cell(done, 5.0, 2).values()) == [15.0, 5.0]  # medians; CPU over 2 cores
    assert bq.minutes_per_cell({}, 5.0, 2) == {"assumed, no cell run yet": 5.0}


def test_flags_of_each_method():
    common = ["--n_layer", "1"]
    diloco = bq.train_flags(bq.Cell("diloco", 32, 0.7, 0.9, 5), 640, 2, common)
    assert diloco[:6] == ["--tau", "32", "--log_every", "32", "--eval_every", "10"]
    assert diloco[-6:] == ["--method", "diloco", "--outer_lr", "0.7", "--outer_momentum", "0.9"]
    assert "--eager" in bq.train_flags(bq.Cell("co2_eager", 8, 1.0, 0.0, 5), 640, 2, common)
    ddp = bq.train_flags(bq.Cell("ddp", None, None, None, 5), 640, 2, common)
    assert ddp[:6] == ["--tau", "1", "--log_every", "320", "--eval_every", "1"] and "--outer_lr" not in ddp
    peer = bq.peer_command(bq.Cell("torchft_streaming", 32, 0.7, 0.9, 5), 640, 2, common, 4, bq.Path("x.jsonl"))
    assert peer[1:5] == ["-m", "scripts.torchft_peer", "--algorithm", "streaming"] and peer[-2:] == [
        "--out_json",
        "x.jsonl",
    ]


def test_unavailable_methods_say_why(monkeypatch):
    from co2_zero import CO2Config

    if "eager" not in {f.name for f in bq.dataclasses.fields(CO2Config)}:  # reported, never run as plain co2
        assert bq.unavailable("co2_eager") == "unavailable: needs the eager field (CO2Config.eager)"
    assert bq.unavailable("co2") is None and bq.unavailable("ddp") is None
    monkeypatch.setattr(bq, "PEER", bq.ROOT / "no_such_peer.py")
    assert bq.unavailable("torchft_diloco") == "unavailable: needs scripts/torchft_peer.py"
    monkeypatch.setattr(bq, "PEER", bq.ROOT / "scripts" / "train_lm.py")  # a peer there, the hook not wired to it
    if not bq.PEER_HOOK_WIRED:
        assert "peer_command is not aligned" in bq.unavailable("torchft_streaming")


def _study() -> dict:
    """ddp and the co2 grid's best (lr 1, m 0) at three seeds; each seed's held-out batches differ."""
    cells = {}
    for seed, ddp, co2 in ((1, 2.00, 2.04), (2, 2.10, 2.10), (3, 1.90, 1.9475)):
        cells.update(_finished([bq.Cell("ddp", None, None, None, seed)], [ddp]))
        cells.update(_finished([bq.Cell("co2", 8, 1.0, 0.0, seed)], [co2]))
    cells.update(_finished([bq.Cell("co2", 8, 0.5, 0.0, 1)], [2.5]))
    return cells


def test_summary_gap_to_ddp_and_spread_over_seeds():
    rows = bq.table_rows(_study(), ["ddp", "co2"], [8], {"co2": ((0.5, 1.0), (0.0,))}, 1)
    ddp, co2 = rows
    assert ddp["method"] == "ddp" and ddp["final_val_loss"] == {"mean": 2.0, "min": 1.9, "max": 2.1, "n": 3}
    assert (co2["tau"], co2["outer_lr"], co2["momentum"], co2["seeds"]) == (8, 1.0, 0.0, [1, 2, 3])
    assert co2["final_val_loss"]["min"] == 1.9475 and co2["final_val_loss"]["max"] == 2.1
    assert co2["gap_of_means"] == pytest.approx((2.04 + 2.10 + 1.9475) / 3 / 2.0 - 1)
    assert co2["gap_per_seed"]["mean"] == pytest.approx(0.015) and co2["gap_per_seed"]["max"] == pytest.approx(0.025)
    assert co2["gap_per_seed"]["min"] == pytest.approx(0.0)


def test_time_to_reach_ddps_final_loss_on_each_link():
    results = _study()
    for seed in (1, 2, 3):  # co2's mean curve: 5.0, 2.0, 2.0291..; ddp's mean final loss 2.0
        results[f"co2_tau8_lr1_m0_s{seed}"]["val_loss"][1] = 2.0
    rows = bq.table_rows(results, ["ddp", "co2"], [8], {"co2": ((0.5, 1.0), (0.0,))}, 1)
    p4 = {"ddp": {"tokens_per_s": 50.0}, "co2": {"tokens_per_s": 200.0, "tau": 64}}
    throughput = {"cells": [{"nodes": 2, "tau": 8, "summary": {"co2": {"tokens_per_s": 1.0}}},
                            {"nodes": 4, "tau": 64, "summary": p4}]}  # fmt: skip
    got = bq.time_to_target(results, rows, {"100mbit": throughput}, 4)
    ddp, co2 = got
    assert ddp["tokens"] == pytest.approx(1000) and ddp["seconds"] == pytest.approx(20.0)
    assert co2["tokens"] == pytest.approx(500) and co2["seconds"] == pytest.approx(2.5)
    assert co2["throughput"] == {"tokens_per_s": 200.0, "label": "co2", "tau": 64}
    # diloco's exchange is blocking local SGD's: its tokens/s stands in where diloco was not measured
    assert bq.link_tokens_per_s({"cells": [{"nodes": 4, "summary": {"localsgd": {"tokens_per_s": 9.0}}}]}, 4,
                                "diloco")["label"] == "localsgd"  # fmt: skip
    assert bq.link_tokens_per_s(throughput, 4, "torchft_diloco") is None
