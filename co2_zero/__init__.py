"""co2_zero: CO2 (Sun et al., ICLR 2024) with the outer state sharded like ZeRO.

Each replica takes `tau` local optimizer steps. The replicas' mean displacement is averaged in the
background while the next steps compute, and an outer Nesterov momentum step applies it as soon as the
exchange is hidden (the sync delay, measured on the job); meanwhile each replica continues from its own
stand-in for that step (`stand_in: local`). CO2 as published (heavy ball, the adaptive staleness gap
penalty, the average applied a round late) is `co2_zero.core.config.PUBLISHED`. docs/design.md §3 has the math.
"""

import torch

from .version import __version__, torch_too_old

if torch_too_old(torch.__version__):  # before any module that would fail on an older torch's missing APIs
    raise ImportError(torch_too_old(torch.__version__))

from . import checkpoint, moved  # noqa: E402
from .core.config import Clip, CO2Config, GapPenalty  # noqa: E402
from .core.errors import CO2Error, CO2TimeoutError, NonFiniteError  # noqa: E402
from .optim import CO2Optimizer  # noqa: E402

moved.install()

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
