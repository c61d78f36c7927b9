"""Errors co2_zero raises at run time (bad configuration raises ValueError)."""


class CO2Error(RuntimeError):
    """The CO2 exchange failed: a peer died, timed out, or the ranks disagree.

    Raised on every rank, naming the round and the process group (or the checkpoint, rank and file); a
    save or load that raised it left the saved and the live state as they were. Failures lists each case.
    """


class CO2TimeoutError(CO2Error, TimeoutError):
    """A wait on the background exchange passed its deadline (`timeout_s`)."""


class NonFiniteError(CO2Error, FloatingPointError):
    """A replica's displacement held NaN or Inf (policy `nonfinite: "raise"`)."""


def missing_extra(package: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError to raise when an optional integration's framework is not installed."""
    message = (
        f"co2_zero needs {package} for this integration, which the base install does not include: "
        f"pip install 'co2_zero[{extra}]' (from a clone: pip install -e '.[{extra}]'); import failed with: {error}"
    )
    return ImportError(message, name=getattr(error, "name", None))
