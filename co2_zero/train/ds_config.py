"""--engine deepspeed: the job's settings from the DeepSpeed config, a flag winning only where it was given.

The config (--deepspeed_config) says the micro-batch, the accumulation, the clipping, the AdamW settings and
the LR scheduler; a flag left at its default takes the config's value, so the job samples the batches the
config asks for. A flag given on the command line replaces the config's value, and rank 0 says so; an LR
flag given replaces the config's `scheduler` by the job's (warmup, then cosine to --min_lr), and a batch
flag given drops its `train_batch_size` (DeepSpeed would refuse the changed product).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

from .. import configs
from .cli import first_rank

# flag -> where the DeepSpeed config holds it (a path of keys; an int: an index in a list)
FLAG_KEYS: dict[str, tuple[Any, ...]] = {
    "batch_size": ("train_micro_batch_size_per_gpu",),
    "grad_accum": ("gradient_accumulation_steps",),
    "grad_clip": ("gradient_clipping",),
    "lr": ("optimizer", "params", "lr"),
    "weight_decay": ("optimizer", "params", "weight_decay"),
    "beta1": ("optimizer", "params", "betas", 0),
    "beta2": ("optimizer", "params", "betas", 1),
}
SCHEDULE_FLAGS = ("lr", "min_lr", "warmup_steps")  # given: the job's schedule replaces the config's scheduler
BATCH_FLAGS = ("batch_size", "grad_accum")  # given: the config's train_batch_size is dropped


def _read(config: dict, path: tuple[Any, ...]) -> Any:
    for key in path:
        try:
            config = config[key]
        except (KeyError, IndexError, TypeError):
            return None
    return config


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def settle(args: argparse.Namespace) -> list[str]:
    """Take the config's value for each flag of FLAG_KEYS left at its default; returns what the given flags
    replace in the config (a value, its scheduler, its train_batch_size), one line each."""
    path = deepspeed_config_path(args)
    if not path.is_file():
        raise ValueError(
            f"--deepspeed_config {args.deepspeed_config}: no such file; accepted: a DeepSpeed JSON config, or a "
            f"shipped one by name ({', '.join(configs.names())})"
        )
    config = json.loads(path.read_text())
    given, replaced = set(args.flags_given), []
    for flag, path in FLAG_KEYS.items():
        value = _read(config, path)
        if not _number(value):  # absent, or a Trainer's "auto": the flag's value fills it
            continue
        if flag not in given:
            setattr(args, flag, value)
        elif value != getattr(args, flag):
            replaced.append(f"--{flag} {getattr(args, flag)} replaces the config's {'.'.join(map(str, path))}={value}")
    schedule = sorted(given.intersection(SCHEDULE_FLAGS))
    if "scheduler" in config and schedule:
        kind = config["scheduler"].get("type")
        replaced.append(f"{', '.join('--' + f for f in schedule)} replace the config's scheduler ({kind})")
    batch = sorted(given.intersection(BATCH_FLAGS))
    if "train_batch_size" in config and batch:
        replaced.append(f"{', '.join('--' + f for f in batch)} drop the config's train_batch_size")
    return replaced


def announce(args: argparse.Namespace, replaced: list[str]) -> None:
    """Rank 0 says which flags replace the DeepSpeed config's settings."""
    if replaced and first_rank():
        warnings.warn(f"co2-train: {deepspeed_config_path(args)}: " + "; ".join(replaced), stacklevel=2)


def deepspeed_config(args: argparse.Namespace, co2: Any, adamw: dict) -> dict:
    """--deepspeed_config as the job runs it: the settled batch, accumulation, clipping and AdamW (`adamw`),
    its scheduler unless an LR flag was given, its train_batch_size unless a batch flag was, `co2` resolved."""
    config = json.loads(deepspeed_config_path(args).read_text())
    config.pop("co2", None)
    given = set(args.flags_given)
    if given.intersection(SCHEDULE_FLAGS):
        config.pop("scheduler", None)
    if given.intersection(BATCH_FLAGS):
        config.pop("train_batch_size", None)
    config.update(
        train_micro_batch_size_per_gpu=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        gradient_clipping=args.grad_clip,
    )
    config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"].update(
        torch_adam=True, **{k: list(v) if k == "betas" else v for k, v in adamw.items()}
    )
    if args.dtype is not None:
        config["bf16"] = {"enabled": args.dtype == "bfloat16"}
        config.pop("fp16", None)
    if co2 is not None:
        config["co2"] = co2.to_dict()
    return config


def json_co2_section(args: argparse.Namespace) -> dict:
    """The "co2" section of --deepspeed_config (engine deepspeed), or {}."""
    if getattr(args, "engine", "plain") != "deepspeed":
        return {}
    section = json.loads(deepspeed_config_path(args).read_text()).get("co2") or {}
    return {k: dict(v) if isinstance(v, dict) else v for k, v in section.items()}


def deepspeed_config_path(args: argparse.Namespace) -> Path:
    """--deepspeed_config as given when that file exists, else the shipped config of that name
    (`co2_zero.configs`: "configs/ds_zero2_co2.json" works from any directory and in an installed
    package, not only in the checkout)."""
    path = Path(args.deepspeed_config)
    if path.is_file() or path.is_absolute() or path.parent.name not in ("", "configs"):
        return path
    try:
        return configs.path(path.name)
    except ValueError:
        return path  # not a shipped name: DeepSpeed reports the missing file by its given name
