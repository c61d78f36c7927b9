"""A load: collective; rank 0 chooses the checkpoint, every rank validates everything it needs with
nothing changed, and only when every rank succeeded and all read the same save does any rank apply
(docs/design.md §7). A refused load ends on every rank with one CO2Error and changes nothing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..core import support
from ..core.config import PUBLISHED, CO2Config, dotted
from ..core.errors import CO2Error, refusal
from ..core.pace import Pace
from ..core.support import Unsupported
from ..core.topology import text_words, words_text
from .agreement import (
    SEEN_WORDS,
    TAG_WORDS,
    UNSEEN,
    Agreement,
    SaveSeen,
    problem_words,
    raise_failed,
    refuse_different_saves,
    refuse_unusable_engine,
    seen_in,
)
from .files import PathLike, check_tag, describe, file_digest, load_file
from .format import LATEST, MARKER, RANK_FILE, clean_temp_files, complete_checkpoints, parse_marker, tidy
from .record import (
    FrameworkState,
    Refused,
    apply_record,
    check_module,
    check_record,
    framework_state,
    module_for_here,
    saved_pieces,
    write_module,
)
from .resharding import consolidate, reshard, stand_in_cost


def load(
    directory: PathLike, model: torch.nn.Module, optimizer: Any, reshard: bool = False, tag: Optional[str] = None
) -> Any:
    """Load a complete checkpoint written by `save` (collective); returns its `extra`.

    Without `tag`: the one `latest_co2` names, else the newest complete one; never a partial one. Same
    topology: every rank restores its own file and the run continues bit for bit. `reshard=True`
    assembles the CO2 state per parameter tensor from every rank's file, so R, S and the integration may
    differ from the saved run's: training resumes at its last round start (with a sync delay, the arrived
    average applied at once), each replica from its rebuilt stand-in, the inner optimizer state fresh. A
    refused load (CO2Error on every rank) changes nothing.

    Args:
        directory: the checkpoint root given to `save`.
        model: the module to restore, built as in the saved run (or for the new layout with `reshard`).
        optimizer: a `CO2Optimizer` or `co2_zero.fairscale.CO2OSS` over `model`.
        reshard: load a checkpoint of another R x S or integration.
        tag: load this checkpoint instead of the newest complete one.

    Returns:
        The `extra` given to `save`.

    Raises:
        CO2Error: on every rank, when there is no complete checkpoint, or any rank's file is missing,
            damaged or from another config or grid (naming the rank, the file and what was wrong).
    """
    loaded = load_checkpoint(directory, framework_state(model, optimizer), tag=tag, reshard=reshard)
    if loaded is None:
        raise refusal(f"co2 checkpoint: no complete checkpoint in {directory}; nothing was loaded")
    return loaded[1]


def load_checkpoint(
    directory: PathLike,
    framework: FrameworkState,
    tag: Optional[str] = None,
    reshard: bool = False,
) -> Optional[tuple[Path, Any]]:
    """Load one complete checkpoint on every rank (collective): returns (its directory, its extra), or
    None when `directory` holds no complete checkpoint at all. Raises CO2Error on every rank when any
    rank cannot load it; nothing was changed then. Protocol: co2_zero.checkpoint, docs/design.md §7."""
    engine = framework.engine
    root = Path(directory)
    refuse_unusable_engine(engine, "load from", root)
    agreement = Agreement(engine, "load from", root)
    agreement.consequence = "Nothing was loaded: the model, the optimizers and the CO2 state are unchanged."
    try:
        clean_temp_files(root, agreement.rank, agreement.world)
    except OSError:
        pass  # cleaning is a courtesy; the load does not depend on it
    chosen = _agree_on_choice(agreement, root, tag)
    if chosen is None:
        return None
    where = root / chosen
    agreement.where = where
    try:
        plan, problem = _prepare(where, framework, reshard), None
    except Refused as refusal:
        plan, problem = None, str(refusal)
    except Exception as error:  # a malformed file can fail anywhere; every rank must still hear of it
        plan, problem = None, f"{where.name}: {describe(error)}"
    _agree_to_apply(agreement, plan, problem)
    assert plan is not None
    plan.apply()
    tidy(root, agreement.rank)  # every rank agreed on the markers: what none names is a leftover
    return where, plan.extra


class _Choice(NamedTuple):
    tag: Optional[str]  # None: nothing to load
    problem: Optional[str]  # a reason to refuse, for every rank


def _choose(root: Path, tag: Optional[str]) -> _Choice:
    """Rank 0's choice of the checkpoint to load."""
    complete = dict(complete_checkpoints(root))
    if tag is not None:
        tag = check_tag(tag)
        if tag in complete:
            return _Choice(tag, None)
        state = "does not exist" if not (root / tag).exists() else f"is incomplete (no valid {MARKER})"
        found = f"complete checkpoints there: {sorted(complete)}" if complete else "no complete checkpoint there"
        return _Choice(None, f"{root / tag} {state} (in {root.resolve()}: {found})")
    latest = root / LATEST
    if latest.is_file():
        named = latest.read_text().strip()
        try:
            check_tag(named)
        except ValueError:
            return _Choice(None, f"{latest} names {named[:80]!r}, which is not a tag inside {root}; refused")
        if named in complete:
            return _Choice(named, None)
        warnings.warn(
            f"co2 checkpoint: {latest} names {named!r}, which is not a complete checkpoint; loading the newest "
            f"complete one instead",
            stacklevel=4,
        )
    if not complete:
        return _Choice(None, None)
    return _Choice(list(complete)[-1], None)


def _agree_on_choice(agreement: Agreement, root: Path, tag: Optional[str]) -> Optional[str]:
    """Rank 0 chooses the tag to load (`_choose`) and every rank receives it; None: nothing to load.
    CO2Error on every rank when rank 0 refuses."""
    kind, chosen, problem = 0, "", ""
    if agreement.rank == 0:
        try:
            choice = _choose(root, tag)
            kind = 2 if choice.problem else (1 if choice.tag is None else 0)
            chosen, problem = choice.tag or "", choice.problem or ""
        except Exception as error:
            kind, problem = 2, f"{root}: {describe(error)}"
    table = agreement.exchange([kind, *text_words(chosen, TAG_WORDS), *problem_words(problem)], "load: choose")
    kind, chosen = table[0][0], words_text(table[0][1 : 1 + TAG_WORDS])
    if kind == 2:
        raise refusal(
            f"co2 checkpoint load from {root} refused: {words_text(table[0][1 + TAG_WORDS :])}. {agreement.consequence}"
        )
    return None if kind == 1 else chosen


def _agree_to_apply(agreement: Agreement, plan: Optional[_Plan], problem: Optional[str]) -> None:
    """The last exchange of a load: every rank validated, and every rank is about to apply the same save
    (save id, step, marker digest: a rank with a stale or non-shared view of the directory would
    otherwise resume elsewhere). Else CO2Error on every rank, before any rank changed anything."""
    seen = UNSEEN if plan is None else plan.seen
    table = agreement.exchange(
        [int(problem is not None), *seen.words(), *problem_words(problem)], "load: every rank validated"
    )
    refuse_different_saves(agreement, [SaveSeen.from_words(row[1 : 1 + SEEN_WORDS]) for row in table])
    raise_failed(agreement, [(r, row[0], row[1 + SEEN_WORDS :]) for r, row in enumerate(table)])


class _Plan(NamedTuple):
    """What a rank will write once every rank validated, and the save it comes from."""

    apply: Callable[[], None]
    extra: Any
    seen: SaveSeen = UNSEEN


def _open(directory: Path, marker: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s payload, after checking it against the marker; raises Refused naming the file."""
    files = marker.get("files", [])
    entry = files[rank] if 0 <= rank < len(files) else None
    if not isinstance(entry, dict) or not RANK_FILE.fullmatch(str(entry.get("name"))):
        raise Refused(f"{directory / MARKER}: no valid entry for rank {rank}")
    path = directory / entry["name"]
    try:
        size, digest = file_digest(path)
    except OSError as error:
        raise Refused(f"{entry['name']}: missing or unreadable ({describe(error)})") from error
    if size != entry.get("bytes") or digest != entry.get("sha256"):
        raise Refused(
            f"{entry['name']}: {size} bytes with SHA-256 {digest[:12]}..., the marker says {entry.get('bytes')} "
            f"bytes with {str(entry.get('sha256'))[:12]}... (empty, truncated or damaged)"
        )
    try:
        payload = load_file(path)
    except Exception as error:
        raise Refused(f"{entry['name']}: {describe(error)}") from error
    if not isinstance(payload, dict) or not isinstance(payload.get("identity"), dict):
        raise Refused(f"{entry['name']}: not a co2_zero checkpoint file (no identity record)")
    identity = payload["identity"]
    for key in ("format", "save_id", "run_id", "tag", "integration", "config_hash", "grid", "world_size"):
        if identity.get(key) != marker.get(key):
            raise Refused(f"{entry['name']}: {key}={identity.get(key)!r} but the marker says {marker.get(key)!r}")
    if identity.get("rank") != rank:
        raise Refused(f"{entry['name']}: written by rank {identity.get('rank')!r}, listed for rank {rank}")
    return payload


def _prepare(directory: Path, framework: FrameworkState, resharding: bool) -> _Plan:
    """Everything that can fail, with nothing changed yet: read and check what this rank needs."""
    engine = framework.engine
    try:
        engine.state_dict()  # usable (not failed, not finalized), and no round in flight any more
    except CO2Error as error:
        raise Refused(str(error)) from error
    try:
        raw = (directory / MARKER).read_bytes()
        marker = parse_marker(raw)
    except Exception as error:
        raise Refused(f"{directory / MARKER}: {describe(error)}") from error
    prepare = _prepare_resharded if resharding else _prepare_same
    return prepare(directory, marker, framework)._replace(seen=seen_in(raw, marker))


def _prepare_resharded(directory: Path, marker: dict[str, Any], framework: FrameworkState) -> _Plan:
    """Every rank's file of the saved run, consolidated and re-cut for this rank (`reshard`); the module's
    buffers and frozen parameters from the saved replica of rank `rank % saved world`."""
    engine = framework.engine
    topology = engine.topology
    saved_world, saved_shards = _saved_layout(directory, marker, engine)
    paced = engine.config.replica_tau is not None
    trainable = {n for n, p in framework.module.named_parameters(remove_duplicate=False) if p.requires_grad}
    needed = set(framework.module.state_dict()) - trainable
    # Buffers, frozen parameters and the framework's state come from the saved rank `source_rank`: whole
    # from that rank's file, FSDP2 rows from every file of its replica. With replica_tau, a rank of the same
    # replica (its own step counts); else the rank `rank % saved world`.
    source_rank = topology.rank % saved_world
    if paced:
        source_rank = topology.replica_index * saved_shards + topology.shard_index % saved_shards
    shares, source, pieces = [], None, {}
    for saved_rank in range(saved_world):
        payload = _open(directory, marker, saved_rank)
        name = marker["files"][saved_rank]["name"]
        try:
            shares.append(consolidate(payload["co2"]))
        except Exception as error:
            raise Refused(f"{name}: the co2 state cannot be consolidated ({describe(error)})") from error
        if saved_rank // saved_shards == source_rank // saved_shards:
            for key, piece in saved_pieces(payload, name, needed, whole=saved_rank == source_rank).items():
                pieces.setdefault(key, []).append(piece)
        if saved_rank == source_rank:
            source = (name, payload)
        del payload
    name, payload = source
    try:
        pace = Pace.of(engine.config, topology.replicas)
        state, dropped = reshard(shares, engine.identity(), engine.config.steps_before_apply, pace)
        engine.check_state_dict(state)
    except ValueError as error:
        raise Refused(f"{directory.name}: {error}") from error
    cost = stand_in_cost(shares, state, keeps_copy=engine.keeps_own_momentum)
    module_state = module_for_here(framework, pieces, needed, name)
    same_framework = payload["identity"].get("integration") == framework.integration
    saved_framework = payload["framework"] if same_framework else None

    def apply() -> None:
        if dropped:
            warnings.warn(
                f"co2 resharding: {dropped} step(s) after the saved run's last round end are dropped; training "
                f"resumes at its last round start (step {state['inner_steps']})",
                stacklevel=4,
            )
        if cost is not None:
            warnings.warn(cost, stacklevel=4)
        write_module(framework, module_state, strict=False)
        engine.load_state_dict(state)
        engine.restart_round()
        framework.after_reshard(saved_framework)

    return _Plan(apply, payload["extra"])


def _saved_layout(directory: Path, marker: dict[str, Any], engine: Any) -> tuple[int, int]:
    """The saved run's world size and shards per replica, refused where a resharded load cannot go from them
    to this run (another number of replicas with `replica_tau`, another co2 config)."""
    saved_world, saved_grid = marker.get("world_size"), marker.get("grid")
    saved_shards = saved_grid.get("shards") if isinstance(saved_grid, dict) else None
    if not isinstance(saved_world, int) or not isinstance(saved_shards, int) or not 0 < saved_shards <= saved_world:
        raise Refused(f"{directory / MARKER}: world_size={saved_world!r}, grid={saved_grid!r}")
    try:
        check_replicas_kept(engine.config, saved_world // saved_shards, engine.topology.replicas)
    except Unsupported as error:
        raise Refused(f"{directory.name}: {error}") from error
    if marker.get("config_hash") != engine.config.math_hash():  # resharding keeps the config: say what differs
        fields = _config_difference(marker.get("config"), engine.config)
        raise Refused(
            f"{directory.name}: {fields}resharding needs the same co2 config; {_config_hint(marker.get('config_hash'))}"
        )
    return saved_world, saved_shards


def check_replicas_kept(config: CO2Config, saved_replicas: int, replicas: int) -> None:
    """Raise `Unsupported` where the support table refuses a resharded load of a run of `saved_replicas` replicas
    at `replicas` under `config` (`replica_tau`: each replica's steps belong to its place)."""
    facts = {"replicas_changed": saved_replicas != replicas, "saved_replicas": saved_replicas, "replicas": replicas}
    support.check({**config.leaves(), **facts})


def _config_hint(saved_hash: Any) -> str:
    """What to resume with when the co2 config differs: the same config; for a checkpoint saved under CO2 as
    published, the preset that holds it."""
    if saved_hash == CO2Config(**PUBLISHED).math_hash():
        return (
            "it was saved under CO2 as published: resume with co2_zero.core.config.PUBLISHED "
            "(CO2Config(**PUBLISHED), or train_lm's --method co2_published; docs/configuration.md)"
        )
    return "resume with the same co2 config (the defaults and presets: docs/configuration.md)"


def _config_difference(saved: Any, config: CO2Config) -> str:
    """The co2 config fields that differ from the checkpoint's, each with both values ("" for a checkpoint
    without that record); a field left out is at its neutral value, the one that changes nothing. Compact:
    a refusal travels between ranks in 512 bytes."""
    if not isinstance(saved, dict):
        return ""
    before, now = (dotted(json.loads(json.dumps(fields))) for fields in (saved, config.math_fields()))  # as JSON
    differ = [name for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name)]

    def value(fields: dict[str, Any], name: str) -> str:
        return repr(fields[name]) if name in fields else "neutral"

    shown = ", ".join(f"{n} {value(before, n)} -> {value(now, n)}" for n in differ)
    return f"co2 config fields differ (checkpoint -> here): {shown}; "


def _prepare_same(directory: Path, marker: dict[str, Any], framework: FrameworkState) -> _Plan:
    engine = framework.engine
    topology = engine.topology
    here = {
        "integration": framework.integration,
        "config_hash": engine.config.math_hash(),
        "grid": {"replicas": topology.replicas, "shards": topology.shards},
        "world_size": topology.world_size,
    }
    for key, value in here.items():
        if marker.get(key) != value:
            hint = _config_hint(marker.get(key)) if key == "config_hash" else "or pass reshard=True"
            fields = _config_difference(marker.get("config"), engine.config) if key == "config_hash" else ""
            raise Refused(
                f"{directory.name}: {fields}{key}={marker.get(key)!r} in the checkpoint, {value!r} here; {hint}"
            )
    payload = _open(directory, marker, topology.rank)
    name = marker["files"][topology.rank]["name"]
    try:
        check_record(framework, payload, {"co2": name, "framework": name})  # as the optimizers' load_state_dict
    except ValueError as error:
        raise Refused(str(error)) from error
    needed = set(framework.module.state_dict()) - framework.module_excluded()
    check_module(framework, payload, needed, name)
    unknown = sorted(set(payload["module"]) - needed)
    if unknown:
        raise Refused(f"{name}: the module state has entries this model lacks: {unknown[:5]}")

    def apply() -> None:
        write_module(framework, payload["module"], strict=not framework.module_excluded())
        apply_record(framework, payload)

    return _Plan(apply, payload.get("extra"))
