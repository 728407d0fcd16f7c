"""A run's configuration, resolved once: presets, then the DeepSpeed config, then one validation, then frozen; and
the engine's part of it (`zo_part`, `engine_config`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from curvzo_ds.config.ds_config import MAPPED_FIELDS, resolve_ds_config
from curvzo_ds.config.fields import field_names, sources_of, to_dict
from curvzo_ds.config.presets import preset_values
from curvzo_ds.config.schema import TrainConfig, ZOConfig, freeze


def resolve(cfg: TrainConfig, *, world_size: int | None = None, hidden_size: int | None = None,
            user_ds: dict | None = None, where: str = "the deepspeed config", notes: list[str] | None = None,
            ds_out: dict | None = None, chosen: dict | None = None) -> TrainConfig:
    """A new, resolved (validated and frozen) config from `cfg`, which is not changed.

    1. presets (`preset_values`): the keys left `None` that depend on the model and LoRA, filled once: a config
       that is already resolved has them;
    2. the DeepSpeed config `user_ds` mapped onto the batch, dtype and ZeRO keys (`resolve_ds_config`), only when
       `world_size` is given (the ranks' shard-group size): the mapping checks every value it sets, and refuses a
       key given explicitly (`cfg`'s sources) that it would set otherwise;
    3. one `validate()`, unless `cfg` is already resolved; validate needs no world size, so the CLI resolves
       before the process group starts (a bad value: exit 2, one line), and the build (train/build.py) resolves
       again with the world size, which only maps the DeepSpeed config;
    4. frozen: assigning a key raises dataclasses.FrozenInstanceError; the engine does not validate it again.

    `notes` (a list) receives the mapping's warnings and `ds_out` (a dict) the config for deepspeed.initialize.
    """
    # replace keeps `sources` and drops `resolved`; `chosen`: values decided for this run's ranks (the layout that
    # zero_stage/shard_group_size "auto" takes, layout/choice.py's choose_layout), valid by construction.
    new = dataclasses.replace(cfg, **{**({} if cfg.resolved else preset_values(cfg)), **(chosen or {})})
    if world_size is not None:
        ds, mapped, warnings = resolve_ds_config(user_ds, world_size, hidden_size, explicit=sources_of(cfg),
                                                 where=where, **{k: getattr(new, k) for k in MAPPED_FIELDS})
        new = dataclasses.replace(new, **mapped)
        if notes is not None:
            notes.extend(warnings)
        if ds_out is not None:
            ds_out.update(ds)
    if not cfg.resolved:
        new.validate()
    return freeze(new)


def resolve_run(cfg: TrainConfig, *, world_size: int, hidden_size: int | None, user_ds: dict | None,
                where: str = "the deepspeed config", chosen: dict | None = None
                ) -> tuple[TrainConfig, dict[str, Any], list[str]]:
    """(resolved config, config for deepspeed.initialize, the mapping's warnings): `resolve` for train.build's run."""
    notes: list[str] = []
    ds: dict[str, Any] = {}
    out = resolve(cfg, world_size=world_size, hidden_size=hidden_size, user_ds=user_ds, where=where, notes=notes,
                  ds_out=ds, chosen=chosen)
    return out, ds, notes


def zo_part(cfg: TrainConfig) -> ZOConfig:
    """The engine's keys of `cfg`, resolved if `cfg` is (TrainConfig's checks include ZOConfig's)."""
    names = set(field_names(ZOConfig))
    part = ZOConfig(**{k: v for k, v in to_dict(cfg).items() if k in names})
    return freeze(part) if cfg.resolved else part


def engine_config(config: ZOConfig | None, overrides: dict[str, Any]) -> ZOConfig:
    """ZOEngine's own copy of `config` (default: ZOConfig()) with its keyword `overrides`, resolved: validated
    unless it was resolved already (config.resolve validated it once), then frozen. A public
    `ZOEngine(model, loss_fn, ZOConfig(...))` with a bad value fails here, naming it."""
    cfg = copy.deepcopy(config) if config is not None else ZOConfig()
    names = set(field_names(type(cfg)))
    for name in overrides:
        if name not in names:
            raise ValueError(f"unknown ZOEngine option {name!r}")
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)  # a new, unresolved config: validated below
    missing = [k for k in ("learning_rate", "zo_eps", "max_steps", "rate_correction") if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} unset: a TrainConfig's presets are resolved by the CLI "
                         "(config.resolve); set them or pass a ZOConfig")
    if not cfg.resolved:
        cfg.validate()
    return freeze(cfg)
