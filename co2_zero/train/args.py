"""The training job's flags, grouped as `--help` shows them, parsed and completed (the CO2 flags: co2_flags.py;
what they refuse: flag_checks.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .cli import DEBUG_HELP, ToolParser
from .co2_flags import CO2_FLAGS as CO2_FLAGS  # where they were, for their callers
from .co2_flags import CO2_METHODS as CO2_METHODS
from .co2_flags import METHOD_PRESETS as METHOD_PRESETS
from .co2_flags import METHODS, add_co2_flags
from .co2_flags import co2_config as co2_config
from .co2_flags import replica_taus as replica_taus
from .data import BYTE_VOCAB, TOKEN_VOCAB
from .ds_config import announce, settle
from .ds_config import deepspeed_config_path as deepspeed_config_path
from .flag_checks import ELASTIC_SUPPORTED, inconsistency
from .model import MODEL_PRESETS

ENGINES = ("plain", "fairscale", "deepspeed", "fsdp")


class HelpWithDefaults(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _run_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("run").add_argument
    a(
        "--method",
        default="co2",
        choices=METHODS,
        help="co2 (the defaults), co2_published, a blocking CO2-family baseline, ddp or none",
    )
    a("--engine", default="plain", choices=ENGINES, help="plain: CO2Optimizer (or DDP); the others shard")
    a(
        "--deepspeed_config",
        default="configs/ds_zero2_co2.json",
        help="--engine deepspeed: the DeepSpeed config (ZeRO stage, precision, batch, accumulation, clipping, AdamW, "
        "LR scheduler, co2 section); a flag given replaces its value, and rank 0 says so",
    )
    a(
        "--max_steps",
        type=int,
        default=320,
        help="optimizer steps per rank (CO2: at least tau; rounded up to whole rounds, with a warning)",
    )
    a("--max_seconds", type=float, default=0.0, help="stop at the next round end after this (0: off)")
    a("--seed", type=int, default=1337, help="model init and held-out batches; rank r samples with seed + r")
    a("--threads", type=int, default=1, help="torch.set_num_threads per process")
    a("--debug", action="store_true", help=DEBUG_HELP)
    a("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's; LOCAL_RANK is used


def _device_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("device").add_argument
    a("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank (LOCAL_RANK)")
    a("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl on cuda, gloo on cpu")
    a(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="autocast dtype; default bfloat16 on cuda, float32 on cpu, deepspeed: what its config says",
    )
    a("--compile", action="store_true", help="torch.compile the model (deepspeed: engine.compile())")
    a("--peak_flops", type=float, default=989e12, help="peak FLOP/s of one GPU for the MFU (H100 SXM bf16 dense)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("data").add_argument
    a("--data", default=None, help="directory with train.bin/val.bin of uint16 token ids; default: stdlib bytes")
    a("--vocab_size", type=int, default=None, help=f"default {BYTE_VOCAB} (bytes), {TOKEN_VOCAB} with --data")
    a("--data_bytes", type=int, default=4_000_000, help="stdlib bytes: cap on corpus bytes read (train + val)")
    a("--val_every", type=int, default=20, help="stdlib bytes: every N-th file (sorted) is held out")
    a("--block_size", type=int, default=None, help="context length; default: the --model preset's")
    a("--batch_size", type=int, default=16, help="sequences per rank per micro-batch")
    a("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")


def _model_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("model").add_argument
    a("--model", default="tiny", choices=tuple(MODEL_PRESETS), help="size preset")
    for name in ("n_layer", "n_head", "n_embd"):
        a(f"--{name}", type=int, default=None, help="default: the --model preset's")
    a("--dropout", type=float, default=0.0, help="dropout probability")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("inner optimizer", "AdamW; LR: linear warmup, then cosine decay to --min_lr").add_argument
    a("--lr", type=float, default=3e-3, help="peak learning rate")
    a("--min_lr", type=float, default=3e-4, help="learning rate at --max_steps")
    a("--warmup_steps", type=int, default=20, help="steps of linear warmup")
    a("--weight_decay", type=float, default=0.1, help="AdamW weight decay")
    a("--beta1", type=float, default=0.9, help="AdamW beta1")
    a("--beta2", type=float, default=0.95, help="AdamW beta2")
    a("--grad_clip", type=float, default=1.0, help="inner grad-norm clip (0: off)")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("checkpoints").add_argument
    a(
        "--save_dir",
        default=None,
        help="write checkpoints to DIR/step<N>/, the newest named in DIR/latest; default: none",
    )
    a("--save_every", type=int, default=0, help="optimizer steps between checkpoints (0: none)")
    a(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from --save_dir's latest checkpoint, or from the checkpoint directory given; "
        "default: start afresh",
    )
    a(
        "--reshard",
        action="store_true",
        help="--resume from a checkpoint of another R x S, world size or engine (CO2 methods): the CO2 state "
        "is re-cut, training resumes at its last round start, the inner optimizer state starts fresh",
    )


def _elastic_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group(
        "elastic", "replicas that come and go (docs/elastic.md); " + ELASTIC_SUPPORTED
    ).add_argument
    a(
        "--lighthouse",
        default=None,
        metavar="URL",
        help="torchft Lighthouse address, http://host:port; default: not elastic",
    )
    a(
        "--replica_id",
        type=int,
        default=None,
        metavar="N",
        help="this launch's replica number, unique in the job, kept across restarts; it picks the data stream "
        "and the checkpoint subdirectory; required with --lighthouse (default: none)",
    )
    a("--start_replicas", type=int, default=1, help="a starting job waits (up to --timeout_s) for this many replicas")


def _log_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("logging and validation").add_argument
    a("--log_every", type=int, default=12, help="steps between log lines (ddp, none; CO2: every round)")
    a("--eval_every", type=int, default=5, help="log lines between validations (0: start/end only)")
    a("--eval_batches", type=int, default=16, help="held-out batches per validation")
    a("--out_json", default=None, help="JSON-lines log (rank 0); default: none")
    a(
        "--events_jsonl",
        default=None,
        help="machine-readable events (rank 0): every step, round commit/cut, the final parameter digest "
        "(co2_zero/train/events.py); default: none",
    )
    a(
        "--stop_file",
        default=None,
        help="a file read at every round end: once it names a step, the job stops at the first round end at or "
        "after it (a benchmark ends every replica of an elastic job at one step); default: none",
    )
    a("--no_progress", action="store_true", help="no progress bar (there is none anyway unless stderr is a terminal)")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser of every training flag (also the model/CO2 flags of `co2-tune-tau`)."""
    p = ToolParser(prog=program(), description=description, formatter_class=HelpWithDefaults)
    for add in (
        _run_flags,
        _device_flags,
        _data_flags,
        _model_flags,
        _optimizer_flags,
        add_co2_flags,
        _checkpoint_flags,
        _elastic_flags,
        _log_flags,
    ):
        add(p)
    return p


def program() -> str:
    """The job's name in its messages: `co2-train`, `train_lm.py`, or `python -m co2_zero.train` (not "__main__.py")."""
    return "python -m co2_zero.train" if sys.argv[0].endswith("__main__.py") else Path(sys.argv[0]).name


def get_args(argv: Optional[Sequence[str]] = None, description: str = "") -> argparse.Namespace:
    """Parse and complete the flags: the model preset, the vocabulary and dtype defaults; refuse
    inconsistent ones with the flag, its value and what is accepted."""
    p = build_parser(description)
    args = p.parse_args(argv)
    for name, value in MODEL_PRESETS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.vocab_size is None:
        args.vocab_size = TOKEN_VOCAB if args.data else BYTE_VOCAB
    if args.dtype is None and args.engine != "deepspeed":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.flags_given = given_flags(p, argv)
    if args.engine == "deepspeed":
        announce(args, settle(args))  # the config's batch, clipping, AdamW and scheduler, unless a flag is given
    problem = inconsistency(args)
    if problem:
        p.error(problem)
    return args


def given_flags(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> list[str]:
    """The flags given on the command line (their destinations, sorted), as opposed to left at their defaults."""
    unset = object()
    every = vars(parser.parse_args([]))
    parsed = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(every, unset)))
    return sorted(name for name, value in vars(parsed).items() if value is not unset)
