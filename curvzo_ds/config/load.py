"""A run's configuration as the command line gives it: --config FILE (YAML), --set KEY=VALUE and --deepspeed JSON,
read, coerced to the keys' types (`coerce`, `build`), resolved (`load_config`); and the keys a checkpoint's run
config fixes for `eval --resume` and for a resumed run (`differences`). A bad value is a one-line ConfigError."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from typing import Any

from curvzo_ds.config.fields import field_names, set_sources
from curvzo_ds.config.resolve import resolve
from curvzo_ds.config.schema import TrainConfig, key_fields
from curvzo_ds.errors import ConfigError


def config_files(config_file: str | list[str] | None) -> list[str]:
    """The --config files in the order given (the option may be repeated; a later file wins)."""
    return [config_file] if isinstance(config_file, str) else list(config_file or [])


def read_config_files(config_file: str | list[str] | None) -> tuple[dict, dict[str, str]]:
    """The keys of every --config file merged in order, a later file winning over an earlier one, and the file
    each key came from (the last that sets it)."""
    values: dict = {}
    origin: dict[str, str] = {}
    for path in config_files(config_file):
        if os.path.isdir(path):
            raise ConfigError(f"--config {path}: is a directory; name the YAML file inside it")
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: no such file")
        loaded = read_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: must be a mapping of key: value")
        values.update(loaded)
        origin.update({k: path for k in loaded})
    return values, origin


def read_values(config_file: str | list[str] | None, sets: list[str], deepspeed: str | None) -> dict:
    """The keys given by --config (each file in order), --set and --deepspeed, coerced to their types (not yet
    validated together)."""
    import yaml

    values, _ = read_config_files(config_file)
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE, for example --set learning_rate=1e-6")
        key, raw = item.split("=", 1)
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            values[key.strip()] = raw
    if deepspeed:
        values["deepspeed"] = deepspeed
    for key in PATH_KEYS:
        if values.get(key) is not None:
            values[key] = checked_path(key, values[key])
    return {k: coerce(TrainConfig, k, v) for k, v in values.items()}


# The keys that may name a path, with the names that are not paths and the kind of path each needs.
PATH_KEYS = ("model", "tokenizer", "task", "data_dir", "deepspeed")


def checked_path(key: str, value):
    """A path-valued key's value: refused in one line where it names the wrong kind of path (a file where a directory
    is needed, or the reverse) or, where it must exist, nothing; made absolute where it names a path that exists, so
    that run_config.json records it absolute and `eval --resume` and `train --resume` work from any directory. A
    built-in name (task=sst2, model=demo, data_dir=samples) or a hub id stays as it is."""
    from curvzo_ds.config.presets import DEMO_MODELS
    from curvzo_ds.tasks.task import TASK_NAMES

    if not isinstance(value, str) or not value:
        return value  # coerce and the validation refuse a value of another type
    names = {"model": DEMO_MODELS, "task": TASK_NAMES, "data_dir": ("hub", "samples")}.get(key, ())
    if value in names:
        return value
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        if key in ("deepspeed", "data_dir"):
            raise ConfigError(f"{key}={value}: no such file or directory")
        return value  # a hub id, or a missing directory that the model, tokenizer or task loader refuses
    if key == "deepspeed" and os.path.isdir(path):
        raise ConfigError(f"deepspeed={value} is a directory: name the DeepSpeed JSON file")
    if key != "deepspeed" and not os.path.isdir(path):
        need = {"model": "the model's directory (the one holding config.json) or a hub id",
                "tokenizer": "the tokenizer's directory (the one holding tokenizer_config.json) or a hub id",
                "task": "a task directory (the one holding task.json) or a built-in task",
                "data_dir": "a directory holding train.jsonl (or .csv) files, or a datasets save_to_disk directory"}
        raise ConfigError(f"{key}={value} is a file, not a directory: give {need[key]}")
    return os.path.abspath(path)


def read_yaml(path: str):
    """A YAML file's contents; a duplicate key or a syntax error is a one-line ConfigError naming its line."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, str) and key in first:
                    raise ConfigError(f"--config {path} line {line}: duplicate key {key!r} (first at line "
                                      f"{first[key]}): keep one")
                first.setdefault(key, line)
            return super().construct_mapping(node, deep)

    try:
        with open(path) as f:
            return yaml.load(f, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}{where}: not valid YAML ({reason})") from None


def key_sources(config_file: str | list[str] | None, sets: list[str], values: dict) -> dict[str, str]:
    """Where each explicitly given key came from: "--set" (a later --set wins over the files) or "--config FILE"
    (the last file that sets it)."""
    given = {item.split("=", 1)[0].strip() for item in sets if "=" in item}
    _, origin = read_config_files(config_file)  # a few small files, read again
    return {k: "--set" if k in given else f"--config {origin[k]}" for k in values if k != "deepspeed"}


def load_config(config_file: str | list[str] | None, sets: list[str], deepspeed: str | None) -> TrainConfig:
    """The validated run configuration of --config (each file in order), --set and --deepspeed, each key's source
    recorded."""
    values = read_values(config_file, sets, deepspeed)
    cfg = build(TrainConfig, values)
    set_sources(cfg, key_sources(config_file, sets, values), config_files(config_file))
    return resolve(cfg)  # presets and the one validation, before any process group (exit 2, one line); frozen


def coerce(cls, key: str, value: Any) -> Any:
    """Check a parsed YAML scalar against the field's default type; ints are accepted for floats."""
    names = field_names(cls)
    if key not in names:
        near = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown key {key!r}{hint}; `curvzo-ds train --help` lists every key")
    f = next(f for f in key_fields(cls) if f.name == key)
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()) \
            and any(t in str(f.type) for t in ("float", "int", "Any")):
        value = float(value)  # YAML 1.1 reads 1e-6 as a string; docs/contracts.md promises a number
    if key in ("zero_stage", "shard_group_size") and isinstance(value, float) and value.is_integer():
        return int(value)  # "auto" or a number
    if value is None or default is None or isinstance(default, str) and key in (
            "score_init", "fp32_master_weights", "zero_stage", "shard_group_size", "report_to"):
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a boolean: use true or false")
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, int | float) and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} is not a number (default {default!r})")
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string (default {default!r})")
    return value


RUN_CONFIG = "run_config.json"  # a checkpoint's copy of the run's resolved keys (train/outputs.write_run_config)


def read_run_config(checkpoint: str, required: bool = True) -> dict[str, Any] | None:
    """The keys of `checkpoint`'s run_config.json, each coerced to its type (`coerce`); keys that this version does
    not know are left out. The one reader of that file: `--resume`, `eval --resume` and `export`. None when the
    file is absent and not `required` (a checkpoint of `from_accelerator` or `ZOTrainer` has none). A file that is
    missing where required, a link, not JSON, not an object, or a value of the wrong type is a one-line ConfigError
    naming the file."""
    path = os.path.join(str(checkpoint), RUN_CONFIG)
    if not os.path.lexists(path):
        if not required:
            return None
        raise ConfigError(f"--resume {checkpoint}: no {RUN_CONFIG} there; pass a checkpoint-<step> directory that "
                          "curvzo-ds train wrote")
    if os.path.islink(path) or not os.path.isfile(path):
        raise ConfigError(f"{path} is a link or not a file: only files inside the checkpoint directory are read")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{path} is not valid JSON ({e}): the checkpoint is damaged; resume from another "
                          "checkpoint") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} holds no JSON object of keys: the checkpoint is damaged; resume from another "
                          "checkpoint")
    known = set(field_names())
    try:
        return {k: coerce(TrainConfig, k, v) for k, v in saved.items() if k in known}
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}: the checkpoint is damaged; resume from another checkpoint") from None


def saved_config(checkpoint: str) -> TrainConfig | None:
    """The TrainConfig of `checkpoint`'s run_config.json (`read_run_config`), or None when it has none."""
    values = read_run_config(checkpoint, required=False)
    if values is None:
        return None
    try:
        return build(TrainConfig, values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{os.path.join(str(checkpoint), RUN_CONFIG)}: {e}: the checkpoint is damaged") from None


def build(cls, values: dict[str, Any]):
    """Make a config of type `cls` from a flat mapping, checking every key and type."""
    kwargs = {k: coerce(cls, k, v) for k, v in values.items()}
    cfg = cls(**kwargs)
    return cfg


# The keys that define what `curvzo-ds eval --resume CKPT` evaluates: they come from the checkpoint's run config,
# and a --set may not change them (batch size, num_eval, the output path and the like may change).
EVAL_FROM_CHECKPOINT = ("model", "tokenizer", "task", "data_dir", "lora", "lora_r", "lora_alpha", "lora_target_modules",
                        "quantization", "seed", "num_train", "num_dev", "max_length", "max_new_tokens",
                        "train_as_classification", "dtype", "block_granularity", "block_chunk_size")
# The keys a resumed training run may change (docs/config.md); every other key changes the trajectory and must
# match the checkpoint's run config.
RESUME_MAY_CHANGE = ("max_steps", "eval_steps", "save_steps", "save_total_limit", "logging_steps", "report_to",
                     "disable_tqdm", "progress_interval", "log_level", "output_dir", "overwrite_output_dir", "threads",
                     "ddp_timeout", "deepspeed", "zero_stage", "offload_param", "num_eval", "visibility_steps",
                     "visibility_warn", "max_consecutive_skips", "trust_remote_code",
                     "shard_group_size", "on_divergence", "max_rollbacks")


# What a run did before the key existed, where that is not the key's default (a preset that depends on the run).
BEFORE_THE_KEY = {"rate_correction": "none"}


def differences(saved: dict[str, Any], values: dict[str, Any], keys) -> list[str]:
    """"key: saved -> new" for each of `keys` whose value in `values` differs from the checkpoint's `saved`. A key
    that `saved` lacks (one added to curvzo_ds after the checkpoint was written) counts as its default, or as what
    runs did before it existed (BEFORE_THE_KEY). A path-valued key that names the same file or directory is the
    same (a run written before paths were recorded absolute holds a relative one)."""
    defaults = {f.name: f.default for f in key_fields(TrainConfig) if f.default is not dataclasses.MISSING}
    defaults.update(BEFORE_THE_KEY)
    old = {k: saved.get(k, defaults.get(k)) for k in keys}
    return [f"{k}: {old[k]!r} -> {values[k]!r}" for k in keys if k in values and not _same(k, old[k], values[k])]


def _same(key: str, old, new) -> bool:
    if old == new:
        return True
    if key not in PATH_KEYS or not isinstance(old, str) or not isinstance(new, str):
        return False
    try:
        return os.path.samefile(os.path.expanduser(old), os.path.expanduser(new))
    except OSError:
        return False
