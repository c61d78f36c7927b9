"""Errors co2_zero raises, and warnings it gives, at run time (bad configuration raises ValueError)."""

import re

# How torch words a passed deadline: gloo "Timed out waiting 5000ms for recv operation", "Operation
# timed out!" (Work.wait), "Application timeout caused pair closure" (the next collective on that pair);
# NCCL's watchdog "... collective operation timeout ...". All arrive as RuntimeError / DistBackendError.
_TIMEOUT_WORDING = re.compile(r"time[d]?\s*out", re.IGNORECASE)


class CO2Error(RuntimeError):
    """The CO2 exchange failed: a peer died, timed out, or the ranks disagree.

    Raised on every rank, naming the round and the process group (or the checkpoint, rank and file); a
    save or load that raised it left the saved and the live state as they were. Failures lists each case.
    `refused` is True for a checkpoint load that refused before changing anything (nothing to load, a
    missing or damaged file, another config or grid): the user's to fix, which the tools report in one line.
    """

    refused = False


def refusal(message: str) -> CO2Error:
    """The CO2Error of a request refused before anything changed (`CO2Error.refused`): a checkpoint load, a
    save directory that holds another run's checkpoints. The tools report it in one line (`train.cli`)."""
    error = CO2Error(message)
    error.refused = True
    return error


class CO2TimeoutError(CO2Error, TimeoutError):
    """A wait on the background exchange passed its deadline (`timeout_s`)."""


class NonFiniteError(CO2Error, FloatingPointError):
    """A replica's displacement held NaN or Inf (policy `nonfinite: "raise"`)."""


def is_timeout(error: BaseException) -> bool:
    """Whether `error` says a deadline passed: a TimeoutError, or a backend error worded as one."""
    return isinstance(error, TimeoutError) or bool(_TIMEOUT_WORDING.search(str(error)))


def collective_error(what: str, error: BaseException, timeout_s: float) -> CO2Error:
    """The error to raise (`from error`) when `what` (naming the round or step and the group) failed.

    The type follows the cause: CO2TimeoutError when a deadline passed, whichever clock fired first
    (the group's own timeout inside the backend, or the library's wait), so `except CO2TimeoutError`
    catches every timeout; CO2Error otherwise (e.g. a peer's connection closed).
    """
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if is_timeout(error):
        return CO2TimeoutError(
            f"co2: {what} did not finish within timeout_s={timeout_s:g} ({detail}); a peer rank is "
            f"probably dead or stuck"
        )
    return CO2Error(f"co2: {what} failed: {detail}")


def missing_extra(package: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError to raise when an optional integration's framework is not installed."""
    message = (
        f"co2_zero needs {package} for this integration, which the base install does not include: "
        f"pip install -e '.[{extra}]' in the clone (co2_zero is installed from its checkout, not from an index); "
        f"import failed with: {error}"
    )
    return ImportError(message, name=getattr(error, "name", None))


def skipped_round_warning(round_index: int, replicas: list[int], skipped_rounds: int) -> str:
    """nonfinite "skip_round": the displacement of `replicas` held NaN or Inf in round `round_index`."""
    return (
        f"co2: round {round_index}: the displacement of replica(s) {replicas} held NaN or Inf; the round's outer "
        f"update was skipped on every replica (skipped_rounds={skipped_rounds}). Every replica restarts from the "
        f"agreed start point; a rank whose own displacement was non-finite reset its inner optimizer state"
    )


def inner_reset_warning(round_index: int, where: str) -> str:
    """nonfinite "skip_round": this rank's own displacement (`where`: its rank and replica) held NaN or Inf."""
    return (
        f"co2: round {round_index}: this rank's displacement ({where}) holds NaN or Inf; its inner optimizer "
        f"state is reset and it restarts from the agreed start point (nonfinite='skip_round')"
    )
