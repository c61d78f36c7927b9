"""scripts/bench_hetero_report.py's arithmetic on hand-made runs: the time to a loss between held-out
evaluations, the steady-state tokens/s, and a case's ratios (own speeds, loss and time over the uniform
run's; torchft's denominator from the same repetition's fixed_tau run)."""

import pytest

from scripts import bench_hetero_report as report


def _curve(points, tokens=800):
    """Evaluations at (seconds, loss), the tokens spread evenly from 0 to `tokens`."""
    last = len(points) - 1
    return [{"train_s": t, "tokens": tokens * i // max(last, 1), "val_loss": v, "final": False}
            for i, (t, v) in enumerate(points)]  # fmt: skip


def test_time_to_a_loss_is_interpolated_between_evaluations():
    curve = _curve([(0.0, 5.0), (10.0, 4.0), (20.0, 3.0)])
    assert report.time_to(curve, 3.5) == pytest.approx(15.0)
    assert report.time_to(curve, 4.0) == pytest.approx(10.0)
    assert report.time_to(curve, 5.5) == 0.0  # already at the start
    assert report.time_to(curve, 2.9) is None  # never reached


def test_steady_state_leaves_out_the_first_round_and_the_end():
    run = {"tokens": 4000, "round_end_s": [3.0, 5.0, 7.0, 9.0]}  # 4 rounds of 1000 tokens
    assert report.steady_tokens_per_s(run) == pytest.approx(3000 / 6.0)
    assert report.steady_tokens_per_s({"tokens": 1000, "round_end_s": [3.0]}) is None


def test_steady_state_of_auto_starts_after_its_measuring_rounds():
    """replica_tau "auto": 2 rounds at τ (400 tokens each, at the slowest pace), then rounds of 300 tokens
    at the τ_r; the steady state is the rounds after the first at the τ_r."""
    run = {"tokens": 1700, "round_end_s": [4.0, 8.0, 9.0, 10.0, 11.5], "measured_rounds": 2,
           "round_tokens": [400, 400, 300, 300, 300]}  # fmt: skip
    assert report.steady_tokens_per_s(run) == pytest.approx(600 / 2.5)
    assert report.steady_tokens_per_s({**run, "round_end_s": [4.0, 8.0, 9.0]}) is None


def _run(method, rep, tokens, train_s, own, loss, curve):
    return {"method": method, "rep": rep, "tokens": tokens, "train_s": train_s, "own_tokens_per_s": own,
            "final_val_loss": loss, "curve": _curve(curve, tokens), "taus": [4, 4], "caps_cores": [0.4, 0.4],
            "host_before": {}, "round_end_s": []}  # fmt: skip


def test_a_case_report_divides_by_own_speeds_and_by_the_uniform_run():
    runs = [
        {**_run("ddp", 0, 800, 1.0, [1.0], 2.0, [(0, 5.0), (1, 2.0)]), "command": "ddp"},
        _run("uniform", 0, 800, 10.0, [50.0, 50.0], 2.1, [(0.0, 5.0), (10.0, 2.0)]),
        _run("fixed_tau", 0, 800, 20.0, [60.0, 20.0], 2.1, [(0.0, 5.0), (20.0, 2.0)]),
        {**_run("torchft_diloco", 0, 800, 40.0, None, 2.2, [(0.0, 5.0), (40.0, 2.04)])},
    ]
    doc = report.case_report("half", [1.0, 0.5], {"command": "x"}, runs)
    m = doc["methods"]
    assert m["uniform"]["tokens_per_s_over_own_speeds"] == [pytest.approx(80 / 100)]
    assert m["fixed_tau"]["tokens_per_s_over_own_speeds"] == [pytest.approx(40 / 80)]
    assert m["torchft_diloco"]["tokens_per_s_over_own_speeds"] == [pytest.approx(20 / 80)]  # fixed_tau's speeds
    assert m["torchft_diloco"]["loss_over_uniform"] == [pytest.approx(2.2 / 2.1)]
    assert m["fixed_tau"]["time_over_uniform"][0]["0"] == pytest.approx(2.0)
    assert m["fixed_tau"]["compute_time_over_uniform"][0]["0"] == pytest.approx(2.0 * 80 / 100)
    assert m["torchft_diloco"]["time_over_uniform"][0]["0"] is None  # 2.04 never reaches 2.0
    uniform_at_2_04 = 10.0 * (5.0 - 2.04) / (5.0 - 2.0)  # 2% above DDP's 2.0, between its two evaluations
    assert m["torchft_diloco"]["time_over_uniform"][0]["0.02"] == pytest.approx(40.0 / uniform_at_2_04)
    assert doc["goals"]["fixed_tau"]["own_speed"] == {"median": pytest.approx(0.5), "met": False}
    assert doc["goals"]["uniform"]["loss_gap"]["met"] is True


def test_a_run_of_fewer_tokens_is_compared_with_the_uniform_run_at_its_tokens():
    """replica_tau's rounds round the tokens: its loss and its time are measured against what the uniform
    run had at as many tokens (linear between the uniform run's evaluations)."""
    runs = [
        _run("uniform", 0, 800, 10.0, [50.0, 50.0], 2.0, [(0.0, 5.0), (5.0, 3.0), (10.0, 2.0)]),
        _run("replica_tau", 0, 600, 6.0, [50.0, 50.0], 2.6, [(0.0, 5.0), (6.0, 2.6)]),
    ]
    m = report.case_report("half", [1.0, 0.5], {"command": "x"}, runs)["methods"]["replica_tau"]
    uniform_at_600 = 3.0 + (600 - 400) / 400 * (2.0 - 3.0)  # 2.5, between its evaluations at 400 and 800
    assert m["loss_over_uniform_equal_tokens"] == [pytest.approx(2.6 / uniform_at_600)]
    assert m["loss_over_uniform"] == [pytest.approx(2.6 / 2.0)]
    assert m["time_over_uniform"][0]["uniform"] is None  # 2.6 never reaches the uniform run's 2.5
    assert report.loss_at(_curve([(0.0, 5.0), (1.0, 4.0)], 100), 150) is None  # past the curve's end


def test_ddp_runs_of_fewer_tokens_are_targets_of_their_own():
    """--ddp_rounds 4 2: the main DDP run (4 rounds' tokens) gives the +0 / 2 / 5 / 10% targets, the shorter
    one its own final loss; the goal times the first target every repetition reached, the main one's loss
    before the shorter run's, before the main one's margins."""
    meta = {"command": "x", "rounds": 4, "ddp_rounds": [4, 2]}
    runs = [
        {**_run("ddp", 0, 800, 1.0, [1.0], 2.0, [(0, 5.0), (1, 2.0)]), "rounds": 4, "command": "ddp"},
        {**_run("ddp", 0, 400, 1.0, [1.0], 3.0, [(0, 5.0), (1, 3.0)]), "rounds": 2, "command": "ddp"},
        _run("uniform", 0, 800, 10.0, [50.0, 50.0], 2.15, [(0.0, 5.0), (10.0, 2.15)]),
        _run("replica_tau", 0, 800, 8.0, [50.0, 50.0], 2.15, [(0.0, 5.0), (8.0, 2.15)]),
    ]  # both within 10% of the main DDP run's 2.0, not within 5%
    doc = report.case_report("half", [1.0, 0.5], meta, runs)
    m = doc["methods"]["replica_tau"]
    assert doc["ddp"]["final_val_loss"] == [2.0]
    assert doc["ddp_shorter"] == {"2": {"final_val_loss": [3.0], "tokens": 400}}
    uniform_at_3, replica_at_3 = 10.0 * 2.0 / 2.85, 8.0 * 2.0 / 2.85  # linear from 5.0 at 0 s
    assert m["time_over_uniform"][0]["ddp_2_rounds"] == pytest.approx(replica_at_3 / uniform_at_3)
    assert m["time_over_uniform"][0]["0"] is None  # neither reaches the main DDP run's 2.0
    assert m["tokens_per_s_over_uniform"] == [pytest.approx(100.0 / 80.0)]
    time = doc["goals"]["replica_tau"]["time_ratio_to_ddp_loss"]
    assert time["target"] == "ddp_2_rounds" and time["median"] == pytest.approx(replica_at_3 / uniform_at_3)
    table = report.markdown({**doc, "rate": "100mbit", "tau": 4, "core_at_speed_1": 0.4, "reps": 1,
                             "host": {"cores": 2}})  # fmt: skip
    assert "at 2 rounds' worth (400 tokens) 3.0000" in table and "DDP's loss at 2 rounds' worth in ×" in table
    assert all(line.count("|") == table.splitlines()[4].count("|") for line in table.splitlines()[4:8])


def test_a_study_of_one_method_judges_only_its_own_speeds():
    """`--methods auto --no_ddp` (a longer run of one method): no uniform run and no DDP, so the loss and
    time goals are not judged (None, "n/a" in the table), the own-speeds one is."""
    runs = [_run("auto", 0, 800, 10.0, [50.0, 50.0], 2.1, [(0.0, 5.0), (10.0, 2.1)])]
    doc = report.case_report("half", [1.0, 0.5], {"command": "x"}, runs)
    goals = doc["goals"]["auto"]
    assert goals["own_speed"] == {"median": pytest.approx(0.8), "met": False}
    assert goals["loss_gap"]["met"] is None and goals["time_ratio_to_ddp_loss"]["met"] is None
    line = report.goals_line(doc["goals"])
    assert "tok/s 0.800 of Σ own speeds (not met), loss vs uniform n/a, time to DDP's loss n/a" in line
    table = report.markdown({**doc, "rate": "100mbit", "tau": 4, "rounds": 2, "core_at_speed_1": 0.4, "reps": 1,
                             "host": {"cores": 2}})  # fmt: skip
    assert table.endswith(line + "\n")


def test_pinned_runs_after_auto_at_its_final_taus():
    """`pinned` runs the same case and repetition's `auto` τ_r, so every rotation puts it after `auto`; without
    that run it is refused, naming what is missing."""
    from scripts import bench_hetero

    methods = bench_hetero.METHODS
    for rep in range(len(methods)):
        order = bench_hetero.rotated(methods, rep)
        assert sorted(order) == sorted(methods) and order.index("pinned") == order.index("auto") + 1, order
    assert bench_hetero.rotated(["pinned", "uniform"], 0) == ["pinned", "uniform"]  # no auto: as given
    runs = [{"case": "half", "method": "auto", "rep": 1, "taus": [32, 31, 32, 15]},
            {"case": "quarter", "method": "auto", "rep": 1, "taus": [32, 32, 16, 7]}]  # fmt: skip
    assert bench_hetero.pinned_taus(runs, "quarter", 1) == [32, 32, 16, 7]
    with pytest.raises(ValueError, match="'pinned' \\(half, repetition 0\\) needs that case and repetition's 'auto'"):
        bench_hetero.pinned_taus(runs, "half", 0)


def test_torchft_runs_an_fp32_wire_and_every_run_has_a_deadline_for_its_rounds():
    """The study's --comm_dtype reaches CO2's runs only (torchft's peer refuses it, in either spelling); a run's
    deadline grows with its rounds: fixed τ and torchft run each at the slowest node's pace."""
    from scripts import bench_hetero

    flags = ["--lr", "3e-3", "--comm_dtype", "int4", "--tau", "32", "--comm_dtype=int8", "--seed", "1"]
    assert bench_hetero.fp32_wire(flags) == ["--lr", "3e-3", "--tau", "32", "--seed", "1"]
    assert bench_hetero.fp32_wire(["--lr", "3e-3"]) == ["--lr", "3e-3"]
    assert bench_hetero.run_timeout_s(10) == bench_hetero.RUN_TIMEOUT_S
    assert bench_hetero.run_timeout_s(30) == 30 * bench_hetero.RUN_TIMEOUT_PER_ROUND_S > bench_hetero.RUN_TIMEOUT_S
