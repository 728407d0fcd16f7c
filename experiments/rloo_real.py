"""Issue 37's real-model runs: RLOO (`difference=rloo`, q one-sided forwards with a leave-one-out baseline) against
MeZO on SmolLM2-135M, at a matched number of forwards.

    nice -n 19 python -m experiments.rloo_real --arm rloo-4 --task sentiment --runs 1e-4:0 2e-4:0 4e-4:0
    nice -n 19 python -m experiments.rloo_real --arm mezo --task topic --runs 1e-4:1
    nice -n 19 python -m experiments.rloo_real --arm curvzo --task topic --runs 1e-5:0   # the paper's CurvZO
    python -m experiments.rloo_real --report          # the cached runs of every arm, in forwards

The model, tasks, data sizes, batches and evaluation are experiments/real_model.py's (experiments/core.py's
`run_curve`, through the project's own ZO step); MeZO's runs are that script's own (200 steps = 400 forwards). An
RLOO arm with q directions runs 400/q steps, so both spend 400 forwards; its dev loss is evaluated every 40 forwards.
Each run is cached as runs/<hash of its settings>.json beside real_model.py's, so an interrupted sweep resumes where
it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from experiments import real_model as R
from experiments.core import Log, cached, every, record_run, run_curve
from experiments.smollm import DATA, base_config, convert, fetch_gguf, write_task

FORWARDS = 400  # MeZO's 200 steps of two forwards
EVAL_FORWARDS = 40
ARMS = {"rloo-4": 4, "rloo-8": 8}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "real-model")


def settings_of(model: str, task: str, arm: str, lr: float, seed: int) -> dict:
    q = ARMS[arm]
    return dict(model=os.path.basename(model), task=task, arm=arm, spec=dict(method="mezo", difference="rloo",
                num_directions=q), lr=lr, seed=seed, steps=FORWARDS // q, eval_every=EVAL_FORWARDS // q,
                data=DATA)


def one_run(model: str, task: str, task_dir: str, arm: str, lr: float, seed: int, log: Log) -> dict:
    settings = settings_of(model, task, arm, lr, seed)
    return cached_run(settings, base_config(model, task_dir, lr, seed, settings["steps"]), settings["spec"],
                      every(EVAL_FORWARDS, FORWARDS), log)


def stable_run(model: str, task: str, task_dir: str, lr: float, seed: int, log: Log) -> dict:
    """The paper's CurvZO (real_model.py's `curvzo` arm, 200 steps) with `rate_correction=max_weight`."""
    settings = dict(model=os.path.basename(model), task=task, arm="curvzo-stable",
                    spec=dict(method="curvzo", rate_correction="max_weight"), lr=lr, seed=seed, steps=FORWARDS // 2,
                    eval_every=25, data=DATA)
    return cached_run(settings, base_config(model, task_dir, lr, seed, settings["steps"]), settings["spec"],
                      every(2 * settings["eval_every"], FORWARDS), log)


def cached_run(settings: dict, cfg, arm: dict, points: dict, log: Log) -> dict:
    """runs/<hash of settings>.json, or `run_curve` of `arm` on `cfg` written there."""
    path, done = cached(OUT, settings)
    if done is not None:
        return done
    result = record_run(path, settings, lambda: run_curve(cfg, arm, points, name=settings["arm"]))
    final = result["curve"][-1]
    log(f"run {settings['task']} {settings['arm']} lr={settings['lr']:g} seed={settings['seed']}: dev loss "
        f"{final['loss']:.4f} acc {final['accuracy']:.3f}, test acc {result['test']['accuracy']:.3f} "
        f"({result['seconds']:.0f}s, {result['step_seconds']:.2f}s/step)")
    return result


def reach(run: dict, per_step: int, target: dict, key: str) -> int | None:
    """The forwards `run` took to reach `target`'s final dev `key` (loss: at or below; accuracy: at or above)."""
    goal = target["curve"][-1][key]
    hit = (lambda c: c[key] <= goal) if key == "loss" else (lambda c: c[key] >= goal)
    return next((c["step"] * per_step for c in run["curve"] if hit(c)), None)


def paired(forwards: int | None, mezos: int | None) -> str:
    """The forwards and their ratio to MeZO's own forwards to the same target (same seed)."""
    if forwards is None:
        return "not reached"
    return f"{forwards} (x{forwards / mezos:.2f})" if mezos else f"{forwards} (MeZO: at 0)"


def mezo_references(runs: list) -> dict:
    """Each task's MeZO reference rate under two rules: "seed-0", the rate with the lowest final dev loss over MeZO's
    seed-0 grid, and "3-seed", the rate with the lowest mean final dev loss over 3 or more seeds (a NaN final loss
    counts as infinite, so one diverged seed dominates its rate's mean)."""
    finals: dict[tuple, dict] = {}  # (task, lr) -> {seed: final dev loss}
    for task, arm, lr, seed, _, run in runs:
        if arm == "mezo":
            loss = run["curve"][-1]["loss"]
            finals.setdefault((task, lr), {})[seed] = loss if math.isfinite(loss) else math.inf
    refs: dict[str, dict] = {"seed-0": {}, "3-seed": {}}
    for (task, lr), seeds in sorted(finals.items()):
        for rule, score in (("seed-0", seeds.get(0)), ("3-seed", sum(seeds.values()) / len(seeds)
                                                         if len(seeds) >= 3 else None)):
            if score is not None and (task not in refs[rule] or score < refs[rule][task][1]):
                refs[rule][task] = (lr, score)
    return {rule: {task: lr for task, (lr, _) in ref.items()} for rule, ref in refs.items()}


def report() -> list[str]:
    """Every cached MeZO, CurvZO and RLOO run of the two tasks: final dev loss and accuracy at 400 forwards, and the
    forwards each run needed to reach the final dev loss and the final dev accuracy of MeZO's run of the same seed at
    MeZO's best seed-0 rate, with their ratio to the forwards MeZO's run took to reach them (dev evaluated every 50
    forwards for MeZO and CurvZO, every 40 for RLOO). Then, for each task, arm and rate run with more than one seed:
    the final dev loss's mean ± sd and the paired per-seed figures, against each of `mezo_references`' rates."""
    runs = []
    for name in sorted(os.listdir(os.path.join(OUT, "runs"))):
        with open(os.path.join(OUT, "runs", name)) as f:
            run = json.load(f)
        s = run["settings"]
        if s["arm"] in ("mezo", "curvzo", "curvzo-stable", *ARMS):
            runs.append((s["task"], s["arm"], s["lr"], s["seed"], ARMS.get(s["arm"], 2) * s["steps"], run))
    runs.sort(key=lambda r: r[:4])
    refs = mezo_references(runs)
    mezo = {(task, lr, seed): run for task, arm, lr, seed, _, run in runs if arm == "mezo"}

    def against(task: str, seed: int, arm: str, run: dict, rule: str) -> tuple[str, str] | None:
        """Forwards to the final dev loss and accuracy of MeZO's run of `seed` at `rule`'s rate, paired."""
        target = mezo.get((task, refs[rule].get(task), seed))
        if target is None:
            return None
        return tuple(paired(reach(run, ARMS.get(arm, 2), target, key), reach(target, 2, target, key))
                     for key in ("loss", "accuracy"))

    pairs = {rule: [against(task, seed, arm, run, rule) for task, arm, _, seed, _, run in runs] for rule in refs}
    rows = ["| task | arm | lr | seed | forwards | final dev loss | final dev accuracy | test accuracy | forwards to "
            "MeZO's final dev loss (x MeZO's) | forwards to MeZO's final dev accuracy (x MeZO's) | run s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for (task, arm, lr, seed, forwards, run), pair in zip(runs, pairs["seed-0"]):
        final = run["curve"][-1]
        by_loss, by_acc = pair or ("-", "-")
        rows.append(f"| {task} | {arm} | {lr:g} | {seed} | {forwards} | {final['loss']:.4f} | "
                    f"{final['accuracy']:.3f} | {run['test']['accuracy']:.3f} | {by_loss} | {by_acc} | "
                    f"{run['seconds']:.0f} |")
    for rule in refs:
        rates = ", ".join(f"{task} {lr:g}" for task, lr in sorted(refs[rule].items()))
        rows += ["", f"Against MeZO's {rule} rate ({rates}):",
                 "", "| task | arm | lr | seeds | final dev loss, mean ± sd | per seed: forwards to MeZO's final dev "
                 "loss | per seed: forwards to MeZO's final dev accuracy |", "|---|---|---:|---|---|---|---|"]
        groups: dict[tuple, list] = {}
        for (task, arm, lr, seed, _, run), pair in zip(runs, pairs[rule]):
            if pair:
                groups.setdefault((task, arm, lr), []).append((seed, run["curve"][-1]["loss"], *pair))
        for (task, arm, lr), seeds in groups.items():
            if len(seeds) > 1:
                losses = [loss for _, loss, _, _ in seeds]
                mean = sum(losses) / len(losses)
                sd = (sum((x - mean) ** 2 for x in losses) / (len(losses) - 1)) ** 0.5
                rows.append(f"| {task} | {arm} | {lr:g} | {', '.join(str(s) for s, *_ in seeds)} | {mean:.4f} ± "
                            f"{sd:.4f} | {'; '.join(f'{s}: {a}' for s, _, a, _ in seeds)} | "
                            f"{'; '.join(f'{s}: {b}' for s, _, _, b in seeds)} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=["mezo", "curvzo", "curvzo-stable", *ARMS], default="rloo-4",
                        help="mezo and curvzo run real_model.py's own MeZO and paper's CurvZO runs (200 steps), "
                             "cached with its runs; curvzo-stable is the paper's CurvZO with "
                             "rate_correction=max_weight (200 steps)")
    parser.add_argument("--task", choices=["sentiment", "topic"], default="sentiment")
    parser.add_argument("--runs", nargs="*", default=[], metavar="LR:SEED")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"))
    parser.add_argument("--report", action="store_true", help="print the cached runs' table and run nothing")
    args = parser.parse_args(argv)
    if args.report:
        print("\n".join(report()))
        return
    import torch

    torch.set_num_threads(1)
    log = Log(os.path.join(OUT, "progress.log"))
    model = convert(fetch_gguf(args.cache, log), args.cache, log)
    task_dir = write_task(os.path.join(OUT, "tasks"), args.task)
    for item in args.runs:
        lr, seed = item.split(":")
        if args.arm == "curvzo-stable":
            stable_run(model, args.task, task_dir, float(lr), int(seed), log)
        elif args.arm in ("mezo", "curvzo"):
            R.one_run(OUT, R.CONFIGS["full"], model, args.task, task_dir, args.arm, float(lr), int(seed), log)
        else:
            one_run(model, args.task, task_dir, args.arm, float(lr), int(seed), log)


if __name__ == "__main__":
    main()
