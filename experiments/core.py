"""The run core of every experiment: `run_curve` (one run: ZO steps through the project's own step, with the dev
curve at evaluation points counted in forwards), the run cache (`cached`, `record_run`: out/runs/<hash of the run's
settings>.json), the provenance each recorded run carries, the progress log and `run_many` (worker processes).

An arm is one row: a dict of config keys (`method`, `difference`, `num_directions`, `step_normalization`, ...) that
`run_curve` applies to the base config, plus the few keys of the experiments' own that no config has (`EXTRA_KEYS`:
`oracle_every`). A task variant is a parameter of `run_curve` (`variant`, e.g. {"label_noise": 0.2}), applied to a
copy of the task directory, so the same arm runs on the plain and the varied task.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

import numpy as np

from curvzo_ds.algo.sampling import CurvZOSampler
from curvzo_ds.train.divergence import DivergenceWatch
from experiments.verdict import add_dev_subset

HERE = os.path.dirname(os.path.abspath(__file__))
EXTRA_KEYS = ("oracle_every",)  # an arm's keys that are the experiments' own, not the config's
SPLIT_KEYS = {"dev": "", "subset": "subset_"}  # an evaluation point's split -> the prefix of its curve keys


def digest(obj) -> str:
    """The cache key of a run's settings: the first 16 hex digits of the SHA-256 of their sorted JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: str) -> str:
    """The SHA-256 of a file's bytes (a shipped model's weights, a downloaded GGUF), as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_path(out: str, settings: dict) -> str:
    return os.path.join(out, "runs", digest(settings) + ".json")


def cached(out: str, settings: dict) -> tuple[str, dict | None]:
    """A run's cache file, out/runs/<hash of its settings>.json, and the run in it (None while it has not run)."""
    path = cache_path(out, settings)
    if not os.path.exists(path):
        return path, None
    with open(path) as f:
        return path, json.load(f)


class Log:
    """A progress line, with the time, to stdout and appended to a file."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, line: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {line}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def provenance() -> dict:
    """The commit and dirty state of this checkout and of the imported curvzo_ds's, and the machine."""
    import torch

    import curvzo_ds

    def git(path: str) -> dict:
        def out(*args) -> str | None:
            try:
                return subprocess.run(["git", "--no-optional-locks", "-C", path, *args], capture_output=True,
                                      text=True, timeout=60, check=True).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                return None

        changed = out("status", "--porcelain", "--untracked-files=no")
        return dict(path=path, commit=out("rev-parse", "HEAD"), dirty=None if changed is None else bool(changed),
                    changed=None if not changed else changed.splitlines()[:20])

    package = os.path.dirname(os.path.dirname(os.path.abspath(curvzo_ds.__file__)))
    return dict(code=git(os.path.dirname(HERE)), curvzo_ds=git(package) | dict(module=curvzo_ds.__file__),
                machine=dict(node=platform.node(), platform=platform.platform(), processor=platform.processor(),
                             cpu=cpu_model(), cpus=os.cpu_count(), python=platform.python_version(),
                             torch=torch.__version__, threads=torch.get_num_threads(), nice=os.nice(0)))


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo's, which `platform` does not give; else platform.processor()): one
    pretraining gives different weights on different CPUs (experiments/RESULTS.md), so a run records its CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        name = None
    return name or platform.processor() or None


def record_run(path: str, settings: dict, train: Callable[[], dict]) -> dict:
    """`train()`'s result written to `path` with its settings, its provenance, when it started and its wall time."""
    import torch

    from curvzo_ds.jsonio import write_json_atomic

    torch.set_num_threads(1)
    start = time.time()
    result = dict(settings=settings, provenance=provenance(), started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), **train())
    result["seconds"] = time.time() - start
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, result)
    return result


def run_many(jobs: int, calls: list[tuple], fn: Callable) -> list[dict]:
    """fn(*args) for each args, `jobs` at a time in spawned worker processes (in order when jobs is 1)."""
    if jobs == 1 or len(calls) <= 1:
        return [fn(*args) for args in calls]
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import torch

    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        return list(pool.map(fn, *zip(*calls)))


# ----------------------------------------------------------------------------------------------------------------
# One run


def forwards_per_step(arm: dict) -> int:
    """The forwards of one step of `arm` (a row of config keys; a key it leaves out takes TrainConfig's default):
    algo/differences.py's `forwards_per_step`, the one source."""
    from curvzo_ds.algo.differences import forwards_per_step as forwards
    from curvzo_ds.config.schema import TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return forwards(arm.get("difference", defaults["difference"]),
                    arm.get("num_directions", defaults["num_directions"]))


def arm_config(config, arm: dict, name: str = "this arm"):
    """`config` with the arm's config keys set (its EXTRA_KEYS left to `run_curve`). A key this checkout's TrainConfig
    does not have stops the run in one line (a run pinned to an older checkout)."""
    keys = {k: v for k, v in arm.items() if k not in EXTRA_KEYS}
    fields = {f.name for f in dataclasses.fields(config)}
    if not set(keys) <= fields:
        raise SystemExit(f"arm {name}: this checkout's TrainConfig has no {', '.join(sorted(set(keys) - fields))}; "
                         "run it from a checkout that has it")
    return dataclasses.replace(config, **keys)


def label_noise(task_dir: str, fraction: float, out: str, seed: int = 0) -> str:
    """A copy of the task directory `task_dir` in `out` whose train.jsonl has round(fraction x n) labels replaced by
    another label word's (chosen by random.Random(seed)); dev and test are unchanged."""
    with open(os.path.join(task_dir, "task.json")) as f:
        classes = len(json.load(f)["label_words"])
    copy = os.path.join(out, f"{os.path.basename(os.path.normpath(task_dir))}-label-noise-{fraction:g}-{seed}")
    shutil.copytree(task_dir, copy, dirs_exist_ok=True)
    with open(os.path.join(task_dir, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rng = random.Random(seed)
    for i in rng.sample(range(len(rows)), round(fraction * len(rows))):
        rows[i]["label"] = rng.choice([c for c in range(classes) if c != rows[i]["label"]])
    with open(os.path.join(copy, "train.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return copy


VARIANTS = {"label_noise": label_noise}  # a task variant: (task directory, its value, a folder) -> task directory


def variant_task(task: str, variant: dict | None, folder: str) -> str:
    """The task directory with each of `variant`'s changes applied (VARIANTS), written under `folder`."""
    for key, value in (variant or {}).items():
        task = VARIANTS[key](task, value, folder)
    return task


def run_curve(config, arm: dict, evaluation_points_in_forwards: dict[int, list[str]], *, variant: dict | None = None,
              subset: dict | None = None, test: bool = True, name: str = "this arm", device: str = "cpu",
              rollback: bool = False) -> dict:
    """One run of `arm` (a row of config keys, and EXTRA_KEYS) on `config` (the task, model, data, rate, seed), through
    the project's own ZO step (`PlainRun`), to the last evaluation point.

    `evaluation_points_in_forwards`: {forwards: splits}, each split "dev" (the full dev set: curve keys `loss`,
    `accuracy`) or "subset" (the fixed dev subset of experiments/verdict.py, `subset` = {size, seed}: `subset_loss`,
    `subset_accuracy`); each point a multiple of the arm's forwards per step. The last point is the horizon:
    max_steps = horizon / forwards per step. A non-finite loss at a point ends the run there (the rest of its
    curve is missing). `variant`: {name: value} of `VARIANTS`, applied to the task directory. `test`: the test
    split at the end. `device`: where the model runs ("cpu", or "cuda" on a GPU). `rollback`: a diverging run goes
    back as `curvzo-ds train`'s does (`_train`). Returns the device, the curve ({step, forwards, ...} per point),
    test, seconds per step (the steps alone), set-up seconds, the mean budget B/G and parameter fraction, the number
    of blocks and parameters, and with `rollback` the rollbacks.
    """
    from curvzo_ds.train.plain import PlainRun

    per_step = forwards_per_step(arm)
    points = {int(f): list(s) for f, s in evaluation_points_in_forwards.items()}
    bad = [f for f in points if f % per_step or f < 0] + [s for v in points.values() for s in v if s not in SPLIT_KEYS]
    if bad or not points:
        raise ValueError(f"evaluation points {bad or 'none'}: use forwards that are multiples of {per_step} and splits "
                         f"among {', '.join(SPLIT_KEYS)}")
    steps = max(points) // per_step
    with tempfile.TemporaryDirectory(prefix="run-curve-") as tmp:  # a variant's task directory, read until the end
        task = variant_task(config.task, variant, tmp)
        cfg = dataclasses.replace(arm_config(config, arm, name), task=task, max_steps=steps)
        setup = time.time()
        # PlainRun fits a static mask and chooses learning_rate auto's rate
        run = PlainRun(cfg, sampler=OracleSampler if "oracle_every" in arm else None, device=device)
        setup = time.time() - setup
        if subset is not None:
            add_dev_subset(run, "subset", subset["size"], subset["seed"])
        return dict(_train(run, steps, per_step, points, arm.get("oracle_every"), rollback), device=device_name(device),
                    **(dict(test=run.evaluate("test")) if test else {}), setup_seconds=setup)


def device_name(device: str) -> str:
    """"cpu", or the GPU's name after the device ("cuda: NVIDIA H200"): a run records where it ran."""
    import torch

    device = torch.device(device)
    return device.type if device.type != "cuda" else f"cuda: {torch.cuda.get_device_name(device)}"


def _train(run, steps: int, per_step: int, points: dict[int, list[str]], oracle_every: int | None,
           rollback: bool = False) -> dict:
    """run_curve's steps and evaluations.

    `rollback`: the dev rule of `curvzo-ds train`'s divergence watch (train/divergence.py: a dev loss not finite, or
    above 2x the larger of the best so far and a quarter of the zero-shot loss) at each evaluation; a run that meets
    it goes back to the state of its best dev evaluation (the newest checkpoint the CLI's rollback could take) with
    the rate halved, at most the config's max_rollbacks times, then stops as the CLI's does. The curve's `forwards`
    count every forward spent, those of an abandoned stretch included (a user pays for them); its `step` is the
    step the weights are at. (The CLI's train-loss rule is left out: runs cached without rollback keep no step losses,
    and a run that never meets the dev rule is then this run step for step, so such a run stands for both.)"""
    engine = run.engine
    watch = DivergenceWatch() if rollback else None
    rollbacks: list[dict] = []

    def point(spent: int, step: int) -> dict:
        out = dict(step=step, forwards=spent * per_step)
        for split in points[spent * per_step]:
            out.update({f"{SPLIT_KEYS[split]}{k}": v for k, v in run.evaluate(split).items()})
        if "loss" in out and step > 0:  # lr_scheduler_type=plateau reads the dev loss of the evaluations during the
            engine.rate.observe_dev(step, out["loss"])  # run, as the CLI's loop does (none at step 0)
            if not engine.rate.needs_choice:
                out["learning_rate"] = engine.rate.at(step)
        return out

    def snapshot(step: int) -> dict:  # what a checkpoint holds: the weights, the engine's state, the watch's
        return dict(step=step, weights=[p.detach().clone() for p in run.model.parameters()],
                    engine=copy.deepcopy(engine.state_dict()), watch=copy.deepcopy(watch.state_dict()))

    def restore(saved: dict) -> None:  # as train/divergence.py's `recover`: the rollback factor carried, then halved
        import torch

        carry = engine.rate.carry()
        with torch.no_grad():
            for p, w in zip(run.model.parameters(), saved["weights"]):
                p.copy_(w)
        engine.load_state_dict(copy.deepcopy(saved["engine"]))
        engine.rate.load_state_dict({**engine.rate.state_dict(), **carry})
        engine.rate.rolled_back()
        watch.load_state_dict(copy.deepcopy(saved["watch"]))

    curve = [point(0, 0)] if 0 in points else []
    if watch is not None:
        if curve:  # the zero-shot evaluation: the dev rule's reference and floor, as the CLI's `zero_shot`
            watch.start({"loss": curve[0].get("loss")})
        saved = snapshot(0)  # the CLI's checkpoint-0
    step_seconds, budgets, fractions = 0.0, [], []
    t = 0  # the step the weights are at; `spent` counts every step taken
    for spent in range(1, steps + 1):
        batch = run.batch(t)
        start = time.time()
        if oracle_every and t % oracle_every == 0:
            engine.sampler.scores = run.block_energy(batch)
        r = engine.step(batch)
        step_seconds += time.time() - start
        t += 1
        budgets.append(r.budget / engine.num_blocks)
        fractions.append(r.param_fraction)
        if spent * per_step not in points:
            continue
        curve.append(point(spent, t))
        if watch is not None:
            best = watch.best_dev_step
            reason = watch.observe_dev(t, curve[-1].get("loss")) if "loss" in curve[-1] else None
            if reason and engine.rate.rollbacks < run.cfg.max_rollbacks:
                restore(saved)
                t = saved["step"]
                rollbacks.append(dict(forwards=spent * per_step, diverged_at=curve[-1]["step"], to_step=t,
                                      learning_rate=engine.rate.at(t), reason=reason))
                continue
            if reason:  # its rollbacks spent: the run stops here, as the CLI's (exit code 4)
                curve[-1]["diverged"] = reason
                break
            if watch.best_dev_step != best:  # a new best: the state a later rollback returns to
                saved = snapshot(t)
        if not all(v is not None and math.isfinite(v) for k, v in curve[-1].items() if k.endswith("loss")):
            break
    return dict(curve=curve, step_seconds=step_seconds / max(1, len(budgets)),
                budget_mean=float(np.mean(budgets)) if budgets else None,
                param_fraction_mean=float(np.mean(fractions)) if fractions else None, blocks=engine.num_blocks,
                params=engine.num_params, learning_rate_chosen=engine.rate.base,
                learning_rate_greedy=engine.rate.greedy, rate_reason=engine.rate.reason,
                **(dict(rollbacks=rollbacks) if rollback else {}))


def every(forwards: int, horizon: int, splits: tuple[str, ...] = ("dev",)) -> dict[int, list[str]]:
    """Evaluation points every `forwards` forwards from 0, and at the horizon."""
    return {f: list(splits) for f in [*range(0, horizon + 1, forwards), horizon]}


class OracleSampler(CurvZOSampler):
    """The paper's pi ∝ sqrt(S) and adaptive budget, with S the true per-block gradient energies ||g_i||^2 that the
    run sets by backprop (`scores`, every `oracle_every` steps); the step's own score estimate is ignored."""

    def observe(self, plan, delta, block_sq) -> None:
        pass
