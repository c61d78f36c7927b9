"""The benchmark harness's own arithmetic and measurements (scripts/bench_throughput.py, co2_zero.train.tune_tau).

The benchmarks are not part of the suite; what decides their numbers is: which runs a cell plans, how
a run's steady state is cut out of its log, and what the tuner times as "one round's exchange".
"""

import pytest

from co2_zero.train import tune_tau
from scripts import bench_throughput as bt
from tests.dist_utils import run_ranks


def _log(intervals: int, seconds_each: float = 2.0, tokens_each: int = 1000) -> list[dict]:
    """train_lm.py's JSON lines: the start record, one per log point, the summary."""
    records = [{"step": 0, "tokens": 0, "elapsed_s": 0.0, "wait_s": None}]
    for i in range(1, intervals + 2):
        records.append({"step": 8 * i, "tokens": tokens_each * i, "elapsed_s": 5.0 + seconds_each * (i - 1),
                        "wait_s": 0.1, "round_end_s": 0.15})  # fmt: skip
    records.append({"summary": True, "step": 8 * (intervals + 1)})
    return records


def test_steady_state_drops_the_first_interval_and_flags_short_runs():
    got = bt.steady_state(_log(6), min_intervals=5)
    assert got["intervals"] == 6 and got["seconds"] == 12.0
    assert got["tokens_per_s"] == 6 * 1000 / 12.0  # the first interval (5 s, start-up) is not counted
    assert abs(got["wait_fraction"] - 6 * 0.1 / 12.0) < 1e-12
    assert abs(got["bookkeeping_fraction"] - 6 * 0.05 / 12.0) < 1e-12
    assert "few_intervals" not in got
    assert bt.steady_state(_log(3), min_intervals=5)["few_intervals"]


def test_every_method_runs_at_one_tau_and_compressed_co2_also_at_its_own():
    methods = ["none", "ddp", "co2", "co2-bf16", "co2-int8", "localsgd"]
    runs = bt.plan(methods, 40, {"fp32": 40, "bf16": 24, "int8": 40})
    assert runs == {**dict.fromkeys(methods, 40), "co2-bf16 @tuned": 24}
    assert [bt.wire_of(x) for x in ("co2", "co2-int8", "co2-int8 @tuned")] == ["fp32", "int8", "int8"]
    assert bt.run_flags("co2-int8 @tuned", ["--n_layer", "1"], ["--gap_strength", "2"]) == [
        "--method", "co2_published", "--comm_dtype", "int8", "--n_layer", "1", "--gap_strength", "2",
    ]  # fmt: skip
    assert bt.run_flags("localsgd", [], ["--gap_strength", "2"]) == ["--method", "localsgd"]


def test_a_fixed_tau_with_tuners_runs_every_wire_also_at_its_own_tau():
    """--tau 32 --tuned_too: every method at 32, and every co2 wire (fp32 too) at its tuner's τ where that is not
    32, above or below; a sparse label runs its format's flags (top-k, 2 bits, the decaying residual)."""
    methods = ["none", "co2", "co2-int4", "co2-top0.9%-int2-decay"]
    runs = bt.plan(methods, 32, {"fp32": 80, "int4": 32, "top0.9%-int2-decay": 2}, every_wire=True)
    assert runs == {**dict.fromkeys(methods, 32), "co2 @tuned": 80, "co2-top0.9%-int2-decay @tuned": 2}
    assert bt.run_flags("co2-top0.9%-int2-decay @tuned", [], []) == [
        "--method", "co2_published", "--comm_dtype", "int2", "--topk", "0.009", "--feedback_decay", "0.95",
    ]  # fmt: skip


def test_ratios_to_none_are_per_repetition():
    runs = [
        {"label": "none", "rep": 0, "tau": 8, "intervals": 5, "tokens_per_s": 100.0},
        {"label": "none", "rep": 1, "tau": 8, "intervals": 5, "tokens_per_s": 200.0},
        {"label": "co2", "rep": 0, "tau": 8, "intervals": 5, "tokens_per_s": 90.0},
        {"label": "co2", "rep": 1, "tau": 8, "intervals": 5, "tokens_per_s": 200.0, "few_intervals": True},
    ]
    row = bt.summarize(runs, ["none", "co2"])["co2"]
    assert row["ratio_range"] == [0.9, 1.0] and row["ratio_to_none"] == 0.95 and row["few_intervals"]


def _exchange_bytes(rank: int, world: int) -> dict:
    from co2_zero import CO2Config

    return {
        dtype: tune_tau.measure_exchange_time(
            4096, CO2Config(collective="reduce_scatter", comm_dtype=dtype, stand_in="shared"), reps=2
        )
        for dtype in ("fp32", "bf16", "int8", "int4", "int2")
    } | {
        "top1.5%-int2": tune_tau.measure_exchange_time(
            4096, CO2Config(comm_dtype="int2", topk=0.015, feedback_decay=0.95, stand_in="shared"), reps=2
        )
    }


def test_tuner_times_the_exchange_in_its_wire_format():
    """The tuner's t_comm comes from the library's own pipeline, so a compressed format sends fewer bytes
    (what makes its tuned τ smaller): int8 at most 0.27x of fp32, int4 0.14x, int2 0.07x, and top-1.5% in
    int2 (all-gathered, with the decaying residual) under 1/100 (docs/design.md §5)."""
    for got in run_ranks(_exchange_bytes, 2):
        fp32, sparse = got["fp32"], got["top1.5%-int2"]
        # reduce-scatter + all-gather, (R-1)/R of 16 KiB each, plus the outer step's few norms
        assert 4096 * 4 <= fp32["bytes_sent"] < 4096 * 4 + 64
        assert got["bf16"]["bytes_sent"] < 0.76 * fp32["bytes_sent"]
        for dtype, share in (("int8", 0.27), ("int4", 0.14), ("int2", 0.07)):
            assert got[dtype]["bytes_sent"] <= share * fp32["bytes_sent"], (dtype, got[dtype])
        assert sparse["collective"] == "all_gather" and sparse["bytes_sent"] < fp32["bytes_sent"] / 100, sparse
        assert all(x["t_comm"] > 0 and len(x["samples"]) == 2 for x in got.values())


def test_the_codec_share_of_a_round_counts_design_s_encodes_and_decodes():
    """bench_wire's round share: a dense format encodes (1 + 1/R)·Ψ and decodes 2·Ψ a round, a sparse one
    encodes Ψ and decodes R payloads; at 4 MB/s a 1M-element (4 MB) pass takes 1 s."""
    from scripts import bench_wire

    codec = [{"wire": w, "encode_MBps": [4.0, 2.0, 8.0], "decode_MBps": [4.0]} for w in ("int2", "top0.9%-int2-decay")]
    cell = {"nodes": 4, "rate": "10mbit", "tuners": {"fp32": {"params": 1_000_000, "compute": {"t_step": 0.5}}}}
    dense, sparse = bench_wire.round_share(codec, [cell], tau=10)
    assert dense["codec_s_per_round"] == 1.25 + 2.0 and sparse["codec_s_per_round"] == 1.0 + 4.0
    assert sparse["share_of_round"] == 5.0 / (10 * 0.5)


def test_every_wire_method_of_the_quality_study_has_its_run_in_bench_throughput():
    """The wall-clock table finds each wire format's tokens/s under its bench_throughput label."""
    from scripts import bench_quality, bench_throughput, wire_quality

    for method in ("ddp", "none", wire_quality.FP32, *bench_quality.WIRE):
        assert wire_quality.throughput_label(method) in bench_throughput.METHODS, method


def test_the_wall_clock_divides_the_tokens_to_each_target_by_the_tokens_per_second():
    """DDP ends at 1.0 after 400 tokens at 5 tokens/s: 80 s. The format's curve crosses 1.10 at 183.3 tokens
    and 1.05 at 275 (linear between validation points) and never gets to 1.0 or 1.02: at 10 tokens/s,
    18.3 s and 27.5 s, its 300 tokens in 30 s."""
    from scripts import wire_quality

    ddp = [{"final_val_loss": 1.0, "tokens": [0, 200, 400], "val_loss": [3.0, 1.5, 1.0]}]
    row = {"method": "diloco_local_sync_int4", "tau": 32, "outer_lr": 0.5, "momentum": 0.9,
           "curve": ([0, 100, 200, 300], [3.0, 1.2, 1.08, 1.04])}  # fmt: skip
    summary = {"none": {"tokens_per_s": 20.0, "tau": 32}, "ddp": {"tokens_per_s": 5.0, "tau": 32},
               "co2-int4": {"tokens_per_s": 10.0, "tau": 32}}  # fmt: skip
    throughput = {"cells": [{"nodes": 4, "rate": "10mbit", "summary": summary}]}
    ddp_row, row_got = wire_quality.wall_clock([row], ddp, throughput, nodes=4)
    assert (ddp_row["method"], ddp_row["over_none"], ddp_row["seconds"][0]) == ("ddp", 0.25, 80.0)
    assert row_got["seconds"][:2] == [None, None] and row_got["budget_seconds"] == 30.0
    assert row_got["seconds"][2:] == [pytest.approx(27.5), pytest.approx(18.333, abs=1e-3)]
    table = wire_quality.wall_clock_markdown([ddp_row, row_got], "10mbit").splitlines()
    assert table[-1].startswith("| diloco_local_sync_int4 | 32 | 0.5, 0.9 | 10 (0.500, run at τ 32) |"), table[-1]


def _check(tau: int, efficiency: float, passes: bool) -> dict:
    return {"tau": tau, "efficiency": efficiency, "passes": passes}


def test_tuner_recommends_the_smallest_passing_tau_else_the_best_measured():
    """Verified: the smallest τ that met the targets. None met them: the τ measured best (highest
    efficiency), not the last one tried, and the report says that nothing met the targets."""
    passed = [_check(4, 0.90, False), _check(16, 0.97, True), _check(8, 0.96, True), _check(6, 0.93, False)]
    assert tune_tau.choose_tau(passed) == {"tau": 8, "verified": True}
    assert tune_tau.recommendation_line({"tau": 8, "verified": True}) == "recommended tau = 8"
    failed = [_check(1, 0.91, False), _check(20, 0.85, False), _check(64, 0.88, False)]
    rec = tune_tau.choose_tau(failed)
    assert rec == {"tau": 1, "verified": False, "best_efficiency": 0.91}
    line = tune_tau.recommendation_line(rec)
    assert line.startswith("recommended tau = 1: NO tau tried met the targets") and "efficiency 0.910" in line
    assert tune_tau.choose_tau([_check(12, 0.9, False), _check(6, 0.9, False)])["tau"] == 6  # tie: the smaller


# ---- scripts/bench_elastic.py: the kill schedule and what it reads from the replicas' event logs


def test_kill_schedule_rotates_nodes_and_restarts_each_before_the_end():
    from scripts import bench_elastic as be

    got = [(a.t, a.kind, a.node) for a in be.kill_schedule(150, 30, 10, 4)]
    assert got == [(30, "kill", 1), (40, "restart", 1), (60, "kill", 2), (70, "restart", 2),
                   (90, "kill", 3), (100, "restart", 3), (120, "kill", 0), (130, "restart", 0)]  # fmt: skip
    assert [a.node for a in be.kill_schedule(600, 60, 20, 4) if a.kind == "kill"] == [1, 2, 3, 0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="restart_after_s"):
        be.kill_schedule(100, 30, 30, 2)


def _steps(node, started, times, replicas, killed=None, final=None):
    """An incarnation whose events log has a step at each time (the quorum size per step)."""
    from scripts import bench_elastic as be

    sizes = replicas if isinstance(replicas, list) else [replicas] * len(times)
    events = [{"t": t, "event": "step", "step": k + 1, "replicas": r} for k, (t, r) in enumerate(zip(times, sizes))]
    if final:
        events.append({"t": times[-1] + 0.1, "event": "final", "step": final[0], "digest": final[1]})
    return be.Incarnation(node, started, events, killed=killed)


def test_events_log_skips_a_line_cut_by_sigkill():
    from scripts import bench_elastic as be

    text = '{"t": 1.0, "event": "step", "step": 1, "replicas": 2}\n{"t": 2.0, "event": "st'
    assert be.parse_events(text) == [{"t": 1.0, "event": "step", "step": 1, "replicas": 2}]


def test_recoveries_efficiency_drops_and_end_from_the_events():
    """Node 2 is killed at t=10 and restarted at t=15; survivors 0 and 1 stall at the round end and go on
    with 2 replicas at 17 and 18 s; the joiner's first step in a quorum comes at 20 s (its steps before
    its first quorum, replicas 0, do not count)."""
    from scripts import bench_elastic as be

    survivor0 = _steps(0, 0.0, [8, 9, 10, 11, 17, 18], [3, 3, 3, 3, 2, 2], final=(24, "d"))
    survivor1 = _steps(1, 0.0, [8, 9, 10, 11, 18, 19], [3, 3, 3, 3, 2, 2], final=(24, "d"))
    dead = _steps(2, 0.0, [8, 9], 3, killed=10.0)
    joiner = _steps(2, 15.0, [19, 20, 21], [0, 3, 3], final=(24, "d"))
    incs = [survivor0, survivor1, dead, joiner]
    kill = be.kill_recovery(incs, dead)
    assert kill["kill_to_next_step_s"] == 8.0  # the slower survivor: 18 - 10
    assert kill["stall_s"] == 7.0  # node 1's pause from 11 to 18
    assert be.join_recovery(joiner)["restart_to_first_step_s"] == 5.0
    # 6 + 6 + 2 + 1 steps in a quorum inside (0, 20] (the joiner's at 21 s is after it), 10 tokens each
    assert be.tokens_per_s(incs, 0.0, 20.0, 10) == 15 * 10 / 20.0
    assert be.identical_at_end([survivor0, survivor1, joiner])["identical"]
    joiner.events[-1]["digest"] = "other"
    end = be.identical_at_end([survivor0, survivor1, joiner])
    assert not end["identical"] and end["digests"] == 2
    survivor0.events.append({"t": 12, "event": "round", "round": 3, "replicas": 3, "committed": False})
    survivor1.events.append({"t": 12, "event": "round", "round": 3, "replicas": 3, "committed": False})
    survivor1.events.append({"t": 13, "event": "round", "round": 4, "replicas": 2, "committed": True})
    assert be.rounds_dropped(incs) == [3]
    summary = be.summarize({"t0": 0.0, "duration_s": 20.0}, incs, 10)
    assert summary["kill_to_next_step_s"] == {"median": 8.0, "max": 8.0, "n": 1, "missing": 0}
    assert summary["restart_to_first_step_s"]["median"] == 5.0


def test_a_survivor_that_never_goes_on_is_reported_not_guessed():
    from scripts import bench_elastic as be

    dead = _steps(1, 0.0, [1, 2], 2, killed=3.0)
    stuck = _steps(0, 0.0, [1, 2, 2.5], 2)
    assert be.kill_recovery([stuck, dead], dead)["kill_to_next_step_s"] is None
    assert be.median_max([None, 4.0, 2.0]) == {"median": 3.0, "max": 4.0, "n": 2, "missing": 1}


def test_a_kill_while_another_replica_joins_is_told_by_the_replica_ids():
    """Node 2 dies at t=10 while node 1's new launch is still joining: in the next quorum node 1 takes
    node 2's place, so the size stays 3; the ids say when node 2 was dropped, and the joiner (no step
    before the kill) is no survivor."""
    from scripts import bench_elastic as be

    def steps(node, started, rows, killed=None):
        events = [{"t": t, "event": "step", "step": k, "replicas": len(q), "quorum": q}
                  for k, (t, q) in enumerate(rows)]  # fmt: skip
        return be.Incarnation(node, started, events, killed=killed)

    old, new = [0, 2, 3], [0, 1, 3]
    survivors = [steps(n, 0.0, [(9, old), (10, old), (12, old), (16, new)]) for n in (0, 3)]
    dead = steps(2, 0.0, [(9, old)], killed=10.0)
    joining = steps(1, 5.0, [(16, new)])
    got = be.kill_recovery([*survivors, dead, joining], dead)
    assert got["kill_to_next_step_s"] == 6.0 and got["stall_s"] == 4.0


def _run(efficiency: dict, failures: dict, baseline: dict, drops: dict, identical: dict) -> dict:
    """One bench_elastic result with the given numbers per method (a kill and a join of 5 s / 10 s)."""

    def method(label: str) -> dict:
        stats = {"median": 5.0, "max": 6.0, "n": 1, "missing": 0}
        stall = {"median": 2.5, "max": 3.0, "n": 1, "missing": 0}
        joins = {"median": 10.0, "max": 11.0, "n": 1, "missing": 0}
        return {
            "step_efficiency": efficiency[label],
            "baseline": {"tokens_per_s": baseline[label]},
            "failures": {"tokens_per_s": failures[label], "kill_to_next_step_s": stats,
                         "stall_s": stall, "restart_to_first_step_s": joins,
                         "rounds_dropped": list(range(drops[label])), "end": {"identical": identical[label]}},
        }  # fmt: skip

    return {"methods": {label: method(label) for label in efficiency}, "command": "python -m scripts.bench_elastic",
            "settings": {}, "host": {}}  # fmt: skip


def test_repetitions_combine_per_method_and_side_by_side_in_each_run():
    """--combine: each method's numbers over the runs, and its tokens/s with failures over the first
    method's of the same run (not over another run's)."""
    from scripts import bench_elastic as be

    runs = [
        _run({"a": 0.8, "b": 0.9}, {"a": 100.0, "b": 50.0}, {"a": 125.0, "b": 55.0}, {"a": 2, "b": 0},
             {"a": True, "b": True}),
        _run({"a": 0.9, "b": 0.7}, {"a": 200.0, "b": 300.0}, {"a": 220.0, "b": 400.0}, {"a": 1, "b": 3},
             {"a": False, "b": True}),
        _run({"a": 0.7, "b": 0.8}, {"a": 150.0, "b": 150.0}, {"a": 200.0, "b": 180.0}, {"a": 0, "b": 0},
             {"a": True, "b": True}),
    ]  # fmt: skip
    c = be.combine(runs)
    assert c["runs"] == 3 and c["first"] == "a"
    assert c["methods"]["b"]["failures_over_a"] == [0.5, 1.5, 1.0]
    assert c["methods"]["a"]["failures_over_a"] == [1.0, 1.0, 1.0]
    assert c["methods"]["a"]["rounds_dropped"] == [2, 1, 0] and c["methods"]["a"]["identical_at_end"] == 2
    table = be.combined_table(c)
    assert "| `b` | 0.800 [0.700–0.900] | 150 [50–300] | 1.000 [0.500–1.500] |" in table, table
    assert "2 of 3 runs" in table and "3 of 3 runs" in table
    assert "| 5.0 [5.0–5.0] | 2.5 [2.5–2.5] | 10.0 [10.0–10.0] |" in table, table  # next step, pause, join
    with pytest.raises(ValueError, match="every run must hold the methods"):
        be.combine([runs[0], _run({"a": 1.0}, {"a": 1.0}, {"a": 1.0}, {"a": 0}, {"a": True})])


def test_each_replica_gets_a_core_or_an_equal_share_and_the_report_says_which():
    """bench_elastic's default CPU cap, and the caveat printed next to its tables: a run without the
    setting (before caps existed) was uncapped and is reported so."""
    from scripts import bench_elastic as be

    assert be.default_cpus_per_node(4, 2) == 0.5 and be.default_cpus_per_node(4, 16) == 1.0
    capped = be.cpu_note({"nodes": 4, "cpus_per_node": 0.5}, 2)
    assert "capped at 0.5 core" in capped and "leaves its share idle" in capped
    for settings in ({"nodes": 4, "cpus_per_node": None}, {"nodes": 4}):
        assert "uncapped" in be.cpu_note(settings, 2) and "flatters step efficiency" in be.cpu_note(settings, 2)


def test_tuner_gives_one_answer_and_its_verify_runs_warn_nothing(tmp_path):
    """co2-tune-tau on 2 ranks: its own runs print no warning (the exchange timing used to warn that tau=1
    cannot hide it, the verify runs that their exchange filled the round); every verified tau reports the
    exchange as the job's sync_delay "auto" measures it, and a verified recommendation is a tau where that
    exchange is hidden (the sync delay the job will fix is below tau), as its last line says."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "tune.json"
    flags = ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "4",
             "--steps", "3", "--reps", "2", "--verify_rounds", "4", "--verify_seconds", "0", "--max_verifies", "3",
             "--max_tau", "24", "--tune_json", str(out)]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(root / "scripts" / "tune_tau.py"), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Warning" not in done.stderr and "sync_delay 'auto'" not in done.stderr, done.stderr[-3000:]
    result = json.loads(out.read_text())
    checks, rec = result["verify"], result["recommendation"]
    assert checks and all(isinstance(v["exchange_steps"], int) and v["exchange_steps"] >= 1 for v in checks), checks
    for v in checks:
        assert v["hidden"] == (v["sync_delay"] < v["tau"]) and (v["passes"] <= v["hidden"]), v
    chosen = next(v for v in checks if v["tau"] == rec["tau"])
    assert chosen["hidden"] or not rec["verified"], (chosen, rec)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"recommended tau = {rec['tau']} (there the exchange took {chosen['exchange_steps']} "), last


def test_format_defaults_compares_seed_for_seed_and_adds_variants_to_every_format():
    """bench_format_defaults: each case's loss over fp32's of the same seed; `--with` adds its flags to every
    format but fp32, `--with_env` its environment variables."""
    from scripts import bench_format_defaults as bfd

    a = bfd.get_args(["--formats", "fp32", "int2", "top1.5%-int2", "--with", "momentum=--outer_momentum 0.9",
                      "--with_env", "flat=CO2_SPARSE_CHUNKS=flat CO2_SPARSE_GUARD=off"])  # fmt: skip
    labels = {label: (flags, env) for label, flags, env in bfd.cases(a)}
    assert list(labels) == ["fp32", "int2", "top1.5%-int2", "int2 momentum", "top1.5%-int2 momentum", "int2 flat",
                            "top1.5%-int2 flat"]  # fmt: skip
    assert labels["top1.5%-int2 momentum"] == (
        ["--comm_dtype", "int2", "--topk", "0.015", "--outer_momentum", "0.9"],
        {},
    )
    flat = {"CO2_SPARSE_CHUNKS": "flat", "CO2_SPARSE_GUARD": "off"}
    assert labels["top1.5%-int2 flat"] == (["--comm_dtype", "int2", "--topk", "0.015"], flat)
    run = lambda seed, loss: {"seed": seed, "final_val_loss": loss, "payload_ratio": None, "senders_per_sent": None}  # noqa: E731
    rows = bfd.table({"fp32": [run(1, 2.0), run(2, 4.0)], "int2": [run(2, 4.4), run(1, 2.0)]})
    assert rows[1]["vs_fp32"] == pytest.approx(1.05) and (rows[1]["min"], rows[1]["max"]) == (1.0, pytest.approx(1.1))
