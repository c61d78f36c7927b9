"""scripts/bench_hetero.py's arithmetic and tables: per method and repetition the job's tokens/s over its
replicas' own speeds, the final held-out loss against the uniform run's, and the training seconds to
DDP's final loss (and to within 2% and 5% of it) against the uniform cluster's; the issue's goals."""

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


def targets(ddp: Optional[dict], uniform: Optional[dict], tokens: int) -> dict[str, Optional[float]]:
    """The losses timed: DDP's final loss and within 2 / 5 / 10% of it, and the uniform run's loss at
    `tokens` (the fewer of the two runs': a run that trained fewer tokens is timed to what the uniform
    cluster reached with as many)."""
    out = {k: ddp["final_val_loss"] * (1 + x) if ddp else None for k, x in zip(KEYS, MARGINS)}
    return {**out, "uniform": loss_at(uniform["curve"], min(tokens, uniform["tokens"])) if uniform else None}


def _times(run: Optional[dict], goal: dict[str, Optional[float]]) -> dict[str, Optional[float]]:
    return {k: time_to(run["curve"], v) if run and v is not None else None for k, v in goal.items()}


def _measures(run: dict, runs: Sequence[dict], ddp: Optional[dict], u: Optional[dict]) -> dict:
    """One run's figures: against its own speeds, against the uniform run of its repetition."""
    own, u_own = _own_speeds(run, runs), _own_speeds(u, runs) if u else None
    goal = targets(ddp, u, run["tokens"])
    times, u_times = _times(run, goal), _times(u, goal)
    equal = min(run["tokens"], u["tokens"]) if u else 0  # the losses compared at the fewer tokens
    return {
        "tokens": run["tokens"], "train_s": run["train_s"], "own_speeds_tokens_per_s": run.get("own_tokens_per_s"),
        "tokens_per_s_over_own_speeds": _ratio(run["tokens"] / run["train_s"], own),
        "steady_tokens_per_s_over_own_speeds": _ratio(steady_tokens_per_s(run), own),
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
    ddp = {r["rep"]: r for r in runs if r["method"] == "ddp"}
    uniform = {r["rep"]: r for r in runs if r["method"] == "uniform"}
    methods: dict[str, dict] = {}
    for run in sorted((r for r in runs if r["method"] != "ddp"), key=lambda r: r["rep"]):
        measured = _measures(run, runs, ddp.get(run["rep"]), uniform.get(run["rep"]))
        m = methods.setdefault(run["method"], {k: [] for k in measured})
        for k, v in measured.items():
            m[k].append(v)
    return {"case": case, "speeds": list(speeds), **meta,
            "ddp": {"final_val_loss": [ddp[k]["final_val_loss"] for k in sorted(ddp)],
                    "tokens": [ddp[k]["tokens"] for k in sorted(ddp)],
                    "curves": [ddp[k]["curve"] for k in sorted(ddp)],
                    "command": next(iter(ddp.values()))["command"] if ddp else None},
            "methods": methods, "goals": goals(methods)}  # fmt: skip


def spread(values: Sequence[Optional[float]], fmt: str = ".3f", missing: str = "n/a") -> str:
    """median [min, max] of the values there are; `missing` for none (and how many are missing)."""
    have = [v for v in values if v is not None]
    if not have:
        return missing
    text = f"{statistics.median(have):{fmt}} [{min(have):{fmt}}, {max(have):{fmt}}]"
    return text + (f" ({len(values) - len(have)} of {len(values)} {missing})" if len(have) < len(values) else "")


def goals(methods: dict) -> dict:
    """Per method, the issue's goals against the medians: met or not, with the median."""
    out = {}
    for name, m in methods.items():
        med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None  # noqa: E731
        own, loss = med(m["tokens_per_s_over_own_speeds"]), med(m["loss_over_uniform_equal_tokens"])
        # DDP's loss itself, else the first of within 2 / 5 / 10% of it that every repetition reached
        margin = next((k for k in KEYS if all(t[k] is not None for t in m["time_over_uniform"])), KEYS[-1])
        time0 = med([t[margin] for t in m["time_over_uniform"]])
        out[name] = {
            "own_speed": {"median": own, "met": own is not None and own >= GOALS["own_speed"]},
            "loss_gap": {"median": loss and loss - 1, "met": loss is not None and loss - 1 <= GOALS["loss_gap"]},
            "time_ratio_to_ddp_loss": {
                "median": time0,
                "margin": float(margin),
                "met": time0 is not None and time0 <= GOALS["time_ratio"],
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
             "| method | τ_r (rep. 1) | tokens | tok/s ÷ Σ own speeds | steady state | final val loss | ÷ uniform's, "
             "equal tokens | time to DDP's loss +0 / 2 / 5 / 10% ÷ uniform's | time to uniform's loss (equal "
             "tokens) ÷ uniform's | the same per unit of compute |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, m in doc["methods"].items():
        ddp_times = " / ".join(_median([t[k] for t in m["time_over_uniform"]]) for k in KEYS)
        taus = ", ".join(str(t) for t in m["taus"][0])
        lines.append(f"| {name} | {taus} | {m['tokens'][0]:,} | {spread(m['tokens_per_s_over_own_speeds'])} | "
                     f"{spread(m['steady_tokens_per_s_over_own_speeds'])} | {spread(m['final_val_loss'], '.4f')} | "
                     f"{spread(m['loss_over_uniform_equal_tokens'], '.4f')} | {ddp_times} | "
                     f"{spread([t['uniform'] for t in m['time_over_uniform']], '.2f', 'not reached')} | "
                     f"{spread([t['uniform'] for t in m['compute_time_over_uniform']], '.2f', 'not reached')} |"
                     )  # fmt: skip
    return "\n".join([*lines, "", goals_line(doc["goals"])]) + "\n"


def _ddp_tokens(doc: dict) -> str:
    """' at N tokens' where DDP trained other tokens than the methods (--ddp_rounds)."""
    tokens = doc["ddp"]["tokens"]
    if not tokens or doc.get("ddp_rounds", doc["rounds"]) == doc["rounds"]:
        return ""
    return f" at {tokens[0]:,} tokens ({doc['ddp_rounds']} rounds' worth)"


def goals_line(found: dict) -> str:
    """The issue's goals, met or not, per method (medians)."""
    parts = []
    for name, g in found.items():
        own, loss, time = g["own_speed"], g["loss_gap"], g["time_ratio_to_ddp_loss"]
        say = lambda goal, text: f"{text} ({'met' if goal['met'] else 'not met'})"  # noqa: E731
        target = "DDP's loss" + (f" + {time['margin']:.0%}" if time["margin"] else "")
        time_text = f"{target} in ×{time['median']:.2f} uniform's time" if time["median"] is not None else (
            f"{target} not reached")  # fmt: skip
        parts.append(f"{name}: " + ", ".join([
            say(own, f"tok/s {own['median']:.3f} of Σ own speeds" if own["median"] is not None else "own speeds n/a"),
            say(loss, f"loss {loss['median']:+.2%} vs uniform"), say(time, time_text)]))  # fmt: skip
    goals = f"≥ {GOALS['own_speed']}, ≤ +{GOALS['loss_gap']:.0%}, ≤ ×{GOALS['time_ratio']}"
    return f"Goals ({goals}), medians: " + "; ".join(parts) + "."
