"""The `report_to` key: which experiment trackers mirror metrics.jsonl (docs/outputs.md, "Trackers").

The names are those of `accelerate.tracking` (Hugging Face's `report_to`): tensorboard, wandb, mlflow, comet_ml, aim,
clearml, dvclive, swanlab, trackio. The value is one name, a list, or a comma-separated string
(`--set report_to=tensorboard,wandb`); `auto` is tensorboard when it is installed, `all` every tracker that is
installed, `none` none. accelerate is imported only when a value names a tracker.
"""

from __future__ import annotations

from typing import Any

from curvzo_ds.errors import ConfigError

SPECIAL = ("auto", "all", "none")


def report_to_names(value: Any) -> list[str]:
    """The names the value lists, in its order, lower case, without repeats."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"report_to={value!r} is invalid: it must be a tracker name, a list of them or a "
                          "comma-separated string (for example report_to=tensorboard,wandb), auto, all or none")
    names = []
    for item in items:
        name = item.strip().lower()
        if name and name not in names:
            names.append(name)
    return names


def known_trackers() -> list[str]:
    """The tracker names accelerate.tracking knows."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    return list(LOGGER_TYPE_TO_CLASS)


def installed_trackers() -> list[str]:
    """The trackers whose package is installed (accelerate's `get_available_trackers`)."""
    from accelerate.tracking import get_available_trackers

    return [str(getattr(t, "value", t)) for t in get_available_trackers()]


def resolve_report_to(value: Any) -> list[str]:
    """The trackers a run reports to. An unknown name, a tracker whose package is missing, or auto/all/none mixed
    with other names is refused in one line (ConfigError) that names the fix."""
    names = report_to_names(value)
    if not names or names == ["none"]:
        return []
    mixed = [name for name in names if name in SPECIAL]
    if mixed and len(names) > 1:
        raise ConfigError(f"report_to={value!r} is invalid: {mixed[0]} stands alone; list tracker names instead "
                          "(for example report_to=tensorboard,wandb)")
    if names == ["auto"]:
        return ["tensorboard"] if "tensorboard" in installed_trackers() else []
    if names == ["all"]:
        return installed_trackers()
    known = known_trackers()
    for name in names:
        if name not in known:
            raise ConfigError(f"report_to={value!r} is invalid: {name!r} is not a tracker; use "
                              f"{', '.join(known)}, auto, all or none")
    installed = installed_trackers()
    for name in names:
        if name not in installed:
            raise ConfigError(f"report_to={value!r}: {name} is not installed: pip install {name}, "
                              f"or remove {name} from report_to")
    return names
