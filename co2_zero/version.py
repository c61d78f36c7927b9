"""The package's version, and the oldest torch it runs on (pyproject.toml's bound says the same)."""

from __future__ import annotations

import re
from typing import Optional

__version__ = "0.2.0"

# The newest torch APIs co2_zero uses: FSDP2's public `torch.distributed.fsdp.fully_shard` (torch 2.6;
# co2_zero.fsdp and co2-train's fsdp engine) over the public `torch.distributed.tensor` (2.5), the
# training job's `torch.uint16` token files (2.3), fp8's `torch.float8_e4m3fn` (2.1).
TORCH_MIN = (2, 6)


def torch_too_old(found: str) -> Optional[str]:
    """Why torch `found` (its `__version__`) cannot run co2_zero, or None when it can."""
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) >= TORCH_MIN:
        return None
    need = ".".join(map(str, TORCH_MIN))
    return (
        f"co2_zero needs torch >= {need}, found torch {found}: it uses FSDP2's torch.distributed.fsdp.fully_shard "
        f"and the public torch.distributed.tensor (torch {need}). Install torch >= {need} first (pip install "
        f"'torch>={need}'; for CUDA, the build for your CUDA from pytorch.org)"
    )
