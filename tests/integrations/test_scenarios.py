"""The scenario matrix (tests/scenarios.py) is what the integration suites run: every integration runs every
schedule or says in `NOT_RUN` why not, and every named configuration is run by some suite."""

from __future__ import annotations

import importlib

import pytest

from tests.scenarios import CO2, NOT_RUN, SCHEDULES, schedule_of


def _configs(sets: list[dict]) -> list[dict]:
    return [sc["config"] for scenarios in sets for sc in scenarios.values()]


def _suite_configs(integration: str) -> list[dict]:
    """The co2 configs the integration's suite trains (its scenario tables, as its tests parametrize them)."""
    suite = importlib.import_module(f"tests.integrations.test_{integration}")
    if integration == "optim":
        return _configs([suite.SCENARIOS_R2, suite.SCENARIOS_R4])
    if integration == "fsdp":
        return _configs([suite.SCENARIOS, {"resume": suite.RESUME, "mixed": suite.MIXED}])
    if integration == "fairscale":
        resumes = {"sharded": suite.RESUME_SHARDED, "one_shard": suite.RESUME_ONE_SHARD}
        return _configs([suite.SHARDED, suite.ONE_SHARD, resumes])
    if integration == "deepspeed":
        tables = [suite._scenarios(1), suite._scenarios(2), {"resume": suite._resume_scenario(2), "bf16": suite.BF16}]
        return [config["co2"] for config in _configs(tables)]
    if integration == "lightning":
        return _configs([suite.SCENARIOS, {"resume": suite.RESUME}])
    return [suite.CO2]  # lightning_deepspeed: one configuration, three checks


INTEGRATIONS = ("optim", "fsdp", "fairscale", "deepspeed", "lightning", "lightning_deepspeed")


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_every_integration_runs_every_schedule_or_says_why_not(integration):
    covered = set().union(*(schedule_of(config) for config in _suite_configs(integration)))
    missing = {s for s in SCHEDULES if s not in covered and (integration, s) not in NOT_RUN}
    assert not missing, f"{integration} runs no scenario of schedule(s) {sorted(missing)} and NOT_RUN says nothing"
    stale = {s for s in SCHEDULES if s in covered and (integration, s) in NOT_RUN}
    assert not stale, f"NOT_RUN says {integration} does not run {sorted(stale)}, but its suite does"


def test_every_named_configuration_is_run():
    run = [config for integration in INTEGRATIONS for config in _suite_configs(integration)]
    # a DeepSpeed scenario's co2 section is the shipped config's, updated with the row
    unused = [name for name, row in CO2.items() if not any(row.items() <= config.items() for config in run)]
    assert not unused, f"tests/scenarios.py names configurations no suite runs: {unused}"
