"""CO2 on DeepSpeed ZeRO stages 1 and 2 (docs/design.md §6.3).

A DeepSpeed user adds a `"co2": {...}` section to the JSON config and calls
`co2_zero.deepspeed.initialize(...)` where they called `deepspeed.initialize(...)`. This module:

- validates the section with `CO2Config` (DeepSpeed ignores unknown top-level keys, so a typo inside
  `co2` is only caught here) and refuses stages 0 and 3;
- builds the R x S topology and hands DeepSpeed a `ReplicaMPU` whose data-parallel group is the
  replica, so ZeRO shards the inner optimizer over the S ranks of a replica only;
- re-classes the ZeRO optimizer DeepSpeed built as `CO2ZeroOptimizer`: its `step()` is DeepSpeed's
  step followed, on every applied step, by the round bookkeeping on `single_partition_of_fp32_groups`
  (the fp32 master partition); a round end rewrites that partition and refreshes the low-precision
  parameters with DeepSpeed's own `update_lp_params` (copy + all-gather inside the replica);
- provides `save_checkpoint` / `load_checkpoint`, per-rank and atomic, because DeepSpeed's own file
  names collide when each replica is a separate ZeRO group.

What this module does only because of DeepSpeed 0.19.8's behaviour (the JIT build of an inference-only
comm op, the gradient-clipping default of 1.0, the module-global mpu) is in one section, "DeepSpeed 0.19.8
behaviours we work around", each entry naming the upstream behaviour and when to delete it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import types
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist

from .errors import CO2Error, missing_extra

try:
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("DeepSpeed", "deepspeed", error) from error

from . import checkpoint
from .agreement import identify
from .config import CO2Config
from .outer import Segment
from .sync import CO2Steps, Partition, RoundEngine, parameter_signature
from .topology import Topology, gather_fingerprints

__all__ = [
    "CO2ZeroOptimizer",
    "ReplicaMPU",
    "init_distributed",
    "initialize",
    "load_checkpoint",
    "patch",
    "save_checkpoint",
    "split_config",
    "unpatch",
    "zero_partition",
]

ConfigLike = Union[str, os.PathLike, Mapping[str, Any]]


# ---- configuration --------------------------------------------------------------------------------------


def _load_ds_config(config: ConfigLike) -> dict[str, Any]:
    """A DeepSpeed config (dict, path or base64 string, as DeepSpeed accepts it) as a fresh dict."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return dict(load_ds_config(os.fspath(config)))


def _config_source(config: ConfigLike) -> str:
    """How an error names the config it read: the file, or the kind of object."""
    if isinstance(config, Mapping):
        return "the DeepSpeed config dict"
    if os.path.isfile(config):
        return f"the DeepSpeed config {os.fspath(config)!r}"
    return "the DeepSpeed config string"


def _within_one_edit(word: str, target: str) -> bool:
    """Whether one insertion, deletion, substitution or swap of neighbours (or none) turns word into target."""
    if len(word) == len(target):
        diffs = [i for i, (a, b) in enumerate(zip(word, target)) if a != b]
        if len(diffs) <= 1:
            return True
        i, j = diffs[0], diffs[-1]
        return len(diffs) == 2 and j == i + 1 and word[i] == target[j] and word[j] == target[i]
    short, long = sorted((word, target), key=len)
    return len(long) == len(short) + 1 and any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _is_near_co2(key: Any) -> bool:
    """Whether a top-level config key other than "co2" is a misspelling of it: ignoring case, '_', '-' and
    spaces, and reading a zero as the letter O, it keeps the 2 and is one typo from "co2" ("CO2", "co_2",
    "Co-2", "c02", "c2o"). No DeepSpeed 0.19.8 config key comes within two edits of "co2" ("comm" is the
    nearest), so none is flagged."""
    if not isinstance(key, str) or key == "co2":
        return False
    word = "".join(c for c in key.lower() if c not in "_- ").replace("0", "o")
    return "2" in word and _within_one_edit(word, "co2")


def _refuse_misspelt_section(ds_config: Mapping[str, Any], source: str) -> None:
    """A misspelt `co2` section ("CO2", "co_2") would be ignored by DeepSpeed, and the run would train
    plain ZeRO without a word until `finalize()` is missing at the end: refuse it, naming the key."""
    for key in ds_config:
        if _is_near_co2(key):
            raise ValueError(
                f"co2 config: top-level key {key!r} in {source} is invalid; accepted: 'co2' (exactly: lower "
                f"case, no separator). DeepSpeed ignores unknown top-level keys, so with {key!r} this run "
                f"would train plain DeepSpeed, not CO2"
            )


def split_config(config: ConfigLike) -> tuple[dict[str, Any], Optional[CO2Config]]:
    """Split a DeepSpeed config into (the config without `co2`, the validated CO2Config or None).

    Raises ValueError naming the field for a bad `co2` section, for a top-level key that is a near miss
    of `co2` ("CO2", "co_2", "c02"; see `_is_near_co2`), and for a ZeRO stage other than 1 or 2 when a
    `co2` section is present. Needs no process group: scripts can call it to fail early.

    Args:
        config: a DeepSpeed config as a dict or a path to its JSON file.

    Returns:
        `(config without "co2", CO2Config or None)`.

    Raises:
        ValueError: the `co2` section is invalid (naming the field, the value and what is accepted), a
            top-level key is a near miss of `co2`, or `zero_optimization.stage` is not 1 or 2 while a
            `co2` section is present.
    """
    ds_config = _load_ds_config(config)
    _refuse_misspelt_section(ds_config, _config_source(config))
    section = ds_config.pop("co2", None)
    if section is None:
        return ds_config, None
    co2 = CO2Config.from_dict(section)
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage not in (1, 2):
        raise ValueError(
            f"co2 config: zero_optimization.stage={stage!r} is invalid with a co2 section; accepted: 1 or 2. "
            f"CO2 needs each rank's fp32 master partition (ZeRO-1/2); stage 0 has no partition and ZeRO-3 "
            f"partitions the parameters themselves, which CO2 does not support"
        )
    return ds_config, co2


def _per_replica_batch(ds_config: dict[str, Any], topology: Topology) -> None:
    """`train_batch_size` in the JSON is global (all N ranks), as in plain DeepSpeed; DeepSpeed sees one
    replica (its data-parallel world is S), so give it the replica's share."""
    total = ds_config.get("train_batch_size")
    if total is None:
        return
    if isinstance(total, bool) or not isinstance(total, int) or total % topology.replicas:
        raise ValueError(
            f"co2 config: train_batch_size={total!r} is invalid; accepted: a multiple of the number of "
            f"replicas R={topology.replicas} (it counts samples per optimizer step over all "
            f"{topology.world_size} ranks)"
        )
    ds_config["train_batch_size"] = total // topology.replicas


# ---- DeepSpeed's view of the topology --------------------------------------------------------------------


class ReplicaMPU:
    """DeepSpeed's "model parallel unit" for CO2: data parallelism is this rank's replica (the inner
    group), there is no model parallelism (a group of this rank alone)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._solo: Any = None

    def get_data_parallel_group(self) -> Any:
        return self.topology.inner_group

    def get_data_parallel_rank(self) -> int:
        return self.topology.shard_index

    def get_data_parallel_world_size(self) -> int:
        return self.topology.shards

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.topology.inner_ranks)

    def get_model_parallel_group(self) -> Any:
        # A real one-rank group, not None: deepspeed.comm reads group=None as the world group.
        # Local synchronisation: only this rank takes part in creating it.
        if self._solo is None:
            self._solo = dist.new_group([self.topology.rank], use_local_synchronization=True)
        return self._solo

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


# ---- the partition --------------------------------------------------------------------------------------


def zero_partition(zero: DeepSpeedZeroOptimizer, module: Optional[torch.nn.Module] = None) -> Partition:
    """This rank's fp32 master partition in a ZeRO-1/2 optimizer, mapped to global parameter tensors.

    Chunk i is `single_partition_of_fp32_groups[i]`: elements [p*size, (p+1)*size) of param group i's
    flat buffer, p = this rank's index in the replica. The flat buffer holds the group's tensors in
    `round_robin_bit16_groups` order at `round_robin_bit16_offsets` (alignment padding between and
    after them belongs to no tensor and gets no segment). Tensor ids count `bit16_groups` in order, the
    same on every rank. The result is checked against DeepSpeed's own `params_in_partition`. `module`
    names the tensors for the start-up check (DeepSpeed keeps the layout of the user's param groups,
    so ranks that list them in different orders are refused there, naming the parameters).
    """
    tensor_ids: dict[int, int] = {}
    params: list[torch.Tensor] = []
    for group in zero.bit16_groups:
        for p in group:
            tensor_ids[id(p)] = len(tensor_ids)
            params.append(p)
    shapes = [p.shape for p in params]
    segments: list[Segment] = []
    base = 0
    for i, chunk in enumerate(zero.single_partition_of_fp32_groups):
        size = int(zero.partition_size[i])
        index = dist.get_rank(group=zero.real_dp_process_group[i])
        if chunk.numel() != size:
            raise CO2Error(
                f"co2: ZeRO param group {i}: fp32 partition has {chunk.numel()} elements but partition_size "
                f"is {size}; this DeepSpeed version's layout is not supported"
            )
        lo, hi = index * size, (index + 1) * size
        tensors = zero.round_robin_bit16_groups[i]
        # Shapes and offsets from DeepSpeed's bookkeeping (offload may swap p.data for an empty tensor);
        # older versions without per-tensor padding have neither: the tensors are then back to back.
        metas = getattr(zero, "round_robin_bit16_meta", None)
        numels = [m.numel() for m in (metas[i] if metas is not None else tensors)]
        offsets = getattr(zero, "round_robin_bit16_offsets", None)
        offsets = offsets[i] if offsets is not None else [sum(numels[:k]) for k in range(len(numels))]
        owned = []
        for tensor, offset, numel in zip(tensors, offsets, numels):
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                segments.append(Segment(tensor_ids[id(tensor)], base + start - lo, base + end - lo, start - offset))
                owned.append(id(tensor))
        expected = [id(t) for t in zero.params_in_partition[i] if t.numel() > 0]
        if owned != expected:
            raise CO2Error(
                f"co2: ZeRO param group {i}: the tensors found in this rank's partition do not match "
                f"DeepSpeed's params_in_partition; this DeepSpeed version's layout is not supported"
            )
        base += size
    return Partition(
        chunks=list(zero.single_partition_of_fp32_groups),
        segments=segments,
        num_tensors=len(tensor_ids),
        signature=parameter_signature(shapes),
        tensors=identify(params, module),
    )


# ---- the optimizer --------------------------------------------------------------------------------------


class CO2ZeroOptimizer(CO2Steps, DeepSpeedZeroOptimizer):
    """DeepSpeed's ZeRO-1/2 optimizer whose `step()` also ends a CO2 round every `tau` applied steps.

    Made by `initialize` from the optimizer DeepSpeed built (see `attach`); it adds methods and the
    CO2 state, nothing of DeepSpeed's changes. `finalize()` as in `CO2Optimizer`.
    """

    engine: RoundEngine  # the round state machine (as in CO2Optimizer and CO2OSS)
    config: CO2Config
    topology: Topology

    @classmethod
    def attach(
        cls, zero: DeepSpeedZeroOptimizer, config: CO2Config, topology: Topology, module: torch.nn.Module
    ) -> CO2ZeroOptimizer:
        """Turn the ZeRO optimizer DeepSpeed built into a CO2ZeroOptimizer, in place.

        DeepSpeedEngine constructs its ZeRO optimizer itself (some forty arguments); re-classing the
        finished object avoids patching DeepSpeed's module globals during construction.
        """
        if type(zero) is not DeepSpeedZeroOptimizer:
            raise ValueError(
                f"co2: DeepSpeed built a {type(zero).__name__} optimizer; a co2 section needs its ZeRO stage "
                f"1/2 optimizer (DeepSpeedZeroOptimizer). ZenFlow, and bf16 with ZeRO-1 and "
                f"data_types.grad_accum_dtype=fp32 (DeepSpeed's BF16_Optimizer), are not supported"
            )
        if zero.has_moe_layers:
            raise ValueError("co2: mixture-of-experts layers (expert-parallel ZeRO groups) are not supported")
        if zero.master_weights_and_grads_dtype != torch.float32:
            raise ValueError(
                f"co2: the ZeRO master weights are {zero.master_weights_and_grads_dtype}; CO2 needs fp32 "
                f"masters (leave fp16/bf16_master_weights_and_grads off)"
            )
        zero.__class__ = cls
        zero._co2_attach(config, topology, module)
        return zero

    def _co2_attach(self, config: CO2Config, topology: Topology, module: torch.nn.Module) -> None:
        partition = zero_partition(self, module)
        self.config = config
        self.topology = topology
        self.engine = RoundEngine(partition, config, topology, refresh=self.update_lp_params, module=module)

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's step; then, if it was applied (not skipped on fp16 overflow), count it for CO2."""
        super().step(closure)
        self._count_step(applied=not self.overflow)


# ==== DeepSpeed 0.19.8 behaviours we work around ==========================================================
#
# Everything this module does only because of how DeepSpeed 0.19.8 behaves lives here, one function per
# upstream behaviour, each saying what upstream does and when to delete it. `initialize` applies all of
# them, with a `co2` section and without one (plain DeepSpeed through our `initialize`).
# tests/test_deepspeed_upstream.py pins each behaviour on plain DeepSpeed: when one of its tests turns
# red (an expected failure that passes, or a pinned behaviour that changed), revisit the entry here.


def _explicit_gradient_clipping(ds_config: dict[str, Any]) -> None:
    """An absent `gradient_clipping` means no clipping, as it did in DeepSpeed before its PR #8068.

    Upstream: deepspeedai/DeepSpeed PR #8068 ("Default gradient_clipping to 1.0", in the pinned 0.19.8) changed
    `GRADIENT_CLIPPING_DEFAULT` in deepspeed/runtime/constants.py from 0.0 to 1.0. A config without the
    key then clips the global gradient norm at 1.0 in `DeepSpeedZeroOptimizer.unscale_and_clip_grads`
    (stage_1_and_2.py), silently: the optimizer receives g * min(1, 1/(|g| + 1e-6)) wherever |g| > 1.
    The same JSON file trains differently on DeepSpeed before and after that change, so co2_zero reads
    an absent key as 0.0 (DeepSpeed's own "off": `unscale_and_clip_grads` then returns at once with
    the unscaled fp32 gradient) and warns. An explicit value, including 1.0, is passed on untouched.
    Delete when DeepSpeed's default is 0.0 again (then this already does nothing), or if co2_zero decides
    to follow DeepSpeed's default instead.
    """
    from deepspeed.runtime.constants import GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT

    if GRADIENT_CLIPPING in ds_config or GRADIENT_CLIPPING_DEFAULT == 0.0:
        return
    warnings.warn(
        f"co2: the DeepSpeed config has no gradient_clipping; DeepSpeed {deepspeed.__version__} would clip "
        f"the gradient norm at {GRADIENT_CLIPPING_DEFAULT} by default (its PR #8068), co2_zero.deepspeed."
        f"initialize does not clip (gradient_clipping=0.0). Set gradient_clipping explicitly to choose",
        stacklevel=3,
    )
    ds_config[GRADIENT_CLIPPING] = 0.0


@contextlib.contextmanager
def _without_shm_comm_build() -> Iterator[None]:
    """DeepSpeed's comm backend without its JIT-built shared-memory op.

    Upstream: `deepspeed.comm.torch.TorchBackend.__init__` calls `build_shm_op()`, which JIT-compiles
    a shared-memory all-reduce kernel (36 s measured, 40-85 s on 2 CPU cores) that only
    `inference_all_reduce` (tensor-parallel inference) uses. Skipped while the backend is created.
    Delete when DeepSpeed builds the op lazily, on first use.
    """
    # importlib: the attribute deepspeed.comm.torch is the torch package, not the submodule.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _forget_replica_mpu() -> None:
    """Clear a CO2 engine's mpu from DeepSpeed's module global before a plain engine is built.

    Upstream: `deepspeed.initialize` stores the mpu in `deepspeed.utils.groups.mpu` and an engine built
    without one reads that global, so a plain engine after a CO2 one would shard over a replica.
    Applied by `initialize` and by a patched `deepspeed.initialize`; an unpatched `deepspeed.initialize`
    is DeepSpeed's own code, which co2_zero does not touch (the CO2 engine still reads the global, so it
    cannot be cleared when that engine is built). Delete when DeepSpeed keeps the mpu per engine.
    """
    from deepspeed.utils import groups

    if isinstance(groups.mpu, ReplicaMPU):
        groups.mpu = None


# ==== end of the DeepSpeed 0.19.8 workarounds ==============================================================


# ---- initialize -----------------------------------------------------------------------------------------


def init_distributed(**kwargs: Any) -> None:
    """`deepspeed.init_distributed(**kwargs)` without its JIT build (see `_without_shm_comm_build`).

    For scripts that need the process group before `initialize` (to read the rank): call this instead
    of `deepspeed.init_distributed`. Joins a process group the script created itself, or starts one from
    the launcher's environment; the backend defaults to the accelerator's (gloo on CPU).

    Args:
        **kwargs: `deepspeed.init_distributed`'s keywords.
    """
    from deepspeed.accelerator import get_accelerator

    kwargs.setdefault("dist_backend", get_accelerator().communication_backend_name())
    with _without_shm_comm_build():
        deepspeed.init_distributed(**kwargs)


def _floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a forward's arguments (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _floating_tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _floating_tensors(item)


def _warn_uncast_inputs(engine: Any) -> None:
    """Warn once, at the first forward, when a bf16/fp16 engine gets inputs of another floating dtype.

    DeepSpeed turns the model's parameters to bf16 (or fp16) but casts no inputs (its `fp16.auto_cast`
    exists for fp16 only), so fp32 inputs fail in the first matmul with torch's bare "mat1 and mat2 must
    have the same dtype" (the shipped configs/ds_zero2_co2_bf16.json enables bf16). The warning comes
    first and names the cast; the hook removes itself after the first forward and costs nothing after.
    """
    dtype = next((p.dtype for p in engine.module.parameters() if p.is_floating_point()), None)
    if dtype not in (torch.bfloat16, torch.float16):
        return

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        other = sorted({str(t.dtype) for t in _floating_tensors((args, kwargs)) if t.dtype != dtype})
        if other:
            warnings.warn(
                f"co2: the DeepSpeed engine's parameters are {dtype} (the config's bf16/fp16 section) but the "
                f"forward got {', '.join(other)} inputs, and DeepSpeed casts none: unless the model casts them "
                f"itself it fails with 'mat1 and mat2 must have the same dtype'. Cast floating inputs, e.g. "
                f"engine(x.to({dtype}))",
                stacklevel=3,
            )

    handle = engine.module.register_forward_pre_hook(check, with_kwargs=True)


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    config: Optional[ConfigLike] = None,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """`deepspeed.initialize` with CO2 when the config has a `"co2"` section.

    Same arguments and return value `(engine, optimizer, training_dataloader, lr_scheduler)`. The config
    may be given as `config` (dict or path), `config_params`, or `args.deepspeed_config`. With `co2`, the
    returned optimizer is a `CO2ZeroOptimizer` (call `finalize()` at the end), `train_batch_size` (if
    given) counts all ranks as in plain DeepSpeed, `training_data` is sampled over all ranks (each
    replica sees different data), and `engine.save_checkpoint` / `engine.load_checkpoint` are this
    module's per-rank versions. Without `co2`, it is plain DeepSpeed. Both ways the DeepSpeed 0.19.8
    workarounds apply: no inference-only JIT build, and an absent `gradient_clipping` means no clipping
    (DeepSpeed 0.19.8 would clip at 1.0; see `_explicit_gradient_clipping`).

    Args:
        args: as for `deepspeed.initialize` (`args.deepspeed_config` may name the config).
        model: the module.
        optimizer: as for `deepspeed.initialize`.
        model_parameters: the parameters to train.
        training_data: an optional dataset, sampled over all N ranks.
        lr_scheduler: as for `deepspeed.initialize`.
        config: the DeepSpeed config, a dict or a path to its JSON file.
        **kwargs: `deepspeed.initialize`'s other keywords (`config_params`, `dist_init_required`, ...).

    Returns:
        `(engine, optimizer, training_dataloader, lr_scheduler)`, as DeepSpeed returns them.

    Raises:
        ValueError: the `co2` section is invalid, the ZeRO stage is not 1 or 2, or a feature CO2 does not
            support is configured (ZeRO-3, an `mpu`, MoE, fp16/bf16 master weights, ...).
        CO2Error: the ranks disagree on the config, the grid or the model.
    """
    if config is None:
        config = kwargs.pop("config_params", None)
    else:
        kwargs.pop("config_params", None)
    for name in ("deepspeed_config", "deepscale_config"):
        path = getattr(args, name, None)
        if path is not None:
            if config is not None:
                raise ValueError(f"co2: the DeepSpeed config was given both as args.{name} and as config=")
            config, args = path, copy.copy(args)
            setattr(args, name, None)
    if config is None:
        raise ValueError("co2: no DeepSpeed config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    ds_config, co2 = split_config(config)
    _explicit_gradient_clipping(ds_config)

    init_distributed(**{k: kwargs[k] for k in ("distributed_port", "dist_init_required") if k in kwargs})
    if co2 is None:
        _forget_replica_mpu()
        return deepspeed.initialize(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            config=ds_config,
            **kwargs,
        )
    if kwargs.get("mpu") is not None or kwargs.get("mesh_param") is not None:
        raise ValueError("co2: mpu / mesh_param cannot be combined with a co2 section (no model parallelism)")
    kwargs.pop("mpu", None)
    topology = Topology.build(co2)
    _per_replica_batch(ds_config, topology)
    engine, zero, _, scheduler = deepspeed.initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=None,
        lr_scheduler=lr_scheduler,
        config=ds_config,
        mpu=ReplicaMPU(topology),
        **kwargs,
    )
    if zero is None:
        raise ValueError("co2: DeepSpeed built no optimizer: give an optimizer in the config or as optimizer=")
    zero = CO2ZeroOptimizer.attach(zero, co2, topology, engine.module)
    _warn_uncast_inputs(engine)
    if training_data is not None:  # the replica is DeepSpeed's data-parallel world; CO2 wants all ranks
        sampler = torch.utils.data.DistributedSampler(
            training_data, num_replicas=topology.world_size, rank=topology.rank
        )
        engine.training_dataloader = engine.deepspeed_io(
            training_data, data_sampler=sampler, collate_fn=kwargs.get("collate_fn")
        )
    engine.save_checkpoint = _bound(save_checkpoint, engine)
    engine.load_checkpoint = _bound(load_checkpoint, engine)
    return engine, zero, engine.training_dataloader, scheduler


def _bound(function: Any, engine: Any) -> Any:
    def method(*args: Any, **kwargs: Any) -> Any:
        return function(engine, *args, **kwargs)

    method.__doc__ = function.__doc__
    method.__name__ = function.__name__
    return method


# ---- checkpoints ----------------------------------------------------------------------------------------
# The files, the agreement, the marker and the validation are co2_zero.checkpoint's; DeepSpeed contributes
# only its own state (`ZeroCheckpointState`). DeepSpeed's own save_checkpoint names files after the rank
# inside the data-parallel group, so with one ZeRO group per replica every replica would write the same names.


def _co2_optimizer(engine: Any) -> CO2ZeroOptimizer:
    zero = getattr(engine, "optimizer", None)
    if not isinstance(zero, CO2ZeroOptimizer):
        raise ValueError("co2: this engine was not built by co2_zero.deepspeed.initialize with a co2 section")
    return zero


class ZeroCheckpointState:
    """DeepSpeed's part of a `co2_zero.checkpoint` file: the ZeRO state dict in its rigid form (this rank's
    fp32 partition and inner optimizer state, as plain data), the LR scheduler and the engine's step
    counters; the module's trainable parameters are restored from the fp32 partition, not saved."""

    integration = "deepspeed"

    def __init__(self, engine: Any) -> None:
        self.ds_engine, self.zero = engine, _co2_optimizer(engine)
        self.engine, self.module = self.zero.engine, engine.module

    def local_rows(self, value: torch.Tensor) -> None:
        """DeepSpeed's module holds every entry whole (ZeRO partitions only the optimizer's flat copy)."""
        return None

    def module_excluded(self) -> set[str]:
        trainable = {id(p) for group in self.zero.bit16_groups for p in group}
        return {name for name, p in self.module.named_parameters(remove_duplicate=False) if id(p) in trainable}

    def capture(self) -> dict[str, Any]:
        engine = self.ds_engine
        return {
            "zero": self._plain_zero_state(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "counters": {
                k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")
            },
        }

    def _plain_zero_state(self) -> dict[str, Any]:
        """DeepSpeed's rigid ZeRO state dict (loads alone, even with `elastic_checkpoint`), as plain data:
        the loss scaler as its attributes, the stage as an int, no universal-checkpoint mappings."""
        zero = self.zero
        elastic, zero.elastic_checkpoint = zero.elastic_checkpoint, False
        try:
            state = dict(zero.state_dict())
        finally:
            zero.elastic_checkpoint = elastic
        scaler = vars(zero.loss_scaler)
        state["loss_scaler"] = {k: v for k, v in scaler.items() if checkpoint.plain_data_problem(v) is None}
        state["zero_stage"] = int(state["zero_stage"])
        state.pop("param_slice_mappings", None)
        state.pop("universal_checkpoint_info", None)
        return state

    def check(self, saved: dict[str, Any]) -> None:
        zero_state = saved.get("zero") if isinstance(saved, dict) else None
        if not isinstance(zero_state, dict) or not isinstance(zero_state.get("single_partition_of_fp32_groups"), list):
            raise ValueError("the ZeRO state is missing")
        mine = [t.numel() for t in self.zero._get_groups_without_padding(self.zero.single_partition_of_fp32_groups)]
        theirs = [
            t.numel() if isinstance(t, torch.Tensor) else None for t in zero_state["single_partition_of_fp32_groups"]
        ]
        if mine != theirs:
            raise ValueError(f"the ZeRO fp32 partitions hold {theirs} elements in the file, {mine} here")
        if (saved.get("lr_scheduler") is None) != (self.ds_engine.lr_scheduler is None):
            raise ValueError("an LR scheduler is saved but none is configured here, or the reverse")

    def restore(self, saved: dict[str, Any]) -> None:
        zero = self.zero
        state = dict(saved["zero"])
        for key, value in state["loss_scaler"].items():
            setattr(zero.loss_scaler, key, value)
        state["loss_scaler"] = zero.loss_scaler
        states: list[Any] = [None] * zero.topology.shards
        states[zero.topology.shard_index] = state
        zero.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        zero.update_lp_params()  # the module's parameters from the restored fp32 masters
        self._restore_engine(saved)

    def after_reshard(self, saved: Optional[dict[str, Any]]) -> None:
        """The ZeRO inner state starts fresh (the partition changed); the schedule and counters carry on
        when the file came from DeepSpeed."""
        if saved is not None:
            self._restore_engine(saved)

    def _restore_engine(self, saved: dict[str, Any]) -> None:
        engine = self.ds_engine
        if engine.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        for key, value in saved["counters"].items():
            setattr(engine, key, value)


def save_checkpoint(
    engine: Any,
    save_dir: Union[str, os.PathLike],
    tag: Optional[str] = None,
    client_state: Optional[Mapping[str, Any]] = None,
    save_latest: bool = True,
) -> Path:
    """Save every rank's state as one complete checkpoint `save_dir/tag` (collective; see
    `co2_zero.checkpoint`). `tag` defaults to `global_step<N>`; `client_state` must be plain data. With
    `save_latest`, `save_dir/latest_co2` names it once it is complete. Call it after an `engine.step()`
    at a gradient accumulation boundary.

    Args:
        engine: the engine `initialize` returned.
        save_dir: the checkpoint root, on a file system every rank sees.
        tag: the checkpoint's directory name; defaults to `global_step<N>`.
        client_state: plain data saved with the checkpoint.
        save_latest: write `save_dir/latest_co2` once the checkpoint is complete.

    Returns:
        The checkpoint's directory.

    Raises:
        CO2Error: on every rank, when any rank failed; the previous state of a reused tag stays loadable."""
    # Accelerate sets the boundary itself and then calls engine.step() once per window: micro_steps counts
    # optimizer steps there, and the flag it set says whether the window is complete.
    boundary = engine._is_gradient_accumulation_boundary
    if (engine.micro_steps % engine.gradient_accumulation_steps()) if boundary is None else not boundary:
        raise ValueError(
            f"co2: save_checkpoint at micro step {engine.micro_steps} is inside a gradient accumulation "
            f"window of {engine.gradient_accumulation_steps()}; save right after an engine.step() that "
            f"stepped the optimizer"
        )
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    state = ZeroCheckpointState(engine)
    return checkpoint.save_checkpoint(
        save_dir, state, extra=dict(client_state or {}), tag=tag, write_latest=save_latest
    )


def load_checkpoint(
    engine: Any, load_dir: Union[str, os.PathLike], tag: Optional[str] = None, reshard: bool = False
) -> tuple[Optional[Path], dict[str, Any]]:
    """Load a complete checkpoint written by `save_checkpoint` (collective; see `co2_zero.checkpoint`).
    `tag` defaults to the one `load_dir/latest_co2` names, else the newest complete one. Returns
    (directory, client_state), like DeepSpeed's `load_checkpoint`; (None, {}) when there is none.
    `reshard=True` loads a checkpoint of another R x S or integration (training resumes at its last
    round start, the ZeRO inner state starts fresh). Training then continues exactly as if it had not
    stopped; a refused load raises CO2Error on every rank and changes nothing.

    Args:
        engine: the engine `initialize` returned.
        load_dir: the checkpoint root given to `save_checkpoint`.
        tag: load this checkpoint instead of the newest complete one.
        reshard: load a checkpoint of another R x S or integration.

    Returns:
        `(directory, client_state)`, or `(None, {})` when there is no complete checkpoint.

    Raises:
        CO2Error: on every rank, when any rank's file is missing, damaged or from another config or grid."""
    loaded = checkpoint.load_checkpoint(load_dir, ZeroCheckpointState(engine), tag=tag, reshard=reshard)
    if loaded is None:
        warnings.warn(f"co2: no complete checkpoint in {load_dir}; nothing loaded", stacklevel=2)
        return None, {}
    directory, client_state = loaded
    return directory, dict(client_state or {})


# ---- patching DeepSpeed's entry point --------------------------------------------------------------------
#
# Hugging Face Trainer and Accelerate (and Lightning) call `deepspeed.initialize` themselves, and DeepSpeed
# ignores unknown top-level config keys: without help a "co2" section would be dropped without a word.
# `patch()` routes DeepSpeed's `initialize` through `_dispatch`, which builds CO2 for a config with a co2
# section; `unpatch()` puts DeepSpeed's code back. Importing this module changes nothing in DeepSpeed.
# The routing replaces the *code* of DeepSpeed's function object, not the `deepspeed.initialize`
# attribute: Accelerate reads the attribute at call time, but a script that ran `from deepspeed import
# initialize` earlier holds the function object itself, and only changing the object reaches it. A copy
# of the original function is what every call without a co2 section runs, including the one co2_zero's
# own `initialize` makes (its config no longer has the section): the routing never recurses.


class _EntryPoint:
    """The routing of DeepSpeed's `initialize` in this process."""

    def __init__(self) -> None:
        self.plain: Optional[types.FunctionType] = None  # a copy of DeepSpeed's initialize as shipped, while patched
        self.signature: Optional[inspect.Signature] = None
        self.patched = False
        self.undo = contextlib.ExitStack()  # what patch() changed


_ENTRY = _EntryPoint()
_PLAIN_ATTRIBUTE = "__co2_zero_plain__"  # on DeepSpeed's function object while routed: its original
_ABSENT = object()


def _routed_initialize(*args: Any, **kwargs: Any) -> Any:
    # This code runs as DeepSpeed's own function object, with the deepspeed package's module globals:
    # only builtins and absolute imports are visible here.
    from co2_zero.deepspeed import _dispatch

    return _dispatch(args, kwargs)


def _plain_copy(function: types.FunctionType) -> types.FunctionType:
    """A new function object with `function`'s code, defaults and names (DeepSpeed's initialize as shipped)."""
    plain = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__)
    plain.__kwdefaults__ = function.__kwdefaults__
    for name in ("__doc__", "__qualname__", "__module__"):
        setattr(plain, name, getattr(function, name))
    return plain


@contextlib.contextmanager
def _routed_entry_point() -> Iterator[None]:
    """DeepSpeed's `initialize` function object runs `_dispatch` inside the block; on exit its original
    code object, defaults and attributes are back exactly. A routing left by an earlier copy of this module
    (removed from sys.modules while patched) is adopted: its original is on the function object."""
    function = deepspeed.initialize
    if not isinstance(function, types.FunctionType) or function.__closure__:
        raise CO2Error(
            f"co2: deepspeed.initialize is {function!r}, not DeepSpeed's function (replaced by another library?); "
            f"co2_zero cannot route it. Call co2_zero.deepspeed.initialize directly"
        )
    adopted = getattr(function, _PLAIN_ATTRIBUTE, None)
    plain = adopted or _plain_copy(function)
    wrapped = _ABSENT if adopted else function.__dict__.get("__wrapped__", _ABSENT)
    function.__code__ = _routed_initialize.__code__
    function.__defaults__ = function.__kwdefaults__ = None
    function.__wrapped__ = plain  # type: ignore[attr-defined]  # inspect.signature shows DeepSpeed's
    setattr(function, _PLAIN_ATTRIBUTE, plain)
    _ENTRY.plain, _ENTRY.signature = plain, inspect.signature(plain)
    try:
        yield
    finally:
        function.__code__, function.__defaults__ = plain.__code__, plain.__defaults__
        function.__kwdefaults__ = plain.__kwdefaults__
        delattr(function, _PLAIN_ATTRIBUTE)
        if wrapped is _ABSENT:
            del function.__wrapped__
        else:
            function.__wrapped__ = wrapped  # type: ignore[attr-defined]
        _ENTRY.plain = _ENTRY.signature = None


def _dispatch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DeepSpeed's `initialize(*args, **kwargs)` while patched: CO2 for a config with a co2 section,
    DeepSpeed as shipped otherwise; a misspelt section ("CO2") is refused."""
    plain = _ENTRY.plain
    try:
        arguments = _ENTRY.signature.bind(*args, **kwargs).arguments
    except TypeError:
        return plain(*args, **kwargs)  # DeepSpeed's own error for bad arguments
    if not _has_co2_section(arguments):
        if arguments.get("mpu") is None:
            _forget_replica_mpu()
        return plain(*args, **kwargs)
    return _initialize_for_framework(arguments)


def _has_co2_section(arguments: Mapping[str, Any]) -> bool:
    """Whether the DeepSpeed config among `initialize`'s arguments has a top-level "co2" key. Raises
    ValueError for a near miss of it ("CO2", "co_2"), which DeepSpeed would silently ignore."""
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None:
            config = getattr(arguments.get("args"), name, None)
    if config is None:
        return False
    try:
        ds_config = config if isinstance(config, Mapping) else _load_ds_config(config)
    except (OSError, ValueError, TypeError):  # unreadable: DeepSpeed reports it in its own words
        return False
    _refuse_misspelt_section(ds_config, _config_source(config))
    return "co2" in ds_config


def _initialize_for_framework(arguments: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """`initialize` for a framework that called `deepspeed.initialize`: the engine's checkpoint methods
    also take DeepSpeed's keyword arguments, which Trainer passes (`load_module_strict`, ...)."""
    engine, zero, loader, scheduler = initialize(**arguments)

    def save(
        save_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        client_state: Optional[Mapping[str, Any]] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Path:
        """`co2_zero.deepspeed.save_checkpoint` with DeepSpeed's signature. Frozen parameters are always
        kept (a CO2 checkpoint restores the module state it was saved with)."""
        return save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load(
        load_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[Optional[Path], dict[str, Any]]:
        """`co2_zero.deepspeed.load_checkpoint` with DeepSpeed's signature. Only a full load is possible,
        and a directory holding a plain DeepSpeed checkpoint (no CO2 state) is refused."""
        full = {
            "load_optimizer_states": True,
            "load_lr_scheduler_states": True,
            "load_module_only": False,
            "custom_load_fn": None,
        }
        given = dict(zip(full, (load_optimizer_states, load_lr_scheduler_states, load_module_only, custom_load_fn)))
        for name, value in given.items():
            if value != full[name]:
                raise ValueError(
                    f"co2: load_checkpoint({name}={value!r}) is not supported; accepted: {name}={full[name]!r}. A "
                    f"CO2 checkpoint restores the model, the inner optimizer, the LR scheduler and the CO2 state "
                    f"together; a partial load would continue CO2 from state that does not belong to it"
                )
        directory, client_state = load_checkpoint(engine, load_dir, tag)
        if directory is None and _seen_on_any_rank((Path(load_dir) / "latest").is_file(), zero):
            raise CO2Error(
                f"co2: {load_dir} holds a plain DeepSpeed checkpoint ('latest' but no '{checkpoint.LATEST}'): it has "
                f"no CO2 state, and resuming from it would silently restart CO2; refused"
            )
        return directory, client_state

    engine.save_checkpoint, engine.load_checkpoint = save, load
    return engine, zero, loader, scheduler


def _seen_on_any_rank(seen: bool, zero: CO2ZeroOptimizer) -> bool:
    """Whether any rank saw it (one fingerprint all-gather on the main-thread CO2 group, with a deadline)."""
    group, timeout_s = zero.topology.buffer_group, zero.config.timeout_s
    return any(row[0] for row in gather_fingerprints([int(seen)], group, timeout_s, "checkpoint directory check"))


class _Patch:
    """What `patch()` returns; as a context manager it restores the state before `patch()` on exit."""

    def __init__(self, was_patched: bool) -> None:
        self.was_patched = was_patched

    def __enter__(self) -> _Patch:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.was_patched:
            unpatch()


def patch() -> _Patch:
    """From now on, `deepspeed.initialize` builds CO2 when its config has a "co2" section.

    For frameworks that call `deepspeed.initialize` themselves (Hugging Face Trainer, Accelerate,
    Lightning): such a call then runs `co2_zero.deepspeed.initialize`, and the engine's
    `save_checkpoint` / `load_checkpoint` (with DeepSpeed's signature) write and read CO2's per-rank
    checkpoints. A config without a co2 section gets DeepSpeed as shipped; one with a misspelt section
    ("CO2", "co_2") is refused. It reaches callers that looked `deepspeed.initialize` up before or after
    this call: it rewrites the code of DeepSpeed's function object (importing co2_zero changes nothing in
    DeepSpeed; this call does). While patched, DeepSpeed's comm backend is also created without its
    inference-only shared-memory op (a JIT build of 40-85 s on CPU), whoever creates it: Accelerate calls
    `deepspeed.init_distributed` itself unless run with `cpu=True`.

    Idempotent. `unpatch()` undoes it; `with co2_zero.deepspeed.patch(): ...` undoes it on exit.

    Returns:
        A context manager whose exit calls `unpatch()`; ignoring it keeps the patch.
    """
    was_patched = _ENTRY.patched
    if not was_patched:
        with contextlib.ExitStack() as changes:  # all of them or none
            changes.enter_context(_routed_entry_point())
            changes.enter_context(_without_shm_comm_build())
            _ENTRY.undo = changes.pop_all()
        _ENTRY.patched = True
    return _Patch(was_patched)


def unpatch() -> None:
    """Undo `patch()`: `deepspeed.initialize` runs DeepSpeed's original code object again (a co2
    section is then ignored by DeepSpeed, without a word). Idempotent."""
    if _ENTRY.patched:
        _ENTRY.undo.close()
        _ENTRY.patched = False
