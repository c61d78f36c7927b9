"""co2_zero: CO2 (Sun et al., ICLR 2024) with the outer state sharded like ZeRO.

Each replica takes `tau` local optimizer steps; the replicas' mean displacement is exchanged in the
background while the next `tau` steps compute, and an outer momentum step applies it as soon as the
exchange is hidden (`sync_delay`; as published, a round late, with a staleness gap penalty and momentum
clipping).
"""

from . import checkpoint
from .config import Clip, CO2Config, GapPenalty
from .errors import CO2Error, CO2TimeoutError, NonFiniteError
from .optim import CO2Optimizer
from .version import __version__

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
