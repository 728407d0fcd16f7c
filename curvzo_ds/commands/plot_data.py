"""The runs that `curvzo-ds plot` draws (commands/plot.py), read from their directories: `load_run` gives a run's
metrics.jsonl lines (train, dev and test), config.json, summary.json and pi file (train/pilog.py) as a `RunData`,
with its legend label (`run_label`). What it leaves out (a line that is not JSON, a damaged file) it says on stderr.
No command: plot's reading of a run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from curvzo_ds.errors import ConfigError
from curvzo_ds.train.logs import METRICS_FILE, read_metrics
from curvzo_ds.train.pilog import PI_FILE, has_pi, read_pi

EVAL_METRICS = ("accuracy", "f1", "exact_match")


@dataclass
class RunData:
    label: str
    config: dict
    summary: dict
    train: list[dict]
    dev: list[dict]
    test: list[dict]
    pi: tuple | None = None  # (steps, names, pi) of pi.bin

    def get(self, key: str):
        """model, task or method: config.json's, else summary.json's."""
        return self.config.get(key) or self.summary.get(key)

    @property
    def num_blocks(self) -> int | None:
        return self.summary.get("num_blocks") or (len(self.pi[1]) if self.pi else None)

    @property
    def metric(self) -> str | None:
        """The task's metric: the first of EVAL_METRICS in the dev (else test) lines."""
        rows = self.dev or self.test
        return next((m for m in EVAL_METRICS if any(is_number(r.get(m)) for r in rows)), None)


def load_run(run_dir: str) -> RunData:
    """A run directory's metrics.jsonl, config.json, summary.json and pi file; ConfigError if it is not a run."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: no such directory; pass a run's output_dir (it holds {METRICS_FILE})")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir} holds no {METRICS_FILE}: pass a run's output_dir, after its first "
                          "logging step")
    skipped: list[int] = []
    rows = [r for r in read_metrics(path, skipped) if is_number(r.get("step"))]
    if skipped:
        torn = skipped == [_count_lines(path)]  # the last line alone: a run writing it, or one stopped mid-line
        why = " (the last line: a run still writing it, or one that stopped mid-line)" if torn else ""
        _warn(f"{path}: line{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped[:5]))}"
              f"{', ...' if len(skipped) > 5 else ''} {'are' if len(skipped) > 1 else 'is'} not a JSON object and "
              f"left out of the figure{why}")
    if not rows:
        raise ConfigError(f"{path} holds no metrics lines with a step yet: plot it after the run's first logging "
                          "step")
    config, summary = _read_json(run_dir, "config.json"), _read_json(run_dir, "summary.json")
    name = os.path.basename(os.path.normpath(run_dir))
    pi = None
    if has_pi(run_dir):
        try:
            pi = read_pi(run_dir)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged pi file: no heat map, said so
            _warn(f"{run_dir}: its pi file ({PI_FILE}) cannot be read ({e}): no heat map of it")
    return RunData(label=run_label(name, config, summary), config=config, summary=summary,
                   train=[r for r in rows if "split" not in r],
                   dev=_by_step([r for r in rows if r.get("split") == "dev"]),
                   test=_by_step([r for r in rows if r.get("split") == "test"]), pi=pi)


def run_label(name: str, config: dict, summary: dict) -> str:
    """`name (mezo rloo q=8, LoRA r=8, lr 3e-4, seed 42, 2 ranks)`: what tells runs apart, from config.json and
    summary.json (what a run lacks is left out): the method with its difference (unless `central`) and its q
    directions per step (unless 1)."""
    method = config.get("method") or summary.get("method")
    difference, directions = config.get("difference"), config.get("num_directions")
    estimator = " ".join([str(method)] * bool(method) + [str(difference)] * (difference not in (None, "central"))
                         + [f"q={directions}"] * (is_number(directions) and directions != 1))
    parts = [estimator] if estimator else []
    if config.get("lora"):
        parts.append(f"LoRA r={config.get('lora_r')}" if config.get("lora_r") else "LoRA")
    if is_number(config.get("learning_rate")):
        parts.append(f"lr {config['learning_rate']:g}")
    seed = config.get("seed", summary.get("seed"))
    if is_number(seed):
        parts.append(f"seed {seed}")
    world = summary.get("world_size")
    if is_number(world):
        parts.append(f"{world} rank{'s' if world != 1 else ''}")
    return f"{name} ({', '.join(parts)})" if parts else name


def _by_step(rows: list[dict]) -> list[dict]:
    """The last line of each step (an end-of-run evaluation repeats a step), in step order."""
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def _read_json(run_dir: str, name: str) -> dict:
    """A run's config.json or summary.json; {} when it has none (a run still going has no summary), and {} with a
    warning when it is damaged (the figure then lacks what it would have given: labels, the best-dev star)."""
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        _warn(f"{path} cannot be read ({e}): the figure goes without it")
        return {}
    if not isinstance(value, dict):
        _warn(f"{path} holds no JSON object: the figure goes without it")
        return {}
    return value


def _warn(text: str) -> None:
    """One line on stderr: what plot left out, and why."""
    print(f"curvzo-ds plot: warning: {' '.join(text.split())}", file=sys.stderr, flush=True)


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = ["EVAL_METRICS", "RunData", "is_number", "load_run", "run_label"]
