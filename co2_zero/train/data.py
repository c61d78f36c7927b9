"""The training job's data: the standard library's bytes or a token file, sampled as random windows."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

BYTE_VOCAB, TOKEN_VOCAB = 256, 50304  # the stdlib bytes; GPT-2's 50257 tokens padded to a multiple of 64


def load_corpus(max_bytes: int, val_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stdlib *.py files, sorted by relative path -> (train, val) uint8 tensors; every `val_every`-th
    file is held out, reading stops at `max_bytes`."""
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


def window_starts(data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator) -> list[int]:
    """Where `batch_size` random windows of `data` start: one draw from `gen`."""
    if len(data) <= block_size + 1:
        raise ValueError(f"--block_size={block_size} needs at least {block_size + 2} tokens; the data has {len(data)}")
    return torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen).tolist()


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator):
    """`batch_size` random windows of `data` -> (inputs, next-token targets), int64, on the CPU."""
    ix = window_starts(data, batch_size, block_size, gen)
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


class Batches:
    """This rank's batches: random training windows from its own stream (seed + `stream`, the global
    rank; elastic: `elastic_stream`), and the fixed held-out batches every rank shares (seed), already
    on the device."""

    def __init__(self, args, stream: int, device: torch.device) -> None:
        self.args, self.device = args, device
        self.train, val = load_tokens(args.data) if args.data else load_corpus(args.data_bytes, args.val_every)
        self.val_tokens = len(val)
        self.stream = stream
        self.gen = torch.Generator().manual_seed(args.seed + stream)
        val_gen = torch.Generator().manual_seed(args.seed)  # same held-out batches everywhere, every time
        self.val = [
            self._on_device(*get_batch(val, args.batch_size, args.block_size, val_gen))
            for _ in range(args.eval_batches)
        ]

    def _on_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_vocab(x, y, self.args.vocab_size)
        return to_device(x, self.device), to_device(y, self.device)

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One optimizer step's micro-batches for this rank, on the device."""
        a = self.args
        x, y = self._on_device(*get_batch(self.train, a.batch_size * a.grad_accum, a.block_size, self.gen))
        return list(zip(x.split(a.batch_size), y.split(a.batch_size)))

    def seek(self, step: int) -> None:
        """Put this rank's stream where it is after `step` optimizer steps: restart it from its seed and
        draw (without reading) the windows of the steps before. An elastic replica that (re)joins, or
        resumes from another replica's checkpoint, reads what it would have read had it trained all along."""
        a = self.args
        self.gen.manual_seed(a.seed + self.stream)
        for _ in range(step):
            window_starts(self.train, a.batch_size * a.grad_accum, a.block_size, self.gen)


def elastic_stream(replica_id: int, rank: int, world: int) -> int:
    """The data stream of `rank` of elastic replica `replica_id` (each replica its own launch of `world`
    ranks): the global rank it would have in one launch of every replica, so replicas never share one."""
    return replica_id * world + rank
