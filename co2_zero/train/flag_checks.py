"""What the training job's flags refuse: each combination that cannot run, named with its flags, their values
and what is accepted, before any process group or model is built."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from ..core import support
from ..core.config import CO2Config
from ..core.step_budget import step_budget_problem
from .co2_flags import CO2_METHODS, METHOD_PRESETS, co2_config

INTEGRATIONS = {"plain": "plain", "fsdp": "fsdp2", "fairscale": "fairscale", "deepspeed": "deepspeed"}  # by --engine
ELASTIC_SUPPORTED = (
    "--lighthouse runs the plain engine (--engine plain: CO2Optimizer, one rank per launch) or FSDP2 (--engine "
    "fsdp: the launch's ranks are one replica, S = --shards_per_replica) with a CO2 method that overlaps "
    "(--method co2, the defaults; co2_published; or localsgd/slowmo with --overlap): each replica is its own "
    "launch with its own --replica_id; FairScale and DeepSpeed take no membership (docs/elastic.md)"
)


def inconsistency(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with a combination of flags, or None."""
    for name in ("grad_accum", "batch_size", "n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        if getattr(args, name) < 1:
            return f"--{name}={getattr(args, name)} is invalid; accepted: an integer >= 1"
    if args.n_embd % args.n_head:
        return f"--n_embd={args.n_embd} is not a multiple of --n_head={args.n_head}"
    if args.save_every and not args.save_dir:
        return f"--save_every={args.save_every} needs --save_dir"
    if args.resume == "latest" and not args.save_dir:
        return "--resume without a checkpoint directory needs --save_dir (its 'latest' is loaded)"
    if args.reshard and not args.resume:
        return "--reshard applies to --resume; accepted: --reshard together with --resume"
    if args.reshard and args.method not in CO2_METHODS:
        return f"--reshard with --method {args.method}: only the CO2 methods ({', '.join(CO2_METHODS)}) reshard"
    try:  # resolved once, for every check below; a refused setting is the flags' error, before any process group
        config = co2_config(args) if args.method in CO2_METHODS else None
    except ValueError as error:
        if args.debug:
            raise
        return str(error)
    return (
        _missing_checkpoint(args)
        or _shorter_than_a_round(args, config)
        or _saves_inside_a_round(args, config)
        or _elastic_inconsistency(args, config)
    )


def _missing_checkpoint(args: argparse.Namespace) -> Optional[str]:
    """A --resume that names no existing directory (or --save_dir without its `latest`), or None: refused
    here, before any process group or model is built (an elastic job picks among its replicas' saves later)."""
    if not args.resume or args.lighthouse:
        return None
    if args.resume != "latest":
        if Path(args.resume).is_dir():
            return None
        return f"--resume {args.resume}: no such directory; accepted: a checkpoint directory (DIR/step<N>) of a run"
    if (Path(args.save_dir) / "latest").is_file():
        return None
    return (
        f"--resume with --save_dir {args.save_dir}: no {Path(args.save_dir) / 'latest'} (no run saved there); "
        f"accepted: the --save_dir of an earlier run, or a checkpoint directory (--resume DIR/step<N>)"
    )


def _shorter_than_a_round(args: argparse.Namespace, config: Optional[CO2Config]) -> Optional[str]:
    """A CO2 run whose --max_steps is shorter than one round, or None: it would train a whole round it
    was not asked for (a longer run that is not whole rounds is rounded up, with a warning: `build`)."""
    if config is None or args.max_steps >= config.tau:
        return None
    return step_budget_problem(args.max_steps, config.tau, "--max_steps", "--tau")


def _saves_inside_a_round(args: argparse.Namespace, config: Optional[CO2Config]) -> Optional[str]:
    """With --replica_tau a checkpoint is taken at a round end (where every replica is at the same job step),
    so --save_every must be whole rounds; else None."""
    if config is None or not args.save_every:
        return None
    if config.replica_tau is None or args.save_every % config.tau == 0:
        return None
    paced = support.describe("replica_tau", config.leaves())
    return (
        f"--save_every={args.save_every} with {paced}: a checkpoint is taken at a round end, where every replica "
        f"is at the same step; accepted: a multiple of tau={config.tau}"
    )


def _elastic_inconsistency(args: argparse.Namespace, config: Optional[CO2Config]) -> Optional[str]:
    """What is wrong with the elastic flags, or None: --lighthouse only where the job can run elastically
    (`config`: the run's CO2Config, None for a method that is not CO2's)."""
    if args.lighthouse is None:
        given = {"--replica_id": args.replica_id is not None, "--start_replicas": args.start_replicas != 1}
        flags = " and ".join(flag for flag, set_ in given.items() if set_)
        return f"{flags}: elastic training's; accepted: together with --lighthouse" if flags else None
    if support.refusal({"elastic": True, "integration": INTEGRATIONS[args.engine]}) is not None:
        return f"--lighthouse with --engine {args.engine} is not supported; {ELASTIC_SUPPORTED}"
    if config is None:
        return f"--lighthouse with --method {args.method} is not supported; {ELASTIC_SUPPORTED}"
    overlap = args.overlap if args.overlap is not None else METHOD_PRESETS[args.method].get("overlap", True)
    if support.refusal({"elastic": True, "overlap": overlap}) is not None:
        return f"--lighthouse with --method {args.method} (overlap off) is not supported; {ELASTIC_SUPPORTED}"
    if args.replica_id is None or args.replica_id < 0:
        return (
            f"--lighthouse needs --replica_id (given: {args.replica_id}); accepted: an integer >= 0, unique in the job"
        )
    if args.start_replicas < 1:
        return f"--start_replicas={args.start_replicas} is invalid; accepted: an integer >= 1"
    facts = {"elastic": True, "driver": "co2-train", "replica_tau": config.replica_tau}
    row = support.refusal(facts)
    return row.message(facts) if row is not None else None
