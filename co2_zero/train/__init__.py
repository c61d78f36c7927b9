"""Train a GPT with CO2 or a baseline: a tiny byte-level model on CPUs, GPT-2 sizes on GPUs.

The main job. Installed, it is the `co2-train` command (or `python -m co2_zero.train`); in a checkout,
scripts/train_lm.py runs the same. Every knob is a flag: `co2-train --help` lists them, grouped, with
their defaults.

    torchrun --nproc_per_node 4 scripts/train_lm.py                      # CO2 (overlapped), CPU, gloo
    torchrun --nproc_per_node 4 scripts/train_lm.py --method diloco      # blocking baselines:
    torchrun --nproc_per_node 4 scripts/train_lm.py --method localsgd    #   localsgd/slowmo/diloco
    torchrun --nproc_per_node 4 scripts/train_lm.py --method ddp         # all-reduce every step
    torchrun --nproc_per_node 4 scripts/train_lm.py --method none        # no communication at all
    python scripts/train_lm.py --max_steps 64                            # one process: R = 1, warned
    torchrun --nproc_per_node 4 -m co2_zero.train                        # installed: the same job
    torchrun --nproc_per_node 8 scripts/train_lm.py --device cuda --model gpt2 --data data/owt \\
        --batch_size 16 --grad_accum 4 --lr 6e-4 --min_lr 6e-5 --warmup_steps 200 --max_steps 4800

Devices: --device cpu (gloo) or cuda (one GPU per rank from LOCAL_RANK, NCCL, autocast bf16, fused
AdamW, pinned host batches copied without blocking; --compile). Engines (engines.py): plain
(CO2Optimizer, or DDP for --method ddp), fairscale (CO2OSS + ShardedDataParallel inside a replica),
deepspeed (ZeRO-1/2 from --deepspeed_config, whose "co2" section is honoured unless a flag overrides
it), fsdp (PyTorch's fully_shard over each replica's ranks, CO2Optimizer across replicas).

Model (model.py): --model tiny (the default, 0.6 M parameters on bytes) or gpt2 / gpt2-medium /
gpt2-large / gpt2-xl (124 M to 1.5 B); --n_layer, --n_head, --n_embd, --block_size override the preset.

Data (data.py): without --data, every *.py file of the running interpreter's standard library
(site-packages excluded), sorted by path, read as raw bytes (vocab 256) until --data_bytes; every
--val_every-th file is held out for validation. With --data DIR: DIR/train.bin and DIR/val.bin of
uint16 token ids (nanoGPT's layout), memory-mapped, --vocab_size 50304 by default. Each rank samples
its own windows (seed + rank); --batch_size sequences per micro-batch, --grad_accum micro-batches per
optimizer step.

Logging (loop.py; rank 0, on stderr, under a progress bar only when stderr is a terminal): a header
with the R x S actually used, then one line per round (CO2 methods) or per --log_every steps (ddp,
none) with the inner loss averaged over ranks and over the steps since the last line, the global
tokens/s, the seconds blocked waiting on the background exchange and the round-end seconds; on CUDA
also the MFU (against --peak_flops per GPU) and the peak GPU memory. The last line reads
"final val loss X (initial Y) | N steps [(resumed at step M)] in Ts | tok/s | R x S = r x s", and for
CO2 methods the rounds, the bytes rank 0 sent (every round's exchange, the last one's, which finalize()
waits for, included) and the seconds it was blocked; N counts only the steps
this process ran. --out_json writes the same as JSON lines plus a final {"summary": true, ...} object
("steps": the step reached, "steps_run": this process's). "elapsed_s" and "tokens_per_s" exclude the
time spent in validation and checkpoints. Validation (every --eval_every log lines, at the start and
after the end) runs right after a round end, i.e. on the round's start point, which is what the live
params are then; ddp/none evaluate at the step (none: rank 0's own model). The loss all-reduce at each
log line (default process group) also carries rank 0's --max_seconds verdict, so all ranks stop
together. --events_jsonl writes machine-readable events (events.py: every step with the quorum's size,
each elastic round committed or cut, the final parameter digest); --stop_file ends the run at the first
round end at or after the step the file names (scripts/bench_elastic.py ends every replica that way).

Checkpoints (checkpoints.py): --save_dir DIR --save_every N writes DIR/step<N, 8 digits>/ through the
library's checkpoints (co2_zero.checkpoint for plain, fairscale and fsdp, co2_zero.deepspeed's for
deepspeed) and names the newest in DIR/latest; --resume continues from it (or from the checkpoint
directory given), on the same flags; with --reshard, from a checkpoint of another R x S, world size or
engine (CO2 methods).

A user error (a refused flag or setting, a checkpoint that cannot be loaded) is one line, printed by rank 0
before any process group is built where it can be, and exit status 2 (cli.py); --debug shows its traceback.

CO2 methods train whole rounds: a --max_steps (optimizer steps) shorter than one round of tau is refused,
another that is not a multiple of tau is rounded up to one, with a warning (finalize() would drop a partial
round). A world of one process (no torchrun) warns that R = 1 has nothing to average. The
LR schedule (warmup, then cosine to --min_lr) spans --max_steps even when --max_seconds stops early.
With --replica_tau (replicas of different speeds, pacing.py) every step count above is the fastest
replica's: each replica takes its own steps per round, and the tokens logged are what they trained.
"""

from typing import Optional, Sequence

from . import loop
from .args import program
from .cli import run_tool


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`co2-train` / `python -m co2_zero.train` / scripts/train_lm.py: one training job; returns 0, or 2 after
    a user error's one line (cli.py; --debug: its traceback)."""
    return run_tool(program(), loop.main, argv)


__all__ = ["main"]
