"""What combines with what: every refused combination of settings as one row of `TABLE`.

A row names the setting it refuses (`subject`), the settings it is refused with (`context`), what to set
instead and why. `check(facts)` raises `Unsupported` for the first row whose conditions all hold; a row
naming a fact that `facts` lacks is left for a later check that knows it. The facts are the `CO2Config`
fields by dotted name (as given), the plan's resolved choices as `plan.<field>` (`co2_zero.core.plan`),
and where the config runs: `integration`, `driver` (what counts the steps), `elastic`, `replicas`,
`float_buffers`, and for a resharded checkpoint load `replicas_changed` (with `saved_replicas`). `CO2Config`
checks the rows that need only its fields when it is built; the plan checks every row when the optimizer
is built, and `checkpoint.load` the rows of a resharded load. A single field's type and range are the schema's
(`co2_zero.core.config`); docs/configuration.md's support matrix is generated from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import CO2Error


class Unsupported(CO2Error, ValueError):
    """A combination of settings that `TABLE` refuses; the message names each setting, its value, why,
    and what to set instead. A ValueError (bad configuration) and a CO2Error (the library refuses)."""


_JSON_WORDS = {None: "null", True: "true", False: "false"}  # as a "co2" section spells them


@dataclass(frozen=True)
class Values:
    """A condition on one fact: its value is one of `values` (or, `besides`, none of them)."""

    values: tuple[Any, ...]
    besides: bool = False

    def holds(self, value: Any) -> bool:
        return (value in self.values) != self.besides

    def __str__(self) -> str:
        shown = ", ".join(
            _JSON_WORDS.get(v, repr(v)) if isinstance(v, (bool, type(None))) else repr(v) for v in self.values
        )
        return f"not {shown}" if self.besides else shown


def one_of(*values: Any) -> Values:
    return Values(values)


def besides(*values: Any) -> Values:
    return Values(values, besides=True)


@dataclass(frozen=True)
class Refusal:
    """One refused combination: `subject` in `refused` together with every `context` condition."""

    subject: str
    refused: Values
    context: tuple[tuple[str, Values], ...]
    accepted: str  # what to set instead; `{tau}` is filled in from the facts
    why: str

    def __str__(self) -> str:
        """The combination in words: `subject: values with name: values and ...`."""
        context = " and ".join(f"{name}: {values}" for name, values in self.context)
        return f"{self.subject}: {self.refused} with {context}"

    def applies(self, facts: Mapping[str, Any]) -> bool:
        conditions = ((self.subject, self.refused), *self.context)
        return all(name in facts for name, _ in conditions) and all(c.holds(facts[n]) for n, c in conditions)

    def message(self, facts: Mapping[str, Any]) -> str:
        context = " and ".join(describe(name, facts) for name, _ in self.context)
        accepted = self.accepted.format(tau=facts.get("tau"))
        refused = f"{describe(self.subject, facts)} is not supported with {context}"
        return f"co2 config: {refused} ({self.why}); accepted: {accepted}"


# How the facts that are not config fields read in a message.
INTEGRATIONS = {
    "plain": "a plain CO2Optimizer (every rank its own replica)",
    "fsdp2": "CO2Optimizer over FSDP2",
    "fairscale": "FairScale OSS (co2_zero.fairscale.CO2OSS)",
    "deepspeed": "DeepSpeed ZeRO (co2_zero.deepspeed.initialize, HF Trainer, Lightning's CO2DeepSpeedStrategy)",
}
DRIVERS = {
    "lightning": "Lightning's CO2Strategy (its Trainer runs the same steps on every replica)",
    "co2-train": "co2-train",
    "hf-trainer": "Hugging Face Trainer with CO2Callback (it runs the same steps on every replica)",
}
ELASTIC_ONES = (
    "CO2Optimizer over plain parameters (one rank per replica launch) or CO2Optimizer over FSDP2 (fully_shard on "
    "co2_zero.fsdp.replica_mesh, the replica's S ranks one launch)"
)


def _show(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def describe(name: str, facts: Mapping[str, Any]) -> str:
    """`name` and its value in `facts` as a message says it."""
    value = facts[name]
    if name == "integration":
        return INTEGRATIONS.get(value, repr(value))
    if name == "driver":
        return DRIVERS.get(value, repr(value))
    if name == "elastic":
        return "an elastic membership (membership=)" if value else "no membership"
    if name == "replicas":
        return f"R={value} replicas in this launch"
    if name == "replicas_changed":
        return f"a resharded load from R={facts['saved_replicas']} to R={facts['replicas']} replicas"
    if name == "float_buffers":
        return f"a model with {value} float buffer(s) (e.g. BatchNorm statistics)"
    if name.startswith("plan."):
        given = name.removeprefix("plan.")
        shown = f"{given}={_show(facts[given])}" if given in facts else given
        return shown if given in facts and facts[given] == value else f"{shown} (resolved: {_show(value)})"
    return f"{name}={_show(value)}"


def _row(subject: str, refused: Values, accepted: str, why: str, **context: Values) -> Refusal:
    """A row; `context` by fact name, a dotted or `plan.` name spelt with `__` for the dot."""
    named = tuple((name.replace("__", "."), values) for name, values in context.items())
    return Refusal(subject, refused, named, accepted, why)


_SPARSE, _DENSE, _SET = besides(1.0), one_of(1.0), besides(None)
_STEP = besides(None, "auto")
_UNTESTED = "the token-weighted average is built and tested without it"
_ELASTIC = one_of(True)
_FIXED_OWNERS = (
    "the compressed exchanges run on the job's fixed set of replicas (each owns pieces of the average), not on "
    "each round's quorum"
)

TABLE: tuple[Refusal, ...] = (
    # the exchange
    _row(
        "collective",
        one_of("reduce_scatter", "all_reduce"),
        "'auto' or 'all_gather', or topk: 1.0",
        "a sparse exchange cannot be summed along a ring; its payloads are all-gathered",
        topk=_SPARSE,
    ),
    _row(
        "collective",
        one_of("all_gather"),
        "'auto', 'reduce_scatter' or 'all_reduce', or topk < 1",
        "all_gather carries only a sparse exchange",
        topk=_DENSE,
    ),
    _row(
        "feedback_decay",
        besides(1.0, "auto"),
        "1.0 or 'auto', or topk < 1",
        "the dense formats keep their whole residual",
        topk=_DENSE,
    ),
    # the schedule and the stand-ins (docs/design.md §3)
    _row(
        "sync_delay",
        _STEP,
        "null or 'auto' (both: at once), or overlap: true",
        "a blocking round applies its average at once",
        overlap=one_of(False),
    ),
    _row(
        "overlap",
        one_of(False),
        "true, or stand_in: 'auto' or 'shared'",
        "a blocking round has no average in flight to stand in for",
        stand_in=one_of("local"),
    ),
    _row(
        "plan.collective",
        one_of("reduce_scatter"),
        "collective: 'all_reduce' (or topk < 1, which all-gathers), "
        "or stand_in: 'shared' with an outer step for it (co2_zero.core.config.PUBLISHED's)",
        "the local stand-in would follow a copy of the outer momentum that a clipped step leaves unknown",
        clip__mode=besides("none"),
        plan__stand_in=one_of("local"),
    ),
    # replicas of different speeds (docs/design.md §3)
    _row("sync_delay", _STEP, "null or 'auto' (the round end: rounds differ in length)", _UNTESTED, replica_tau=_SET),
    _row("comm_dtype", one_of("bf16"), "'fp32', 'int8', 'fp8', 'int4' or 'int2'", _UNTESTED, replica_tau=_SET),
    _row(
        "replica_tau",
        _SET,
        "null",
        "each replica has to run rounds x its own steps_per_round steps; a loop of your own runs it, or co2-train",
        driver=one_of("lightning", "hf-trainer"),
    ),
    _row(
        "replica_tau",
        _SET,
        "null; or CO2Optimizer with the membership in a loop of your own",
        "co2-train's elastic replicas count their own steps, and with 'auto' each round's differ",
        driver=one_of("co2-train"),
        elastic=_ELASTIC,
    ),
    _row(
        "replica_tau",
        besides(None, "auto"),
        "null or 'auto' (each replica measures its own steps per round)",
        "a list is keyed by the replica's place in a fixed grid, and each round's quorum changes who is averaged",
        elastic=_ELASTIC,
    ),
    _row(
        "replica_tau",
        _SET,
        "null, or resume with the saved run's number of replicas (any number of shards per replica)",
        "each replica's steps and data position belong to its place among the replicas",
        replicas_changed=one_of(True),
    ),
    # where the config runs
    _row(
        "shards_per_replica",
        besides("node", 1),
        "1 or 'node' (read as 1); shard a replica with FSDP2 "
        "(co2_zero.fsdp.replica_mesh), co2_zero.fairscale.CO2OSS or co2_zero.deepspeed",
        "it cannot shard a replica",
        integration=one_of("plain"),
    ),
    # elastic replicas (docs/elastic.md)
    _row(
        "elastic",
        _ELASTIC,
        ELASTIC_ONES,
        "elastic training runs on CO2Optimizer only",
        integration=one_of("fairscale", "deepspeed"),
    ),
    _row("topk", _SPARSE, "1.0", _FIXED_OWNERS, elastic=_ELASTIC),
    _row("comm_dtype", besides("fp32", "bf16"), "'fp32' or 'bf16'", _FIXED_OWNERS, elastic=_ELASTIC),
    _row(
        "plan.collective",
        besides("all_reduce"),
        "collective: 'all_reduce' (or 'auto' on gloo)",
        "every replica keeps the whole partition's outer state, so a lost replica takes nothing with it",
        elastic=_ELASTIC,
    ),
    _row("overlap", one_of(False), "true", "elastic mode runs CO2's overlapped rounds", elastic=_ELASTIC),
    _row(
        "plan.sync_delay",
        one_of("fixed"),
        "'auto' (the round end there), null, or the value of tau ({tau})",
        "a quorum is formed and healed at round ends, where the average in flight is applied",
        elastic=_ELASTIC,
    ),
    _row(
        "float_buffers",
        besides(0),
        "a model without float buffers, or no membership",
        "elastic mode does not average buffers across replicas",
        elastic=_ELASTIC,
    ),
    _row(
        "replicas",
        besides(1),
        "one replica per launch (one torchrun per replica, its ranks the replica's shards)",
        "each replica group is its own launch",
        elastic=_ELASTIC,
    ),
)


def refusal(facts: Mapping[str, Any]) -> Refusal | None:
    """The first row of `TABLE` that refuses `facts`, or None."""
    return next((row for row in TABLE if row.applies(facts)), None)


def check(facts: Mapping[str, Any]) -> None:
    """Raise `Unsupported` naming the settings of the first row of `TABLE` that refuses `facts`."""
    row = refusal(facts)
    if row is not None:
        raise Unsupported(row.message(facts))
