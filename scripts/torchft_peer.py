"""torchft's own DiLoCo / Streaming DiLoCo on the training job's model and data: the peer co2_zero is measured against.

Why: the elastic benchmark (scripts/bench_elastic.py) and the quality study compare co2_zero with what
a user would otherwise run, torchft 0.2.0's `torchft.local_sgd.DiLoCo`, on the same model, data, inner
optimizer and schedule. Everything but the algorithm comes from co2_zero.train: the model preset and
overrides (`gpt_from_args`), each replica's data stream (`Batches`, `elastic_stream`), AdamW, the LR
schedule and clipping (`accumulating_step`). Only torchft's public API is used: `Manager`,
`ProcessGroupGloo`, `DiLoCo`.

- `--peer diloco`: one fragment (the whole model) synced every --tau steps. `--peer streaming`:
  --fragments contiguous fragments, one synced every tau/fragments steps, --fragment_sync_delay,
  --fragment_update_alpha (Streaming DiLoCo).
- fp32 on the wire (on CPU torchft's quantization needs triton; docs/elastic.md). The outer optimizer is
  SGD with the --method preset's outer settings (default --method diloco: lr 0.7, momentum 0.9, Nesterov).
- Every replica is seeded identically and torchft's `init_sync` is off (it would overwrite every replica
  but one with that one's model after the first round). A (re)joining replica heals from a live peer
  at its first quorum (model, inner AdamW, LR schedule and the step; DiLoCo adds its outer state) and
  puts its data stream at that step.
- Logs in the training job's format: --events_jsonl (co2_zero/train/events.py; a step before the
  replica's first quorum has `replicas: 0`) and --stop_file.

One replica per launch; run it like the training job's elastic mode (a Lighthouse, one process per replica):

    torchft_lighthouse --bind "[::]:29510" --min_replicas 1 --join_timeout_ms 60000 --quorum_tick_ms 100
    python -m scripts.torchft_peer --lighthouse http://localhost:29510 --replica_id 0 --tau 12 --max_steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
from torch import nn

from co2_zero.train.args import co2_config
from co2_zero.train.args import get_args as train_get_args
from co2_zero.train.data import Batches, elastic_stream
from co2_zero.train.engines import accumulating_step, adamw_kwargs, lr_lambda
from co2_zero.train.events import Events, parameter_digest, stop_step
from co2_zero.train.loop import setup_dist
from co2_zero.train.model import gpt_from_args

PEERS = ("diloco", "streaming")


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The peer's own flags; every other flag is the training job's (model, data, optimizer, --tau, ...)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--peer", default="diloco", choices=PEERS, help="torchft's DiLoCo or Streaming DiLoCo")
    p.add_argument("--lighthouse", required=True, help="the torchft Lighthouse, http://host:port")
    p.add_argument("--replica_id", type=int, required=True, help="this replica's number, kept across restarts")
    p.add_argument("--fragments", type=int, default=2, help="--peer streaming: model fragments")
    p.add_argument("--fragment_sync_delay", type=int, default=0, help="--peer streaming: steps of overlap")
    p.add_argument("--fragment_update_alpha", type=float, default=0.0, help="--peer streaming: local/global mix")
    own, rest = p.parse_known_args(argv)
    if "--method" not in rest:
        rest = ["--method", "diloco", *rest]  # the outer settings of the DiLoCo preset
    args = train_get_args(rest, "torchft's DiLoCo on the training job's model and data")
    if own.replica_id < 0:
        p.error(f"--replica_id={own.replica_id} is invalid; accepted: an integer >= 0")
    args.tau = co2_config(args).tau  # the --tau given, else the --method preset's
    fragments = own.fragments if own.peer == "streaming" else 1
    if args.tau % fragments:
        p.error(f"--tau={args.tau} is not a multiple of --fragments={fragments}; torchft syncs one fragment every "
                f"tau/fragments steps")  # fmt: skip
    vars(args).update(vars(own), fragments=fragments)
    return args


def model_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """`count` contiguous fragments of the GPT (embeddings, blocks, final norm; the head is tied to the
    token embedding): each a ModuleList whose parameters torchft syncs together."""
    if count == 1:
        return [model]
    parts = [model.tok, model.pos, *model.blocks, model.ln_f]
    if count > len(parts):
        raise ValueError(f"--fragments={count}: the model has only {len(parts)} parts; accepted: 1..{len(parts)}")
    bounds = [round(k * len(parts) / count) for k in range(count + 1)]
    return [nn.ModuleList(parts[bounds[k] : bounds[k + 1]]) for k in range(count)]


class Replica:
    """One replica: model, inner optimizer, data, and what a live peer sends a joiner (`state_dict`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.manual_seed(args.seed)  # every replica starts from the same model (init_sync off)
        self.model = gpt_from_args(args)
        self.batches = Batches(args, elastic_stream(args.replica_id, 0, 1), torch.device("cpu"))
        self.inner = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(args))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.inner, lr_lambda(args))
        clip = lambda max_norm: nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)  # noqa: E731
        self.train_step = accumulating_step(args, self.model, self.inner, self.sched, clip)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict(),
                "sched": self.sched.state_dict(), "step": self.step}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]
        self.batches.seek(self.step)  # read what it would have read had it trained all along


def make_manager(args: argparse.Namespace, replica: Replica) -> Any:
    """torchft's Manager for this replica: synchronous quorum (DiLoCo needs it), no init_sync."""
    import torchft
    from torchft.process_group import ProcessGroupGloo

    config = co2_config(args)
    timeout = timedelta(seconds=config.timeout_s)
    return torchft.Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=replica.load_state_dict,
        state_dict=replica.state_dict, min_replica_size=1, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=args.lighthouse, replica_id=str(args.replica_id), init_sync=False,
    )  # fmt: skip


def outer_optimizers(args: argparse.Namespace, fragments: list[nn.Module]) -> list[torch.optim.Optimizer]:
    """One SGD per fragment with the --method preset's outer lr, momentum and Nesterov."""
    c = co2_config(args)
    return [torch.optim.SGD(f.parameters(), lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)
            for f in fragments]  # fmt: skip


def train(args: argparse.Namespace, replica: Replica, manager: Any, events: Events) -> None:
    """Inner steps until --max_steps or the stop file; a step and (at each sync) a round event each."""
    every = args.tau // args.fragments  # torchft syncs one fragment every this many steps
    own_steps = 0
    events.emit("start", step=replica.step, replica_id=args.replica_id, joined_at=None)
    while replica.step < args.max_steps:
        committed_before = manager.current_step()
        replica.train_step(replica.batches.micro_batches())
        replica.step += 1
        own_steps += 1
        events.emit("step", step=replica.step, replicas=manager.num_participants(), quorum=quorum_ids(manager))
        if own_steps % every == 0:
            events.emit("round", round=committed_before, replicas=manager.num_participants(),
                        committed=manager.current_step() > committed_before)  # fmt: skip
        stop = stop_step(args.stop_file)
        if replica.step % args.tau == 0 and stop is not None and replica.step >= stop:
            break


def quorum_ids(manager: Any) -> list[int]:
    """The replica ids of the Manager's current quorum (one rank per replica: its process group's global
    ranks, as torchft configured them; co2_zero.elastic reads the same), [] before the first quorum."""
    return list(getattr(manager._pg, "_global_ranks", None) or [])


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torchft.local_sgd import DiLoCo

    args = get_args(argv)
    torch.set_num_threads(args.threads)
    setup_dist("cpu")  # a world of one; its store (MASTER_ADDR:MASTER_PORT) is the Manager's
    replica = Replica(args)
    manager = make_manager(args, replica)
    fragments = model_fragments(replica.model, args.fragments)
    events = Events(args.events_jsonl)
    with DiLoCo(manager, fragments, replica.inner, outer_optimizers(args, fragments), sync_every=args.tau,
                pin_memory=False, fragment_sync_delay=args.fragment_sync_delay,
                fragment_update_alpha=args.fragment_update_alpha):  # fmt: skip
        train(args, replica, manager, events)
    events.emit("final", step=replica.step, digest=parameter_digest(replica.model.parameters()))
    events.close()
    print(f"replica {args.replica_id}: {replica.step} steps, {manager.current_step()} rounds committed",
          file=sys.stderr)  # fmt: skip
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
