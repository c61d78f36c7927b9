"""Replays `replica_tau: "auto"`'s choice of τ_r on a heterogeneous study's recorded timings (issue 40).

For each `"auto"` run in <study>/runs.json: every replica's speed relative to the fastest as each reading
gives it (the first decision's timed steps, the correction's timed round, the two together: the geometric
mean of a replica's step times) against the speed it trained at over the run (`own_tokens_per_s`), and the
share of the replicas' own speeds that each rule's τ_r would train at those speeds, a round lasting its
slowest replica's τ_r at its own speed (no exchange waits, no start-up: what the choice alone costs). The
rules are `co2_zero.core.pace.taus_for_speeds` on each reading, with and without the correction's hedge
(`SPEED_ERROR`); the last is the correction `"auto"` makes.
Offline: the speeds over the run were measured at the τ_r the run chose. Prints a table, writes JSON.

    python -m scripts.pace_replay benchmarks/heterogeneous
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from co2_zero.core.pace import steps_per_second, taus_for_speeds
from co2_zero.core.pace_meter import SPEED_ERROR

READINGS = ("first", "timed_round", "both")
RULES = {  # name: (reading, error)
    "first steps": ("first", 0.0),
    "timed round": ("timed_round", 0.0),
    "both": ("both", 0.0),
    "both, hedged": ("both", SPEED_ERROR),
    "timed round, hedged (now)": ("timed_round", SPEED_ERROR),
}


def readings(step_ms: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """Each replica's step time by reading, from one run's `decision_step_ms` (one row of times per decision,
    one time per replica: the runs here are S = 1)."""
    first, timed = step_ms
    return {"first": list(first), "timed_round": list(timed), "both": [math.sqrt(a * b) for a, b in zip(first, timed)]}


def relative_errors(step_times: Sequence[float], own: Sequence[float]) -> list[float]:
    """How far each replica's speed over the fastest's, as `step_times` read it, is from its own over the run."""
    speeds = [1 / t for t in step_times]
    return [(s / max(speeds)) / (o / max(own)) - 1 for s, o in zip(speeds, own)]


def share_of_own(taus: Sequence[int], own: Sequence[float]) -> float:
    """The replicas' steps per second at `taus` (a round lasts the slowest's τ_r / own speed) over the sum of
    their own speeds."""
    return steps_per_second(taus, own) / sum(own)


def replay(run: dict, tau: int) -> dict:
    """One run's readings' errors and every rule's τ_r and share of the run's own speeds."""
    own, times = run["own_tokens_per_s"], readings(run["decision_step_ms"])
    out = {"case": run["case"], "rep": run["rep"], "ran": run["paces"][-1][1],
           "errors": {name: relative_errors(times[name], own) for name in READINGS}, "rules": {}}  # fmt: skip
    for rule, (reading, error) in RULES.items():
        taus = taus_for_speeds([1 / t for t in times[reading]], tau, error)
        out["rules"][rule] = {"taus": taus, "share_of_own": share_of_own(taus, own)}
    return out


def summary(replays: Sequence[dict]) -> dict:
    """Per rule the mean share of own speeds; per reading the largest error and the count within SPEED_ERROR."""
    errors = {name: [abs(e) for r in replays for e in r["errors"][name]] for name in READINGS}
    return {
        "mean_share_of_own": {
            rule: statistics.fmean(r["rules"][rule]["share_of_own"] for r in replays) for rule in RULES
        },
        "largest_error": {name: max(v) for name, v in errors.items()},
        "within_speed_error": {name: [sum(e <= SPEED_ERROR for e in v), len(v)] for name, v in errors.items()},
    }


def table(replays: Sequence[dict], totals: dict) -> str:
    head = "| case | rep | ran | " + " | ".join(RULES) + " |"
    rows = [head, "|" + "---|" * (3 + len(RULES))]
    for r in replays:
        cells = [f"{r['rules'][rule]['taus']} {r['rules'][rule]['share_of_own']:.3f}" for rule in RULES]
        rows.append(f"| {r['case']} | {r['rep']} | {r['ran']} | " + " | ".join(cells) + " |")
    rows.append("| mean | | | " + " | ".join(f"{totals['mean_share_of_own'][rule]:.3f}" for rule in RULES) + " |")
    errors = ", ".join(f"{name} ≤ {100 * v:.1f}%" for name, v in totals["largest_error"].items())
    within = ", ".join(f"{name} {k}/{n}" for name, (k, n) in totals["within_speed_error"].items())
    return "\n".join(rows) + f"\n\nlargest error: {errors}; within ±{SPEED_ERROR:.0%}: {within}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="a folder with runs.json (scripts/bench_hetero.py)")
    parser.add_argument("--tau", type=int, default=32)
    parser.add_argument("--out", help="JSON to write (default: <study>/pace_replay.json)")
    a = parser.parse_args()
    runs = json.loads(Path(a.study, "runs.json").read_text())["runs"]
    replays = [replay(r, a.tau) for r in runs if r["method"] == "auto" and len(r.get("decision_step_ms") or []) == 2]
    if not replays:
        raise SystemExit(f"pace_replay: no 'auto' run with two decisions' times in {a.study}/runs.json")
    totals = summary(replays)
    print(table(replays, totals))
    Path(a.out or Path(a.study, "pace_replay.json")).write_text(
        json.dumps({"runs": replays, **totals}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
