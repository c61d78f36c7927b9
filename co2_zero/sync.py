"""Compatibility names: the round engine now lives in `engine` (lifecycle), `partition` (what it
averages), `startup`, `buffers` and `engine_state`. Code outside the library may keep importing these
names from here."""

from .engine import RoundEngine
from .integration import CO2Steps
from .partition import ParameterWatch, Partition, parameter_signature

__all__ = ["CO2Steps", "ParameterWatch", "Partition", "RoundEngine", "parameter_signature"]
