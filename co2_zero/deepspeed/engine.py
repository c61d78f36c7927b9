"""`initialize`: `deepspeed.initialize` with CO2 when the config has a "co2" section, and
`init_distributed` without DeepSpeed's inference-only JIT build.

With a `co2` section it builds the R x S topology, hands DeepSpeed a `ReplicaMPU` (ZeRO shards over the
replica), re-classes the ZeRO optimizer as `CO2ZeroOptimizer`, samples the data over all ranks and
replaces the engine's checkpoint methods with co2_zero's per-rank ones; without one it is plain
DeepSpeed. Both ways the workarounds of `workarounds.py` apply.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Iterator, Mapping, Optional

import deepspeed
import torch

from ..core.topology import Topology
from ..integration import Integration, refuse_membership
from .checkpoints import load_checkpoint, save_checkpoint
from .config import ConfigLike, _per_replica_batch, split_config
from .mpu import ReplicaMPU
from .optimizer import CO2ZeroOptimizer
from .workarounds import (
    _explicit_gradient_clipping,
    _forget_replica_mpu,
    _quiet_renamed_collectives,
    _without_shm_comm_build,
)


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
    _quiet_renamed_collectives()
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


def _the_config(config: Optional[ConfigLike], args: Any, kwargs: dict[str, Any]) -> tuple[ConfigLike, Any]:
    """The one DeepSpeed config among `config`, `config_params` (popped from kwargs) and
    `args.deepspeed_config`, and `args` without it (a copy: DeepSpeed must not read it a second time)."""
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
    return config, args


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
    replica sees different data), and `engine.save_checkpoint` / `engine.load_checkpoint` are
    co2_zero.deepspeed's per-rank versions. Without `co2`, it is plain DeepSpeed. Both ways the
    DeepSpeed 0.19.8 workarounds apply: no inference-only JIT build, and an absent `gradient_clipping`
    means no clipping (DeepSpeed 0.19.8 would clip at 1.0; see `_explicit_gradient_clipping`).

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
    refuse_membership(Integration.DEEPSPEED, kwargs)
    config, args = _the_config(config, args, kwargs)
    ds_config, co2 = split_config(config)
    _explicit_gradient_clipping(ds_config)

    init_distributed(**{k: kwargs[k] for k in ("distributed_port", "dist_init_required") if k in kwargs})
    given = {"args": args, "model": model, "optimizer": optimizer, "model_parameters": model_parameters}
    given["lr_scheduler"] = lr_scheduler
    if co2 is None:
        _forget_replica_mpu()
        return deepspeed.initialize(**given, training_data=training_data, config=ds_config, **kwargs)
    return _co2_initialize(given, training_data, ds_config, co2, kwargs)


def _co2_initialize(
    given: dict[str, Any], training_data: Any, ds_config: dict[str, Any], co2: Any, kwargs: dict[str, Any]
) -> tuple[Any, Any, Any, Any]:
    """`initialize` with a co2 section: DeepSpeed's engine on the replica's group, its ZeRO optimizer
    re-classed as `CO2ZeroOptimizer`, the data sampled over all ranks, co2_zero's checkpoint methods."""
    if kwargs.get("mpu") is not None or kwargs.get("mesh_param") is not None:
        raise ValueError("co2: mpu / mesh_param cannot be combined with a co2 section (no model parallelism)")
    kwargs.pop("mpu", None)
    topology = Topology.build(co2)
    _per_replica_batch(ds_config, topology)
    engine, zero, _, scheduler = deepspeed.initialize(
        **given, training_data=None, config=ds_config, mpu=ReplicaMPU(topology), **kwargs
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
    """`function(engine, ...)` as a method of `engine`, with `function`'s name and docstring."""
    return functools.update_wrapper(functools.partial(function, engine), function)
