"""A user's DeepSpeed config: each key honoured, mapped onto `TrainConfig`, or refused.

CurvZO takes no optimizer step, so a DeepSpeed config written for Adam (the Hugging Face
`ds_config_zero3.json` shape) carries keys that either mean something else here or cannot be
served. `resolve_ds_config` reads the user's dict and returns the dict to hand to
`deepspeed.initialize(model=..., config=...)`, the values of our keys that it maps (batch sizes, dtype,
ZeRO stage, parameter offload), and one-line warnings for what it dropped. It edits nothing it is given.
What cannot be served raises `ConfigError` naming the key, the reason and the fix.

Policy:
- a key mapped onto `TrainConfig` that the user also set explicitly (`--set` or the YAML) to another value is
  refused, naming both values and where each came from (docs/config.md); set in one place only, it is taken from there.
- batch keys map to `global_batch_size`/`micro_batch_size` ("auto" keeps ours). DeepSpeed's own
  batch fields are then set to `micro`, `1`, `micro * world_size`, which it accepts at any world
  size; the engine does its own batching.
- what cannot be served (ZeRO stages 1/2, hpZ, quantized weights, NVMe offload, pipeline, tensor and
  sequence parallelism) is refused from the one table in ds_policy.py, which the engine's own check
  reads too. `zero_optimization.stage` 3 and 0 are served; a missing stage takes `cfg.zero_stage`.
  `offload_param` cpu is served.
  `offload_optimizer` and `zero_quantized_gradients` are dropped with a warning. The bucket and
  persistence sizes are honoured; their "auto" is resolved as Hugging Face does from the hidden
  size, or left to DeepSpeed's defaults when the hidden size is unknown. Other ZeRO keys pass
  through and are checked against DeepSpeed's own schema.
- `bf16`/`fp16` `enabled: true` set `cfg.dtype`; fp16 loss scaling is dropped (no gradients).
- `optimizer`, `scheduler`, `activation_checkpointing`, a numeric `gradient_clipping`, `amp`,
  `torch_autocast` and DeepSpeed's monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`) are
  dropped with a warning. Keys that only configure gradients or DeepSpeed's optimizer, data
  loader or checkpoint engine are dropped quietly (`QUIET_DROP`). Profiling and logging keys
  pass through quietly (`QUIET_PASS`). Any other key passes through with a warning.
- pipeline stages > 1, `tensor_parallel.autotp_size` > 1 and `sequence_parallel_size` > 1 are
  refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

from curvzo_ds.config.ds_policy import (
    BATCH_KEYS,
    DROPPED,
    FP16_LOSS_SCALING,
    HONOURED_ZERO_SIZES,
    MAPPED_FIELDS,
    MONITOR_REASON,
    MONITORS,
    QUIET_DROP,
    QUIET_PASS,
    refusal,
)
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.errors import ConfigError


def load_ds_config(path: str) -> dict:
    """Read a DeepSpeed JSON config; a missing file or bad JSON is a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"deepspeed config {path!r} cannot be read ({e.strerror}): pass an existing JSON file "
                          "to --deepspeed") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed config {path!r} is not valid JSON: {e.msg} at line {e.lineno} column "
                          f"{e.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed config {path!r} must hold a JSON object, not {type(data).__name__}")
    return data


def resolve_ds_config(user: dict | None, world_size: int, hidden_size: int | None, *,
                      explicit: dict[str, str] | None = None, where: str = "the deepspeed config",
                      **ours: Any) -> tuple[dict, dict, list[str]]:
    """(config for deepspeed.initialize, mapped values, warnings) for the user's DeepSpeed config `user`.

    `ours`: the current values of our `MAPPED_FIELDS` (global_batch_size, micro_batch_size, dtype, zero_stage,
    offload_param); one not given takes TrainConfig's default. The mapped values are those five after the user's
    keys are applied: `dataclasses.replace(cfg, **mapped)` is the run's config. A key of `ours` that was given
    explicitly (`explicit`: name -> where it came from, config.sources_of: `--set` or the YAML) and that `user`
    sets to another value is refused, naming both values and where each came from (`where`: the DeepSpeed
    config's name, docs/config.md); otherwise the user's keys win over our defaults. Nothing given is edited.
    """
    unknown = set(ours) - set(MAPPED_FIELDS)
    if unknown:
        raise TypeError(f"resolve_ds_config maps {', '.join(MAPPED_FIELDS)}, not {', '.join(sorted(unknown))}")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in MAPPED_FIELDS}
    staged = SimpleNamespace(**{**defaults, **ours})
    user = copy.deepcopy(user or {})
    given = copy.deepcopy(user)
    warnings: list[str] = []
    out: dict[str, Any] = {}

    refused = refusal(user)
    if refused:
        raise ConfigError(f"{refused} (in the deepspeed config)")
    staged.micro_batch_size, staged.global_batch_size = _map_batch(user, staged, world_size, warnings)
    staged.dtype = _map_dtype(user, staged.dtype, warnings)
    zero, staged.zero_stage, staged.offload_param = _map_zero(user.pop("zero_optimization", None), staged,
                                                              hidden_size, warnings)
    _refuse_conflicts(given, ours, explicit or {}, staged, world_size, where)

    for key, reason in DROPPED.items():
        if key in user:
            user.pop(key)
            warnings.append(f"{key}: ignored; {reason}")
    clip = user.pop("gradient_clipping", None)
    if clip not in (None, "auto", 0, 0.0):
        warnings.append(f"gradient_clipping={clip}: ignored; CurvZO computes no gradient to clip")
    for key in MONITORS:
        if key in user:
            user.pop(key)
            warnings.append(f"{key}: ignored; {MONITOR_REASON}")
    for key in QUIET_DROP:
        user.pop(key, None)
    for key, value in user.items():
        if key not in QUIET_PASS:
            warnings.append(f"{key}: not a key curvzo_ds knows; passed to DeepSpeed unchanged")
        out[key] = value

    out["train_micro_batch_size_per_gpu"] = staged.micro_batch_size
    out["gradient_accumulation_steps"] = 1
    out["train_batch_size"] = staged.micro_batch_size * world_size
    out["zero_optimization"] = zero
    if staged.dtype == "bfloat16":
        out["bf16"] = {"enabled": True}
    elif staged.dtype == "float16":
        out["fp16"] = {"enabled": True}
    _refuse_auto(out, "")
    return out, {name: getattr(staged, name) for name in MAPPED_FIELDS}, warnings


def _refuse_conflicts(given: dict, ours: dict, explicit: dict[str, str], staged, world_size: int, where: str) -> None:
    """The rule of docs/config.md: a key set explicitly (--set or the YAML) that the DeepSpeed config maps to another
    value is refused in one line naming both values and where each came from."""
    for name in MAPPED_FIELDS:
        mine = ours.get(name)
        if name in explicit and mine != getattr(staged, name):
            theirs = _ds_setting(given, name, staged, world_size)
            raise ConfigError(f"{name}={mine} ({explicit[name]}) conflicts with {theirs} ({where}): make them agree, "
                              "or remove one of the two")


def _ds_setting(given: dict, name: str, staged, world_size: int) -> str:
    """The DeepSpeed key (and value) that set `name` in `staged`, as the user wrote it."""
    if name == "global_batch_size":
        if _batch_value(given.get("train_batch_size"), "train_batch_size") is not None:
            return f"train_batch_size={given['train_batch_size']}"
        return (f"gradient_accumulation_steps={given.get('gradient_accumulation_steps')} (x micro_batch_size "
                f"{staged.micro_batch_size} x {world_size} rank{'s' * (world_size != 1)} = {staged.global_batch_size})")
    if name == "micro_batch_size":
        return f"train_micro_batch_size_per_gpu={given.get('train_micro_batch_size_per_gpu')}"
    if name == "dtype":
        return f"{'bf16' if staged.dtype == 'bfloat16' else 'fp16'}.enabled=true"
    if name == "zero_stage":
        return f"zero_optimization.stage={staged.zero_stage}"
    return f"zero_optimization.offload_param.device={staged.offload_param}"


def _map_batch(user: dict, cfg, world_size: int, warnings: list[str]) -> tuple[int, int]:
    """(micro_batch_size, global_batch_size) after the user's batch keys; `cfg` holds the current values."""
    total, micro, accum = (_batch_value(user.pop(key, None), key) for key in BATCH_KEYS)
    micro = cfg.micro_batch_size if micro is None else micro
    if total is not None:
        if accum is not None and total != micro * accum * world_size:
            warnings.append(f"gradient_accumulation_steps={accum}: ignored; train_batch_size={total} sets the "
                            "global batch (CurvZO does its own batching)")
        return micro, total
    if accum is not None:
        return micro, micro * accum * world_size
    return micro, cfg.global_batch_size


def _batch_value(value: Any, key: str) -> int | None:
    if value is None or value == "auto":
        return None
    number = _integer(value)
    if number is None or number < 1:
        raise ConfigError(f"{key}={value!r} in the deepspeed config must be an integer >= 1 or \"auto\"")
    return number


def _map_dtype(user: dict, current: str, warnings: list[str]) -> str:
    """The dtype after the user's bf16/fp16 sections; `current`: ours."""
    if "bfloat16" in user and "bf16" not in user:  # DeepSpeed's older spelling
        user["bf16"] = user.pop("bfloat16")
    chosen, loss_scaling = [], []
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = user.pop(key, None)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{key} in the deepspeed config must be an object like {{\"enabled\": true}}")
        enabled = section.get("enabled", False)
        if enabled not in (True, False, "auto"):
            raise ConfigError(f"{key}.enabled={enabled!r} in the deepspeed config must be true, false or \"auto\"")
        if enabled is False and current == dtype:
            raise ConfigError(f"{key}.enabled=false in the deepspeed config conflicts with dtype={dtype}: set "
                              f"{key}.enabled to true or \"auto\", or set dtype=float32")
        if enabled is True:
            chosen.append(dtype)
        if key == "fp16":
            loss_scaling = [k for k in FP16_LOSS_SCALING if k in section]
    if len(chosen) == 2:
        raise ConfigError("bf16.enabled and fp16.enabled are both true in the deepspeed config: enable one")
    dtype = chosen[0] if chosen else current
    if dtype == "float16" and loss_scaling:
        warnings.append(f"fp16.{'/'.join(loss_scaling)}: ignored; loss scaling protects gradients, and CurvZO "
                        "computes none")
    return dtype


def _map_zero(zero: Any, cfg, hidden_size: int | None, warnings: list[str]) -> tuple[dict, int, str]:
    """(the zero_optimization section for DeepSpeed, zero_stage, offload_param); `cfg` holds our current values."""
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization in the deepspeed config must be an object like {\"stage\": 3}")
    stage = zero.pop("stage", cfg.zero_stage)
    stage = stage if _integer(stage) is None else _integer(stage)
    if stage not in (0, 3, "auto") or isinstance(stage, bool):  # auto: train/build.py's layout decides first
        raise ConfigError(f"zero_optimization.stage={stage!r} is invalid: use 3 (or 0 for no ZeRO)")

    hpz = zero.pop("zero_hpz_partition_size", 1)
    if _integer(hpz) is None:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={hpz!r} must be an integer (1: no hpZ)")
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        zero.pop(key, False)  # refused above when true
    if zero.pop("zero_quantized_gradients", False):
        warnings.append("zero_optimization.zero_quantized_gradients: ignored; CurvZO communicates no gradients")
    opt, legacy = zero.pop("offload_optimizer", None), zero.pop("cpu_offload", None)
    # {"device": "none"} asks for nothing (Accelerate always writes it).
    asked = not (opt is None or (isinstance(opt, dict) and opt.get("device") in ("none", None)))
    if asked or legacy:
        warnings.append("zero_optimization.offload_optimizer: ignored; CurvZO keeps no optimizer state")

    offload = zero.pop("offload_param", None)
    if zero.pop("cpu_offload_param", False):  # DeepSpeed's deprecated spelling
        offload = {"device": "cpu"}
    if offload is not None:
        if not isinstance(offload, dict):
            raise ConfigError("zero_optimization.offload_param must be an object like {\"device\": \"cpu\"}")
        device = offload.get("device", "none")
        if device not in ("cpu", "none"):
            raise ConfigError(f"zero_optimization.offload_param.device={device!r} is invalid: use \"cpu\" or \"none\"")
    else:
        device = cfg.offload_param
    if device == "cpu" and stage not in (3, "auto"):  # auto: the layout takes ZeRO-3 (layout/choice.py)
        raise ConfigError("offload_param=cpu needs ZeRO stage 3: set zero_optimization.stage to 3, or remove "
                          "offload_param")
    if stage == 0:
        return {"stage": 0}, stage, device

    for key in HONOURED_ZERO_SIZES:
        if zero.get(key) == "auto":
            value = _hf_auto(key, hidden_size)
            if value is None:
                zero.pop(key)
            else:
                zero[key] = value
        elif key in zero:
            number = _integer(zero[key])
            if number is None or number < 0:
                raise ConfigError(f"zero_optimization.{key}={zero[key]!r} must be an integer >= 0 or \"auto\"")
            zero[key] = number
    for key, value in list(zero.items()):
        if isinstance(value, float) and value.is_integer():  # 1e9 in JSON is a float
            zero[key] = int(value)
    out = {"stage": 3, **zero}
    if device == "cpu":
        out["offload_param"] = {**(offload or {}), "device": "cpu"}
    _check_zero_schema(out)
    return out, stage, device


def _hf_auto(key: str, hidden_size: int | None) -> int | None:
    """transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize`; None means DeepSpeed's default."""
    if hidden_size is None:
        return None
    rule = {"reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size}
    return rule.get(key)


def _check_zero_schema(zero: dict) -> None:
    """Check the ZeRO section against DeepSpeed's own schema now, to fail in one line."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return
    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise ConfigError(f"zero_optimization.{where} in the deepspeed config: {err['msg']} (DeepSpeed's "
                          "schema); fix or remove the key") from None


def _refuse_auto(node: Any, path: str) -> None:
    """An "auto" left over would fail inside DeepSpeed; name it here instead."""
    if node == "auto":
        raise ConfigError(f"{path}=\"auto\" in the deepspeed config cannot be resolved by curvzo_ds: set a value "
                          "or remove the key")
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_auto(value, f"{path}.{key}" if path else key)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


__all__ = ["load_ds_config", "resolve_ds_config"]
