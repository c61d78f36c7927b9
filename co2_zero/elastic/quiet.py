"""What torchft 0.2.0 (and torch under it) print on a CPU elastic run that tells its user nothing, silenced
at the source and no wider: one entry per upstream behaviour, each saying when to delete it.

- `torchft.manager` warns at every quorum "Unable to reset NCCL flight recorder recording so traces will be
  incorrect" when torch has no `_reset_fr_recording_nccl`: on CPU, with gloo, there are no NCCL traces to
  reset. Dropped by a filter on that logger for that message only. Delete when torchft asks only for NCCL.
- `torchft.checkpointing.HTTPTransport` serves heals with a `BaseHTTPRequestHandler`, which writes an access
  line per request (`"GET /checkpoint/0/full HTTP/1.1" 200 -`) to stderr, into the job's lines. Its
  `log_request` is a no-op on this manager's server (errors are still logged). Delete when torchft logs
  them through `logging`.
- A heal's receiver reads each storage with `torch.frombuffer` over read-only bytes
  (`torch.distributed._serialization`), and torch warns "The given buffer is not writable": the storage
  is only read, then copied into the model. Ignored for that message from that module. Delete when torch
  reads into a writable buffer.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

NO_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder"


class _WithoutFlightRecorderWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return NO_FLIGHT_RECORDER not in record.getMessage()


def quiet_torchft(manager: Any) -> Any:
    """Silence the entries above for this `torchft.Manager` (and its process); returns the manager."""
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _WithoutFlightRecorderWarning) for f in logger.filters):
        logger.addFilter(_WithoutFlightRecorderWarning())
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    if server is not None:
        server.RequestHandlerClass.log_request = _no_access_line
    warnings.filterwarnings(
        "ignore",
        message="The given buffer is not writable",
        category=UserWarning,
        module=r"torch\.distributed\._serialization",
    )
    return manager


def _no_access_line(handler: Any, code: Any = "-", size: Any = "-") -> None:
    """`BaseHTTPRequestHandler.log_request` without the line."""
