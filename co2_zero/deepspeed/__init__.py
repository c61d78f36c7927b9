"""CO2 on DeepSpeed ZeRO stages 1 and 2 (docs/design.md §6.3).

A DeepSpeed user adds a `"co2": {...}` section to the JSON config and calls
`co2_zero.deepspeed.initialize(...)` where they called `deepspeed.initialize(...)`. This package:

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

What it does only because of DeepSpeed 0.19.8's behaviour (the JIT build of an inference-only comm op,
the gradient-clipping default of 1.0, the module-global mpu) is in `workarounds.py`, each entry naming
the upstream behaviour and when to delete it.

Files: `config.py` (split and validate the config), `mpu.py` (the replica mpu), `optimizer.py` (the
partition and `CO2ZeroOptimizer`), `workarounds.py`, `engine.py` (`initialize`, `init_distributed`),
`checkpoints.py` (`save_checkpoint`, `load_checkpoint`), `routing.py` (`patch`, `unpatch`).
"""

from ..core.errors import missing_extra

try:  # the deepspeed extra; without it, an ImportError that names the extra
    import deepspeed  # noqa: F401
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("DeepSpeed", "deepspeed", error) from error

from .checkpoints import load_checkpoint, save_checkpoint
from .config import split_config
from .engine import init_distributed, initialize
from .mpu import ReplicaMPU
from .optimizer import CO2ZeroOptimizer, zero_partition
from .routing import patch, unpatch

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
