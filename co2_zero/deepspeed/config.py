"""The DeepSpeed config: split off the "co2" section and validate it (docs/design.md §6.3).

DeepSpeed ignores unknown top-level keys, so a typo inside `co2` is only caught here, and a near miss of
the section's name ("CO2", "co_2") is refused rather than left to DeepSpeed to drop. Needs no process group.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from .. import configs
from ..core.config import CO2Config
from ..core.topology import Topology

ConfigLike = Union[str, os.PathLike, Mapping[str, Any]]


def _load_ds_config(config: ConfigLike) -> dict[str, Any]:
    """A DeepSpeed config (dict, path or base64 string, as DeepSpeed accepts it) as a fresh dict."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    _refuse_missing_file(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return dict(load_ds_config(os.fspath(config)))


def _refuse_missing_file(config: Union[str, os.PathLike]) -> None:
    """A config path that names no file (DeepSpeed would read it as base64 and fail with "Expected a string
    path to an existing deepspeed config"): say where it was looked for, and for a shipped config's name the
    file that works from any directory. A ".json" name or one with a directory is a path, never base64."""
    path = Path(os.fspath(config))
    if path.is_file() or not (path.suffix == ".json" or len(path.parts) > 1):
        return
    shipped = path.name in configs.names()
    hint = f"; the shipped {path.name} from any directory: co2_zero.configs.path({path.name!r})" if shipped else ""
    raise ValueError(
        f"co2: config={os.fspath(config)!r} is no file (relative paths start at {os.getcwd()}); accepted: the "
        f"path of a DeepSpeed JSON config, or a dict{hint}"
    )


def _config_source(config: ConfigLike) -> str:
    """How an error names the config it read: the file, or the kind of object."""
    if isinstance(config, Mapping):
        return "the DeepSpeed config dict"
    if os.path.isfile(config):
        return f"the DeepSpeed config {os.fspath(config)!r}"
    return "the DeepSpeed config string"


def _within_one_edit(word: str, target: str) -> bool:
    """Whether one insertion, deletion, substitution or swap of neighbours (or none) turns word into target."""
    if len(word) == len(target):
        diffs = [i for i, (a, b) in enumerate(zip(word, target)) if a != b]
        if len(diffs) <= 1:
            return True
        i, j = diffs[0], diffs[-1]
        return len(diffs) == 2 and j == i + 1 and word[i] == target[j] and word[j] == target[i]
    short, long = sorted((word, target), key=len)
    return len(long) == len(short) + 1 and any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _is_near_co2(key: Any) -> bool:
    """Whether a top-level config key other than "co2" is a misspelling of it: ignoring case, '_', '-' and
    spaces, and reading a zero as the letter O, it keeps the 2 and is one typo from "co2" ("CO2", "co_2",
    "Co-2", "c02", "c2o"). No DeepSpeed 0.19.8 config key comes within two edits of "co2" ("comm" is the
    nearest), so none is flagged."""
    if not isinstance(key, str) or key == "co2":
        return False
    word = "".join(c for c in key.lower() if c not in "_- ").replace("0", "o")
    return "2" in word and _within_one_edit(word, "co2")


def _refuse_misspelt_section(ds_config: Mapping[str, Any], source: str) -> None:
    """A misspelt `co2` section ("CO2", "co_2") would be ignored by DeepSpeed, and the run would train
    plain ZeRO without a word until `finalize()` is missing at the end: refuse it, naming the key."""
    for key in ds_config:
        if _is_near_co2(key):
            raise ValueError(
                f"co2 config: top-level key {key!r} in {source} is invalid; accepted: 'co2' (exactly: lower "
                f"case, no separator). DeepSpeed ignores unknown top-level keys, so with {key!r} this run "
                f"would train plain DeepSpeed, not CO2"
            )


def split_config(config: ConfigLike) -> tuple[dict[str, Any], Optional[CO2Config]]:
    """Split a DeepSpeed config into (the config without `co2`, the validated CO2Config or None).

    Raises ValueError naming the field for a bad `co2` section, for a top-level key that is a near miss
    of `co2` ("CO2", "co_2", "c02"; see `_is_near_co2`), and for a ZeRO stage other than 1 or 2 when a
    `co2` section is present. Needs no process group: scripts can call it to fail early.

    Args:
        config: a DeepSpeed config as a dict or a path to its JSON file.

    Returns:
        `(config without "co2", CO2Config or None)`.

    Raises:
        ValueError: the `co2` section is invalid (naming the field, the value and what is accepted), a
            top-level key is a near miss of `co2`, or `zero_optimization.stage` is not 1 or 2 while a
            `co2` section is present.
    """
    ds_config = _load_ds_config(config)
    _refuse_misspelt_section(ds_config, _config_source(config))
    section = ds_config.pop("co2", None)
    if section is None:
        return ds_config, None
    co2 = CO2Config.from_dict(section)
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage not in (1, 2):
        raise ValueError(
            f"co2 config: zero_optimization.stage={stage!r} is invalid with a co2 section; accepted: 1 or 2. "
            f"CO2 needs each rank's fp32 master partition (ZeRO-1/2); stage 0 has no partition and ZeRO-3 "
            f"partitions the parameters themselves, which CO2 does not support"
        )
    return ds_config, co2


def _per_replica_batch(ds_config: dict[str, Any], topology: Topology) -> None:
    """`train_batch_size` in the JSON is global (all N ranks), as in plain DeepSpeed; DeepSpeed sees one
    replica (its data-parallel world is S), so give it the replica's share."""
    total = ds_config.get("train_batch_size")
    if total is None:
        return
    if isinstance(total, bool) or not isinstance(total, int) or total % topology.replicas:
        raise ValueError(
            f"co2 config: train_batch_size={total!r} is invalid; accepted: a multiple of the number of "
            f"replicas R={topology.replicas} (it counts samples per optimizer step over all "
            f"{topology.world_size} ranks)"
        )
    ds_config["train_batch_size"] = total // topology.replicas
