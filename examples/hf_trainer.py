"""Train a small byte-level GPT-2 with Hugging Face Trainer, DeepSpeed ZeRO-2 and CO2, on CPU.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer.py
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer.py --resume   # from the last checkpoint

It writes to runs/hf_trainer/ (--output_dir): Trainer's checkpoints every 30 steps and the final model.

A plain Trainer script plus the two lines marked (1) and (2). The DeepSpeed config is
examples/ds_zero2_co2_hf.json: "auto" for what Trainer fills in, a "co2" section with explicit values.
Its `shards_per_replica: 1` makes every rank its own replica, so two ranks on one machine have something
to average; on a cluster use "node" (ZeRO-2 inside each node, CO2 between nodes). The data is the Python
standard library's source, read as bytes; the model is randomly initialised (no download).
"""

import argparse
import json
import os
import sysconfig
from pathlib import Path
from typing import Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from co2_zero.hf import CO2Callback  # (1)

BLOCK = 64  # bytes per sample


class StdlibBytes(torch.utils.data.Dataset):
    """Blocks of BLOCK bytes from the standard library's sources: every `val_every`-th block is held out."""

    def __init__(self, split: str, max_bytes: int = 2_000_000, val_every: int = 20) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))[:max_bytes]
        blocks = torch.tensor(list(data[: len(data) // BLOCK * BLOCK]), dtype=torch.long).view(-1, BLOCK)
        held_out = torch.arange(len(blocks)) % val_every == 0
        self.blocks = blocks[held_out if split == "val" else ~held_out]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def finished_at(output_dir: str, max_steps: int) -> Optional[int]:
    """The step of the last checkpoint in `output_dir` if it already reached `max_steps`, else None.

    Trainer resumed from a checkpoint at max_steps still trains one more step (and CO2Callback's
    finalize() then drops it, as it ends no round): a finished run is not resumed at all.
    """
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        return None
    step = json.loads((Path(last) / "trainer_state.json").read_text())["global_step"]
    return step if step >= max_steps else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path("runs") / "hf_trainer"))
    parser.add_argument("--max_steps", type=int, default=60, help="a multiple of the config's tau")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output_dir")
    cli = parser.parse_args(argv)
    done = finished_at(cli.output_dir, cli.max_steps) if cli.resume else None
    if done is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"nothing to train: {cli.output_dir} holds a checkpoint at step {done} >= --max_steps {cli.max_steps}"
            )
        return

    config = GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    set_seed(0)  # the same initial model on every rank and every run
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=cli.output_dir,
        deepspeed=str(Path(__file__).with_name("ds_zero2_co2_hf.json")),
        use_cpu=True,  # on GPUs leave this out
        per_device_train_batch_size=8,  # the micro-batch of each rank
        gradient_accumulation_steps=2,  # tau counts optimizer steps, i.e. accumulation windows
        max_steps=cli.max_steps,
        learning_rate=3e-3,
        warmup_steps=6,
        logging_steps=12,
        save_steps=30,
        average_tokens_across_devices=False,  # no all-gather over every replica at every step
        report_to="none",
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=StdlibBytes("train"),
        eval_dataset=StdlibBytes("val", max_bytes=200_000),
        callbacks=[CO2Callback()],  # (2) patches deepspeed.initialize; checks, round figures, finalize()
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    metrics = trainer.evaluate()  # after finalize(): one model on every rank
    if trainer.is_world_process_zero():
        print(f"validation loss {metrics['eval_loss']:.3f} nats/byte")
    trainer.save_model(str(Path(cli.output_dir) / "final"))


if __name__ == "__main__":
    main()
