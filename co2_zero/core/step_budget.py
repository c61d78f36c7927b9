"""Whether a run's known number of optimizer steps fits CO2's rounds of tau steps.

`finalize()` drops the steps since the last round end and returns every rank to the start point the
last round produced: a run shorter than one round ends on the model it started from, and one that is
not whole rounds loses its last partial round. Where the length is known when the optimizer is built
(co2-train's --max_steps, Hugging Face Trainer's max_steps), the integration checks it here.
"""

from __future__ import annotations

from typing import Optional


def step_budget_problem(max_steps: int, tau: int, steps: str = "max_steps", tau_name: str = "tau") -> Optional[str]:
    """What a run of `max_steps` optimizer steps would lose at this tau, with what to do; None when it is
    whole rounds. `steps`, `tau_name`: how the message names the two (a flag, a field)."""
    if max_steps < tau:
        return (
            f"{steps}={max_steps} is shorter than one CO2 round ({tau_name}={tau}): no round would end, and "
            f"finalize() would return every rank to the model it started from; accepted: {tau_name} <= "
            f"{max_steps} (one that divides {max_steps} trains every step), or {steps} a multiple of {tau}"
        )
    dropped = max_steps % tau
    if dropped:
        whole = max_steps - dropped
        return (
            f"{steps}={max_steps} is not a multiple of {tau_name}={tau}: finalize() would drop the last {dropped} "
            f"step(s), a partial round; accepted: {steps} {whole} or {whole + tau}, or a {tau_name} that divides "
            f"{max_steps}"
        )
    return None


def dropped_steps_warning(dropped: int, inner_steps: int, tau: int) -> str:
    """finalize() with `dropped` inner steps since the last round end (`inner_steps` in all)."""
    ended = inner_steps >= tau
    where = "start point" if ended else f"model it started from: no round ended (tau={tau})"
    return (
        f"co2 finalize: the {dropped} inner step(s) since the last round end (step {inner_steps - dropped}) are "
        f"dropped; every rank returns to the {where}. Train whole rounds: a number of steps that tau divides"
    )
