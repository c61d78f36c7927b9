"""co2_zero: CO2 (Sun et al., ICLR 2024) with the outer state sharded like ZeRO.

Each replica takes `tau` local optimizer steps; the replicas' mean displacement is exchanged in the
background while the next `tau` steps compute, and an outer momentum step applies it as soon as the
exchange is hidden (`sync_delay`; as published, a round late, with a staleness gap penalty and momentum
clipping).
"""

import warnings

# Without numpy (the base install needs none), `import torch` warns "Failed to initialize NumPy" in every
# process, five times per 4-rank launch. Import torch here first, with that one warning from torch
# silenced, when co2_zero comes first (the co2-train job, `python -m co2_zero.train`, scripts that
# import co2_zero before torch); a process that imported torch already has printed it.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning, module="torch")
    import torch  # noqa: F401

from . import checkpoint  # noqa: E402
from .config import Clip, CO2Config, GapPenalty  # noqa: E402
from .errors import CO2Error, CO2TimeoutError, NonFiniteError  # noqa: E402
from .optim import CO2Optimizer  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = [
    "CO2Config",
    "CO2Error",
    "CO2Optimizer",
    "CO2TimeoutError",
    "Clip",
    "GapPenalty",
    "NonFiniteError",
    "checkpoint",
    "__version__",
]
