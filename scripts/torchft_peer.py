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
  replica's first quorum has `replicas: 0`) and --stop_file. With --out_json, the training job's JSON
  lines: a record at every round end (every --tau steps, as the job's CO2 methods log), the held-out loss
  at the start, every --eval_every round ends and at the end (co2_zero.train's `evaluate`, this replica's
  own model on every held-out batch), and the summary record.

One replica per launch; run it like the training job's elastic mode (a Lighthouse, one process per replica):

    torchft_lighthouse --bind "[::]:29510" --min_replicas 1 --join_timeout_ms 5000 --quorum_tick_ms 100
    python -m scripts.torchft_peer --lighthouse http://localhost:29510 --replica_id 0 --tau 12 --max_steps 300

or let it launch a failure-free job on this host (scripts/bench_quality.py's torchft cells): without
--lighthouse, --replicas N starts a Lighthouse on an ephemeral port (--min_replicas N) and N replicas,
waits for them (all killed on the first failure or after --launch_timeout_s), and merges their JSON lines
into --out_json (tokens summed over the replicas, the held-out loss their mean: equal for DiLoCo, whose
replicas are identical after a sync; Streaming DiLoCo's differ in the fragments not synced last):

    python -m scripts.torchft_peer --replicas 4 --peer streaming --tau 32 --max_steps 640 --out_json peer.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from co2_zero.train.args import co2_config
from co2_zero.train.args import get_args as train_get_args
from co2_zero.train.data import Batches, elastic_stream
from co2_zero.train.engines import accumulating_step, adamw_kwargs, lr_lambda
from co2_zero.train.events import Events, parameter_digest, stop_step
from co2_zero.train.loop import evaluate, setup_dist
from co2_zero.train.model import gpt_from_args
from co2_zero.train.state import Clock, Console, Tally

PEERS = ("diloco", "streaming")
ROOT = Path(__file__).resolve().parent.parent
LIGHTHOUSE_START_S = 30.0  # the Lighthouse says its port within this (it starts in milliseconds)
KILL_GRACE_S = 10.0  # a process asked to stop (SIGTERM) gets this long before SIGKILL


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The peer's own flags; every other flag is the training job's (model, data, optimizer, --tau, ...)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--peer", default="diloco", choices=PEERS, help="torchft's DiLoCo or Streaming DiLoCo")
    p.add_argument("--lighthouse", default=None, help="the torchft Lighthouse, http://host:port (else --replicas)")
    p.add_argument("--replica_id", type=int, default=None, help="this replica's number, kept across restarts")
    p.add_argument("--replicas", type=int, default=None,
                   help="no --lighthouse: launch a Lighthouse and N replicas, merge their --out_json")  # fmt: skip
    p.add_argument("--launch_timeout_s", type=float, default=3600.0, help="--replicas: deadline of the whole job")
    p.add_argument("--fragments", type=int, default=2, help="--peer streaming: model fragments")
    p.add_argument("--fragment_sync_delay", type=int, default=0, help="--peer streaming: steps of overlap")
    p.add_argument("--fragment_update_alpha", type=float, default=0.0, help="--peer streaming: local/global mix")
    own, rest = p.parse_known_args(argv)
    if "--method" not in rest:
        rest = ["--method", "diloco", *rest]  # the outer settings of the DiLoCo preset
    args = train_get_args(rest, "torchft's DiLoCo on the training job's model and data")
    problem = _mode_problem(own, args.out_json) or _wire_problem(args.comm_dtype)
    if problem:
        p.error(problem)
    args.tau = co2_config(args).tau  # the --tau given, else the --method preset's
    fragments = own.fragments if own.peer == "streaming" else 1
    if args.tau % fragments:
        p.error(f"--tau={args.tau} is not a multiple of --fragments={fragments}; torchft syncs one fragment every "
                f"tau/fragments steps")  # fmt: skip
    own_flags = [f"--peer={own.peer}", f"--fragments={own.fragments}",
                 f"--fragment_sync_delay={own.fragment_sync_delay}",
                 f"--fragment_update_alpha={own.fragment_update_alpha}"]  # fmt: skip
    vars(args).update(vars(own), fragments=fragments, replica_argv=[*rest, *own_flags])
    return args


def _mode_problem(own: argparse.Namespace, out_json: Optional[str]) -> Optional[str]:
    """What is wrong with the choice between one replica (--lighthouse, --replica_id) and a launched
    job (--replicas, --out_json), or None."""
    if own.lighthouse is not None:
        if own.replicas is not None:
            return f"--replicas={own.replicas} with --lighthouse: accepted one of them (a replica, or a job to launch)"
        if own.replica_id is None or own.replica_id < 0:
            return f"--replica_id={own.replica_id} is invalid; accepted: an integer >= 0 with --lighthouse"
        return None
    if own.replicas is None or own.replicas < 1:
        return f"--replicas={own.replicas} without --lighthouse; accepted: --lighthouse URL, or --replicas >= 1"
    if own.replica_id is not None or out_json is None:
        return (f"--replicas {own.replicas} launches replicas 0..{own.replicas - 1} and merges their records into "
                f"--out_json; accepted: no --replica_id and an --out_json (given: --replica_id={own.replica_id}, "
                f"--out_json={out_json})")  # fmt: skip
    return None


def _wire_problem(comm_dtype: Optional[str]) -> Optional[str]:
    """torchft's DiLoCo all-reduces fp32 pseudo-gradients: a compressed CO2 wire format cannot be honoured."""
    if comm_dtype in (None, "fp32"):
        return None
    return f"--comm_dtype={comm_dtype}: torchft's DiLoCo sends fp32; accepted: fp32 or no --comm_dtype"


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


def train(args: argparse.Namespace, replica: Replica, manager: Any, events: Events, log: Log) -> None:
    """Inner steps until --max_steps or the stop file; a step and (at each sync) a round event each, a
    record at every round end."""
    every = args.tau // args.fragments  # torchft syncs one fragment every this many steps
    own_steps = 0
    events.emit("start", step=replica.step, replica_id=args.replica_id, joined_at=None)
    while replica.step < args.max_steps:
        committed_before = manager.current_step()
        log.tally.add_loss(replica.train_step(replica.batches.micro_batches()))
        replica.step += 1
        own_steps += 1
        events.emit("step", step=replica.step, replicas=manager.num_participants(), quorum=quorum_ids(manager))
        if own_steps % every == 0:
            events.emit("round", round=committed_before, replicas=manager.num_participants(),
                        committed=manager.current_step() > committed_before)  # fmt: skip
        if replica.step % args.tau == 0:
            log.round_end(replica)
        stop = stop_step(args.stop_file)
        if replica.step % args.tau == 0 and stop is not None and replica.step >= stop:
            break


class Log:
    """--out_json in the training job's format (co2_zero.train's Console, Clock and Tally): training
    seconds without the validations, the training loss since the last record, the held-out loss of this
    replica's own model at the start, every --eval_every round ends and the end. Without --out_json
    nothing is evaluated (bench_elastic measures steps only)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.console, self.clock, self.tally = args, Console(True, args.out_json, False), Clock(), Tally()
        self.method = f"torchft-{args.peer}"
        self.tokens_per_step = args.batch_size * args.block_size * args.grad_accum  # this replica's
        self.initial: Optional[float] = None

    def validate(self, replica: Replica) -> Optional[float]:
        if not self.args.out_json:
            return None
        with self.clock.paused():
            return evaluate(replica.model, replica.batches.val, 0, 1, alone=True, args=self.args)

    def start(self, replica: Replica) -> None:
        self.console.new_json()
        self.initial = self.validate(replica)
        self.console.record(method=self.method, step=replica.step, tokens=replica.step * self.tokens_per_step,
                            elapsed_s=0.0, loss=None, tokens_per_s=None, val_loss=self.initial)  # fmt: skip
        self.clock.start(replica.step)

    def round_end(self, replica: Replica) -> None:
        a, step, now = self.args, replica.step, time.perf_counter()
        elapsed = self.clock.training_s(now)
        tps = (step - self.clock.step_last) * self.tokens_per_step / max(now - self.clock.t_last, 1e-9)
        loss = float(self.tally.loss_sum / max(self.tally.loss_n, 1))
        self.tally.loss_sum, self.tally.loss_n = 0.0, 0
        self.tally.log_lines += 1
        due = a.eval_every > 0 and self.tally.log_lines % a.eval_every == 0 and step < a.max_steps
        self.console.record(method=self.method, step=step, tokens=step * self.tokens_per_step, elapsed_s=elapsed,
                            loss=loss, tokens_per_s=tps, val_loss=self.validate(replica) if due else None)  # fmt: skip
        self.clock.mark(step)

    def finish(self, replica: Replica, steps_run: int, rounds_committed: int) -> None:
        train_s = self.clock.training_s()
        self.console.record(summary=True, method=self.method, replica_id=self.args.replica_id, steps=replica.step,
                            steps_run=steps_run, tokens=replica.step * self.tokens_per_step, elapsed_s=train_s,
                            tokens_per_s=steps_run * self.tokens_per_step / max(train_s, 1e-9),
                            initial_val_loss=self.initial, val_loss=self.validate(replica),
                            rounds_committed=rounds_committed, args=vars(self.args))  # fmt: skip


def quorum_ids(manager: Any) -> list[int]:
    """The replica ids of the Manager's current quorum (one rank per replica: its process group's global
    ranks, as torchft configured them; co2_zero.elastic reads the same), [] before the first quorum."""
    return list(getattr(manager._pg, "_global_ranks", None) or [])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    return run_replica(args) if args.lighthouse else launch(args)


def run_replica(args: argparse.Namespace) -> int:
    """One replica of a job whose Lighthouse is --lighthouse."""
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(args.threads)
    setup_dist("cpu")  # a world of one; its store (MASTER_ADDR:MASTER_PORT) is the Manager's
    replica = Replica(args)
    manager = make_manager(args, replica)
    fragments = model_fragments(replica.model, args.fragments)
    events, log = Events(args.events_jsonl), Log(args)
    log.start(replica)
    with DiLoCo(manager, fragments, replica.inner, outer_optimizers(args, fragments), sync_every=args.tau,
                pin_memory=False, fragment_sync_delay=args.fragment_sync_delay,
                fragment_update_alpha=args.fragment_update_alpha):  # fmt: skip
        first_step = replica.step
        train(args, replica, manager, events, log)
    events.emit("final", step=replica.step, digest=parameter_digest(replica.model.parameters()))
    events.close()
    log.finish(replica, replica.step - first_step, manager.current_step())
    print(f"replica {args.replica_id}: {replica.step} steps, {manager.current_step()} rounds committed",
          file=sys.stderr)  # fmt: skip
    manager.shutdown(wait=False)
    return 0


# ---- --replicas: a failure-free job on this host ---------------------------------------------------------


def launch(args: argparse.Namespace) -> int:
    """A Lighthouse and --replicas replicas of this script; every one of them is stopped on the first
    failure, at --launch_timeout_s, on SIGTERM and at the end. Then their JSON lines merged into --out_json."""
    out = Path(args.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [out.with_name(f"{out.stem}.replica{i}.jsonl") for i in range(args.replicas)]
    logs = [part.with_suffix(".log") for part in parts]
    deadline = time.monotonic() + args.launch_timeout_s
    die_with_launcher = _parent_death_signal()
    procs: list[subprocess.Popen] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        lighthouse_log = out.with_name(f"{out.stem}.lighthouse.log")
        procs.append(_popen(lighthouse_argv(args.replicas), lighthouse_log, die_with_launcher))
        url = lighthouse_url(procs[0], lighthouse_log)
        for i in range(args.replicas):
            argv = replica_argv(args.replica_argv, url, i, parts[i])
            procs.append(_popen(argv, logs[i], die_with_launcher, env=replica_env()))
        wait_all(procs[1:], logs, deadline, args.launch_timeout_s)
    finally:
        stop_all(procs)
        signal.signal(signal.SIGTERM, previous)
    merged = merge_records([[json.loads(x) for x in part.read_text().splitlines()] for part in parts])
    out.write_text("".join(json.dumps(record) + "\n" for record in merged))
    return 0


def replica_argv(flags: Sequence[str], lighthouse: str, replica_id: int, out_json: Path) -> list[str]:
    """The command of one replica of a job whose Lighthouse is `lighthouse`: this script with `flags`
    (the peer's and the training job's), writing its JSON lines to `out_json`."""
    return [sys.executable, "-m", "scripts.torchft_peer", *flags, "--lighthouse", lighthouse,
            "--replica_id", str(replica_id), "--out_json", str(out_json)]  # fmt: skip


def lighthouse_argv(min_replicas: int, bind: str = "[::]:0") -> list[str]:
    """torchft's Lighthouse at `bind` (default an ephemeral port) forming quorums of at least
    `min_replicas` (all of them: a failure-free job; 1: an elastic one)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    return [str(binary), "--bind", bind, "--min_replicas", str(min_replicas), "--join_timeout_ms", "5000",
            "--quorum_tick_ms", "100"]  # fmt: skip


def lighthouse_url(proc: subprocess.Popen, log: Path) -> str:
    """The Lighthouse's address, from the port its log names (within LIGHTHOUSE_START_S)."""
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline:
        found = re.search(r"listening on: http://\S+:(\d+)", log.read_text())
        if found:
            return f"http://localhost:{found.group(1)}"
        if proc.poll() is not None:
            raise RuntimeError(f"the Lighthouse exited with {proc.returncode} before it named its port: {_tail(log)}")
        time.sleep(0.1)
    raise TimeoutError(f"the Lighthouse named no port within {LIGHTHOUSE_START_S:g}s: {_tail(log)}")


def replica_env() -> dict[str, str]:
    """A launched replica's environment: one thread, this checkout importable, a world of one of its own
    (no launcher's RANK/WORLD_SIZE/MASTER_PORT: setup_dist picks a free store port)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
               os.environ.get("PYTHONPATH")])))  # fmt: skip
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def wait_all(procs: Sequence[subprocess.Popen], logs: Sequence[Path], deadline: float, timeout_s: float) -> None:
    """Until every replica has exited 0; raises at the first that fails (its log's end) or at `deadline`."""
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                raise RuntimeError(
                    f"replica {i} exited with {code}; every other is stopped. {logs[i]}: {_tail(logs[i])}"
                )
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [i for i, code in enumerate(codes) if code is None]
            raise TimeoutError(f"--launch_timeout_s={timeout_s:g}: replicas {running} still running, stopped; "
                               f"logs next to {logs[0]}")  # fmt: skip
        time.sleep(0.2)


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process still running, SIGKILL those not gone within KILL_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=KILL_GRACE_S)


def merge_records(per_replica: Sequence[Sequence[dict]]) -> list[dict]:
    """The job's JSON lines from its replicas' (the same log points in the same order): tokens and tokens/s
    summed, training and held-out losses averaged, the slowest replica's training seconds; each replica's
    held-out loss in `val_loss_replicas`."""
    points = {tuple((r.get("summary", False), r.get("step"), r.get("steps")) for r in rs) for rs in per_replica}
    if len(points) != 1:
        raise ValueError(f"the replicas' records are at different steps: {sorted(points)}; accepted: one schedule")
    merged = []
    for records in zip(*per_replica):
        out = {**records[0], "tokens": sum(r["tokens"] for r in records), "replicas": len(records),
               "elapsed_s": max(r["elapsed_s"] for r in records)}  # fmt: skip
        out.pop("replica_id", None)
        for key, combine in (("loss", _mean), ("val_loss", _mean), ("initial_val_loss", _mean), ("tokens_per_s", sum)):
            values = [r.get(key) for r in records]
            if key in out:
                out[key] = None if None in values else combine(values)
        if out["val_loss"] is not None:
            out["val_loss_replicas"] = [r["val_loss"] for r in records]
        merged.append(out)
    return merged


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text()[-chars:] if path.exists() else "(no log)"


def _popen(argv: list[str], log: Path, preexec: Any, env: Optional[dict] = None) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, preexec_fn=preexec)


def _parent_death_signal() -> Any:
    """A preexec_fn that has Linux SIGKILL the child when the launcher dies (a launcher killed with no time
    to clean up, e.g. by its caller's timeout, leaves nothing running); None elsewhere. libc is loaded
    here, in the parent: the child only calls it between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    sys.exit(main())
