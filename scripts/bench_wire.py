"""Bytes on the wire and the codec's cost, per wire format (docs/design.md §5, docs/wire-formats.md).

1. Bytes per round, measured from the wire: R gloo ranks (plain CO2Optimizer, one replica each) train
   a model of --params parameters with every format (dense fp32, bf16, int8, fp8, int4, int2, and top-k
   in int2/int4/fp32) for two blocking rounds; `last_round["bytes_sent"]` of rank 0's last round, its
   ratio to fp32's (the wire bytes per rank: all-gather against ring all-reduce), the payload ratio (fp32
   bytes over one replica's payload, the field's measure), and `co2_state_bytes()`, next to the closed
   forms of design §5.
2. The codec's cost on one CPU core (torch.set_num_threads(1)), or on a GPU with --codec_device cuda:
   encode (with error feedback; the sparse formats with the decaying residual they are recommended with)
   and decode of an fp32 vector of --codec_elements elements, --repeats times; MB/s of fp32 input (a
   sparse decode: the senders' mean of one payload, what each of the R payloads of a round costs).

Writes <out_dir>/wire.json and wire.md.

    OMP_NUM_THREADS=1 python -m scripts.bench_wire --replicas 2 4 --params 1000000 --codec_elements 100000000
    python -m scripts.bench_wire --codec_only --codec_device cuda --codec_elements 100000000 --repeats 5

With --codec_only, part 2 alone, into <out_dir>/codec.json and codec.md; with --throughput FILE (a
bench_throughput.py JSON whose cells ran the tuner) also the codec's seconds per round on each cell's
model and replicas (one round's encodes and decodes, design §5: a dense format encodes (1 + 1/R)·Ψ and
decodes 2·Ψ, a sparse one encodes Ψ and decodes R payloads of Ψ) and their share of τ inner steps.

    OMP_NUM_THREADS=1 python -m scripts.bench_wire --codec_only --codec_elements 100000000 --repeats 3 \
        --throughput benchmarks/throughput/throughput_P4_10mbit_wire.json --tau 32

3. With --quality DIR (a bench_quality.py --out_dir): the compressed defaults against the fp32 defaults
   there, seed for seed, and with --throughput the wall-clock each needs to DDP's loss on that link
   (`scripts/wire_quality.py`); nothing else runs.

    python -m scripts.bench_wire --quality benchmarks/quality_wire
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from co2_zero import CO2Optimizer  # noqa: E402
from co2_zero.core.compress import FORMATS, RecordLayout, dequantize_into, quantize_with_feedback_  # noqa: E402
from co2_zero.core.sparse import SparseLayout, average_over_senders_, encode_with_feedback_  # noqa: E402
from co2_zero.train.cli import ToolParser, run_tool  # noqa: E402
from co2_zero.train.link import round_bytes  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402

# label -> the co2 config's wire fields
WIRES = {
    "fp32": {"comm_dtype": "fp32"},
    "bf16": {"comm_dtype": "bf16"},
    "int8": {"comm_dtype": "int8"},
    "int4": {"comm_dtype": "int4"},
    "int2": {"comm_dtype": "int2"},
    "top3%-int2": {"comm_dtype": "int2", "topk": 0.03},
    "top1.5%-int2": {"comm_dtype": "int2", "topk": 0.015},
    "top1%-int2": {"comm_dtype": "int2", "topk": 0.01},
    "top0.9%-int2": {"comm_dtype": "int2", "topk": 0.009},
    "top1.5%-int4": {"comm_dtype": "int4", "topk": 0.015},
    "top1.5%-fp32": {"comm_dtype": "fp32", "topk": 0.015},
}
BLOCKING = {"tau": 1, "overlap": False, "outer_lr": 0.7, "outer_momentum": 0.9, "collective": "auto"}


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = ToolParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--params", type=int, default=1_000_000, help="parameters of the model (one square Linear)")
    p.add_argument("--codec_elements", type=int, default=25_000_000, help="elements of the codec's vector")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "wire"))
    p.add_argument("--quality", default=None, help="only summarise a bench_quality.py study of the wire formats")
    p.add_argument("--baseline", default=None, help="with --quality: a study whose fp32 cells complete its own")
    p.add_argument("--codec_only", action="store_true", help="only the codec's cost (codec.json, codec.md)")
    p.add_argument("--codec_device", default="cpu", help="where the codec runs: cpu (one core) or cuda")
    p.add_argument("--throughput", default=None, help="a bench_throughput.py JSON: the codec's share of its rounds")
    p.add_argument("--tau", type=int, default=32, help="inner steps per round for that share")
    return p.parse_args(argv)


def _model(params: int) -> nn.Module:
    torch.manual_seed(0)
    side = int(math.sqrt(params))
    return nn.Linear(side, side, bias=False)


def wire_rank(rank: int, world: int, params: int) -> dict:
    """Rank `rank`'s bytes sent in its second round and its CO2 state, per wire format."""
    out = {}
    for label, wire in WIRES.items():
        model = _model(params)
        opt = CO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), {**BLOCKING, **wire}, model=model)
        x = torch.randn(4, model.in_features, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        out[label] = {
            "bytes_sent": opt.last_round["bytes_sent"],
            "state_bytes": opt.co2_state_bytes(),
            "strategy": opt.engine.exchange.strategy,
            "padded": opt.engine.layout.padded,
            "payload_ratio": opt.last_round["payload_ratio"],
        }
        opt.finalize()
    return out


def closed_form(label: str, padded: int, replicas: int) -> int:
    """design §5's bytes per round per rank, without the norms' all-reduce (2 float64 per tensor)."""
    wire = WIRES[label]
    return round_bytes(padded, replicas, wire["comm_dtype"], wire.get("topk", 1.0))


def measure_wire(a: argparse.Namespace) -> list[dict]:
    rows = []
    for replicas in a.replicas:
        per_rank = run_ranks(wire_rank, replicas, a.params, timeout=1200.0)
        got = per_rank[0]
        fp32 = got["fp32"]["bytes_sent"]
        norms = 2 * (replicas - 1) * (2 * 1 * 8) // replicas  # one tensor
        for label, r in got.items():
            rows.append({"replicas": replicas, "wire": label, **r, "ratio_to_fp32": fp32 / r["bytes_sent"],
                         "closed_form": closed_form(label, r["padded"], replicas) + norms,
                         "bits_per_parameter": 8 * r["bytes_sent"] / r["padded"]})  # fmt: skip
    return rows


def _timed(fn, repeats: int, device: torch.device) -> tuple[list[float], list[float]]:
    """(wall seconds, this process's CPU seconds) of each of `repeats` calls, after one warm-up, the
    device's queue drained: on one thread the CPU seconds are the core's work, whatever else shares it."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return wall, cpu


def _codec(label: str, vector: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, decay: float = 1.0):
    """(encode, decode) of `label` on the whole vector, as the exchange runs them on a partition."""
    wire = WIRES[label]
    if "topk" in wire:
        layout = SparseLayout.for_length(vector.numel(), wire["topk"], wire["comm_dtype"])
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=vector.device)
        one = payload.view(1, -1)  # the senders' mean over one payload: what each of the R payloads costs
        return (lambda: encode_with_feedback_(vector.clone(), residual, layout, payload, decay),
                lambda: average_over_senders_(one, [1.0], layout, out))  # fmt: skip
    fmt = FORMATS[wire["comm_dtype"]]
    nbytes = RecordLayout.for_length(vector.numel(), bits=fmt.bits).nbytes
    records = torch.empty(1, nbytes, dtype=torch.uint8, device=vector.device)
    rows, residual_rows, out_rows = vector.view(1, -1), residual.view(1, -1), out.view(1, -1)
    return (lambda: quantize_with_feedback_(rows.clone(), residual_rows, fmt, records),
            lambda: dequantize_into(records, fmt, out=out_rows))  # fmt: skip


# the codec's formats: label -> (a WIRES label, the residual's decay)
CODECS = {"int8": ("int8", 1.0), "int4": ("int4", 1.0), "int2": ("int2", 1.0), "top3%-int2": ("top3%-int2", 1.0),
          "top1.5%-int2": ("top1.5%-int2", 1.0), "top1.5%-int2-decay": ("top1.5%-int2", 0.95),
          "top0.9%-int2-decay": ("top0.9%-int2", 0.95)}  # fmt: skip


def codec_cost(elements: int, repeats: int, device: str = "cpu") -> list[dict]:
    """encode+feedback and decode MB/s (of fp32 input) per format, on one CPU core or on `device`: on the
    CPU by CPU time (`*_MBps`, what the core spends) and by wall time (`*_wall_MBps`, which a shared host
    lowers); on a GPU both by wall time (the host's CPU time says nothing of the card's)."""
    where = torch.device(device)
    if where.type == "cpu":
        torch.set_num_threads(1)
    by = 1 if where.type == "cpu" else 0  # the column of `_timed` that `*_MBps` reads
    vector = torch.randn(elements, generator=torch.Generator().manual_seed(0)).to(where)
    residual, out = torch.zeros_like(vector), torch.zeros_like(vector)
    copy = [statistics.median(t) for t in _timed(vector.clone, repeats, where)]  # the input's clone is not the codec's
    rows, mb = [], 4 * elements / 1e6
    for label, (wire, decay) in CODECS.items():
        encode, decode = _codec(wire, vector, residual, out, decay)
        enc = [[mb / max(t - c, 1e-9) for t in ts] for ts, c in zip(_timed(encode, repeats, where), copy)]
        dec = [[mb / max(t, 1e-9) for t in ts] for ts in _timed(decode, repeats, where)]
        rows.append({"wire": label, "elements": elements, "device": str(where), "encode_MBps": enc[by],
                     "decode_MBps": dec[by], "encode_wall_MBps": enc[0], "decode_wall_MBps": dec[0]})  # fmt: skip
    return rows


def round_share(codec: Sequence[dict], cells: Sequence[dict], tau: int) -> list[dict]:
    """The codec's seconds per round on each throughput cell's model and replicas (design §5's encodes and
    decodes of one round, at the median MB/s) and their share of `tau` inner steps (the tuner's t_step)."""
    rows = []
    for cell in cells:
        tuner = cell["tuners"]["fp32"]
        psi, replicas, t_step = tuner["params"], cell["nodes"], tuner["compute"]["t_step"]
        for r in codec:
            sparse = "topk" in WIRES[CODECS[r["wire"]][0]]
            encoded, decoded = (psi, replicas * psi) if sparse else ((1 + 1 / replicas) * psi, 2 * psi)
            seconds = (4 * encoded / 1e6 / statistics.median(r["encode_MBps"])
                       + 4 * decoded / 1e6 / statistics.median(r["decode_MBps"]))  # fmt: skip
            rows.append({"wire": r["wire"], "nodes": replicas, "rate": cell["rate"], "params": psi,
                         "t_step": t_step, "tau": tau, "codec_s_per_round": seconds,
                         "share_of_round": seconds / (tau * t_step)})  # fmt: skip
    return rows


def _span(values: Sequence[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.0f} [{min(values):.0f}–{max(values):.0f}]"


def markdown(result: dict) -> str:
    lines = ["| R | wire | bytes/round (rank 0) | closed form | × fewer wire bytes than fp32 | payload × fewer than "
             "fp32's | bits/param | state bytes |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result.get("wire", []):
        lines.append(f"| {r['replicas']} | {r['wire']} | {r['bytes_sent']:,} | {r['closed_form']:,} | "
                     f"{r['ratio_to_fp32']:.1f} | {r.get('payload_ratio') or 1:.1f} | {r['bits_per_parameter']:.3f} | "
                     f"{r['state_bytes']:,} |")  # fmt: skip
    lines = lines if result.get("wire") else []
    where = result.get("codec_device", "cpu")
    lines += ["", f"Codec on {'one core' if where == 'cpu' else where}, {result['codec'][0]['elements']:,} fp32 "
              f"elements, MB/s of fp32 input, median [min–max] of {result['repeats']}, by the process's CPU time "
              f"(on a GPU: wall time) and by wall time:", "",
              "| wire | encode + feedback (CPU) | decode (CPU) | encode + feedback (wall) | decode (wall) |",
              "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['wire']} | {_span(r['encode_MBps'])} | {_span(r['decode_MBps'])} | "
              f"{_span(r.get('encode_wall_MBps', []))} | {_span(r.get('decode_wall_MBps', []))} |"
              for r in result["codec"]]  # fmt: skip
    if result.get("round_share"):
        lines += ["", "The codec's CPU seconds per round per rank (median MB/s) and their share of τ inner steps:", "",
                  "| P | link | Ψ | t_step | τ | wire | codec s/round | share of τ·t_step |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['nodes']} | {r['rate']} | {r['params']:,} | {r['t_step']:.3f} s | {r['tau']} | "
                  f"{r['wire']} | {r['codec_s_per_round']:.3f} | {r['share_of_round']:.1%} |"
                  for r in result["round_share"]]  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    if a.quality:
        from scripts import wire_quality

        throughput = json.loads(Path(a.throughput).read_text()) if a.throughput else None
        return wire_quality.summarise(Path(a.quality), Path(a.baseline) if a.baseline else None, throughput)
    result = {"command": " ".join(["python -m scripts.bench_wire", *(argv or sys.argv[1:])]), "params": a.params,
              "repeats": a.repeats, "host": {"cores": os.cpu_count(), "load": os.getloadavg()}}  # fmt: skip
    if not a.codec_only:
        result["wire"] = measure_wire(a)
    result["codec_device"], result["codec"] = a.codec_device, codec_cost(a.codec_elements, a.repeats, a.codec_device)
    if a.codec_device != "cpu":
        result["host"]["device_name"] = torch.cuda.get_device_name()
    result["host"]["load_after"] = os.getloadavg()
    if a.throughput:
        result["round_share"] = round_share(result["codec"], json.loads(Path(a.throughput).read_text())["cells"], a.tau)
    out, stem = Path(a.out_dir), "codec" if a.codec_only else "wire"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"{stem}.md").write_text(f"`{result['command']}`\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(Path(__file__).name, main))
