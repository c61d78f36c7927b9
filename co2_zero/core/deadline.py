"""Every collective with a deadline: the library's own, and those its tools issue on the default group.

A collective is started asynchronously and waited for within `timeout_s`; when it fails (a peer died:
at once, its connection closed; or the deadline passed) it raises `collective_error`'s CO2Error naming
what it was, the group's ranks and the ranks this one waited for, never a bare backend error.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Callable, Union

import torch
import torch.distributed as dist

from .errors import collective_error


def wait_within(start: Callable[[], Any], what: str, timeout_s: float) -> None:
    """Start a collective (`start` returns its async work) and wait for it within `timeout_s`; the
    CO2Error (`collective_error`, whose message starts with `what`) when it fails."""
    try:
        start().wait(timeout=timedelta(seconds=timeout_s))
    except Exception as error:
        raise collective_error(what, error, timeout_s) from error


def on_default_group(what: str) -> str:
    """`what`, with the default group's ranks and those this rank waits for (a lost one is among them)."""
    ranks, me = list(range(dist.get_world_size())), dist.get_rank()
    others = [r for r in ranks if r != me]
    peers = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
    return f"{what} on the default group (global ranks {ranks}), where rank {me} waited for {peers},"


def all_reduce(
    tensor: torch.Tensor, what: str, timeout_s: float, op: Union[dist.ReduceOp, Any] = dist.ReduceOp.SUM
) -> None:
    """Reduce `tensor` over the default group in place (a sum unless `op` says otherwise), within `timeout_s`."""
    wait_within(lambda: dist.all_reduce(tensor, op=op, async_op=True), on_default_group(what), timeout_s)


def broadcast_object(obj: Any, src: int, what: str, timeout_s: float, device: torch.device) -> Any:
    """Rank `src`'s picklable `obj` on every rank of the default group, within `timeout_s` (its size, then
    its bytes: `broadcast_object_list` has no asynchronous form to wait on)."""
    what = on_default_group(what)
    payload = pickle.dumps(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    wait_within(lambda: dist.broadcast(size, src, async_op=True), what, timeout_s)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    wait_within(lambda: dist.broadcast(data, src, async_op=True), what, timeout_s)
    return obj if dist.get_rank() == src else pickle.loads(data.cpu().numpy().tobytes())


def barrier(what: str, timeout_s: float, device: torch.device) -> None:
    """Every rank of the default group got here, within `timeout_s` (NCCL's barrier needs the rank's GPU)."""
    ids = [device.index] if dist.get_backend() == "nccl" else None
    wait_within(lambda: dist.barrier(async_op=True, device_ids=ids), on_default_group(what), timeout_s)
