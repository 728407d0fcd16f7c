"""A run's configuration as the command line gives it: --config FILE (YAML), --set KEY=VALUE and --deepspeed JSON,
read, coerced to the keys' types, built and validated (`load_config`). A bad value is a one-line ConfigError."""

from __future__ import annotations

import os

from curvzo_ds.config.resolve import resolve
from curvzo_ds.config.schema import TrainConfig, build, coerce, set_sources
from curvzo_ds.errors import ConfigError


def read_values(config_file: str | None, sets: list[str], deepspeed: str | None) -> dict:
    """The keys given by --config, --set and --deepspeed, coerced to their types (not yet validated together)."""
    import yaml

    values: dict = {}
    if config_file:
        if os.path.isdir(config_file):
            raise ConfigError(f"--config {config_file}: is a directory; name the YAML file inside it")
        if not os.path.isfile(config_file):
            raise ConfigError(f"--config {config_file}: no such file")
        loaded = read_yaml(config_file)
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {config_file}: must be a mapping of key: value")
        values.update(loaded)
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
    for key in ("model", "tokenizer", "task", "data_dir", "deepspeed"):
        path = values.get(key)
        must_exist = key == "deepspeed" or (key == "data_dir" and path not in (None, "hub", "samples"))
        if must_exist and path is not None and not os.path.exists(str(path)):
            raise ConfigError(f"{key}={path}: no such file or directory")
    if values.get("deepspeed"):  # recorded in run_config.json: absolute, so `eval --resume` works from any directory
        values["deepspeed"] = os.path.abspath(str(values["deepspeed"]))
    return {k: coerce(TrainConfig, k, v) for k, v in values.items()}


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


def key_sources(config_file: str | None, sets: list[str], values: dict) -> dict[str, str]:
    """Where each explicitly given key came from: "--set" (a later --set wins over the file) or "--config FILE"."""
    given = {item.split("=", 1)[0].strip() for item in sets if "=" in item}
    return {k: "--set" if k in given else f"--config {config_file}" for k in values if k != "deepspeed"}


def load_config(config_file: str | None, sets: list[str], deepspeed: str | None) -> TrainConfig:
    """The validated run configuration of --config, --set and --deepspeed, each key's source recorded."""
    values = read_values(config_file, sets, deepspeed)
    cfg = build(TrainConfig, values)
    set_sources(cfg, key_sources(config_file, sets, values))
    return resolve(cfg)  # presets and the one validation, before any process group (exit 2, one line); frozen
    return cfg
