"""Errors co2_zero raises at run time (bad configuration raises ValueError)."""


class CO2Error(RuntimeError):
    """The CO2 exchange failed: a peer died, timed out, or the ranks disagree."""


class CO2TimeoutError(CO2Error, TimeoutError):
    """A wait on the background exchange passed its deadline (`timeout_s`)."""


class NonFiniteError(CO2Error, FloatingPointError):
    """A replica's displacement held NaN or Inf (policy `nonfinite: "raise"`)."""
