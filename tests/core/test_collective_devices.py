"""Every collective the library and the scripts issue has its tensors on its group's device (NCCL rule).

Under NCCL a collective takes tensors on the rank's CUDA device only; a small tensor made without
`device=` (a flag, a norm, a timing) sits on the default device, the CPU, and fails there ("No backend
type associated with device type cpu"). On a CPU machine with gloo the default device and the
collective device are both the CPU, so such a bug is invisible to every other test. This test makes it
visible, on CPU, by simulating a rank whose default device is not its groups' device:

- every tensor a torch factory function creates without a device (`torch.tensor`, `zeros`, `ones`,
  `empty`, `full`, `arange`, `rand*`, `frombuffer`, ...) is tagged as "on the default device"; an
  explicit `.to(device)` removes the tag (on a GPU it would move the tensor);
- every torch.distributed collective (all_reduce, broadcast, reduce, all_gather and its tensor forms,
  reduce_scatter and its tensor forms, gather, scatter, all_to_all*, send/recv; barrier needs no
  tensor) is wrapped: each tensor it gets must be untagged and on `collective_device(group)`, the
  library's one placement helper (which also reads the group's real backend).

Tensors derived from the partition or the model inherit its device and are untagged: the simulation
catches tensors created without a device (the failure mode of the `_all_ok` flag that issue 10 found),
not a partition on the wrong device (co2_zero refuses that when the engine is built). A tensor created
with an explicit `device="cpu"` passes too: the rule for those is "use `collective_device`", which review
has to enforce. The wrapper records a violation and still runs the collective, so no rank is left
waiting; the test asserts there are none, and a deliberate violation in the same run (the canary)
proves the wrapper is live. Two gloo ranks run the plain `CO2Optimizer` (start-up agreement, common
start, round ends with both collective strategies and bf16 on the wire, module-buffer averaging,
non-finite flags, checkpoint save/load, finalize), the DeepSpeed integration (round ends, its checkpoint
save/load and their agreement flags), and the tau tuner's measurements.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import traceback
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.dist_utils import run_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the children

FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn",
    "randint", "randperm", "scalar_tensor", "empty_strided", "frombuffer", "from_numpy",
)  # fmt: skip
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv",
)  # fmt: skip
OURS = ("co2_zero", "scripts")  # frames of these trees name the caller of a collective
CANARY = "canary"


class CollectiveChecker:
    """Tags tensors made without a device; checks the tensors of every collective (see module docstring)."""

    def __init__(self) -> None:
        self._tagged: dict[int, weakref.ref] = {}
        self._local = threading.local()
        self.violations: list[dict] = []
        self.checked: list[dict] = []

    # ---- tagging ---------------------------------------------------------------------------------------

    def _tag(self, t: torch.Tensor) -> None:
        key = id(t)
        self._tagged[key] = weakref.ref(t, lambda _, k=key: self._tagged.pop(k, None))

    def is_tagged(self, t: torch.Tensor) -> bool:
        ref = self._tagged.get(id(t))
        return ref is not None and ref() is t

    def _factory(self, original):
        @functools.wraps(original)
        def make(*args, **kwargs):
            out = original(*args, **kwargs)
            from_tensor = bool(args) and isinstance(args[0], torch.Tensor)  # as_tensor(t) may return t itself
            if kwargs.get("device") is None and not from_tensor and isinstance(out, torch.Tensor):
                self._tag(out)
            return out

        return make

    def _to(self, original):
        @functools.wraps(original)
        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            first = args[0] if args else None
            if kwargs.get("device") is not None or isinstance(first, (str, torch.device, int, torch.Tensor)):
                self._tagged.pop(id(out), None)  # explicitly placed (on a GPU: moved)
            return out

        return to

    # ---- checking --------------------------------------------------------------------------------------

    def _collective(self, name: str, original):
        from co2_zero.core.topology import collective_device

        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            if getattr(self._local, "inside", False):  # e.g. all_gather_into_tensor -> all_gather_single
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            tensors = [
                t
                for value in bound.arguments.values()
                for t in (value if isinstance(value, (list, tuple)) else [value])
                if isinstance(t, torch.Tensor)
            ]
            expected = collective_device(group)
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if any(f"/{tree}/" in f.filename for tree in OURS)]
            record = {
                "op": name,
                "chain": [f.name for f in ours],
                "where": f"{ours[-1].filename}:{ours[-1].lineno}" if ours else f"{stack[-1].filename}",
                "ranks": dist.get_process_group_ranks(group) if group is not None else "default group",
                "expected": str(expected),
                "devices": [str(t.device) for t in tensors],
                "untagged": [not self.is_tagged(t) for t in tensors],
                "canary": getattr(self._local, "canary", False),
            }
            self.checked.append(record)
            if not all(record["untagged"]) or any(t.device != expected for t in tensors):
                self.violations.append(record)
            self._local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._local.inside = False

        return collective

    # ---- installation ----------------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the factories, Tensor.to and the collectives, including references bound at import."""
        import sys

        import torch.distributed.distributed_c10d as c10d

        for name in FACTORIES:
            if hasattr(torch, name):
                setattr(torch, name, self._factory(getattr(torch, name)))
        torch.Tensor.to = self._to(torch.Tensor.to)
        originals = {}
        for name in COLLECTIVES:
            if hasattr(c10d, name):
                originals[name] = getattr(c10d, name)
                wrapped = self._collective(name, originals[name])
                setattr(c10d, name, wrapped)
                if hasattr(dist, name):
                    setattr(dist, name, wrapped)
        by_original = {id(fn): getattr(c10d, name) for name, fn in originals.items()}
        for module_name, module in list(sys.modules.items()):  # e.g. co2_zero.core.comm's _reduce_scatter
            if module_name.startswith(OURS) and module is not None:
                for attribute, value in list(vars(module).items()):
                    if id(value) in by_original:
                        setattr(module, attribute, by_original[id(value)])

    def canary(self):
        checker = self

        class Canary:
            def __enter__(self):
                checker._local.canary = True

            def __exit__(self, *exc):
                checker._local.canary = False

        return Canary()


# ---- the children ----------------------------------------------------------------------------------------


def _train_plain(rank: int, config: dict, steps: int, nan_at: int | None = None):
    from co2_zero import CO2Optimizer

    model = models.make_model("bn").to("cpu")
    opt = CO2Optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), config, model=model)
    for step in range(steps):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        if step == nan_at and rank == 1:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        opt.step()
    return model, opt


def _plain_path(rank: int, directory: str) -> dict:
    from co2_zero import NonFiniteError, checkpoint

    out = {}
    # overlap, reduce-scatter, module buffers (BatchNorm), a checkpoint taken with an exchange in flight
    model, opt = _train_plain(rank, {"tau": 2, "collective": "reduce_scatter"}, steps=5)
    checkpoint.save(directory, model, opt)
    checkpoint.load(directory, model, opt)
    for step in range(5, 7):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
    opt.finalize()
    # blocking, one all-reduce, bf16 on the wire
    _, opt = _train_plain(rank, {"tau": 2, "overlap": False, "collective": "all_reduce", "comm_dtype": "bf16"}, 4)
    opt.finalize()
    # a NaN in replica 1's displacement: the non-finite flags are all-reduced, every rank raises
    try:
        _train_plain(rank, {"tau": 1, "overlap": False, "nonfinite": "raise"}, steps=2, nan_at=0)
        out["nonfinite"] = "not raised"
    except NonFiniteError as error:
        out["nonfinite"] = str(error)
    return out


def _deepspeed_path(rank: int, directory: str) -> dict:
    import json

    from co2_zero.deepspeed import initialize, load_checkpoint

    config = json.loads((Path(__file__).resolve().parents[2] / "configs" / "ds_zero1_co2.json").read_text())
    config["co2"].update(tau=2, shards_per_replica=1)
    model = models.make_model("bn").to("cpu")
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(3):
        x, y = models.batch(rank, step)
        engine.backward(models.loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(directory)
    engine.load_checkpoint(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nothing = load_checkpoint(engine, os.path.join(directory, "nowhere"))  # the "no latest file" flag
    opt.finalize()
    return {"nothing": nothing}


def _tuner(rank: int) -> dict:
    from co2_zero import CO2Config
    from co2_zero.train import tune_measure, tune_tau

    tune_tau.measure_exchange_time(1000, CO2Config(collective="reduce_scatter"), reps=1)
    tune_tau.measure_exchange_time(1000, CO2Config(collective="all_reduce", comm_dtype="bf16"), reps=1)
    tune_tau.measure_exchange_time(
        1000, CO2Config(collective="reduce_scatter", comm_dtype="int8", stand_in="shared"), reps=1
    )
    sparse = tune_tau.measure_exchange_time(1000, CO2Config(topk=0.05, comm_dtype="int2"), reps=1)
    return {"slowest": tune_measure.slowest_rank(float(rank)), "sparse": (sparse["collective"], sparse["topk"])}


def run_all(rank: int, world: int, directory: str) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    checker = CollectiveChecker()
    checker.install()
    from co2_zero.core.topology import collective_device

    with checker.canary():  # what the wrapper must catch, and what it must let through
        dist.all_reduce(torch.zeros(1))
        dist.all_reduce(torch.zeros(1).to(collective_device()))
        dist.all_reduce(torch.zeros(1, device=collective_device()))
    out = {
        "plain": _plain_path(rank, os.path.join(directory, "plain")),
        "deepspeed": _deepspeed_path(rank, os.path.join(directory, "deepspeed")),
        "tuner": _tuner(rank),
    }
    out["violations"] = [v for v in checker.violations if not v["canary"]]
    out["canary_violations"] = [v for v in checker.violations if v["canary"]]
    out["checked"] = [v for v in checker.checked if not v["canary"]]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    pytest.importorskip("deepspeed")
    return run_ranks(run_all, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_the_checker_catches_a_tensor_made_without_a_device(results):
    for got in results:
        assert [v["op"] for v in got["canary_violations"]] == ["all_reduce"], got["canary_violations"]
        assert got["canary_violations"][0]["untagged"] == [False]


def _describe(v: dict) -> str:
    return (
        f"{v['op']} at {v['where']} (via {' > '.join(v['chain'])}) on {v['ranks']}: devices {v['devices']}, "
        f"expected {v['expected']}, made with a device: {v['untagged']}"
    )


def test_every_collective_has_its_tensors_on_its_groups_device(results):
    for rank, got in enumerate(results):
        lines = [_describe(v) for v in got["violations"]]
        assert not lines, f"rank {rank}:\n" + "\n".join(lines)


def test_the_run_went_through_every_collective_of_the_library_and_the_tuner(results):
    """The paths above really issued the collectives this test is about (else it would check nothing)."""
    expected = {
        "gather_fingerprints",  # start-up agreement
        "common_start",  # every replica from replica 0 (co2_zero.core.startup)
        "_average",  # the displacement: reduce-scatter and all-reduce
        "_average_sparse",  # the sparse exchange's all-gather (the tuner's topk run)
        "_pipeline",  # all-gather of the new start point
        "_sum_across_ranks",  # per-tensor norms of the outer step
        "_non_finite",  # the non-finite flags
        "_average_buffers",  # module buffers
        "exchange",  # the checkpoint agreements (co2_zero.checkpoint, DeepSpeed's included)
        "measure_exchange_time",  # the tuner
        "slowest_rank",
    }
    for got in results:
        seen = {name for v in got["checked"] for name in v["chain"]}
        assert expected <= seen, sorted(expected - seen)
        assert "replica(s) [1]" in got["plain"]["nonfinite"], got["plain"]["nonfinite"]
        assert got["deepspeed"]["nothing"] == (None, {})
        assert got["tuner"]["sparse"] == ("all_gather", 0.05)  # the tuner times the format's own exchange


# ---- where the CO2 state lives (no processes: the NCCL case is simulated) --------------------------------


def _nccl_rank(monkeypatch) -> None:
    import co2_zero.core.startup as startup

    monkeypatch.setattr(startup, "collective_device", lambda group=None: torch.device("cuda", 3))
    monkeypatch.setattr(startup.dist, "get_backend", lambda group=None: "nccl")


def test_an_empty_partition_keeps_its_state_on_the_collective_device(monkeypatch):
    from types import SimpleNamespace

    from co2_zero.core.partition import Partition
    from co2_zero.core.startup import state_device

    _nccl_rank(monkeypatch)
    empty = Partition(chunks=[], segments=[], num_tensors=1, signature="s")
    assert state_device(empty, SimpleNamespace(outer_group=None)) == torch.device("cuda", 3)


def test_a_partition_off_the_nccl_device_is_refused_naming_both(monkeypatch):
    from types import SimpleNamespace

    from co2_zero import CO2Error
    from co2_zero.core.partition import Partition
    from co2_zero.core.startup import state_device

    _nccl_rank(monkeypatch)
    on_cpu = Partition(chunks=[torch.zeros(4)], segments=[], num_tensors=1, signature="s")  # e.g. CPU offload
    with pytest.raises(CO2Error, match=r"partition is on cpu.*nccl.*cuda:3.*CPU offload"):
        state_device(on_cpu, SimpleNamespace(outer_group=None))
