"""The configuration in sections: each component is built from its own section (issue 36).

The keys stay flat (`--set KEY=VALUE`, run_config.json); `SECTIONS` names the one section each key belongs to, and
`section(cfg, name)` gives a component that section's keys as a frozen object. docs/config.md lists the keys by
section (tools/make_docs.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from curvzo_ds.config.schema import TrainConfig

SECTIONS: dict[str, tuple[str, ...]] = {
    # The zeroth-order step: SPSA, its schedule, the blocks and the precision of the update.
    "engine": ("seed", "learning_rate", "zo_eps", "weight_decay", "lr_scheduler_type", "auto_rate_fraction",
               "auto_rate_probes", "plateau_factor", "plateau_patience", "max_steps",
               "block_granularity", "block_chunk_size", "fp32_master_weights", "num_directions", "difference",
               "step_normalization", "perturbation", "static_mask", "static_mask_batches", "max_consecutive_skips"),
    # Which blocks a step perturbs: the method, the budget rule and the curvature scores.
    "sampler": ("method", "budget_min", "budget_max", "budget_alpha", "budget", "budget_unit", "score_beta",
                "budget_floor", "rate_correction", "score_estimator", "score_init", "score_warmup_steps"),
    "model": ("model", "tokenizer", "trust_remote_code", "dtype", "lora", "lora_r", "lora_alpha",
              "lora_target_modules", "quantization"),
    "data": ("task", "data_dir", "global_batch_size", "micro_batch_size", "num_train", "num_dev", "num_eval",
             "max_length", "max_new_tokens", "train_as_classification", "objective"),
    "eval": ("eval_steps",),
    # What a diverging run does (train/divergence.py).
    "divergence": ("on_divergence", "max_rollbacks"),
    "checkpoint": ("output_dir", "overwrite_output_dir", "save_steps", "save_total_limit"),
    # What a run reports, and the health checks it logs.
    "logging": ("logging_steps", "report_to", "disable_tqdm", "progress_interval", "log_level", "visibility_steps",
                "visibility_warn", "consistency_steps", "flat_loss_steps"),
    # How the job runs: DeepSpeed, ZeRO, the process groups and the threads.
    "launch": ("zero_stage", "offload_param", "deepspeed", "shard_group_size", "threads", "ddp_timeout"),
}

SECTION_OF: dict[str, str] = {k: name for name, keys in SECTIONS.items() for k in keys}


@functools.cache
def _section_class(name: str):
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    return dataclasses.make_dataclass(f"{name.capitalize()}Section", [(k, fields[k].type) for k in SECTIONS[name]],
                                      frozen=True)


def section(cfg: TrainConfig, name: str) -> Any:
    """The keys of section `name` of `cfg`, as a frozen dataclass (attribute access, `dataclasses.asdict`)."""
    if name not in SECTIONS:
        raise KeyError(f"no config section {name!r}; the sections: {', '.join(SECTIONS)}")
    return _section_class(name)(**{k: getattr(cfg, k) for k in SECTIONS[name]})
