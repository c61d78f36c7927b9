"""DeepSpeed 0.19.8 behaviours co2_zero works around, one delimited entry per upstream defect
(docs/design.md §8): the gradient-clipping default of 1.0, the JIT build of an inference-only comm op,
the module-global mpu, the deprecated collective names it calls. Each entry names the upstream behaviour
and when to delete it."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, Iterator

import deepspeed

from .mpu import ReplicaMPU

# ==== DeepSpeed 0.19.8 behaviours we work around ==========================================================
#
# Everything co2_zero.deepspeed does only because of how DeepSpeed 0.19.8 behaves lives here, one function
# per upstream behaviour, each saying what upstream does and when to delete it. `initialize` applies all
# of them, with a `co2` section and without one (plain DeepSpeed through our `initialize`).
# tests/integrations/test_deepspeed_upstream.py pins each behaviour on plain DeepSpeed: when one of its tests turns
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


RENAMED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def _quiet_renamed_collectives() -> None:
    """Ignore torch's FutureWarning for the two collective names DeepSpeed's comm backend binds.

    Upstream: torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `*_single` and warns
    once per process on the old names; DeepSpeed 0.19.8's `TorchBackend.get_all_gather_function` and
    `get_reduce_scatter_function` (deepspeed/comm/torch.py) still bind the old ones, so every run whose ZeRO
    group has more than one rank printed it on every rank, about code the script does not call. Ignored by
    category and by that message only (a script's own call of the old names is not told either). Delete
    when DeepSpeed binds the new names (tests/integrations/test_deepspeed_upstream.py turns red then).
    """
    warnings.filterwarnings("ignore", message=RENAMED_COLLECTIVES, category=FutureWarning)


# ==== end of the DeepSpeed 0.19.8 workarounds ==============================================================
