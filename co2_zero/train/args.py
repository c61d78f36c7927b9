"""The training job's flags, grouped as `--help` shows them, and the CO2 configuration they resolve to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..core import support
from ..core.config import PUBLISHED, STAND_INS, CO2Config
from ..core.step_budget import step_budget_problem
from .cli import DEBUG_HELP, ToolParser
from .data import BYTE_VOCAB, TOKEN_VOCAB
from .ds_config import announce, json_co2_section, settle
from .ds_config import deepspeed_config_path as deepspeed_config_path  # where it was, for its callers
from .model import MODEL_PRESETS

# The baselines are CO2 configurations; "co2" is the library's defaults (CO2Config), "co2_published" CO2 as
# published (config.PUBLISHED). Precedence, low to high: CO2Config's defaults, the "co2" section of
# --deepspeed_config (engine deepspeed), the method's preset, the flags given.
METHOD_PRESETS = {
    "co2": {},
    "co2_published": PUBLISHED,
    "localsgd": {"overlap": False, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False,
                 "gap_penalty": {"mode": "none"}},
    "slowmo": {"overlap": False, "outer_lr": 1.0, "outer_momentum": 0.5, "nesterov": False,
               "gap_penalty": {"mode": "none"}},
    "diloco": {"overlap": False, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
               "gap_penalty": {"mode": "none"}},
}  # fmt: skip
CO2_METHODS = tuple(METHOD_PRESETS)
METHODS = CO2_METHODS + ("ddp", "none")
ENGINES = ("plain", "fairscale", "deepspeed", "fsdp")

# CO2 flag -> the CO2Config field it sets (a pair: a field of a nested section).
CO2_FLAGS = {
    "tau": "tau", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum", "nesterov": "nesterov",
    "overlap": "overlap", "gap_penalty": ("gap_penalty", "mode"), "gap_strength": ("gap_penalty", "strength"),
    "gap_value": ("gap_penalty", "value"), "clip": ("clip", "mode"), "clip_threshold": ("clip", "threshold"),
    "shards_per_replica": "shards_per_replica", "collective": "collective", "comm_dtype": "comm_dtype",
    "timeout_s": "timeout_s", "nonfinite": "nonfinite", "stand_in": "stand_in",
    "sync_delay": "sync_delay", "topk": "topk", "feedback_decay": "feedback_decay", "replica_tau": "replica_tau",
}  # fmt: skip
PRESET = "default: the --method preset, else the config's co2 section, else CO2Config's"
INTEGRATIONS = {"plain": "plain", "fsdp": "fsdp2", "fairscale": "fairscale", "deepspeed": "deepspeed"}  # by --engine
ELASTIC_SUPPORTED = (
    "--lighthouse runs the plain engine (--engine plain: CO2Optimizer, one rank per launch) or FSDP2 (--engine "
    "fsdp: the launch's ranks are one replica, S = --shards_per_replica) with a CO2 method that overlaps "
    "(--method co2, the defaults; co2_published; or localsgd/slowmo with --overlap): each replica is its own "
    "launch with its own --replica_id; FairScale and DeepSpeed take no membership (docs/elastic.md)"
)


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
    a("--deepspeed_config", default="configs/ds_zero2_co2.json",
      help="--engine deepspeed: the DeepSpeed config (ZeRO stage, precision, batch, accumulation, clipping, AdamW, "
           "LR scheduler, co2 section); a flag given replaces its value, and rank 0 says so")  # fmt: skip
    a("--max_steps", type=int, default=320,
      help="optimizer steps per rank (CO2: at least tau; rounded up to whole rounds, with a warning)")  # fmt: skip
    a("--max_seconds", type=float, default=0.0, help="stop at the next round end after this (0: off)")
    a("--seed", type=int, default=1337, help="model init and held-out batches; rank r samples with seed + r")
    a("--threads", type=int, default=1, help="torch.set_num_threads per process")
    a("--debug", action="store_true", help=DEBUG_HELP)
    a("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's; LOCAL_RANK is used


def _device_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("device").add_argument
    a("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank (LOCAL_RANK)")
    a("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl on cuda, gloo on cpu")
    a("--dtype", default=None, choices=("float32", "bfloat16"),
      help="autocast dtype; default bfloat16 on cuda, float32 on cpu, deepspeed: what its config says")  # fmt: skip
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


def _sync_delay(text: str) -> int | str:
    """--sync_delay: an integer, or "auto" (CO2Config checks the range)."""
    return text if text == "auto" else int(text)


TAUS_ACCEPTED = "one integer per replica, comma-separated (e.g. 32,32,16)"


def replica_taus(text: str, accepted: str = TAUS_ACCEPTED) -> list[int]:
    """The τ_r of a `replica_tau` list, one integer per replica, comma-separated (CO2Config checks the range)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: {accepted}") from None


def _replica_tau(text: str) -> list[int] | str:
    """--replica_tau: "auto", or the τ_r (`replica_taus`)."""
    return text if text == "auto" else replica_taus(text, f"'auto' or {TAUS_ACCEPTED}")


def _co2_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("CO2", f"each flag given overrides the CO2Config field ({PRESET})").add_argument
    a("--tau", type=int, default=None, help=f"local steps per round; {PRESET} 32")
    a("--outer_lr", type=float, default=None, help=f"{PRESET} auto: 0.5, 1.0 with --topk < 1")
    a("--outer_momentum", type=float, default=None, help=f"{PRESET} auto: 0.9, 0 with --topk < 1")
    a("--nesterov", default=None, action=argparse.BooleanOptionalAction, help=f"{PRESET} on")
    a("--overlap", default=None, action=argparse.BooleanOptionalAction, help=f"{PRESET} on")
    a("--stand_in", default=None, choices=STAND_INS,
      help=f"where a replica starts a round while the average is in flight (design §3); {PRESET} auto")  # fmt: skip
    a(
        "--sync_delay",
        type=_sync_delay,
        default=None,
        help=f"inner steps of the next round the exchange must finish in, or auto (design §3); {PRESET} auto",
    )
    a("--replica_tau", type=_replica_tau, default=None, metavar="auto|N,N,...",
      help="each replica's inner steps per round, or auto to measure them (replicas of different speeds; "
           f"--max_steps, --save_every and the LR schedule count the fastest's steps); {PRESET} null: tau")  # fmt: skip
    a("--gap_penalty", default=None, choices=("none", "constant", "adaptive"), help=f"{PRESET} none")
    a("--gap_strength", type=float, default=None, help=f"adaptive: 1 + strength*|gap|/|g|; {PRESET} 2.0")
    a("--gap_value", type=float, default=None, help=f"constant: divide by this; {PRESET} 1.0")
    a("--clip", default=None, choices=("none", "value", "norm"), help=f"outer momentum clip; {PRESET} none")
    a("--clip_threshold", type=float, default=None, help=f"{PRESET} 1.0")
    a("--shards_per_replica", type=int, default=None,
      help=f"S of the fairscale/deepspeed/fsdp engines (plain: always 1); {PRESET} the ranks per node")  # fmt: skip
    a("--collective", default=None, help=f"{PRESET} auto")
    a("--comm_dtype", default=None, help=f"wire format of the exchange; {PRESET} fp32")
    a("--topk", type=float, default=None, help=f"fraction of each chunk a replica sends; {PRESET} 1.0 (dense)")
    a("--feedback_decay", type=float, default=None, help=f"the sparse exchange's residual decay; {PRESET} auto: 0.95")
    a("--timeout_s", type=float, default=None, help=f"deadline of every wait; {PRESET} 600")
    a("--nonfinite", default=None, choices=("raise", "skip_round"), help=f"on a NaN/inf round; {PRESET} raise")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("checkpoints").add_argument
    a(
        "--save_dir",
        default=None,
        help="write checkpoints to DIR/step<N>/, the newest named in DIR/latest; default: none",
    )
    a("--save_every", type=int, default=0, help="optimizer steps between checkpoints (0: none)")
    a("--resume", nargs="?", const="latest", default=None,
      help="continue from --save_dir's latest checkpoint, or from the checkpoint directory given; "
           "default: start afresh")  # fmt: skip
    a("--reshard", action="store_true",
      help="--resume from a checkpoint of another R x S, world size or engine (CO2 methods): the CO2 state "
           "is re-cut, training resumes at its last round start, the inner optimizer state starts fresh")  # fmt: skip


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
    a("--replica_id", type=int, default=None, metavar="N",
      help="this launch's replica number, unique in the job, kept across restarts; it picks the data stream "
           "and the checkpoint subdirectory; required with --lighthouse (default: none)")  # fmt: skip
    a("--start_replicas", type=int, default=1, help="a starting job waits (up to --timeout_s) for this many replicas")


def _log_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("logging and validation").add_argument
    a("--log_every", type=int, default=12, help="steps between log lines (ddp, none; CO2: every round)")
    a("--eval_every", type=int, default=5, help="log lines between validations (0: start/end only)")
    a("--eval_batches", type=int, default=16, help="held-out batches per validation")
    a("--out_json", default=None, help="JSON-lines log (rank 0); default: none")
    a("--events_jsonl", default=None,
      help="machine-readable events (rank 0): every step, round commit/cut, the final parameter digest "
           "(co2_zero/train/events.py); default: none")  # fmt: skip
    a("--stop_file", default=None,
      help="a file read at every round end: once it names a step, the job stops at the first round end at or "
           "after it (a benchmark ends every replica of an elastic job at one step); default: none")  # fmt: skip
    a("--no_progress", action="store_true", help="no progress bar (there is none anyway unless stderr is a terminal)")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser of every training flag (also the model/CO2 flags of `co2-tune-tau`)."""
    p = ToolParser(prog=program(), description=description, formatter_class=HelpWithDefaults)
    for add in (_run_flags, _device_flags, _data_flags, _model_flags, _optimizer_flags, _co2_flags,
                _checkpoint_flags, _elastic_flags, _log_flags):  # fmt: skip
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
    problem = _inconsistency(args)
    if problem:
        p.error(problem)
    return args


def given_flags(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> list[str]:
    """The flags given on the command line (their destinations, sorted), as opposed to left at their defaults."""
    unset = object()
    every = vars(parser.parse_args([]))
    parsed = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(every, unset)))
    return sorted(name for name, value in vars(parsed).items() if value is not unset)


def _inconsistency(args: argparse.Namespace) -> Optional[str]:
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
