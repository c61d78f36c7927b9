"""Replicas of different speeds: fixed tau against `replica_tau` (docs/configuration.md, "Replicas of
different speeds"), side by side in one run, against a uniform cluster of the same tokens.

P = 4 gloo ranks on this machine (S = 1), a small regression MLP on a fixed teacher. A replica's speed is
emulated: each inner step is padded with a sleep to `BASE_S / speed` seconds (its compute included), so
a slow replica is slow without taking CPU from the others (on a shared machine a CPU-share limit would
mix the emulated slowness with everyone's contention; the sleep keeps it to the replica itself).

Per method and repetition: `tokens_per_s_over_own_speeds`, the job's tokens/s over the sum of the
replicas' own speeds (a replica's own speed: its batch over its mean inner-step time, round ends
excluded), and `final_val_loss` after finalize() on a held-out set. Methods at equal total tokens:
`uniform` (every speed 1, tau), `fixed_tau` (the case's speeds, tau on every replica), `replica_tau`
(τ_r = tau × speed_r, rounded; as many rounds as give the same tokens, rounded), all with the defaults but
the sync delay, the round end everywhere (replica_tau's), so that pacing is the only difference. torchft's
DiLoCo is not run here.

    python scripts/bench_hetero.py --repeats 3 --out benchmarks/heterogeneous
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from co2_zero.core.pace import taus_for_speeds

CASES = {"half": [1.0, 1.0, 1.0, 0.5], "quarter": [1.0, 1.0, 0.5, 0.25]}
BASE_S = 0.03  # an inner step at speed 1, compute included
TAU, ROUNDS, BATCH, WIDTH = 8, 12, 64, 128
SEED = 1234
# the round end for every method (replica_tau's sync delay), so that pacing is the only difference; the
# rest are the defaults
COMMON = {"tau": TAU, "sync_delay": None}


def _data(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch at its inner step `step`, labelled by a fixed teacher plus noise."""
    g = torch.Generator().manual_seed(1_000_003 * (replica + 1) + step)
    x = torch.randn(BATCH, 16, generator=g)
    return x, _teacher(x) + 0.1 * torch.randn(BATCH, 4, generator=g)


def _teacher(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(32, 4, generator=g)
    return torch.tanh(x @ w1) @ w2 / 4


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 4))


def _validation_loss(model: torch.nn.Module) -> float:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(4096, 16, generator=g)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), _teacher(x)).item()


def _rank(rank: int, world: int, store: str, speeds: list[float], config: dict, rounds: int, out: str) -> None:
    from co2_zero import CO2Optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    model = _model()
    opt = CO2Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), config, model=model)
    step_s, began = [], time.perf_counter()
    for _ in range(rounds * opt.steps_per_round):
        start = time.perf_counter()
        x, y = _data(rank, opt.engine.inner_steps)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(max(0.0, start + BASE_S / speeds[rank] - time.perf_counter()))  # the emulated speed
        step_s.append(time.perf_counter() - start)
        opt.step()  # a round end happens in here: not part of the replica's own speed
    wall = time.perf_counter() - began
    opt.finalize()
    result = {"steps": len(step_s), "own_speed": BATCH / statistics.mean(step_s), "wall_s": wall,
              "val_loss": _validation_loss(model)}  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_once(speeds: list[float], config: dict, rounds: int) -> dict:
    """One job of len(speeds) ranks; its tokens/s over the sum of its replicas' own speeds, its loss."""
    with tempfile.TemporaryDirectory() as work:
        args = (len(speeds), f"{work}/store", speeds, config, rounds, work)
        mp.start_processes(_rank, args=args, nprocs=len(speeds), start_method="spawn")
        ranks = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(len(speeds))]
    tokens = sum(r["steps"] for r in ranks) * BATCH
    wall = max(r["wall_s"] for r in ranks)
    return {"tokens": tokens, "wall_s": wall,
            "tokens_per_s_over_own_speeds": tokens / wall / sum(r["own_speed"] for r in ranks),
            "final_val_loss": ranks[0]["val_loss"]}  # fmt: skip


def methods(speeds: list[float]) -> dict[str, tuple[list[float], dict, int]]:
    """name: (speeds, co2 config, rounds), at equal total tokens (up to rounding)."""
    taus = taus_for_speeds(speeds, TAU)
    paced_rounds = round(ROUNDS * TAU * len(speeds) / sum(taus))
    return {
        "uniform": ([1.0] * len(speeds), {**COMMON}, ROUNDS),
        "fixed_tau": (speeds, {**COMMON}, ROUNDS),
        "replica_tau": (speeds, {**COMMON, "replica_tau": taus}, paced_rounds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="benchmarks/heterogeneous")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for case in args.cases:
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # methods interleaved: each repetition sees the same load
            for name, (speeds, config, rounds) in methods(CASES[case]).items():
                runs.setdefault(name, []).append(run_once(speeds, config, rounds))
        report = {
            "case": case, "speeds": CASES[case], "tau": TAU, "base_step_s": BASE_S, "batch": BATCH,
            "command": " ".join([sys.executable, *sys.argv]), "cpus": os.cpu_count(),
            "methods": {name: {"config": methods(CASES[case])[name][1],
                               "tokens": [r["tokens"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
                               "tokens_per_s_over_own_speeds": [r["tokens_per_s_over_own_speeds"] for r in rs],
                               "final_val_loss": [r["final_val_loss"] for r in rs]} for name, rs in runs.items()},
        }  # fmt: skip
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"{case}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"\n{case}: speeds {CASES[case]}, tau {TAU}, {args.repeats} repetitions (median [min, max])")
        print(f"{'method':<12} {'tokens':>8} {'tok/s over own speeds':>28} {'final val loss':>30}")
        for name, m in report["methods"].items():
            print(f"{name:<12} {m['tokens'][0]:>8} {_spread(m['tokens_per_s_over_own_speeds']):>28} "
                  f"{_spread(m['final_val_loss']):>30}")  # fmt: skip
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


if __name__ == "__main__":
    sys.exit(main())
