"""The presets: the values of `TrainConfig`'s `None` defaults that depend on the kind of run (a demo model or
another, LoRA or every parameter; docs/config.md: MeZO's defaults), filled once by `config.resolve`."""

from __future__ import annotations

import dataclasses
from typing import Any

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.tasks.tokenizer import DEMO_MODELS  # the demo models' names (and their tokenizers' kinds)


def preset_values(cfg: TrainConfig) -> dict[str, Any]:
    """The values of the `None` defaults that depend on the kind of run (docs/config.md: MeZO's defaults), for
    `dataclasses.replace`; `cfg` is not changed."""
    demo = cfg.model in DEMO_MODELS
    out: dict[str, Any] = {}
    if cfg.learning_rate is None and cfg.step_normalization != "none":
        out["learning_rate"] = 1e-3  # eta, a step length in units of z (not MeZO's rate): its measured start
    elif cfg.learning_rate is None:
        out["learning_rate"] = (1e-2 if cfg.lora else 3e-4) if demo else (5e-5 if cfg.lora else 1e-6)
    if cfg.zo_eps is None:
        out["zo_eps"] = 1e-2 if demo or cfg.lora else 1e-3
    if cfg.max_steps is None:
        out["max_steps"] = 300 if demo else 20000
    if cfg.rate_correction is None:  # the demo's rate was chosen for the paper's step; elsewhere it is MeZO's
        out["rate_correction"] = "none" if demo else "max_weight"
    if demo and cfg.eval_steps == 500:
        out["eval_steps"] = 100
    if demo and cfg.save_steps == 500:
        out["save_steps"] = 100
    if cfg.lora_target_modules is None:
        out["lora_target_modules"] = ["q_proj", "v_proj"]
    elif isinstance(cfg.lora_target_modules, str):
        out["lora_target_modules"] = [m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()]
    return out


def resolve_presets(cfg: TrainConfig) -> TrainConfig:
    """A copy of `cfg` with its presets filled (`preset_values`); `cfg` itself is not changed. A resolved config
    (presets already filled) is returned as it is."""
    values = preset_values(cfg)
    return dataclasses.replace(cfg, **values) if values else cfg


__all__ = ["DEMO_MODELS", "preset_values", "resolve_presets"]
