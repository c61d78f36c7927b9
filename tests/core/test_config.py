"""CO2Config: one schema, every bad field named in the error."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from co2_zero import CO2Config
from co2_zero.core.config import PUBLISHED, Clip, GapPenalty

BAD_FIELDS = [
    ("tau", 0, "tau"),
    ("tau", 2.5, "tau"),
    ("tau", True, "tau"),
    ("outer_lr", 0.0, "outer_lr"),
    ("outer_lr", "1", "outer_lr"),
    ("outer_momentum", 1.0, "outer_momentum"),
    ("outer_momentum", -0.1, "outer_momentum"),
    ("nesterov", 1, "nesterov"),
    ("overlap", "yes", "overlap"),
    ("gap_penalty", {"mode": "exp"}, "gap_penalty.mode"),
    ("gap_penalty", {"mode": "constant", "value": 0.5}, "gap_penalty.value"),
    ("gap_penalty", {"strength": -1}, "gap_penalty.strength"),
    ("gap_penalty", {"streng": 1.0}, "gap_penalty.streng"),
    ("gap_penalty", "adaptive", "gap_penalty"),
    ("clip", {"mode": "max"}, "clip.mode"),
    ("clip", {"mode": "norm", "threshold": 0}, "clip.threshold"),
    ("clip", {"thresh": 1.0}, "clip.thresh"),
    ("shards_per_replica", 0, "shards_per_replica"),
    ("shards_per_replica", "gpu", "shards_per_replica"),
    ("collective", "allreduce", "collective"),
    ("comm_dtype", "fp16", "comm_dtype"),
    ("timeout_s", 0, "timeout_s"),
    ("timeout_s", float("inf"), "timeout_s"),
    ("timeout_s", 1e10, "timeout_s"),
    ("outer_lr", float("inf"), "outer_lr"),
    ("outer_lr", float("nan"), "outer_lr"),
    ("gap_penalty", {"strength": float("inf")}, "gap_penalty.strength"),
    ("gap_penalty", {"mode": "constant", "value": float("inf")}, "gap_penalty.value"),
    ("clip", {"mode": "norm", "threshold": float("inf")}, "clip.threshold"),
    ("nonfinite", "ignore", "nonfinite"),
    ("stand_in", True, "stand_in"),
    ("sync_delay", "4", "sync_delay"),
]


def test_local_stand_in_refuses_blocking_rounds():
    """docs/design.md §3, "Stand-ins": a blocking round has no average in flight to stand in for; the refusal
    names the field, its value and what is accepted. The stand-in never travels: any wire type."""
    with pytest.raises(ValueError) as info:
        CO2Config.from_dict({"stand_in": "local", "overlap": False})
    message = str(info.value)
    assert "overlap=False" in message and "accepted" in message and "stand_in='local'" in message
    assert CO2Config.from_dict({"overlap": False, "stand_in": "shared"}).effective_stand_in == "shared"
    assert CO2Config.from_dict({"stand_in": "local", "clip": {"mode": "norm"}}).effective_stand_in == "local"
    for comm_dtype in ("bf16", "int8", "fp8"):
        assert CO2Config.from_dict({"stand_in": "local", "comm_dtype": comm_dtype}).stand_in == "local"


def test_skip_round_runs_the_local_stand_in():
    """local restarts a non-finite replica from the shared start (design §3), so it and the defaults accept
    skip_round."""
    for stand_in in ("local", "auto"):
        assert CO2Config(stand_in=stand_in, nonfinite="skip_round").effective_stand_in == "local"


def test_retired_eager_stand_in_says_what_to_set_instead():
    """The `eager` stand-in is retired (its study found it worse than `local`): a config that names it is
    refused, the message naming the field, the value, that it is retired and what to set instead."""
    for section in ({"stand_in": "eager"}, {"stand_in": "eager", "overlap": False}):
        with pytest.raises(ValueError) as info:
            CO2Config.from_dict(section)
        message = str(info.value)
        assert "stand_in='eager'" in message and "retired" in message
        assert "accepted: 'local'" in message


@pytest.mark.parametrize(
    "section,accepted",
    [
        ({"sync_delay": 0}, "an integer >= 1"),
        ({"sync_delay": 33}, "null, 'auto', or an integer in [1, tau=32]"),
        ({"sync_delay": "fast"}, "null, 'auto', or an integer in [1, tau=32]"),
        ({"sync_delay": 2.0}, "an integer >= 1"),
        (
            {"sync_delay": 4, "overlap": False},
            "with overlap=False (a blocking round applies its average at once); accepted: null or 'auto'",
        ),
        ({"stand_in": "fresh"}, "'auto' | 'shared' | 'local'"),
    ],
)
def test_sync_delay_and_stand_in_refusals_name_what_is_accepted(section, accepted):
    with pytest.raises(ValueError) as info:
        CO2Config.from_dict(section)
    key = next(iter(section))
    assert f"{key}={section[key]!r}" in str(info.value) and accepted in str(info.value), str(info.value)


@pytest.mark.parametrize("value", ["nodes", 0, 2.0, True])
def test_shards_per_replica_refusal_says_what_the_reference_table_says(value):
    """One source of truth: docs/configuration.md's "accepted" cell is the refusal's own words."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "hooks"))
    import config_reference

    with pytest.raises(ValueError) as info:
        CO2Config(shards_per_replica=value)
    accepted = str(info.value).split("accepted: ", 1)[1]
    assert f"shards_per_replica={value!r}" in str(info.value) and accepted == "an integer >= 1, or 'node'"
    (row,) = [r for r in config_reference.reference_markdown().splitlines() if r.startswith("| `shards_per_replica`")]
    assert f" {accepted} |" in row, row


def test_sync_delay_null_is_the_round_end():
    """null and tau are one schedule (and one checkpoint hash); blocking applies at once."""
    null = CO2Config(tau=12, sync_delay=None)
    assert null.steps_before_apply == 12 and CO2Config(tau=5, sync_delay=2).steps_before_apply == 2
    assert CO2Config(overlap=False, sync_delay=None).steps_before_apply == 0
    assert (
        CO2Config(tau=12, sync_delay=12).math_hash() == null.math_hash() != CO2Config(tau=12, sync_delay=11).math_hash()
    )


def test_auto_sync_delay_starts_at_the_round_end_and_hashes_apart():
    """ "auto" (the default) applies at the round end until it fixes a delay (co2_zero.core.schedule); its
    trajectory is not a fixed delay's, so a checkpoint of one does not load into the other."""
    auto = CO2Config(tau=12)
    assert auto.sync_delay == "auto" and auto.measures_sync_delay and auto.steps_before_apply == 12
    fixed = {CO2Config(tau=12, sync_delay=None).math_hash(), CO2Config(tau=12, sync_delay=11).math_hash()}
    assert auto.math_hash() not in fixed


def test_blocking_rounds_take_the_auto_defaults_as_at_once():
    """overlap: false with the defaults: no average is in flight, so the `auto` stand-in is the shared start,
    nothing is measured, and the config (and its hash) is the one that spells out null and `shared`."""
    blocking = CO2Config(overlap=False)
    assert blocking.steps_before_apply == 0 and not blocking.measures_sync_delay
    assert blocking.effective_stand_in == "shared"
    assert blocking.math_hash() == CO2Config(overlap=False, stand_in="shared", sync_delay=None).math_hash()


@pytest.mark.parametrize("other", [{}, {"comm_dtype": "bf16"}, {"comm_dtype": "int8"}, {"comm_dtype": "fp8"},
                                   {"overlap": False}])  # fmt: skip
def test_auto_stand_in_is_local_with_overlap_and_shared_without(other):
    """stand_in `auto` (the default) is the local stand-in, the shared start in blocking mode; the config
    hashes as the one that names it."""
    config = CO2Config.from_dict(other)
    assert config.stand_in == "auto"
    assert config.effective_stand_in == ("shared" if other == {"overlap": False} else "local")
    named = CO2Config.from_dict({**other, "stand_in": config.effective_stand_in})
    assert config.math_hash() == named.math_hash()


@pytest.mark.parametrize("clip", [{"mode": "value"}, {"mode": "norm"}])
def test_the_defaults_run_a_clip_and_skip_round(clip):
    """The local stand-in (the default) is defined with a clip and with skip_round (design §3): nothing
    falls back to the shared start, and the config hash names the local stand-in."""
    config = CO2Config(clip=clip, nonfinite="skip_round")
    assert config.effective_stand_in == "local"
    assert config.math_hash() == CO2Config(clip=clip, nonfinite="skip_round", stand_in="local").math_hash()


def test_a_membership_runs_auto_sync_delay_at_the_round_end_and_keeps_the_rest():
    """Elastic mode: `sync_delay: "auto"` is the round end (the plan's rewrite); the stand-in is kept, and what
    the exchange cannot heal is refused with what it accepts (test_elastic.py)."""
    from types import SimpleNamespace

    from co2_zero.core.plan import resolve
    from co2_zero.core.round_schedule import RoundSchedule

    topology = SimpleNamespace(replicas=1, shards=1, outer_group=None)
    elastic = resolve(CO2Config(), topology, elastic=True, backend="gloo")
    applies_at = RoundSchedule(elastic, 0).decision.applies_at  # the schedule's, not the plan's (issue 63)
    assert (elastic.config.stand_in, elastic.config.sync_delay, applies_at) == ("auto", None, 32)
    assert (elastic.sync_delay, elastic.stand_in, elastic.collective) == ("round end", "local", "all_reduce")
    kept = resolve(CO2Config(stand_in="local", sync_delay=4), topology, backend="gloo")
    assert (kept.config.stand_in, kept.config.sync_delay, kept.sync_delay) == ("local", 4, "fixed")


def test_published_preset_loads_checkpoints_of_the_old_defaults():
    """`PUBLISHED` is co2_zero 0.1's defaults (CO2 as published): its hash is the one 0.1 wrote into every
    checkpoint saved with them, so those checkpoints load under `CO2Config(**PUBLISHED)`."""
    assert CO2Config(**PUBLISHED).math_hash() == "f24a5a9ea77b8c21"  # what 0.1's CO2Config().math_hash() gave
    assert CO2Config().math_hash() != CO2Config(**PUBLISHED).math_hash()
    assert CO2Config(**PUBLISHED).effective_stand_in == "shared" and not CO2Config(**PUBLISHED).measures_sync_delay


@pytest.mark.parametrize("field,value,named", BAD_FIELDS)
def test_bad_field_is_named_with_value_and_accepted(field, value, named):
    with pytest.raises(ValueError) as info:
        CO2Config.from_dict({field: value})
    message = str(info.value)
    shown = value[named.split(".")[1]] if isinstance(value, dict) else value
    assert named in message and repr(shown) in message and "accepted" in message
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        CO2Config(**{field: value})


def test_outer_settings_auto_fit_the_exchange():
    """`auto` outer settings: the dense defaults, or with topk < 1 the sparse exchange's (alpha 1, no outer
    momentum, residual decay 0.95); a config that names the values `auto` gives has the same identity."""
    sparse = CO2Config(topk=0.015, comm_dtype="int2")
    assert [sparse.effective(name) for name in ("outer_lr", "outer_momentum", "feedback_decay")] == [1.0, 0.0, 0.95]
    explicit = CO2Config(topk=0.015, comm_dtype="int2", outer_lr=1, outer_momentum=0.0, feedback_decay=0.95)
    assert explicit.math_hash() == sparse.math_hash()
    assert CO2Config(outer_lr=0.5, outer_momentum=0.9).math_hash() == CO2Config().math_hash()
    assert CO2Config(topk=0.015, outer_momentum=0.9).effective("outer_momentum") == 0.9  # asked for: kept
    assert CO2Config(topk=0.015, outer_momentum=0.9).math_hash() != sparse.math_hash()


def test_unknown_top_level_key_is_named():
    with pytest.raises(ValueError, match="co2.outer_lrr"):
        CO2Config.from_dict({"outer_lrr": 1.0})


def test_defaults_and_dict_round_trip():
    config = CO2Config()
    assert (config.tau, config.outer_lr, config.outer_momentum, config.nesterov) == (32, "auto", "auto", True)
    assert [config.effective(name) for name in ("outer_lr", "outer_momentum", "feedback_decay")] == [0.5, 0.9, 1.0]
    assert (config.stand_in, config.sync_delay, config.gap_penalty.mode) == ("auto", "auto", "none")
    assert config.effective_stand_in == "local" and config.overlap and config.collective == "auto"
    assert config.gap_penalty == GapPenalty() and config.clip == Clip()
    section = json.loads(json.dumps(config.to_dict()))  # what a DeepSpeed JSON "co2" section holds
    assert CO2Config.from_dict(section) == config


def test_nested_sections_accept_dataclasses_and_partial_dicts():
    config = CO2Config(gap_penalty={"mode": "constant", "value": 2}, clip=Clip("norm", 0.5), stand_in="shared")
    assert config.gap_penalty == GapPenalty(mode="constant", value=2, strength=2.0)
    assert config.clip.mode == "norm" and config.clip.threshold == 0.5
    assert dataclasses.replace(config, tau=3).tau == 3
    with pytest.raises(ValueError, match="tau"):
        dataclasses.replace(config, tau=-3)


def test_math_hash_ignores_plumbing_only():
    base = CO2Config()
    assert base.math_hash() == CO2Config(timeout_s=5, collective="all_reduce").math_hash()
    assert base.math_hash() != CO2Config(tau=3).math_hash()
    assert base.math_hash() != CO2Config(clip={"mode": "value"}, stand_in="shared").math_hash()
    assert base.math_hash() != CO2Config(stand_in="shared").math_hash()
    assert base.math_hash() == CO2Config(stand_in="local").math_hash()  # `auto` is local with overlap


def test_shards_node_reads_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert CO2Config().resolve_shards(8) == 4
    assert CO2Config(shards_per_replica=2).resolve_shards(8) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert CO2Config().resolve_shards(8) == 1


def test_json_integers_and_python_floats_are_one_config():
    """`"outer_lr": 1` in a JSON file and `outer_lr=1.0` in Python must resume each other's runs."""
    from_json = CO2Config.from_dict(json.loads('{"outer_lr": 1, "gap_penalty": {"strength": 2}, "timeout_s": 60}'))
    in_python = CO2Config(outer_lr=1.0, gap_penalty={"strength": 2.0}, timeout_s=60.0)
    assert from_json == in_python
    assert from_json.math_hash() == in_python.math_hash()
    assert isinstance(from_json.outer_lr, float) and isinstance(from_json.gap_penalty.strength, float)


def test_json_infinity_is_refused():
    with pytest.raises(ValueError, match="outer_lr"):
        CO2Config.from_dict(json.loads('{"outer_lr": Infinity}'))
