"""The benchmark harness's own arithmetic and measurements (scripts/bench_throughput.py, co2_zero.tune_tau).

The benchmarks are not part of the suite; what decides their numbers is: which runs a cell plans, how
a run's steady state is cut out of its log, and what the tuner times as "one round's exchange".
"""

from co2_zero import tune_tau
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
    assert [bt.comm_dtype(x) for x in ("co2", "co2-int8", "co2-int8 @tuned")] == ["fp32", "int8", "int8"]
    assert bt.run_flags("co2-int8 @tuned", ["--n_layer", "1"], ["--gap_strength", "2"]) == [
        "--method", "co2", "--comm_dtype", "int8", "--n_layer", "1", "--gap_strength", "2",
    ]  # fmt: skip
    assert bt.run_flags("localsgd", [], ["--gap_strength", "2"]) == ["--method", "localsgd"]


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
        dtype: tune_tau.measure_exchange_time(4096, CO2Config(collective="reduce_scatter", comm_dtype=dtype), reps=2)
        for dtype in ("fp32", "bf16", "int8")
    }


def test_tuner_times_the_exchange_in_its_wire_format():
    """The tuner's t_comm comes from the library's own pipeline, so a compressed format sends fewer bytes
    (what makes its tuned τ smaller): int8 at most 0.27x of fp32 (docs/design.md §5)."""
    for got in run_ranks(_exchange_bytes, 2):
        fp32, bf16, int8 = got["fp32"], got["bf16"], got["int8"]
        # reduce-scatter + all-gather, (R-1)/R of 16 KiB each, plus the outer step's few norms
        assert 4096 * 4 <= fp32["bytes_sent"] < 4096 * 4 + 64
        assert bf16["bytes_sent"] < 0.76 * fp32["bytes_sent"]
        assert int8["bytes_sent"] <= 0.27 * fp32["bytes_sent"]
        assert all(x["t_comm"] > 0 and len(x["samples"]) == 2 for x in (fp32, bf16, int8))


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
