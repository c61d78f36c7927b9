"""The shipped DeepSpeed configs with a "co2" section, as package data.

They are installed with the package (`pip install co2_zero` has them too) and are the files the checkout's
top-level `configs/` links to; `ds_zero2_co2_hf.json` is the Hugging Face Trainer's ("auto" for what the Trainer
fills in; examples/ links to it). `path("ds_zero2_co2.json")` gives a file DeepSpeed can read:

    import co2_zero.configs, co2_zero.deepspeed
    co2_zero.deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=co2_zero.configs.path("ds_zero2_co2.json"))
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["names", "path"]


def names() -> list[str]:
    """The shipped config file names, sorted."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def path(name: str) -> Path:
    """The file of a shipped DeepSpeed config, for `co2_zero.deepspeed.initialize(config=...)`.

    Args:
        name: "ds_zero2_co2.json"; "configs/ds_zero2_co2.json" and the name without ".json" work too.

    Returns:
        The installed file (in a checkout: co2_zero/configs/<name>, which configs/ links to).

    Raises:
        ValueError: naming the shipped configs, for any other name.
    """
    stem = Path(name).name
    file = stem if stem.endswith(".json") else f"{stem}.json"
    if file not in names():
        raise ValueError(f"co2: no shipped config {name!r}; accepted: one of {names()}")
    return Path(str(resources.files(__name__) / file))
