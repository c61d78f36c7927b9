"""What `co2-tune-tau` prints (rank 0): its measurements, each verified τ's verdict, the recommendation.

Figures are printed in units that show them (a 17 kB payload is not "0.0 MB"); an efficiency above 1.0
(CO2 faster than no communication at all) is the host's noise, and is printed as such, not as a pass.
"""

from __future__ import annotations

from typing import Optional

from .summary import shown_bytes


def report(r: dict) -> None:
    """Print the tuner's result `r` (`tune_tau.tune`)."""
    c, rec = r["compute"], r["recommendation"]
    print(
        f"tune_tau: {r['world_size']} rank{'s' if r['world_size'] != 1 else ''}, {r['params'] / 1e6:.2f}M params, "
        f"{r['tokens_per_rank_step']} tokens per rank and step"
    )
    print(f"  t_step = {c['t_step'] * 1e3:.1f} ms  (one inner step, no communication; slowest rank median)")
    if "t_comm" in r["comm"] and r["comm"].get("outer_group_size", 1) > 1:
        print(f"  t_comm = {r['comm']['t_comm'] * 1e3:.1f} ms  ({exchange_words(r['comm'])})")
    alone = " (the exchange alone: a first guess, verified below while training)" if r.get("verify") else ""
    print(
        f"  t_comm / t_step = {rec['comm_over_step']:.2f}; margin {rec['margin']} -> "
        f"tau_comm = ceil({rec['margin']} x {rec['comm_over_step']:.2f}) = {rec['tau_comm']}{alone}"
    )
    for v in r.get("verify", []):
        print(verify_line(v))
    if r.get("verify"):
        print(
            f"  targets: efficiency >= {rec['target_efficiency']} of compute-only, bookkeeping <= "
            f"{100 * rec['max_overhead']:.0f}% of a round, the exchange hidden inside the round; the advice is "
            f"the smallest tau at and above which every tau tried passed"
        )
        print(noise_line(r["verify"]))
    print(recommendation_line(rec, next((v for v in r.get("verify", []) if v["tau"] == rec["tau"]), None)))


def exchange_words(m: dict) -> str:
    """What t_comm is: measured (the pipeline, its format, the bytes and the rate) or a what-if on a link."""
    wire = m["comm_dtype"] + (f", top {m['topk']:.2%} of each chunk" if m.get("topk", 1.0) < 1.0 else "")
    sent = f"{shown_bytes(m['bytes_sent'])} sent per rank"
    if m.get("link_mbit") is not None:
        return (
            f"not measured: {sent} in {wire} over {m['outer_group_size']} replicas on a {m['link_mbit']:g} Mbit/s "
            f"link, {m['latency_ms']:g} ms per message"
        )
    rate = m.get("sent_bits_per_s")
    shown_rate = f", {rate / 1e6:.3g} Mbit/s" if rate else ""
    return f"{m['collective']} pipeline in {wire} over {m['outer_group_size']} replicas, {sent}{shown_rate}"


def verify_line(v: dict) -> str:
    """One verified tau: its rounds, its efficiency, bookkeeping and blocked time, and its verdict."""
    rounds = f"{v['rounds']} round{'s' if v['rounds'] != 1 else ''}"
    return (
        f"  verify tau={v['tau']:3d} ({rounds}): round {v['round_s'] * 1e3:.0f} ms vs compute-only "
        f"{v['compute_round_s'] * 1e3:.0f} ms -> efficiency {v['efficiency']:.3f}; bookkeeping "
        f"{v['t_book'] * 1e3:.1f} ms ({100 * v['book_fraction']:.1f}%); blocked {v['wait_s'] * 1e3:.0f} ms "
        f"({100 * v['wait_fraction']:.0f}%){_exchange_steps(v)} -> {v['verdict']}"
    )


def noise_line(checks: list[dict]) -> str:
    """How much the compute-only rounds varied, and what an efficiency above 1.0 means."""
    spread = max(v.get("noise", 0.0) for v in checks)
    line = f"  noise: compute-only rounds varied by up to {100 * spread:.1f}% (standard deviation / mean)"
    if any(v.get("verdict") == "noise" for v in checks):
        line += "; an efficiency above 1.0 (faster than no communication) is that noise, not a pass"
    return line


def _exchange_steps(v: dict) -> str:
    """A verify line's exchange as sync_delay "auto" measures it, or nothing where it was not measured."""
    if v.get("exchange_steps") is None:
        return ""
    where = f"applied after {v['sync_delay']} steps" if v["hidden"] else "not hidden: a round late"
    steps = v["exchange_steps"]
    return f"; exchange {steps} inner step{'s' if steps != 1 else ''} ({where})"


def recommendation_line(rec: dict, verified: Optional[dict] = None) -> str:
    """The report's last line: the tau, what the verify run at that tau measured of the exchange (the sync
    delay the job will fix), and when no tau tried met the targets, that it is only the best measured."""
    line = f"recommended tau = {rec['tau']}"
    if verified is not None and verified.get("exchange_steps") is not None:
        line += (
            f" (there the exchange took {verified['exchange_steps']} inner steps: sync_delay 'auto' applies each "
            f"average after {verified['sync_delay']}; docs/design.md §3)"
        )
    elif rec.get("link_mbit") is not None:
        line += f" (for the {rec['link_mbit']:g} Mbit/s link asked about: computed, not verified while training)"
    elif verified is None and "tau_comm" in rec:
        line += " (not verified while training: --verify_rounds > 0 on more than one rank does)"
    if rec.get("verified", True):
        return line
    return (
        f"{line}: NO tau tried met the targets (the link or the host is too slow, or busy, for them); "
        f"tau = {rec['tau']} measured best (efficiency {rec['best_efficiency']:.3f})"
    )
