"""The scenario matrix of the integration suites: every CO2 configuration they train against the
independent reference, named once by what it exercises, and the schedules each integration must cover.

A suite takes a row with `co2(name)` (a copy: suites add their own fields, e.g. `shards_per_replica`)
and adds what is its own (steps, model, inner optimizer, wrappers). Row names read
`<overlap|blocking>[-<stand-in>]-<outer step>-<gap penalty>[-clip<mode>]-<collective>-t<tau>[-d<sync delay>]`;
a field a name leaves out takes CO2Config's default. tests/integrations/test_scenarios.py checks that
every integration runs every schedule of `SCHEDULES`, or names in `NOT_RUN` why not and where it is tested.
"""

from __future__ import annotations

import copy

HEAVY_BALL = {"outer_lr": 0.8, "outer_momentum": 0.5, "nesterov": False}
NESTEROV = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
ADAPTIVE = {"mode": "adaptive", "strength": 1.5}

CO2 = {
    "blocking-heavyball-adaptive-reducescatter-t2": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "blocking-heavyball-adaptive-reducescatter-t3": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "blocking-heavyball-constant1.5-reducescatter-t2": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 2,
        "gap_penalty": {"mode": "constant", "value": 1.5},
        "collective": "reduce_scatter",
    },
    "blocking-heavyball-constant1.5-reducescatter-t3": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 3,
        "gap_penalty": {"mode": "constant", "value": 1.5},
        "collective": "reduce_scatter",
    },
    "blocking-heavyball-nopenalty-allreduce-t3": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 3,
        "gap_penalty": {"mode": "none"},
        "collective": "all_reduce",
    },
    "blocking-localsgd-nopenalty-reducescatter-t3": {
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "overlap": False,
        "tau": 3,
        "gap_penalty": {"mode": "none"},
        "collective": "reduce_scatter",
    },
    "blocking-nesterov-adaptive-allreduce-t2": {
        **NESTEROV,
        "overlap": False,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "all_reduce",
    },
    "blocking-nesterov-nopenalty-allreduce-t2": {
        **NESTEROV,
        "overlap": False,
        "tau": 2,
        "gap_penalty": {"mode": "none"},
        "collective": "all_reduce",
    },
    "blocking-nesterov-nopenalty-allreduce-t3": {
        **NESTEROV,
        "overlap": False,
        "tau": 3,
        "gap_penalty": {"mode": "none"},
        "collective": "all_reduce",
    },
    "blocking-shared-heavyball-adaptive-clipnorm-reducescatter-t3": {
        **HEAVY_BALL,
        "overlap": False,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.05},
        "stand_in": "shared",
        "collective": "reduce_scatter",
    },
    "defaults": {},
    "defaults-clipnorm-t3": {"tau": 3, "clip": {"mode": "norm", "threshold": 0.05}},
    "defaults-t3": {"tau": 3},
    "defaults-t4": {"tau": 4},
    "overlap-heavyball-adaptive-allreduce-t2": {
        **HEAVY_BALL,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "all_reduce",
    },
    "overlap-heavyball-adaptive-allreduce-t3": {
        **HEAVY_BALL,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "collective": "all_reduce",
    },
    "overlap-heavyball-adaptive-clipnorm-allreduce-t2": {
        **HEAVY_BALL,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.1},
        "collective": "all_reduce",
    },
    "overlap-heavyball-adaptive-clipvalue-t3": {
        **HEAVY_BALL,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "value", "threshold": 0.02},
    },
    "overlap-heavyball-adaptive-reducescatter-t2": {
        **HEAVY_BALL,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "overlap-heavyball-adaptive-reducescatter-t3": {
        **HEAVY_BALL,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "overlap-heavyball-adaptive-reducescatter-t3-d2": {
        **HEAVY_BALL,
        "tau": 3,
        "sync_delay": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "overlap-heavyball-adaptive-t3": {**HEAVY_BALL, "tau": 3, "gap_penalty": ADAPTIVE},
    "overlap-heavyball-adaptive-t3-d1": {**HEAVY_BALL, "tau": 3, "sync_delay": 1, "gap_penalty": ADAPTIVE},
    "overlap-heavyball-t2": {**HEAVY_BALL, "tau": 2},
    "overlap-local-heavyball-adaptive-allreduce-t3-d2": {
        **HEAVY_BALL,
        "tau": 3,
        "sync_delay": 2,
        "gap_penalty": ADAPTIVE,
        "stand_in": "local",
        "collective": "all_reduce",
    },
    "overlap-local-nesterov-adaptive-clipnorm-allreduce-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "local",
        "collective": "all_reduce",
    },
    "overlap-local-nesterov-adaptive-reducescatter-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
        "stand_in": "local",
    },
    "overlap-local-nesterov-clipnorm-allreduce-t2-skipround": {
        **NESTEROV,
        "tau": 2,
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "local",
        "collective": "all_reduce",
        "nonfinite": "skip_round",
    },
    "overlap-local-nesterov-nopenalty-reducescatter-t4-d1": {
        **NESTEROV,
        "tau": 4,
        "sync_delay": 1,
        "gap_penalty": {"mode": "none"},
        "stand_in": "local",
        "collective": "reduce_scatter",
    },
    "overlap-nesterov-adaptive-reducescatter-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "overlap-nesterov-adaptive-reducescatter-t3-d1": {
        **NESTEROV,
        "tau": 3,
        "sync_delay": 1,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
    },
    "overlap-nesterov-constant2.0-clipvalue-allreduce-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": {"mode": "constant", "value": 2.0},
        "clip": {"mode": "value", "threshold": 0.02},
        "collective": "all_reduce",
    },
    "overlap-shared-heavyball-adaptive-clipnorm-t2": {
        **HEAVY_BALL,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "shared",
    },
    "overlap-shared-heavyball-adaptive-clipvalue-allreduce-t3": {
        **HEAVY_BALL,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "value", "threshold": 0.02},
        "stand_in": "shared",
        "collective": "all_reduce",
    },
    "overlap-shared-heavyball-adaptive-reducescatter-t2": {
        **HEAVY_BALL,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "stand_in": "shared",
        "collective": "reduce_scatter",
    },
    "overlap-shared-heavyball-adaptive-reducescatter-t3": {
        **HEAVY_BALL,
        "tau": 3,
        "gap_penalty": ADAPTIVE,
        "collective": "reduce_scatter",
        "stand_in": "shared",
    },
    "overlap-shared-lr1.0-m0.3-nopenalty-clipnorm-allreduce-t1": {
        "outer_lr": 1.0,
        "outer_momentum": 0.3,
        "tau": 1,
        "gap_penalty": {"mode": "none"},
        "clip": {"mode": "norm", "threshold": 0.05},
        "stand_in": "shared",
        "collective": "all_reduce",
    },
    "overlap-shared-nesterov-adaptive-clipnorm-allreduce-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "shared",
        "collective": "all_reduce",
    },
    "overlap-shared-nesterov-adaptive-clipnorm-reducescatter-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": ADAPTIVE,
        "clip": {"mode": "norm", "threshold": 0.1},
        "stand_in": "shared",
        "collective": "reduce_scatter",
    },
    "overlap-shared-nesterov-constant2.0-clipvalue-reducescatter-t2": {
        **NESTEROV,
        "tau": 2,
        "gap_penalty": {"mode": "constant", "value": 2.0},
        "clip": {"mode": "value", "threshold": 0.02},
        "stand_in": "shared",
        "collective": "reduce_scatter",
    },
}

# What a schedule is: how the outer step reaches the replicas (CO2Config.overlap, stand_in, sync_delay).
SCHEDULES = ("defaults", "blocking", "shared", "local", "fixed-delay")

# (integration, schedule) -> why that integration's suite does not run it, and where it is tested instead
_PHASES = "tests/checkpoint/test_checkpoint_phases.py runs CO2Optimizer with it against the reference at every step"
_LIGHTNING = "CO2Strategy hands its co2 config to CO2Optimizer unchanged: test_optim.py runs the schedules"
_LIGHTNING_DS = "CO2DeepSpeedStrategy hands its co2 section to co2_zero.deepspeed: test_deepspeed.py runs the schedules"
NOT_RUN = {
    ("optim", "fixed-delay"): _PHASES,
    ("fairscale", "defaults"): "test_optim.py runs the defaults; CO2OSS adds no default of its own",
    **{("lightning", schedule): _LIGHTNING for schedule in ("blocking", "fixed-delay")},
    **{
        ("lightning_deepspeed", schedule): _LIGHTNING_DS
        for schedule in ("defaults", "blocking", "shared", "fixed-delay")
    },
}


def co2(name: str) -> dict:
    """A copy of the named row (suites extend it)."""
    return copy.deepcopy(CO2[name])


def schedule_of(config: dict) -> set[str]:
    """The schedules a co2 config runs (`stand_in: "auto"` is the local stand-in with overlap, shared without)."""
    if not set(config) - {"tau", "shards_per_replica", "clip"}:
        return {"defaults", "local"}
    if config.get("overlap", True) is False:
        found = {"blocking"}
    else:
        found = {"shared" if config.get("stand_in") == "shared" else config.get("stand_in", "local")}
    if isinstance(config.get("sync_delay"), int) and config["sync_delay"] > 0:
        found.add("fixed-delay")
    return found
