"""The training job's CO2 flags: the method presets, which CO2Config field each flag sets, and the CO2Config
a run resolves to."""

from __future__ import annotations

import argparse
from typing import Any

from ..core.config import PUBLISHED, STAND_INS, CO2Config
from .ds_config import json_co2_section

# The baselines are CO2 configurations; "co2" is the library's defaults (CO2Config), "co2_published" CO2 as
# published (config.PUBLISHED). Precedence, low to high: CO2Config's defaults, the "co2" section of
# --deepspeed_config (engine deepspeed), the method's preset, the flags given.
BLOCKING = {"overlap": False, "gap_penalty": {"mode": "none"}}  # what the baselines share
METHOD_PRESETS = {
    "co2": {},
    "co2_published": PUBLISHED,
    "localsgd": {**BLOCKING, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    "slowmo": {**BLOCKING, "outer_lr": 1.0, "outer_momentum": 0.5, "nesterov": False},
    "diloco": {**BLOCKING, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
}
CO2_METHODS = tuple(METHOD_PRESETS)
METHODS = CO2_METHODS + ("ddp", "none")

_SAME_NAME = "tau outer_lr outer_momentum nesterov overlap shards_per_replica collective comm_dtype timeout_s"
_SAME_NAME += " nonfinite stand_in sync_delay topk feedback_decay replica_tau"
# CO2 flag -> the CO2Config field it sets (a pair: a field of a nested section).
CO2_FLAGS = {
    **{name: name for name in _SAME_NAME.split()},
    "gap_penalty": ("gap_penalty", "mode"),
    "gap_strength": ("gap_penalty", "strength"),
    "gap_value": ("gap_penalty", "value"),
    "clip": ("clip", "mode"),
    "clip_threshold": ("clip", "threshold"),
}
PRESET = "default: the --method preset, else the config's co2 section, else CO2Config's"
TAUS_ACCEPTED = "one integer per replica, comma-separated (e.g. 32,32,16)"


def _sync_delay(text: str) -> int | str:
    """--sync_delay: an integer, or "auto" (CO2Config checks the range)."""
    return text if text == "auto" else int(text)


def replica_taus(text: str, accepted: str = TAUS_ACCEPTED) -> list[int]:
    """The τ_r of a `replica_tau` list, one integer per replica, comma-separated (CO2Config checks the range)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: {accepted}") from None


def _replica_tau(text: str) -> list[int] | str:
    """--replica_tau: "auto", or the τ_r (`replica_taus`)."""
    return text if text == "auto" else replica_taus(text, f"'auto' or {TAUS_ACCEPTED}")


def add_co2_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("CO2", f"each flag given overrides the CO2Config field ({PRESET})").add_argument
    a("--tau", type=int, default=None, help=f"local steps per round; {PRESET} 32")
    a("--outer_lr", type=float, default=None, help=f"{PRESET} auto: 0.5, 1.0 with --topk < 1")
    a("--outer_momentum", type=float, default=None, help=f"{PRESET} auto: 0.9, 0 with --topk < 1")
    a("--nesterov", default=None, action=argparse.BooleanOptionalAction, help=f"{PRESET} on")
    a("--overlap", default=None, action=argparse.BooleanOptionalAction, help=f"{PRESET} on")
    a(
        "--stand_in",
        default=None,
        choices=STAND_INS,
        help=f"where a replica starts a round while the average is in flight (design §3); {PRESET} auto",
    )
    a(
        "--sync_delay",
        type=_sync_delay,
        default=None,
        help=f"inner steps of the next round the exchange must finish in, or auto (design §3); {PRESET} auto",
    )
    a(
        "--replica_tau",
        type=_replica_tau,
        default=None,
        metavar="auto|N,N,...",
        help="each replica's inner steps per round, or auto to measure them (replicas of different speeds; "
        f"--max_steps, --save_every and the LR schedule count the fastest's steps); {PRESET} null: tau",
    )
    a("--gap_penalty", default=None, choices=("none", "constant", "adaptive"), help=f"{PRESET} none")
    a("--gap_strength", type=float, default=None, help=f"adaptive: 1 + strength*|gap|/|g|; {PRESET} 2.0")
    a("--gap_value", type=float, default=None, help=f"constant: divide by this; {PRESET} 1.0")
    a("--clip", default=None, choices=("none", "value", "norm"), help=f"outer momentum clip; {PRESET} none")
    a("--clip_threshold", type=float, default=None, help=f"{PRESET} 1.0")
    a(
        "--shards_per_replica",
        type=int,
        default=None,
        help=f"S of the fairscale/deepspeed/fsdp engines (plain: always 1); {PRESET} the ranks per node",
    )
    a("--collective", default=None, help=f"{PRESET} auto")
    a("--comm_dtype", default=None, help=f"wire format of the exchange; {PRESET} fp32")
    a("--topk", type=float, default=None, help=f"fraction of each chunk a replica sends; {PRESET} 1.0 (dense)")
    a("--feedback_decay", type=float, default=None, help=f"the sparse exchange's residual decay; {PRESET} auto: 0.95")
    a("--timeout_s", type=float, default=None, help=f"deadline of every wait; {PRESET} 600")
    a("--nonfinite", default=None, choices=("raise", "skip_round"), help=f"on a NaN/inf round; {PRESET} raise")


def co2_config(args: argparse.Namespace) -> CO2Config:
    """The CO2Config of this run: CO2Config's defaults, under the --deepspeed_config "co2" section
    (engine deepspeed), under the --method preset, under the CO2 flags that were given."""
    fields: dict[str, Any] = {}

    def put(name, value):  # `name`: a field, or (section, field) of a nested section (gap_penalty, clip)
        if isinstance(name, tuple):
            name, value = name[0], {name[1]: value}
        if isinstance(value, dict) and isinstance(fields.get(name), dict):
            value = {**fields[name], **value}
        fields[name] = value

    for layer in (json_co2_section(args), METHOD_PRESETS[args.method]):
        for name, value in layer.items():
            put(name, value)
    for flag, name in CO2_FLAGS.items():
        if getattr(args, flag, None) is not None:
            put(name, getattr(args, flag))
    return CO2Config.from_dict(fields)
