"""Soak: many CO2 rounds (tiny model, tau = 1) and many optimizer lifetimes, watching for growth in
memory, threads and process groups. Prints a table and writes JSON.

    python scripts/soak.py --ranks 2 --rounds 1000 --lifetimes 20 --out benchmarks/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from co2_zero import CO2Config, CO2Optimizer


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def process_groups() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def sample(label: str, rounds: int) -> dict:
    return {
        "at": label,
        "rounds": rounds,
        "rss_mib": round(rss_mib(), 1),
        "threads": threading.active_count(),
        "process_groups": process_groups(),
    }


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    config = CO2Config(tau=1, outer_momentum=0.5, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    samples = []
    generator = torch.Generator().manual_seed(rank)

    def train(opt: CO2Optimizer, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=generator)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    # Part 1: one optimizer, many rounds.
    opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), config)
    checkpoints = {10, args.rounds // 2, args.rounds}
    began = time.perf_counter()
    for done in range(1, args.rounds + 1):
        train(opt, 1)
        if done in checkpoints:
            samples.append(sample("rounds", done))
    opt.finalize()
    seconds = time.perf_counter() - began
    samples.append(sample("after finalize", args.rounds))
    # Part 2: many optimizer lifetimes (groups and worker threads must be released each time).
    for life in range(1, args.lifetimes + 1):
        opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), config)
        train(opt, 5)
        opt.finalize()
        if life in (1, args.lifetimes):
            samples.append(sample(f"after lifetime {life}", 5))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds_part1": seconds, "samples": samples}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--lifetimes", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = f"{tmp}/result.json"
        mp.start_processes(
            worker, args=(args.ranks, f"{tmp}/store", args, result), nprocs=args.ranks, start_method="spawn"
        )
        with open(result) as f:
            report = json.load(f)
    first, last_round = report["samples"][0], report["samples"][2]
    report.update(
        {
            "command": (
                f"python scripts/soak.py --ranks {args.ranks} --rounds {args.rounds} --lifetimes {args.lifetimes}"
            ),
            "ranks": args.ranks,
            "rounds": args.rounds,
            "lifetimes": args.lifetimes,
            "rss_growth_mib": round(last_round["rss_mib"] - first["rss_mib"], 1),
            "thread_growth": report["samples"][-1]["threads"] - first["threads"],
            "process_group_growth": report["samples"][-1]["process_groups"] - first["process_groups"],
            "load_average": os.getloadavg()[0],
        }
    )
    print(f"{'at':<22}{'rounds':>8}{'RSS MiB':>10}{'threads':>9}{'groups':>8}")
    for s in report["samples"]:
        print(f"{s['at']:<22}{s['rounds']:>8}{s['rss_mib']:>10}{s['threads']:>9}{s['process_groups']:>8}")
    print(
        f"{args.rounds} rounds in {report['seconds_part1']:.1f} s; RSS growth {report['rss_growth_mib']} MiB "
        f"(round 10 to {args.rounds}), threads {report['thread_growth']:+d}, "
        f"process groups {report['process_group_growth']:+d}"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
