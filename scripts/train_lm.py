"""Train a tiny byte-level GPT on the Python standard library with CO2 or a baseline.

One file, nanoGPT-style: every knob is an argparse flag below. CPU + gloo.

    torchrun --nproc_per_node 4 scripts/train_lm.py                      # CO2 (overlapped)
    torchrun --nproc_per_node 4 scripts/train_lm.py --method diloco      # blocking baselines:
    torchrun --nproc_per_node 4 scripts/train_lm.py --method localsgd    #   localsgd/slowmo/diloco
    torchrun --nproc_per_node 4 scripts/train_lm.py --method ddp         # all-reduce every step
    torchrun --nproc_per_node 4 scripts/train_lm.py --method none        # no communication at all
    python scripts/train_lm.py --max_steps 50                           # one process works too

Data: every *.py file of the running interpreter's standard library (site-packages excluded),
sorted by path, read as raw bytes (vocab 256) until --data_bytes; every --val_every-th file is
held out for validation and never trained on. Each rank samples its own batches (seed + rank).

Logging (rank 0): one line per round (CO2 methods) or per --log_every steps (ddp, none) with the
inner loss averaged over ranks and over the steps since the last line, the global tokens/s, the
seconds blocked waiting on the background exchange and the round-end seconds. --out_json writes
the same as JSON lines plus a final {"summary": true, ...} object. "elapsed_s" and "tokens_per_s"
exclude the time spent in validation. Validation (every --eval_every log lines, at step 0 and after
the end) runs right after a round end, i.e. on the round's start point, which is what the live params
are then; ddp/none evaluate at the step (none: rank 0's own model). The loss all-reduce at each log
line (default process group) also carries rank 0's --max_seconds verdict, so all ranks stop together.

CO2 methods train whole rounds: --max_steps is rounded up to a multiple of --tau. The LR schedule
(warmup, then cosine to --min_lr) spans --max_steps even when --max_seconds stops the run earlier.
"""

import argparse
import json
import math
import os
import socket
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

# Presets for the CO2-family methods; any flag given explicitly overrides them.
_P = ("overlap", "outer_lr", "outer_momentum", "nesterov", "gap_penalty")
METHOD_PRESETS = {
    "co2": dict(zip(_P, (True, 1.0, 0.0, False, "adaptive"))),
    "localsgd": dict(zip(_P, (False, 1.0, 0.0, False, "none"))),
    "slowmo": dict(zip(_P, (False, 1.0, 0.5, False, "none"))),
    "diloco": dict(zip(_P, (False, 0.7, 0.9, True, "none"))),
}
CO2_METHODS = tuple(METHOD_PRESETS)
METHODS = CO2_METHODS + ("ddp", "none")
ENGINES = ("plain", "fairscale", "deepspeed")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    # run
    a("--method", default="co2", choices=METHODS)
    a("--engine", default="plain", choices=ENGINES)
    a("--deepspeed_config", default="configs/ds_zero2_co2.json", help="--engine deepspeed: ZeRO config")
    a("--max_steps", type=int, default=300, help="inner steps per rank")
    a("--max_seconds", type=float, default=0.0, help="stop at the next round end after this (0: off)")
    a("--seed", type=int, default=1337)
    a("--threads", type=int, default=1, help="torch.set_num_threads per process")
    # data
    a("--data_bytes", type=int, default=4_000_000, help="cap on corpus bytes read (train + val)")
    a("--val_every", type=int, default=20, help="every N-th file (sorted) is held out")
    a("--block_size", type=int, default=64)
    a("--batch_size", type=int, default=16, help="sequences per rank per inner step")
    # model
    a("--n_layer", type=int, default=3)
    a("--n_head", type=int, default=4)
    a("--n_embd", type=int, default=128)
    a("--dropout", type=float, default=0.0)
    # inner optimizer: AdamW, linear warmup then cosine decay to min_lr
    a("--lr", type=float, default=3e-3)
    a("--min_lr", type=float, default=3e-4)
    a("--warmup_steps", type=int, default=20)
    a("--weight_decay", type=float, default=0.1)
    a("--beta1", type=float, default=0.9)
    a("--beta2", type=float, default=0.95)
    a("--grad_clip", type=float, default=1.0, help="inner grad-norm clip (0: off)")
    # CO2 knobs (default None: take the --method preset)
    a("--tau", type=int, default=12, help="local steps per round")
    a("--outer_lr", type=float, default=None)
    a("--outer_momentum", type=float, default=None)
    a("--nesterov", default=None, action=argparse.BooleanOptionalAction)
    a("--overlap", default=None, action=argparse.BooleanOptionalAction)
    a("--gap_penalty", default=None, choices=("none", "constant", "adaptive"))
    a("--gap_strength", type=float, default=2.0, help="adaptive: 1 + strength*|gap|/|g|")
    a("--gap_value", type=float, default=1.0, help="constant: divide by this")
    a("--clip", default="none", choices=("none", "value", "norm"), help="outer momentum clip")
    a("--clip_threshold", type=float, default=1.0)
    a("--shards_per_replica", type=int, default=None, help="ZeRO/OSS engines (plain: always 1)")
    a("--collective", default="auto")
    a("--comm_dtype", default="fp32")
    a("--timeout_s", type=float, default=300.0)
    a("--nonfinite", default="raise", choices=("raise", "skip_round"), help="on a NaN/inf round")
    # logging / eval
    a("--log_every", type=int, default=12, help="steps between log lines (ddp, none)")
    a("--eval_every", type=int, default=5, help="log lines between validations (0: start/end only)")
    a("--eval_batches", type=int, default=16)
    a("--out_json", default=None, help="JSON-lines log (rank 0)")
    a("--no_progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


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


def get_batch(data, batch_size, block_size, gen):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()]).long()
    return x, y


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
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ----------------------------------------------------------------------------- optimizer


def co2_config(args):
    from co2_zero import CO2Config

    preset = METHOD_PRESETS[args.method]

    def pick(name):
        v = getattr(args, name)
        return preset[name] if v is None else v

    gap = {"mode": pick("gap_penalty")}
    if gap["mode"] == "adaptive":
        gap["strength"] = args.gap_strength
    elif gap["mode"] == "constant":
        gap["value"] = args.gap_value
    clip = {"mode": args.clip}
    if args.clip != "none":
        clip["threshold"] = args.clip_threshold
    extra = {} if args.shards_per_replica is None else {"shards_per_replica": args.shards_per_replica}
    return CO2Config(
        tau=args.tau,
        outer_lr=pick("outer_lr"),
        outer_momentum=pick("outer_momentum"),
        nesterov=pick("nesterov"),
        overlap=pick("overlap"),
        gap_penalty=gap,
        clip=clip,
        collective=args.collective,
        comm_dtype=args.comm_dtype,
        timeout_s=args.timeout_s,
        nonfinite=args.nonfinite,
        **extra,
    )


def build_optimizer(args, model):
    """-> (train_model, opt, train_step, current_lr). train_model is what forward() is called on;
    train_step(loss) does backward, clipping, the optimizer step and the LR schedule.

    The one place an --engine hooks in: plain (CO2Optimizer, or DDP / nothing for the baselines),
    fairscale (CO2OSS + ShardedDataParallel inside a replica), deepspeed (a ZeRO-1/2 JSON config with a
    "co2" section)."""
    co2 = co2_config(args) if args.method in CO2_METHODS else None
    adamw = dict(lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
    if args.engine == "deepspeed":
        return build_deepspeed(args, model, co2)
    if args.engine == "fairscale":
        from co2_zero.fairscale import CO2OSS, ShardedDataParallel  # FairScale's SDP, fixed for replica groups

        if co2 is None:
            raise ValueError("--engine fairscale runs the CO2-family methods; use --engine plain for ddp/none")
        opt = CO2OSS(model.parameters(), optim=torch.optim.AdamW, co2=co2, **adamw)
        train_model = ShardedDataParallel(model, opt, process_group=opt.group)
        clip = opt.clip_grad_norm  # the gradients are sharded: the norm over the replica, as OSS computes it
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        train_model = model
        if args.method == "ddp":
            train_model = nn.parallel.DistributedDataParallel(model)
        elif co2 is not None:
            from co2_zero import CO2Optimizer

            opt = CO2Optimizer(opt, co2, model=model)
        clip = lambda max_norm: nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    def train_step(loss):
        opt.zero_grad(set_to_none=args.engine != "fairscale")  # OSS + SDP keep their gradient buckets
        loss.backward()
        if args.grad_clip > 0:
            clip(args.grad_clip)
        opt.step()
        sched.step()

    return train_model, opt, train_step, lambda: sched.get_last_lr()[0]


def build_deepspeed(args, model, co2):
    """DeepSpeed from --deepspeed_config: its ZeRO stage, precision and clipping; the co2 section is the
    one this script's flags describe (--method ddp: none, i.e. plain DeepSpeed data parallelism)."""
    import co2_zero.deepspeed

    if co2 is None and args.method != "ddp":
        raise ValueError("--engine deepspeed runs the CO2-family methods or ddp")
    config = json.loads(Path(args.deepspeed_config).read_text())
    config.pop("co2", None)
    config.pop("scheduler", None)  # this script's warmup + cosine schedule (lr_lambda) is used
    config.pop("train_batch_size", None)
    config.update(train_micro_batch_size_per_gpu=args.batch_size, gradient_accumulation_steps=1,
                  gradient_clipping=args.grad_clip)  # fmt: skip
    config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"].update(
        lr=args.lr, betas=[args.beta1, args.beta2], weight_decay=args.weight_decay, torch_adam=True
    )
    if co2 is not None:
        config["co2"] = co2.to_dict()
    engine, opt, _, sched = co2_zero.deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(args)),
    )

    def train_step(loss):
        engine.backward(loss)
        engine.step()  # zero_grad, gradient clipping (from the config), the LR schedule: DeepSpeed's

    return engine, opt, train_step, lambda: sched.get_last_lr()[0]


def lr_lambda(args):
    def f(step):  # multiplier on args.lr at inner step `step` (0-based)
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        t = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return (args.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (args.lr - args.min_lr)) / args.lr

    return f


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(model, batches, rank, world, alone):
    """Mean loss over the fixed held-out batches. Ranks split the batches and all-reduce
    (all hold the same model); alone=True: this rank evaluates every batch by itself."""
    was_training = model.training
    model.eval()
    mine = batches if alone else batches[rank::world]
    s = torch.tensor([sum(model(x, y).item() for x, y in mine), len(mine)], dtype=torch.float64)
    if not alone and world > 1:
        dist.all_reduce(s)
    model.train(was_training)
    return (s[0] / s[1]).item()


# ----------------------------------------------------------------------------- main


def setup_dist():
    if "WORLD_SIZE" not in os.environ:  # plain `python train_lm.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def main(argv=None):
    args = get_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = setup_dist()
    master = rank == 0
    is_co2 = args.method in CO2_METHODS
    if is_co2 and args.max_steps % args.tau:  # finalize() drops a partial last round: don't train one
        args.max_steps += args.tau - args.max_steps % args.tau

    train_data, val_data = load_corpus(args.data_bytes, args.val_every)
    gen = torch.Generator().manual_seed(args.seed + rank)
    val_gen = torch.Generator().manual_seed(args.seed)  # same held-out batches everywhere, every time
    val_batches = [get_batch(val_data, args.batch_size, args.block_size, val_gen) for _ in range(args.eval_batches)]

    torch.manual_seed(args.seed)  # identical init on every rank
    model = GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    train_model, opt, train_step, current_lr = build_optimizer(args, model)
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.block_size * world  # global

    def log(*msg):
        if master:
            tqdm.write(" ".join(str(m) for m in msg), file=sys.stderr)

    log(
        f"method={args.method} engine={args.engine} world={world} params={n_params / 1e6:.2f}M "
        f"train={len(train_data) / 1e6:.2f}MB val={len(val_data) / 1e6:.2f}MB "
        f"tokens/step={tokens_per_step} max_steps={args.max_steps}" + (f" {co2_config(args)}" if is_co2 else "")
    )
    if master and args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text("")

    def emit(**rec):
        if master and args.out_json:
            with open(args.out_json, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def val_loss():  # `none`: rank 0's own model, evaluated by rank 0 alone
        if args.method == "none":
            return evaluate(model, val_batches, rank, world, alone=True) if master else None
        return evaluate(model, val_batches, rank, world, alone=False)

    eval_s = 0.0
    v0 = val_loss()
    log(f"step 0 | val {v0:.4f}" if master else "")
    emit(method=args.method, step=0, tokens=0, elapsed_s=0.0, loss=None, tokens_per_s=None,
         wait_s=None, round_end_s=None, val_loss=v0)  # fmt: skip

    bar = tqdm(total=args.max_steps, disable=not master or args.no_progress, dynamic_ncols=True,
               file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 10.0)  # fmt: skip
    t0 = time.perf_counter()
    t_last, step_last = t0, 0
    loss_sum, loss_n, n_logs = 0.0, 0, 0
    wait_tot = round_end_tot = 0.0
    step = 0
    train_model.train()
    while step < args.max_steps:
        x, y = get_batch(train_data, args.batch_size, args.block_size, gen)
        loss = train_model(x, y)
        train_step(loss)
        step += 1
        loss_sum += loss.item()
        loss_n += 1
        bar.update(1)

        if is_co2:
            if not opt.round_ended and step < args.max_steps:
                continue
            info = opt.last_round if opt.round_ended else {}
            wait_s, round_end_s = info.get("wait_s", 0.0), info.get("round_end_s", 0.0)
        elif step % args.log_every == 0 or step == args.max_steps:
            wait_s = 0.0 if args.method == "none" else None  # ddp: overlapped inside backward, unmeasured
            round_end_s = None
        else:
            continue
        if wait_s is not None:
            wait_tot += wait_s
            round_end_tot += round_end_s or 0.0

        # --- log point (round end / every log_every steps): the only default-group collective
        now = time.perf_counter()
        out_of_time = master and args.max_seconds > 0 and now - t0 - eval_s >= args.max_seconds
        s = torch.tensor([loss_sum, loss_n, float(out_of_time)], dtype=torch.float64)
        dist.all_reduce(s)
        stop = s[2].item() > 0
        loss_mean = (s[0] / s[1]).item()
        loss_sum, loss_n = 0.0, 0
        n_logs += 1
        tps = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9)
        elapsed = now - t0 - eval_s
        v = None
        if (args.eval_every > 0 and n_logs % args.eval_every == 0) and step < args.max_steps and not stop:
            te = time.perf_counter()
            v = val_loss()
            eval_s += time.perf_counter() - te
        msg = f"step {step} | loss {loss_mean:.4f} | {tps:,.0f} tok/s"
        if wait_s is not None:
            msg += f" | wait {wait_s:.3f}s"
        if round_end_s is not None:
            msg += f" | round_end {round_end_s:.3f}s"
        if v is not None:
            msg += f" | val {v:.4f}"
        log(msg + f" | lr {current_lr():.2e}")
        emit(method=args.method, step=step, tokens=step * tokens_per_step, elapsed_s=elapsed,
             loss=loss_mean, tokens_per_s=tps, wait_s=wait_s, round_end_s=round_end_s, val_loss=v)  # fmt: skip
        t_last, step_last = time.perf_counter(), step
        if stop:
            log(f"--max_seconds {args.max_seconds} reached at step {step}")
            break
    bar.close()
    if is_co2:  # waits for the round in flight: part of the training time
        t_fin = time.perf_counter()
        opt.finalize()
        log(f"finalize {time.perf_counter() - t_fin:.3f}s")
    train_s = time.perf_counter() - t0 - eval_s
    tokens = step * tokens_per_step

    vf = val_loss()
    log(f"final val loss {vf:.4f} (initial {v0:.4f}) | {step} steps in {train_s:.1f}s | "
        f"{tokens / train_s:,.0f} tok/s" if master else "")  # fmt: skip
    emit(summary=True, method=args.method, engine=args.engine, world_size=world, steps=step,
         tokens=tokens, elapsed_s=train_s, tokens_per_s=tokens / train_s,
         wait_s=wait_tot if is_co2 or args.method == "none" else None,
         round_end_s=round_end_tot if is_co2 else None, initial_val_loss=v0, val_loss=vf,
         co2_state_bytes=opt.co2_state_bytes() if is_co2 else 0, n_params=n_params,
         args=vars(args))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
