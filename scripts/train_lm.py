"""Train a GPT with CO2 or a baseline: a tiny byte-level model on CPUs, GPT-2 sizes on GPUs.

One file, nanoGPT-style: every knob is an argparse flag below.

    torchrun --nproc_per_node 4 scripts/train_lm.py                      # CO2 (overlapped), CPU, gloo
    torchrun --nproc_per_node 4 scripts/train_lm.py --method diloco      # blocking baselines:
    torchrun --nproc_per_node 4 scripts/train_lm.py --method localsgd    #   localsgd/slowmo/diloco
    torchrun --nproc_per_node 4 scripts/train_lm.py --method ddp         # all-reduce every step
    torchrun --nproc_per_node 4 scripts/train_lm.py --method none        # no communication at all
    python scripts/train_lm.py --max_steps 50                           # one process works too
    torchrun --nproc_per_node 8 scripts/train_lm.py --device cuda --model gpt2 --data data/owt \\
        --batch_size 16 --grad_accum 4 --lr 6e-4 --min_lr 6e-5 --warmup_steps 200 --max_steps 5000

Devices: --device cpu (gloo) or cuda (one GPU per rank from LOCAL_RANK, NCCL, autocast bf16, fused
AdamW, pinned host batches copied without blocking; --compile). Engines: plain (CO2Optimizer, or DDP
for --method ddp), fairscale (CO2OSS + ShardedDataParallel inside a replica), deepspeed (ZeRO-1/2
from --deepspeed_config, whose "co2" section is honoured unless a flag overrides it), fsdp (PyTorch's
fully_shard over each replica's ranks, CO2Optimizer across replicas).

Model: --model tiny (the default, 0.6 M parameters on bytes) or gpt2 / gpt2-medium / gpt2-large /
gpt2-xl (124 M to 1.5 B); --n_layer, --n_head, --n_embd, --block_size override the preset.

Data: without --data, every *.py file of the running interpreter's standard library (site-packages
excluded), sorted by path, read as raw bytes (vocab 256) until --data_bytes; every --val_every-th file
is held out for validation. With --data DIR: DIR/train.bin and DIR/val.bin of uint16 token ids
(nanoGPT's layout), memory-mapped, --vocab_size 50304 by default. Each rank samples its own windows
(seed + rank); --batch_size sequences per micro-batch, --grad_accum micro-batches per optimizer step.

Logging (rank 0): one line per round (CO2 methods) or per --log_every steps (ddp, none) with the
inner loss averaged over ranks and over the steps since the last line, the global tokens/s, the
seconds blocked waiting on the background exchange and the round-end seconds; on CUDA also the MFU
(against --peak_flops per GPU) and the peak GPU memory. --out_json writes the same as JSON lines plus
a final {"summary": true, ...} object. "elapsed_s" and "tokens_per_s" exclude the time spent in
validation and checkpoints. Validation (every --eval_every log lines, at the start and after the end)
runs right after a round end, i.e. on the round's start point, which is what the live params are
then; ddp/none evaluate at the step (none: rank 0's own model). The loss all-reduce at each log line
(default process group) also carries rank 0's --max_seconds verdict, so all ranks stop together.

Checkpoints: --save_dir DIR --save_every N writes DIR/step<N>/ through the library's checkpoints
(co2_zero.checkpoint for plain, fairscale and fsdp, co2_zero.deepspeed's for deepspeed) and names the newest
in DIR/latest; --resume continues from it (or from the checkpoint directory given), on the same flags.

CO2 methods train whole rounds: --max_steps (optimizer steps) is rounded up to a multiple of tau. The
LR schedule (warmup, then cosine to --min_lr) spans --max_steps even when --max_seconds stops early.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

# The baselines are CO2 configurations; "co2" is the library's defaults (CO2Config). Precedence, low to
# high: CO2Config's defaults, the "co2" section of --deepspeed_config (engine deepspeed), the method's
# preset, the flags given.
METHOD_PRESETS = {
    "co2": {},
    "localsgd": {"overlap": False, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False,
                 "gap_penalty": {"mode": "none"}},
    "slowmo": {"overlap": False, "outer_lr": 1.0, "outer_momentum": 0.5, "nesterov": False,
               "gap_penalty": {"mode": "none"}},
    "diloco": {"overlap": False, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
               "gap_penalty": {"mode": "none"}},
}  # fmt: skip
CO2_METHODS = tuple(METHOD_PRESETS)
METHODS = CO2_METHODS + ("ddp", "none")

# Model sizes; --n_layer, --n_head, --n_embd, --block_size override them one by one.
MODEL_PRESETS = {
    "tiny": {"n_layer": 3, "n_head": 4, "n_embd": 128, "block_size": 64},  # 0.6 M parameters on bytes
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},  # 124 M
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024},  # 350 M
    "gpt2-large": {"n_layer": 36, "n_head": 20, "n_embd": 1280, "block_size": 1024},  # 774 M
    "gpt2-xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024},  # 1558 M
}
BYTE_VOCAB, TOKEN_VOCAB = 256, 50304  # the stdlib bytes; GPT-2's 50257 tokens padded to a multiple of 64

# CO2 flag -> the CO2Config field it sets (a pair: a field of a nested section).
CO2_FLAGS = {
    "tau": "tau", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum", "nesterov": "nesterov",
    "overlap": "overlap", "gap_penalty": ("gap_penalty", "mode"), "gap_strength": ("gap_penalty", "strength"),
    "gap_value": ("gap_penalty", "value"), "clip": ("clip", "mode"), "clip_threshold": ("clip", "threshold"),
    "shards_per_replica": "shards_per_replica", "collective": "collective", "comm_dtype": "comm_dtype",
    "timeout_s": "timeout_s", "nonfinite": "nonfinite",
}  # fmt: skip


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    # run
    a("--method", default="co2", choices=METHODS)
    a("--engine", default="plain", choices=tuple(ENGINES))
    a("--deepspeed_config", default="configs/ds_zero2_co2.json", help="--engine deepspeed: ZeRO config")
    a("--max_steps", type=int, default=300, help="optimizer steps per rank")
    a("--max_seconds", type=float, default=0.0, help="stop at the next round end after this (0: off)")
    a("--seed", type=int, default=1337)
    a("--threads", type=int, default=1, help="torch.set_num_threads per process")
    a("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's; LOCAL_RANK is used
    # device
    a("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank (LOCAL_RANK)")
    a("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl on cuda, gloo on cpu")
    a("--dtype", default=None, choices=("float32", "bfloat16"),
      help="autocast dtype (deepspeed: the config's bf16 section); default bfloat16 on cuda, float32 on cpu, "
           "deepspeed: what the config says")  # fmt: skip
    a("--compile", action="store_true", help="torch.compile the model (deepspeed: engine.compile())")
    a("--peak_flops", type=float, default=989e12, help="peak FLOP/s of one GPU for the MFU (H100 SXM bf16 dense)")
    # data
    a("--data", default=None, help="directory with train.bin/val.bin of uint16 token ids (default: stdlib bytes)")
    a("--vocab_size", type=int, default=None, help=f"default {BYTE_VOCAB} (bytes), {TOKEN_VOCAB} with --data")
    a("--data_bytes", type=int, default=4_000_000, help="stdlib bytes: cap on corpus bytes read (train + val)")
    a("--val_every", type=int, default=20, help="stdlib bytes: every N-th file (sorted) is held out")
    a("--block_size", type=int, default=None, help="context length (default: the --model preset)")
    a("--batch_size", type=int, default=16, help="sequences per rank per micro-batch")
    a("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    # model
    a("--model", default="tiny", choices=tuple(MODEL_PRESETS))
    a("--n_layer", type=int, default=None)
    a("--n_head", type=int, default=None)
    a("--n_embd", type=int, default=None)
    a("--dropout", type=float, default=0.0)
    # inner optimizer: AdamW, linear warmup then cosine decay to min_lr
    a("--lr", type=float, default=3e-3)
    a("--min_lr", type=float, default=3e-4)
    a("--warmup_steps", type=int, default=20)
    a("--weight_decay", type=float, default=0.1)
    a("--beta1", type=float, default=0.9)
    a("--beta2", type=float, default=0.95)
    a("--grad_clip", type=float, default=1.0, help="inner grad-norm clip (0: off)")
    # CO2 knobs: None = the --method preset, else the config's co2 section, else CO2Config's default
    a("--tau", type=int, default=None, help="local steps per round")
    a("--outer_lr", type=float, default=None)
    a("--outer_momentum", type=float, default=None)
    a("--nesterov", default=None, action=argparse.BooleanOptionalAction)
    a("--overlap", default=None, action=argparse.BooleanOptionalAction)
    a("--gap_penalty", default=None, choices=("none", "constant", "adaptive"))
    a("--gap_strength", type=float, default=None, help="adaptive: 1 + strength*|gap|/|g|")
    a("--gap_value", type=float, default=None, help="constant: divide by this")
    a("--clip", default=None, choices=("none", "value", "norm"), help="outer momentum clip")
    a("--clip_threshold", type=float, default=None)
    a("--shards_per_replica", type=int, default=None, help="ZeRO/OSS/FSDP2 engines (plain: always 1)")
    a("--collective", default=None)
    a("--comm_dtype", default=None)
    a("--timeout_s", type=float, default=None)
    a("--nonfinite", default=None, choices=("raise", "skip_round"), help="on a NaN/inf round")
    # checkpoints
    a("--save_dir", default=None, help="write checkpoints to DIR/step<N>/ and DIR/latest")
    a("--save_every", type=int, default=0, help="optimizer steps between checkpoints (0: none)")
    a("--resume", nargs="?", const="latest", default=None,
      help="continue from --save_dir's latest checkpoint, or from the checkpoint directory given")  # fmt: skip
    # logging / eval
    a("--log_every", type=int, default=12, help="steps between log lines (ddp, none)")
    a("--eval_every", type=int, default=5, help="log lines between validations (0: start/end only)")
    a("--eval_batches", type=int, default=16)
    a("--out_json", default=None, help="JSON-lines log (rank 0)")
    a("--no_progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    for name, value in MODEL_PRESETS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.vocab_size is None:
        args.vocab_size = TOKEN_VOCAB if args.data else BYTE_VOCAB
    if args.dtype is None and args.engine != "deepspeed":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    for name in ("grad_accum", "batch_size", "n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} is invalid; accepted: an integer >= 1")
    if args.n_embd % args.n_head:
        p.error(f"--n_embd={args.n_embd} is not a multiple of --n_head={args.n_head}")
    if args.save_every and not args.save_dir:
        p.error(f"--save_every={args.save_every} needs --save_dir")
    if args.resume == "latest" and not args.save_dir:
        p.error("--resume without a checkpoint directory needs --save_dir (its 'latest' is loaded)")
    return args


# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes, val_every):
    """Stdlib *.py files, sorted by relative path -> (train, val) uint8 tensors."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(d, n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    files.sort()
    train, val, total = [], [], 0
    for i, f in enumerate(files):
        if total >= max_bytes:
            break
        try:
            b = (root / f).read_bytes()[: max_bytes - total] + b"\n"
        except OSError:
            continue
        (val if i % val_every == 0 else train).append(b)
        total += len(b)

    def to_tensor(chunks):
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    return to_tensor(train), to_tensor(val)


def load_tokens(directory) -> tuple[torch.Tensor, torch.Tensor]:
    """DIR/train.bin, DIR/val.bin of uint16 token ids (nanoGPT's layout) -> (train, val) uint16 tensors,
    memory-mapped copy-on-write: only the windows sampled are ever read from disk."""
    out = []
    for name in ("train.bin", "val.bin"):
        path = Path(directory) / name
        if not path.is_file():
            raise FileNotFoundError(
                f"--data {directory}: no {name}; expected train.bin and val.bin of uint16 token ids "
                f"(README, 'Training on GPUs', shows how to write them)"
            )
        size = path.stat().st_size
        if size % 2:
            raise ValueError(f"--data {directory}: {name} has {size} bytes, not a whole number of uint16 tokens")
        out.append(torch.from_file(str(path), shared=False, size=size // 2, dtype=torch.uint16))
    return out[0], out[1]


def get_batch(data, batch_size, block_size, gen):
    """`batch_size` random windows of `data` -> (inputs, next-token targets), int64, on the CPU."""
    if len(data) <= block_size + 1:
        raise ValueError(f"--block_size={block_size} needs at least {block_size + 2} tokens; the data has {len(data)}")
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen).tolist()
    x = torch.stack([data[i : i + block_size].to(torch.int64) for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size].to(torch.int64) for i in ix])
    return x, y


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU: as is. CUDA: through pinned memory, copied without blocking the host."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def check_vocab(x: torch.Tensor, y: torch.Tensor, vocab_size: int) -> None:
    """An out-of-range id would be a device-side assert on CUDA; say which flag is wrong instead."""
    top = max(int(x.max()), int(y.max()))
    if top >= vocab_size:
        raise ValueError(
            f"--vocab_size={vocab_size} is too small: the data holds token id {top}; accepted: a vocab_size "
            f"above every token id (e.g. {TOKEN_VOCAB} for GPT-2's tokenizer)"
        )


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        assert n_embd % n_head == 0
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, prm in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x)).float()  # the loss in fp32 also when the model is bf16 (DeepSpeed)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def flops_per_token(n_params: int, args) -> float:
    """Training FLOPs per token (PaLM, appendix B; nanoGPT's estimate_mfu): 6 N for the weights plus
    12 L d T for attention; N without the position embedding, which costs no matmul."""
    n = n_params - args.block_size * args.n_embd
    return 6 * n + 12 * args.n_layer * args.n_embd * args.block_size


# ----------------------------------------------------------------------------- engines


def co2_config(args):
    """The CO2Config of this run: CO2Config's defaults, under the --deepspeed_config "co2" section
    (engine deepspeed), under the --method preset, under the CO2 flags that were given."""
    from co2_zero import CO2Config

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


def json_co2_section(args) -> dict:
    """The "co2" section of --deepspeed_config (engine deepspeed), or {}."""
    if getattr(args, "engine", "plain") != "deepspeed":
        return {}
    section = json.loads(deepspeed_config_path(args).read_text()).get("co2") or {}
    return {k: dict(v) if isinstance(v, dict) else v for k, v in section.items()}


def deepspeed_config_path(args) -> Path:
    """--deepspeed_config as given, else relative to the repository (so the default works from anywhere)."""
    path = Path(args.deepspeed_config)
    repo = Path(__file__).resolve().parent.parent / path
    return repo if not path.is_file() and not path.is_absolute() and repo.is_file() else path


@dataclass
class Trainer:
    """What an engine builds.

    `train_step(micro_batches)` runs forward and backward on each (x, y) micro-batch, one optimizer step
    and the LR schedule, and returns the mean loss as a detached tensor (no host sync). `opt` carries
    the CO2 bookkeeping for the CO2 methods (round_ended, last_round, finalize(), co2_state_bytes()).
    `model` is the bare module (evaluation, checkpoints); `ds_engine` the DeepSpeed engine, whose
    checkpoints hold the LR schedule; otherwise `sched` is the script's scheduler.
    """

    train_step: Callable[[list], torch.Tensor]
    opt: Any
    lr: Callable[[], float]
    model: nn.Module
    ds_engine: Any = None
    sched: Any = None


def adamw_kwargs(args) -> dict:
    kwargs = dict(lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
    if args.device == "cuda":
        kwargs["fused"] = True  # one kernel for the whole step
    return kwargs


def autocast(args):
    return torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")


def maybe_compile(module: nn.Module, args) -> nn.Module:
    return torch.compile(module) if args.compile else module


def accumulating_step(args, module, opt, sched, clip, no_sync=None, set_to_none=True):
    """train_step of the engines that run the backward themselves: the gradient of the mean loss over
    the micro-batches (no gradient exchange before the last one when `no_sync` is given), clipping,
    the optimizer step and the LR schedule."""

    def train_step(micro):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for k, (x, y) in enumerate(micro):
            hold = no_sync() if no_sync is not None and k < len(micro) - 1 else contextlib.nullcontext()
            with hold:
                with autocast(args):
                    loss = module(x, y)
                (loss / len(micro)).backward()
            total = total + loss.detach()
        if args.grad_clip > 0:
            clip(args.grad_clip)
        opt.step()
        sched.step()
        return total / len(micro)

    return train_step


def build_plain(args, model, co2) -> Trainer:
    """torch AdamW; CO2Optimizer around it for the CO2 methods, DDP for ddp, nothing for none."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(args))
    module, no_sync = model, None
    if args.method == "ddp":
        module = nn.parallel.DistributedDataParallel(model)
        no_sync = module.no_sync
    elif co2 is not None:
        from co2_zero import CO2Optimizer

        opt = CO2Optimizer(opt, co2, model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    def clip(max_norm):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    step = accumulating_step(args, maybe_compile(module, args), opt, sched, clip, no_sync)
    return Trainer(step, opt, lambda: sched.get_last_lr()[0], model, sched=sched)


def build_fairscale(args, model, co2) -> Trainer:
    """CO2OSS (OSS shards AdamW over the replica) + the fixed ShardedDataParallel inside the replica."""
    from co2_zero.fairscale import CO2OSS, ShardedDataParallel  # FairScale's SDP, fixed for replica groups

    if co2 is None:
        raise ValueError("--engine fairscale runs the CO2-family methods; use --engine plain for ddp/none")
    opt = CO2OSS(model.parameters(), optim=torch.optim.AdamW, co2=co2, **adamw_kwargs(args))
    module = ShardedDataParallel(maybe_compile(model, args), opt, process_group=opt.group)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    # the gradients are sharded: opt.clip_grad_norm takes the norm over the replica, as OSS computes it;
    # OSS + SDP keep their gradient buckets, so gradients are zeroed in place
    step = accumulating_step(args, module, opt, sched, opt.clip_grad_norm, module.no_sync, set_to_none=False)
    return Trainer(step, opt, lambda: sched.get_last_lr()[0], model, sched=sched)


def build_deepspeed(args, model, co2) -> Trainer:
    """DeepSpeed from --deepspeed_config: its ZeRO stage and precision (unless --dtype), this script's
    batch, accumulation, clipping, AdamW and LR schedule, and the co2 section `co2_config` resolved
    (--method ddp: none, i.e. plain DeepSpeed data parallelism)."""
    os.environ["DS_ACCELERATOR"] = args.device  # DeepSpeed's accelerator is this script's device
    import co2_zero.deepspeed

    if co2 is None and args.method != "ddp":
        raise ValueError("--engine deepspeed runs the CO2-family methods or ddp")
    config = json.loads(deepspeed_config_path(args).read_text())
    for key in ("co2", "scheduler", "train_batch_size"):  # replaced by co2_config and the flags below
        config.pop(key, None)
    config.update(train_micro_batch_size_per_gpu=args.batch_size, gradient_accumulation_steps=args.grad_accum,
                  gradient_clipping=args.grad_clip)  # fmt: skip
    config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"].update(
        torch_adam=True, **{k: list(v) if k == "betas" else v for k, v in adamw_kwargs(args).items()}
    )
    if args.dtype is not None:
        config["bf16"] = {"enabled": args.dtype == "bfloat16"}
        config.pop("fp16", None)
    if co2 is not None:
        config["co2"] = co2.to_dict()
    engine, opt, _, sched = co2_zero.deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(args)),
    )
    if args.compile:
        engine.compile()

    def train_step(micro):  # DeepSpeed scales the loss for accumulation and steps at the boundary
        total = 0.0
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()  # zero_grad, gradient clipping, the LR schedule: DeepSpeed's
            total = total + loss.detach()
        return total / len(micro)

    return Trainer(train_step, opt, lambda: sched.get_last_lr()[0], model, ds_engine=engine)


def build_fsdp(args, model, co2) -> Trainer:
    """PyTorch's FSDP2 inside each replica (fully_shard per block and the root over the replica's 1-D
    mesh), CO2Optimizer across replicas on the local shards."""
    from torch.distributed.fsdp import fully_shard

    from co2_zero import CO2Optimizer
    from co2_zero.fsdp import replica_mesh

    if co2 is None:
        raise ValueError("--engine fsdp runs the CO2-family methods; use --engine plain for ddp/none")
    mesh = replica_mesh(co2)  # this rank's replica: S = --shards_per_replica ranks
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm and the tied head in the root group
    opt = CO2Optimizer(torch.optim.AdamW(model.parameters(), **adamw_kwargs(args)), co2, model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    def clip(max_norm):  # DTensor gradients: the norm is taken over the replica
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    step = accumulating_step(args, maybe_compile(model, args), opt, sched, clip)
    return Trainer(step, opt, lambda: sched.get_last_lr()[0], model, sched=sched)


ENGINES = {"plain": build_plain, "fairscale": build_fairscale, "deepspeed": build_deepspeed, "fsdp": build_fsdp}


def lr_lambda(args):
    def f(step):  # multiplier on args.lr at inner step `step` (0-based)
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        t = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return (args.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (args.lr - args.min_lr)) / args.lr

    return f


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(trainer: Trainer, directory: Path, extra: dict) -> None:
    """Write this rank's part of checkpoint `directory` (collective) with the library's checkpoints."""
    if trainer.ds_engine is not None:  # co2_zero.deepspeed's per-rank files, or plain DeepSpeed's own
        trainer.ds_engine.save_checkpoint(directory.parent, tag=directory.name, client_state=extra, save_latest=False)
        return
    from co2_zero import checkpoint

    extra = {**extra, "sched": trainer.sched.state_dict()}
    if hasattr(trainer.opt, "engine"):  # CO2Optimizer, CO2OSS: model, inner optimizer, CO2 state
        checkpoint.save(directory, trainer.model, trainer.opt, extra=extra)
    else:  # ddp / none: no CO2 state; every rank its own file, written atomically
        state = {"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict(), "extra": extra}
        checkpoint.save_atomic(state, directory / f"rank{dist.get_rank():05d}.pt")


def load_checkpoint(trainer: Trainer, directory: Path) -> dict:
    """Restore what `save_checkpoint` wrote; returns its `extra`."""
    if trainer.ds_engine is not None:
        loaded, extra = trainer.ds_engine.load_checkpoint(directory.parent, tag=directory.name)
        if loaded is None:
            raise FileNotFoundError(f"--resume {directory}: DeepSpeed found no checkpoint there")
        return extra
    from co2_zero import checkpoint

    if hasattr(trainer.opt, "engine"):
        extra = checkpoint.load(directory, trainer.model, trainer.opt)
    else:
        state = checkpoint.load_file(directory / f"rank{dist.get_rank():05d}.pt")
        trainer.model.load_state_dict(state["model"])
        trainer.opt.load_state_dict(state["optimizer"])
        extra = state["extra"]
    trainer.sched.load_state_dict(extra["sched"])
    return extra


def rng_state(gen: torch.Generator) -> dict:
    """This rank's random streams: its data sampler, torch's CPU and (on CUDA) device generators."""
    state = {"data": gen.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(gen: torch.Generator, state: dict) -> None:
    gen.set_state(state["data"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resume_directory(args) -> Path:
    if args.resume != "latest":
        return Path(args.resume)
    latest = Path(args.save_dir) / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume: no {latest}; give a checkpoint directory, or --save_dir of an earlier run")
    return Path(args.save_dir) / latest.read_text().strip()


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(model, batches, rank, world, alone, args=None, shards=1):
    """Mean loss over the fixed held-out batches. Ranks split the batches and all-reduce
    (all hold the same model); alone=True: this rank evaluates every batch by itself. `shards` > 1
    (FSDP2: every forward is a collective over the replica): the ranks of a replica evaluate the same
    batches, which scales the sum and the count alike."""
    was_training = model.training
    model.eval()
    mine = batches if alone else batches[rank // shards :: world // shards]
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with autocast(args) if args is not None else contextlib.nullcontext():
        for x, y in mine:
            total += model(x, y).double()
    s = torch.stack([total, torch.tensor(float(len(mine)), dtype=torch.float64, device=device)])
    if not alone and world > 1:
        dist.all_reduce(s)
    model.train(was_training)
    return (s[0] / s[1]).item()


# ----------------------------------------------------------------------------- main


def setup_dist(device: str = "cpu", backend: Optional[str] = None) -> tuple[int, int]:
    """Join the launcher's process group (or make a world of one); on CUDA pick this rank's GPU."""
    if "WORLD_SIZE" not in os.environ:  # plain `python train_lm.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device here; accepted: --device cpu")
        gpus, local = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)  # torchrun, deepspeed
        if backend == "nccl" and per_node > gpus:
            raise RuntimeError(
                f"--device cuda --backend nccl needs one GPU per rank: {per_node} ranks on this node but "
                f"{gpus} GPU(s) visible; accepted: at most {gpus} ranks per node, or --backend gloo to share GPUs"
            )
        torch.cuda.set_device(local % gpus)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Run:
    """One training run: what `build` made and what the loop counts."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    config: Any  # CO2Config, or None for ddp / none
    trainer: Trainer
    train_data: torch.Tensor
    val_batches: list
    gen: torch.Generator
    n_params: int
    tokens_per_step: int  # global, per optimizer step
    flops_per_token: float
    step: int = 0
    start_step: int = 0  # the step this process started at (a resumed run: the checkpoint's)
    v0: Optional[float] = None
    # since the start: seconds spent in validation and checkpoints (excluded from the training time)
    paused_s: float = 0.0
    wait_tot: float = 0.0
    round_end_tot: float = 0.0
    # since the last log line
    loss_sum: Any = 0.0
    loss_n: int = 0
    n_logs: int = 0
    t0: float = 0.0
    t_last: float = 0.0
    step_last: int = 0
    last_mfu: Optional[float] = None
    bar: Any = field(default=None, repr=False)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def is_co2(self) -> bool:
        return self.config is not None

    def log(self, msg: str) -> None:
        if self.master:
            tqdm.write(msg, file=sys.stderr)

    def emit(self, **record) -> None:
        if self.master and self.args.out_json:
            with open(self.args.out_json, "a") as f:
                f.write(json.dumps(record) + "\n")

    def micro_batches(self) -> list:
        """One optimizer step's micro-batches for this rank, on the device."""
        a = self.args
        x, y = get_batch(self.train_data, a.batch_size * a.grad_accum, a.block_size, self.gen)
        check_vocab(x, y, a.vocab_size)
        x, y = to_device(x, self.device), to_device(y, self.device)
        return list(zip(x.split(a.batch_size), y.split(a.batch_size)))

    def val_loss(self) -> Optional[float]:  # `none`: rank 0's own model, evaluated by rank 0 alone
        t = time.perf_counter()
        alone = self.args.method == "none"
        v = None
        if self.master or not alone:
            shards = self.config.resolve_shards(self.world) if self.args.engine == "fsdp" else 1
            v = evaluate(self.trainer.model, self.val_batches, self.rank, self.world, alone, self.args, shards)
        self.barrier()  # nobody trains while rank 0 evaluates alone: the pause is every rank's
        self.paused_s += time.perf_counter() - t
        return v

    def save(self) -> None:
        t = time.perf_counter()
        directory = Path(self.args.save_dir) / f"step{self.step:07d}"
        save_checkpoint(self.trainer, directory, {"step": self.step, "rng": rng_state(self.gen)})
        self.barrier()  # every rank's part is written before `latest` names it
        if self.master:
            from co2_zero.checkpoint import write_text_atomic

            write_text_atomic(Path(self.args.save_dir) / "latest", directory.name)
        self.log(f"step {self.step} | checkpoint {directory} ({time.perf_counter() - t:.1f}s)")
        self.paused_s += time.perf_counter() - t

    def barrier(self) -> None:
        if dist.get_backend() == "nccl":  # NCCL's barrier must know the rank's GPU
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def memory_gib(self) -> Optional[float]:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


def build(args) -> Run:
    """Process group, data, model and engine; resume if asked."""
    torch.set_num_threads(args.threads)
    rank, world = setup_dist(args.device, args.backend)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    config = co2_config(args) if args.method in CO2_METHODS else None
    if config is not None and args.max_steps % config.tau:  # finalize() drops a partial last round
        args.max_steps += config.tau - args.max_steps % config.tau

    if args.data:
        train_data, val_data = load_tokens(args.data)
    else:
        train_data, val_data = load_corpus(args.data_bytes, args.val_every)
    val_gen = torch.Generator().manual_seed(args.seed)  # same held-out batches everywhere, every time
    val_batches = []
    for _ in range(args.eval_batches):
        x, y = get_batch(val_data, args.batch_size, args.block_size, val_gen)
        check_vocab(x, y, args.vocab_size)
        val_batches.append((to_device(x, device), to_device(y, device)))

    torch.manual_seed(args.seed)  # identical init on every rank
    with device:
        model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = ENGINES[args.engine](args, model, config)
    run = Run(args, rank, world, device, config, trainer, train_data, val_batches,
              gen=torch.Generator().manual_seed(args.seed + rank), n_params=n_params,
              tokens_per_step=args.batch_size * args.block_size * args.grad_accum * world,
              flops_per_token=flops_per_token(n_params, args))  # fmt: skip
    if args.resume:
        directory = resume_directory(args)
        extra = load_checkpoint(trainer, directory)
        run.step = run.start_step = extra["step"]
        set_rng_state(run.gen, extra["rng"])
        run.log(f"resumed from {directory} at step {run.step}")
    data = f"--data {args.data}" if args.data else "stdlib bytes"
    run.log(
        f"method={args.method} engine={args.engine} world={world} device={args.device} dtype={args.dtype} "
        f"model={args.model} params={n_params / 1e6:.2f}M data={data} train={len(train_data) / 1e6:.2f}M "
        f"val={len(val_data) / 1e6:.2f}M tokens tokens/step={run.tokens_per_step} max_steps={args.max_steps}"
        + (f" {config}" if config is not None else "")
    )
    if run.master and args.out_json and not args.resume:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text("")
    return run


def train(run: Run) -> None:
    """The loop: one optimizer step per iteration; a log point at every round end (CO2 methods) or
    every --log_every steps; checkpoints every --save_every steps."""
    a, t = run.args, run.trainer
    run.v0 = run.val_loss()
    run.log(f"step {run.step} | val {run.v0:.4f}" if run.master else "")
    run.emit(method=a.method, step=run.step, tokens=run.step * run.tokens_per_step, elapsed_s=0.0, loss=None,
             tokens_per_s=None, wait_s=None, round_end_s=None, val_loss=run.v0)  # fmt: skip
    run.bar = tqdm(total=a.max_steps, initial=run.step, disable=not run.master or a.no_progress, dynamic_ncols=True,
                   file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 10.0)  # fmt: skip
    run.t0 = run.t_last = time.perf_counter()  # after val_loss's barrier: every rank starts the clock together
    run.paused_s, run.step_last = 0.0, run.step
    t.model.train()
    while run.step < a.max_steps:
        run.loss_sum = run.loss_sum + t.train_step(run.micro_batches()).double()
        run.loss_n += 1
        run.step += 1
        run.bar.update(1)
        if a.save_every and run.step % a.save_every == 0:
            run.save()
        if run.is_co2:
            if not t.opt.round_ended and run.step < a.max_steps:
                continue
            info = t.opt.last_round if t.opt.round_ended else {}
            wait_s, round_end_s = info.get("wait_s", 0.0), info.get("round_end_s", 0.0)
        elif run.step % a.log_every == 0 or run.step == a.max_steps:
            wait_s = 0.0 if a.method == "none" else None  # ddp: overlapped inside backward, unmeasured
            round_end_s = None
        else:
            continue
        if log_point(run, wait_s, round_end_s):
            run.log(f"--max_seconds {a.max_seconds} reached at step {run.step}")
            break
    run.bar.close()


def log_point(run: Run, wait_s: Optional[float], round_end_s: Optional[float]) -> bool:
    """Average the loss over ranks (the only default-group collective of the loop), log, validate every
    --eval_every points. Returns True when rank 0 says --max_seconds is up."""
    a = run.args
    if wait_s is not None:
        run.wait_tot += wait_s
        run.round_end_tot += round_end_s or 0.0
    out_of_time = run.master and a.max_seconds > 0 and time.perf_counter() - run.t0 - run.paused_s >= a.max_seconds
    s = torch.stack([torch.as_tensor(run.loss_sum, dtype=torch.float64, device=run.device).reshape(()),
                     torch.tensor(float(run.loss_n), dtype=torch.float64, device=run.device),
                     torch.tensor(float(out_of_time), dtype=torch.float64, device=run.device)])  # fmt: skip
    dist.all_reduce(s)
    loss_sum, loss_n, stop = s.tolist()
    # After the all-reduce (and its .tolist() sync): the interval ends when the slowest rank got here,
    # so the time rank 0 waits for the others is counted in this interval, not lost between two.
    now = time.perf_counter()
    loss_mean = loss_sum / loss_n
    run.loss_sum, run.loss_n = 0.0, 0
    run.n_logs += 1
    tps = (run.step - run.step_last) * run.tokens_per_step / max(now - run.t_last, 1e-9)
    elapsed = now - run.t0 - run.paused_s
    mfu = run.flops_per_token * tps / (run.world * a.peak_flops) if run.device.type == "cuda" else None
    run.last_mfu = mfu
    v = None
    if a.eval_every > 0 and run.n_logs % a.eval_every == 0 and run.step < a.max_steps and not stop:
        v = run.val_loss()
    msg = f"step {run.step} | loss {loss_mean:.4f} | {tps:,.0f} tok/s"
    msg += f" | wait {wait_s:.3f}s" if wait_s is not None else ""
    msg += f" | round_end {round_end_s:.3f}s" if round_end_s is not None else ""
    msg += f" | mfu {100 * mfu:.1f}% | mem {run.memory_gib():.1f} GiB" if mfu is not None else ""
    msg += f" | val {v:.4f}" if v is not None else ""
    run.log(msg + f" | lr {run.trainer.lr():.2e}")
    run.emit(method=a.method, step=run.step, tokens=run.step * run.tokens_per_step, elapsed_s=elapsed,
             loss=loss_mean, tokens_per_s=tps, wait_s=wait_s, round_end_s=round_end_s, val_loss=v, mfu=mfu,
             max_memory_gib=run.memory_gib())  # fmt: skip
    run.t_last, run.step_last = time.perf_counter(), run.step
    return stop > 0


def finish(run: Run) -> None:
    """One model everywhere (CO2: finalize), the final validation and the summary record."""
    a, opt = run.args, run.trainer.opt
    if run.is_co2:  # waits for the round in flight: part of the training time
        t_fin = time.perf_counter()
        opt.finalize()
        run.log(f"finalize {time.perf_counter() - t_fin:.3f}s")
    train_s = time.perf_counter() - run.t0 - run.paused_s
    trained = (run.step - run.start_step) * run.tokens_per_step  # by this process (a resumed run: since then)
    vf = run.val_loss()
    run.log(f"final val loss {vf:.4f} (initial {run.v0:.4f}) | {run.step} steps in {train_s:.1f}s | "
            f"{trained / train_s:,.0f} tok/s" if run.master else "")  # fmt: skip
    run.emit(summary=True, method=a.method, engine=a.engine, world_size=run.world, steps=run.step,
             tokens=run.step * run.tokens_per_step, elapsed_s=train_s, tokens_per_s=trained / train_s,
             wait_s=run.wait_tot if run.is_co2 or a.method == "none" else None,
             round_end_s=run.round_end_tot if run.is_co2 else None, initial_val_loss=run.v0, val_loss=vf,
             co2_state_bytes=opt.co2_state_bytes() if run.is_co2 else 0, n_params=run.n_params,
             mfu=run.last_mfu, max_memory_gib=run.memory_gib(), args=vars(a))  # fmt: skip
    run.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    run = build(get_args(argv))
    train(run)
    finish(run)


if __name__ == "__main__":
    main()
