"""A config's keys as data: their names (`field_names`), the flat dict of run_config.json and config.json
(`to_dict`), and the internal `sources` field, where each explicitly given key came from (`set_sources`,
`sources_of`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from curvzo_ds.config.schema import TrainConfig, key_fields


def field_names(cls=TrainConfig) -> list[str]:
    return [f.name for f in key_fields(cls)]


def set_sources(cfg, sources: dict[str, str], files: list[str] | tuple = ()):
    """Record where each explicitly given key of `cfg` came from ("--set", "--config FILE") in its `sources` field,
    and the --config files in the order they were merged (`config_files`, which the run logs). The DeepSpeed mapping
    reads the sources: a key given there and set to another value by the DeepSpeed config is refused
    (docs/deepspeed.md). Neither goes into config.json (`to_dict`)."""
    cfg.sources = dict(sources)
    cfg.config_files = tuple(files)
    return cfg


def sources_of(cfg) -> dict[str, str]:
    return dict(getattr(cfg, "sources", None) or {})


def to_dict(cfg) -> dict[str, Any]:
    """The flat keys of `cfg` (run_config.json, config.json): `dataclasses.asdict` less the internal fields."""
    internal = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("internal")}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in internal}


__all__ = ["field_names", "set_sources", "sources_of", "to_dict"]
