"""What CO2's outer step costs a training step: plain training against CO2 at several τ, one rank.

One process, one rank (it builds its own single-rank process group: gloo on CPU, NCCL on CUDA), a
GPT-2-shaped model, AdamW. For plain training and for `CO2Optimizer` at each τ it measures ms/step
(median and range over --reps repetitions, each a fresh model timed over whole rounds after a
warm-up), the round-end ms (`opt.last_round["round_end_s"]`: wait + displacement + launch + refresh),
and memory against the README formula (docs/design.md §4): on CUDA the peak allocated memory of CO2
minus plain; everywhere `co2_state_bytes()` against 4·(2Ψ/S + 2Ψ/N) (reduce_scatter) or 4·3Ψ/S
(all_reduce) bytes + 4 per tensor + the segment index. With one rank R = S = N = 1, so the whole
outer step (penalty, momentum, update over every parameter) runs every round: the worst case.

    python scripts/bench_outer_step.py                                   # CPU, tiny model (~2 min)
    python scripts/bench_outer_step.py --device cuda --model gpt2        # the GPU target: GPT-2 small,
        # bf16 autocast, fused AdamW, batch 16 x 1024 (issue 12: tau=1 <= 1.03x, tau=4 <= 1.01x of plain)

The model is defined here (nanoGPT's GPT-2 shapes: 12 tensors per block, tied head), not imported
from the training job (co2_zero.train), so the benchmark stays fixed while the training script evolves.
"""

import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from co2_zero import CO2Config, CO2Optimizer
from co2_zero.core.config import PUBLISHED
from co2_zero.core.outer import OuterHyper, Segment, SegmentIndex, outer_step
from co2_zero.train.cli import ToolParser, run_tool

PRESETS = {  # n_layer, n_head, n_embd, block_size, vocab_size, batch_size
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=512, batch_size=8),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, batch_size=16),
}


def get_args(argv=None):
    p = ToolParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--device", default="cpu", choices=["cpu", "cuda"])
    a("--model", default=None, choices=list(PRESETS), help="size preset (default: tiny on CPU, gpt2 on CUDA)")
    for name in PRESETS["tiny"]:
        a(f"--{name}", type=int, default=None, help="overrides the preset")
    a("--taus", type=int, nargs="+", default=[1, 4, 12, 48])
    a("--reps", type=int, default=3, help="repetitions of every configuration (interleaved)")
    a("--steps", type=int, default=48, help="timed steps per repetition, rounded up to whole rounds")
    a("--warmup", type=int, default=10, help="untimed steps first, rounded up to at least two rounds")
    a("--collective", default="auto", choices=["auto", "reduce_scatter", "all_reduce"])
    a("--lr", type=float, default=6e-4)
    a("--threads", type=int, default=1, help="torch threads on CPU")
    a("--out_json", default=None)
    a("--out_md", default=None, help="also write the table as markdown")
    args = p.parse_args(argv)
    preset = PRESETS[args.model or ("gpt2" if args.device == "cuda" else "tiny")]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ----------------------------------------------------------------------------- model (GPT-2 shapes)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- one measured run


def whole_rounds(steps, tau):
    return math.ceil(steps / tau) * tau


def run(args, tau, device):
    """Train a fresh model; tau None = plain AdamW. Returns the measurements of the timed steps."""
    torch.manual_seed(0)
    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    fused = device.type == "cuda"  # fused AdamW: one kernel for all parameters
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=fused)
    opt = (
        inner
        if tau is None
        else CO2Optimizer(inner, CO2Config(**{**PUBLISHED, "tau": tau}, collective=args.collective), model=model)
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [
        torch.randint(args.vocab_size, (args.batch_size, args.block_size + 1), device=device, generator=gen)
        for _ in range(4)
    ]

    def step(i):
        tokens = batches[i % len(batches)]
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return tau is not None and opt.round_ended

    period = tau or 1
    warmup, timed = whole_rounds(max(args.warmup, 2 * period), period), whole_rounds(args.steps, period)
    for i in range(warmup):
        step(i)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    round_end_ms, wait_ms = [], []
    began, began_cpu = time.perf_counter(), time.process_time()
    for i in range(warmup, warmup + timed):
        if step(i):
            round_end_ms.append(1e3 * opt.last_round["round_end_s"])
            wait_ms.append(1e3 * opt.last_round["wait_s"])
    sync()
    elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
    out = {
        "tau": tau,
        "ms_per_step": 1e3 * elapsed / timed,
        # CPU time of the whole process (background worker included) per step: on a shared CPU
        # machine far less sensitive to other jobs than the wall clock
        "cpu_ms_per_step": 1e3 * elapsed_cpu / timed,
        "timed_steps": timed,
        "round_end_ms": statistics.median(round_end_ms) if round_end_ms else None,
        "wait_ms": statistics.median(wait_ms) if wait_ms else None,
        "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    }
    if tau is not None:
        out["co2_state_bytes"] = opt.co2_state_bytes()
        out["index_bytes"] = opt.engine.exchange.index_bytes
        out["collective"] = opt.engine.exchange.strategy
        opt.finalize()
    return out


# the outer step alone, on the model's layout; "default": CO2 as published, as the results in benchmarks/
OUTER_CONFIGS = {
    "default (adaptive penalty, no momentum)": CO2Config(**PUBLISHED),
    "momentum 0.9 + Nesterov + norm clip": CO2Config(
        **{**PUBLISHED, "outer_momentum": 0.9, "nesterov": True}, clip={"mode": "norm"}
    ),
}


def outer_step_alone(sizes, device, config, repeats=10):
    """One `outer_step` over a slice holding tensors of `sizes` (one process, no communication):
    kernels launched (CUDA kernels, or aten ops on CPU, from the profiler) and ms (median)."""
    segments, at = [], 0
    for i, n in enumerate(sizes):
        segments.append(Segment(i, at, at + n))
        at += n
    index = SegmentIndex(segments, len(sizes), device)
    g0 = 1e-3 * torch.randn(at, device=device)
    g, momentum, base = g0.clone(), torch.zeros_like(g0), torch.randn_like(g0)
    kwargs = dict(segments=index, counted=index, hyper=OuterHyper.from_config(config), sum_across_ranks=lambda t: t)
    previous = torch.rand(len(sizes), device=device)
    cuda = device.type == "cuda"
    ms = []
    for i in range(repeats + 2):
        g.copy_(g0)
        if cuda:
            torch.cuda.synchronize()
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
        t = time.perf_counter()
        outer_step(g, momentum, base, previous_update_sq_norms=previous, **kwargs)
        if cuda:
            ended.record()
            torch.cuda.synchronize()
        if i >= 2:  # warm-up
            ms.append(began.elapsed_time(ended) if cuda else 1e3 * (time.perf_counter() - t))
    g.copy_(g0)
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        outer_step(g, momentum, base, previous_update_sq_norms=previous, **kwargs)
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    launched = sum(1 for e in prof.events() if e.device_type == kind)
    return {"kernels" if cuda else "aten_ops": launched, "ms": statistics.median(ms), "index_bytes": index.nbytes}


def formula_bytes(psi, tensors, collective):
    """README / docs/design.md §4 with R = S = N = 1: fp32 words of the CO2 state, + one per tensor."""
    words = 4 * psi if collective == "reduce_scatter" else 3 * psi  # 2Ψ/S + 2Ψ/N, or 3Ψ/S
    return 4 * (words + tensors)


# ----------------------------------------------------------------------------- main


def init_single_rank(device):
    """A one-rank process group (or the one torchrun describes)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("bench_outer_step.py measures one rank; launch it with world size 1")


def summarise(name, runs, plain_median, plain_cpu_median):
    ms = [r["ms_per_step"] for r in runs]
    median = statistics.median(ms)
    row = {"run": name, "ms_per_step_median": median, "ms_per_step_min": min(ms), "ms_per_step_max": max(ms)}
    row["vs_plain"] = median / plain_median if plain_median else None
    row["cpu_ms_per_step_median"] = statistics.median(r["cpu_ms_per_step"] for r in runs)
    row["cpu_vs_plain"] = row["cpu_ms_per_step_median"] / plain_cpu_median if plain_cpu_median else None
    ends = [r["round_end_ms"] for r in runs if r["round_end_ms"] is not None]
    row["round_end_ms_median"] = statistics.median(ends) if ends else None
    for key in ("co2_state_bytes", "index_bytes", "collective"):
        if key in runs[0]:
            row[key] = runs[0][key]
    peaks = [r["peak_bytes"] for r in runs if r["peak_bytes"] is not None]
    row["peak_bytes"] = max(peaks) if peaks else None
    return row


def table(rows, plain_peak, formula):
    mib = 2**20
    lines = [
        "| run | ms/step (median) | range | × plain | CPU ms/step | × plain | round end ms | CO2 state MiB "
        "| formula MiB | peak − plain MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        state = r.get("co2_state_bytes")
        peak = r["peak_bytes"] - plain_peak if r["peak_bytes"] is not None and plain_peak is not None else None
        cells = [
            r["run"],
            f"{r['ms_per_step_median']:.2f}",
            f"{r['ms_per_step_min']:.2f}–{r['ms_per_step_max']:.2f}",
            f"{r['vs_plain']:.3f}",
            f"{r['cpu_ms_per_step_median']:.2f}",
            f"{r['cpu_vs_plain']:.3f}",
            "" if r["round_end_ms_median"] is None else f"{r['round_end_ms_median']:.2f}",
            "" if state is None else f"{state / mib:.3f}",
            "" if state is None else f"{formula[r['collective']] / mib:.3f}",
            "" if peak is None else f"{peak / mib:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = get_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads)
    init_single_rank(device)
    load_before = os.getloadavg()  # other jobs on the machine show here (the CPU numbers are sensitive to them)

    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    sizes = [p.numel() for p in model.parameters()]
    psi, tensors = sum(sizes), len(sizes)
    del model
    print(f"model: {psi / 1e6:.2f} M parameters in {tensors} tensors; device {device}; taus {args.taus}")
    alone = {name: outer_step_alone(sizes, device, config) for name, config in OUTER_CONFIGS.items()}
    for name, measured in alone.items():
        print(f"outer step alone, {name}: {measured}")

    configs = [("plain", None)] + [(f"co2 tau={t}", t) for t in args.taus]
    runs = {name: [] for name, _ in configs}
    run(args, None, device)  # discarded: the machine reaches its steady state (clocks, allocator, kernels)
    for rep in range(args.reps):  # interleaved and rotated: a slow phase or a drift hits every configuration
        for name, tau in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
            runs[name].append(run(args, tau, device))
            print(f"rep {rep} {name}: {runs[name][-1]['ms_per_step']:.2f} ms/step")

    plain = summarise("plain", runs["plain"], None, None)
    plain["vs_plain"] = plain["cpu_vs_plain"] = 1.0
    medians = plain["ms_per_step_median"], plain["cpu_ms_per_step_median"]
    rows = [plain] + [summarise(name, runs[name], *medians) for name, _ in configs[1:]]
    formula = {c: formula_bytes(psi, tensors, c) for c in ("reduce_scatter", "all_reduce")}
    text = table(rows, plain["peak_bytes"], formula)
    index_note = ", ".join(sorted({f"{r['index_bytes']} B" for r in rows if "index_bytes" in r}))
    print(text)
    print(f"CO2 state = formula + the segment index ({index_note}); formula = 4·(4Ψ or 3Ψ + tensors) bytes")

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {
        "device": device_name,
        "note": (
            "CPU run of the benchmark, not the H100 target of issue 12 (GPT-2 small, bf16, fused AdamW): "
            "ratios here measure this machine's CPU, not the GPU's kernel costs"
            if device.type == "cpu"
            else "GPU run"
        ),
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "args": vars(args),
        "parameters": psi,
        "tensors": tensors,
        "formula_bytes": formula,
        "outer_step_alone": alone,
        "rows": rows,
        "runs": runs,
    }
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=1)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(f"# bench_outer_step.py on {device_name}\n\n{result['note']}.\n\n")
            f.write(f"`{result['command']}` (torch {torch.__version__})\n\n")
            f.write(f"Model: {psi / 1e6:.2f} M parameters in {tensors} tensors, batch {args.batch_size} × ")
            f.write(f"{args.block_size}, {args.reps} repetitions, {args.steps} timed steps (whole rounds).\n")
            f.write(f"Load average before/after: {load_before[0]:.1f} / {result['load_average_after'][0]:.1f} ")
            f.write(f"on {os.cpu_count()} cores.\n\n")
            f.write(text + "\n\n")
            f.write(f"CO2 state = formula + the segment index ({index_note}).\n\n")
            f.write("One `outer_step` alone on this model's layout (no communication):\n\n")
            for name, measured in alone.items():
                f.write(f"- {name}: {json.dumps(measured)}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_tool("bench_outer_step.py", main))
