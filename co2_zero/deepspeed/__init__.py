"""CO2 on DeepSpeed ZeRO stages 1 and 2 (docs/deepspeed.md; docs/design.md §6.3): a `"co2"` section in the
JSON config and `co2_zero.deepspeed.initialize(...)` where `deepspeed.initialize(...)` was. ZeRO shards the
inner optimizer over the S ranks of a replica (`ReplicaMPU`), `CO2ZeroOptimizer` runs the rounds on the fp32
master partition, checkpoints are per rank (`save_checkpoint` / `load_checkpoint`); what only DeepSpeed
0.19.8's behaviour needs is in `workarounds.py`.
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
