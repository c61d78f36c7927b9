"""scripts/bench_hetero.py's arithmetic and tables: per method and repetition the job's tokens/s over its
replicas' own speeds and over the uniform run's, the final held-out loss against the uniform run's, and
the training seconds to DDP's final loss (within 2, 5 and 10% of it, and the final losses of DDP runs of
fewer tokens) against the uniform cluster's; the issue's goals."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

MARGINS = (0.0, 0.02, 0.05, 0.1)  # time to DDP's final loss × (1 + margin)
KEYS = tuple(f"{x:g}" for x in MARGINS)
GOALS = {"own_speed": 0.95, "loss_gap": 0.01, "time_ratio": 1.15}


def from_peer_records(records: Sequence[dict], tau: int, flags: Sequence[str]) -> dict:
    """A torchft job's merged JSON lines (scripts/torchft_peer.py) as a run: tokens, training seconds,
    the held-out curve (the replicas' mean), the final held-out loss; its own speeds are not timed."""
    end = next(r for r in records if r.get("summary"))
    curve = [{"train_s": r["elapsed_s"], "tokens": r["tokens"], "val_loss": r["val_loss"], "final": False}
             for r in records if not r.get("summary") and r.get("val_loss") is not None]  # fmt: skip
    curve.append({"train_s": end["elapsed_s"], "tokens": end["tokens"], "val_loss": end["val_loss"], "final": True})
    ends = [r["elapsed_s"] for r in records if not r.get("summary") and r["step"] > 0 and r["step"] % tau == 0]
    return {"pacing": "torchft_diloco", "taus": [tau] * end["replicas"], "tokens": end["tokens"], "round_end_s": ends,
            "train_s": end["elapsed_s"], "curve": curve, "final_val_loss": end["val_loss"],
            "own_tokens_per_s": None, "command": "scripts/torchft_peer.py " + " ".join(flags)}  # fmt: skip


def steady_tokens_per_s(run: dict) -> Optional[float]:
    """Tokens/s from the end of the first round at the run's own τ_r to the last round end: start-up,
    `"auto"`'s measuring rounds (`measured_rounds`) and the last exchange's wait left out. Each round's
    tokens from `round_tokens` (else the run's tokens spread evenly over its rounds)."""
    ends, first = run.get("round_end_s") or [], run.get("measured_rounds", 0)
    if len(ends) < first + 2:
        return None
    tokens = run.get("round_tokens") or [run["tokens"] / len(ends)] * len(ends)
    return sum(tokens[first + 1 :]) / (ends[-1] - ends[first])


def time_to(curve: Sequence[dict], target: float) -> Optional[float]:
    """Training seconds at which the held-out loss first reaches `target`, linear between evaluations."""
    for before, point in zip([None, *curve], curve):
        if point["val_loss"] <= target:
            if before is None:
                return point["train_s"]
            span = before["val_loss"] - point["val_loss"]
            share = (before["val_loss"] - target) / span if span > 0 else 1.0
            return before["train_s"] + share * (point["train_s"] - before["train_s"])
    return None


def _own_speeds(run: dict, runs: Sequence[dict]) -> Optional[float]:
    """Σ of the run's ranks' own tokens/s (torchft: the same case and repetition's fixed_tau run's)."""
    if run.get("own_tokens_per_s"):
        return sum(run["own_tokens_per_s"])
    twin = [r for r in runs if r["method"] == "fixed_tau" and r["rep"] == run["rep"]]
    return sum(twin[0]["own_tokens_per_s"]) if twin else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def loss_at(curve: Sequence[dict], tokens: float) -> Optional[float]:
    """The held-out loss at `tokens`, linear between evaluations; None past the curve's end."""
    for before, point in zip(curve, curve[1:]):
        if before["tokens"] <= tokens <= point["tokens"]:
            span = point["tokens"] - before["tokens"]
            share = (tokens - before["tokens"]) / span if span > 0 else 1.0
            return before["val_loss"] + share * (point["val_loss"] - before["val_loss"])
    return curve[0]["val_loss"] if curve and tokens == curve[0]["tokens"] else None


def ddp_budgets(meta: dict) -> list[int]:
    """DDP's budgets in rounds at one τ, the main target's first (`--ddp_rounds`; one number in older
    studies, none: the methods' rounds)."""
    budgets = meta.get("ddp_rounds") or meta["rounds"]
    return list(budgets) if isinstance(budgets, list) else [budgets]


def shorter_key(rounds: int) -> str:
    """The target key of the final loss of DDP trained for `rounds` rounds' tokens (not the main one)."""
    return f"ddp_{rounds}_rounds"


def targets(ddps: Sequence[dict], uniform: Optional[dict], tokens: int) -> dict[str, Optional[float]]:
    """The losses timed: the main DDP run's (`ddps[0]`) final loss and within 2 / 5 / 10% of it, each other
    DDP run's final loss, and the uniform run's loss at `tokens` (the fewer of the two runs': a run that
    trained fewer tokens is timed to what the uniform cluster reached with as many)."""
    main = ddps[0] if ddps else None
    out = {k: main["final_val_loss"] * (1 + x) if main else None for k, x in zip(KEYS, MARGINS)}
    out.update({shorter_key(run["rounds"]): run["final_val_loss"] for run in ddps[1:]})
    return {**out, "uniform": loss_at(uniform["curve"], min(tokens, uniform["tokens"])) if uniform else None}


def _times(run: Optional[dict], goal: dict[str, Optional[float]]) -> dict[str, Optional[float]]:
    return {k: time_to(run["curve"], v) if run and v is not None else None for k, v in goal.items()}


def _measures(run: dict, runs: Sequence[dict], ddps: Sequence[dict], u: Optional[dict]) -> dict:
    """One run's figures: against its own speeds, against the uniform run of its repetition."""
    own, u_own = _own_speeds(run, runs), _own_speeds(u, runs) if u else None
    goal = targets(ddps, u, run["tokens"])
    times, u_times = _times(run, goal), _times(u, goal)
    equal = min(run["tokens"], u["tokens"]) if u else 0  # the losses compared at the fewer tokens
    return {
        "tokens": run["tokens"], "train_s": run["train_s"], "own_speeds_tokens_per_s": run.get("own_tokens_per_s"),
        "tokens_per_s_over_own_speeds": _ratio(run["tokens"] / run["train_s"], own),
        "steady_tokens_per_s_over_own_speeds": _ratio(steady_tokens_per_s(run), own),
        "tokens_per_s_over_uniform": _ratio(run["tokens"] / run["train_s"], u and u["tokens"] / u["train_s"]),
        "final_val_loss": run["final_val_loss"], "loss_over_uniform": _ratio(run["final_val_loss"],
                                                                              u and u["final_val_loss"]),
        "loss_over_uniform_equal_tokens": _ratio(loss_at(run["curve"], equal),
                                                 loss_at(u["curve"], equal) if u else None),
        "taus": run["taus"], "caps_cores": run["caps_cores"], "host_before": run["host_before"],
        "time_to_s": times, "time_over_uniform": {k: _ratio(v, u_times[k]) for k, v in times.items()},
        "compute_time_over_uniform": {k: _ratio(v and own and v * own, u_times[k] and u_own and u_times[k] * u_own)
                                      for k, v in times.items()},
        "curves": run["curve"], "commands": run.get("command"),
    }  # fmt: skip


def case_report(case: str, speeds: Sequence[float], meta: dict, runs: Sequence[dict]) -> dict:
    """One case's JSON: per method, lists over repetitions (index = repetition)."""
    budgets = ddp_budgets(meta) if "rounds" in meta else []
    ddps = _ddp_runs(runs, budgets)
    ddp = {rep: ddps[rep][0] for rep in sorted(ddps)}
    uniform = {r["rep"]: r for r in runs if r["method"] == "uniform"}
    methods: dict[str, dict] = {}
    for run in sorted((r for r in runs if r["method"] != "ddp"), key=lambda r: r["rep"]):
        measured = _measures(run, runs, ddps.get(run["rep"], []), uniform.get(run["rep"]))
        m = methods.setdefault(run["method"], {k: [] for k in measured})
        for k, v in measured.items():
            m[k].append(v)
    return {"case": case, "speeds": list(speeds), **meta,
            "ddp": {"final_val_loss": [ddp[k]["final_val_loss"] for k in sorted(ddp)],
                    "tokens": [ddp[k]["tokens"] for k in sorted(ddp)],
                    "curves": [ddp[k]["curve"] for k in sorted(ddp)],
                    "command": next(iter(ddp.values()))["command"] if ddp else None},
            "ddp_shorter": _shorter(ddps, budgets[1:]),
            "methods": methods, "goals": goals(methods, budgets[1:], bool(uniform), bool(uniform and ddp))}  # fmt: skip


def _ddp_runs(runs: Sequence[dict], budgets: Sequence[int]) -> dict[int, list[dict]]:
    """Per repetition its DDP runs in `budgets`' order, the main target's first (a run without a budget,
    as a hand-made one: the main one)."""
    place = {b: i for i, b in enumerate(budgets)}
    out: dict[int, list[dict]] = {}
    for run in sorted((r for r in runs if r["method"] == "ddp"), key=lambda r: place.get(r.get("rounds"), 0)):
        out.setdefault(run["rep"], []).append(run)
    return out


def _shorter(ddps: dict[int, list[dict]], budgets: Sequence[int]) -> dict[str, dict]:
    """The other DDP budgets' final losses (a list over repetitions) and tokens, by their rounds."""
    out: dict[str, dict] = {}
    for rep in sorted(ddps):
        for run in ddps[rep][1:]:
            if run.get("rounds") in budgets:
                b = out.setdefault(str(run["rounds"]), {"final_val_loss": [], "tokens": run["tokens"]})
                b["final_val_loss"].append(run["final_val_loss"])
    return out


def spread(values: Sequence[Optional[float]], fmt: str = ".3f", missing: str = "n/a") -> str:
    """median [min, max] of the values there are; `missing` for none (and how many are missing)."""
    have = [v for v in values if v is not None]
    if not have:
        return missing
    text = f"{statistics.median(have):{fmt}} [{min(have):{fmt}}, {max(have):{fmt}}]"
    return text + (f" ({len(values) - len(have)} of {len(values)} {missing})" if len(have) < len(values) else "")


def goals(methods: dict, shorter: Sequence[int] = (), uniform: bool = True, timed: bool = True) -> dict:
    """Per method, the issue's goals against the medians: met or not, with the median. The time is to the
    main DDP run's final loss, else to the final loss of the longest of the `shorter` DDP runs, else to
    within 2 / 5 / 10% of the main one's: the first that every repetition reached. A study without a
    `uniform` run judges neither the loss nor the time, one without DDP (not `timed`) not the time: None."""
    order = [KEYS[0], *(shorter_key(b) for b in sorted(shorter, reverse=True)), *KEYS[1:]]
    out = {}
    for name, m in methods.items():
        med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None  # noqa: E731
        own, loss = med(m["tokens_per_s_over_own_speeds"]), med(m["loss_over_uniform_equal_tokens"])
        target = next((k for k in order if all(t.get(k) is not None for t in m["time_over_uniform"])), KEYS[-1])
        time0 = med([t.get(target) for t in m["time_over_uniform"]])
        out[name] = {
            "own_speed": {"median": own, "met": own is not None and own >= GOALS["own_speed"]},
            "loss_gap": {
                "median": loss and loss - 1,
                "met": loss is not None and loss - 1 <= GOALS["loss_gap"] if uniform else None,
            },
            "time_ratio_to_ddp_loss": {
                "median": time0,
                "target": target,
                "met": time0 is not None and time0 <= GOALS["time_ratio"] if timed else None,
            },
        }
    return out


def _median(values: Sequence[Optional[float]]) -> str:
    have = [v for v in values if v is not None]
    return f"{statistics.median(have):.2f}" if have else "–"


def markdown(doc: dict) -> str:
    """The case's table: median [min, max] over repetitions (the DDP-loss times: medians, – not reached)."""
    lines = [f"### speeds {', '.join(f'{s:g}' for s in doc['speeds'])} ({doc['case']})", "",
             f"`{doc['command']}`; P = 4, {doc['rate']}, τ = {doc['tau']}, {doc['rounds']} rounds at one τ, "
             f"speed 1 = {doc['core_at_speed_1']:g} core (cgroup CFS quota), {doc['reps']} repetitions, "
             f"{doc['host']['cores']}-core host shared with other jobs; DDP's final loss "
             f"{spread(doc['ddp']['final_val_loss'], '.4f')}{_ddp_tokens(doc)}.", "",
             "| " + " | ".join(_columns(doc)) + " |", "|" + "---|" * len(_columns(doc))]  # fmt: skip
    shorter = [shorter_key(int(b)) for b in doc.get("ddp_shorter", {})]
    for name, m in doc["methods"].items():
        ddp_times = " / ".join(_median([t[k] for t in m["time_over_uniform"]]) for k in KEYS)
        shorter_times = " / ".join(_median([t.get(k) for t in m["time_over_uniform"]]) for k in shorter)
        taus = ", ".join(str(t) for t in m["taus"][0])
        lines.append(f"| {name} | {taus} | {m['tokens'][0]:,} | {spread(m['tokens_per_s_over_own_speeds'])} | "
                     f"{spread(m['steady_tokens_per_s_over_own_speeds'])} | "
                     f"{spread(m['tokens_per_s_over_uniform'])} | {spread(m['final_val_loss'], '.4f')} | "
                     f"{spread(m['loss_over_uniform_equal_tokens'], '.4f')} | {ddp_times} | "
                     f"{shorter_times + ' | ' if shorter else ''}"
                     f"{spread([t['uniform'] for t in m['time_over_uniform']], '.2f', 'not reached')} | "
                     f"{spread([t['uniform'] for t in m['compute_time_over_uniform']], '.2f', 'not reached')} |"
                     )  # fmt: skip
    return "\n".join([*lines, "", goals_line(doc["goals"])]) + "\n"


def _ddp_tokens(doc: dict) -> str:
    """' at N tokens' where DDP trained other tokens than the methods (--ddp_rounds), and the final losses
    of the DDP runs of fewer tokens."""
    tokens, main = doc["ddp"]["tokens"], ddp_budgets(doc)[0]
    text = "" if not tokens or main == doc["rounds"] else f" at {tokens[0]:,} tokens ({_worth(main)})"
    return text + "".join(f"; at {_worth(int(b))} ({d['tokens']:,} tokens) {spread(d['final_val_loss'], '.4f')}"
                          for b, d in doc.get("ddp_shorter", {}).items())  # fmt: skip


def _worth(rounds: int) -> str:
    return f"{rounds} round's worth" if rounds == 1 else f"{rounds} rounds' worth"


def _columns(doc: dict) -> list[str]:
    """The table's column heads (the times to the final losses of DDP runs of fewer tokens: where run)."""
    budgets = " / ".join(doc.get("ddp_shorter", {}))
    shorter = [f"time to DDP's loss at {budgets} rounds' tokens ÷ uniform's"] if budgets else []
    return ["method", "τ_r (rep. 1)", "tokens", "tok/s ÷ Σ own speeds", "steady state", "tok/s ÷ uniform's",
            "final val loss", "÷ uniform's, equal tokens", "time to DDP's loss +0 / 2 / 5 / 10% ÷ uniform's",
            *shorter, "time to uniform's loss (equal tokens) ÷ uniform's", "the same per unit of compute"]  # fmt: skip


def _target_text(key: str) -> str:
    """A target key in words: "DDP's loss", "DDP's loss + 2%", "DDP's loss at 2 rounds' worth"."""
    if key.startswith("ddp_"):
        return f"DDP's loss at {_worth(int(key.split('_')[1]))}"
    return "DDP's loss" + (f" + {float(key):.0%}" if float(key) else "")


def goals_line(found: dict) -> str:
    """The issue's goals, met or not, per method (medians); "n/a" where the study has no run to judge one by
    (no uniform run, no DDP)."""
    parts = []
    for name, g in found.items():
        own, loss, time = g["own_speed"], g["loss_gap"], g["time_ratio_to_ddp_loss"]
        target = _target_text(time["target"])
        parts.append(f"{name}: " + ", ".join([
            _goal_text(own, "tok/s {:.3f} of Σ own speeds", "own speeds n/a"),
            _goal_text(loss, "loss {:+.2%} vs uniform", "loss vs uniform n/a"),
            _goal_text(time, f"{target} in ×{{:.2f}} uniform's time", f"{target} not reached",
                       "time to DDP's loss n/a"),
        ]))  # fmt: skip
    goals = f"≥ {GOALS['own_speed']}, ≤ +{GOALS['loss_gap']:.0%}, ≤ ×{GOALS['time_ratio']}"
    return f"Goals ({goals}), medians: " + "; ".join(parts) + "."


def _goal_text(goal: dict, figure: str, missing: str, unjudged: Optional[str] = None) -> str:
    """`figure` filled with the goal's median, met or not; `missing` where a run has no median; `unjudged`
    (default `missing`) where the study has nothing to judge the goal by."""
    if goal["met"] is None:
        return unjudged or missing
    shown = missing if goal["median"] is None else figure.format(goal["median"])
    return f"{shown} ({'met' if goal['met'] else 'not met'})"
