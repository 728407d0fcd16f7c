"""Issue 31's experiment: does curvature-guided sampling beat MeZO on a real pretrained model?

    pip install ".[experiments]"                                           # gguf, the one extra dependency
    nice -n 10 python -m experiments.real_model --config full --jobs 2       # what experiments/RESULTS.md reports
    python -m experiments.real_model --config ci --model DIR --out /tmp/x    # the CI test's: 2 steps, a tiny Llama

1. the weights and 2. the tasks: experiments/smollm.py's (SmolLM2-135M-Instruct from its GGUF, cached under --cache;
   `sentiment` and `topic`);
3. the arms, each a row of config keys run by experiments/core.py's `run_curve` (the project's own ZO step through
   `PlainRun`: the CLI's model, data, batches, loss and `ZOEngine`): MeZO; CurvZO as the paper specifies; oracle
   pi (the paper's rule pi ∝ sqrt(S) fed the true per-block gradient energies by backprop every `oracle_every`
   steps, a diagnostic and upper bound, not a method); static masks (one backprop on a few training batches picks
   the top 0.1% or 1% of elements by squared gradient; SPSA perturbs only those, with no inverse-probability
   weights: SensZOQ's mechanism);
4. the protocol: a learning-rate grid per arm on dev with seed 0, the best rate by final dev loss, that rate with
   seed 1, and seed 2 for the arm and MeZO where seeds 0 and 1 disagree on whether the arm ends below MeZO;
5. the diagnostic (`curvzo-ds diagnose`'s code) with every estimator on the model;
6. tables.md, convergence plots and the wall time of every run in --out.
Every run is cached as runs/<hash of its settings>.json, so an interrupted pipeline resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from curvzo_ds.commands.diagnose import diagnose
from curvzo_ds.config.schema import SCORE_ESTIMATORS, TrainConfig
from curvzo_ds.train.plain import PlainRun
from experiments.core import Log, cached, digest, every, record_run, run_curve, run_many
from experiments.curvature import curvature_table
from experiments.smollm import DATA, base_config, convert, fetch_gguf, write_task
from experiments.stats import mean_sd, reach_ratio, speedup_at_own_loss

ARMS = {"mezo": dict(method="mezo"), "curvzo": dict(method="curvzo"),
        "oracle": dict(method="curvzo", oracle_every=10),
        "static-0.1%": dict(method="mezo", static=0.001), "static-1%": dict(method="mezo", static=0.01)}
# Learning-rate grids, 3 points each on a ladder of half-decades, from 10-step pilots on sentiment (seed 0): MeZO at
# 1e-5 moved the dev loss from 0.369 to 0.345; the 0.1% mask diverged at 3e-3 and reached 0.163 at 5e-4. Where the
# best rate of a grid is at its edge, the grid grows by the next ladder point beyond it (at most `extend` times), so
# that every arm's chosen rate is bracketed, or the edge is a rate beyond which the arm diverged.
LADDER = [1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
GRID = {"mezo": [3e-5, 1e-4, 3e-4], "curvzo": [1e-5, 3e-5, 1e-4], "oracle": [1e-5, 3e-5, 1e-4],
        "static-0.1%": [1e-4, 3e-4, 1e-3], "static-1%": [3e-5, 1e-4, 3e-4]}
CONFIGS = {
    "full": dict(tasks=["sentiment", "topic"], arms=list(ARMS), grid=GRID, extend=2, seeds=[0, 1, 2], steps=200,
                 eval_every=25, diagnose_steps=100, diagnose_probe_every=10, curvature=[4, 8]),
    "ci": dict(tasks=["sentiment"], arms=list(ARMS), grid={a: GRID[a][1:] for a in ARMS}, extend=1, seeds=[0, 1, 2],
               steps=2, eval_every=1, diagnose_steps=3, diagnose_probe_every=1, curvature=[1, 2]),
}


# ----------------------------------------------------------------------------------------------------------------
# One run


def arm_row(arm: str) -> dict:
    """The arm as one row of config keys for `run_curve`: its method; the oracle's scores start at 1 and are set
    every `oracle_every` steps; a static mask is the product's (shard/mask.py), fitted on the first probe batches."""
    spec = ARMS[arm]
    row = dict(method=spec["method"])
    if "oracle_every" in spec:
        row.update(score_init=1.0, oracle_every=spec["oracle_every"])
    if "static" in spec:
        row.update(static_mask=spec["static"], static_mask_batches=DATA["probe_batches"])
    return row


def run_config(model: str, task_dir: str, arm: str, lr: float, seed: int, steps: int) -> TrainConfig:
    """The config of `arm` (its config keys; `oracle_every` is run_curve's)."""
    return base_config(model, task_dir, lr, seed, steps,
                       **{k: v for k, v in arm_row(arm).items() if k != "oracle_every"})


def one_run(out: str, plan: dict, model: str, task: str, task_dir: str, arm: str, lr: float, seed: int,
            log: Log) -> dict:
    """One training run, from runs/<hash>.json when its settings were run before."""
    settings = dict(model=os.path.basename(model), task=task, arm=arm, spec=ARMS[arm], lr=lr, seed=seed,
                    steps=plan["steps"], eval_every=plan["eval_every"], data=DATA)
    if "static" in ARMS[arm]:  # since 2026-11-28 the product's mask (shard/mask.py), not this script's former copy
        settings["mask"] = "curvzo_ds.shard.mask"
    path, done = cached(out, settings)
    if done is not None:
        return done
    result = record_run(path, settings, lambda: run_curve(
        base_config(model, task_dir, lr, seed, plan["steps"]), arm_row(arm),
        every(2 * plan["eval_every"], 2 * plan["steps"]), name=arm))
    final = result["curve"][-1]
    log(f"run {task} {arm} lr={lr:g} seed={seed}: dev loss {final['loss']:.4f} acc {final['accuracy']:.3f}, "
        f"test acc {result['test']['accuracy']:.3f} ({result['seconds']:.0f}s, {result['step_seconds']:.2f}s/step)")
    return result


def final_loss(run: dict) -> float:
    loss = run["curve"][-1]["loss"]
    return loss if math.isfinite(loss) else math.inf


def beyond(grid: dict) -> float | None:
    """The next ladder rate past the edge of `grid` ({lr: run}) where its best rate sits, if not run yet."""
    rates = sorted(grid)
    best = min(rates, key=lambda lr: final_loss(grid[lr]))
    step = -1 if best == rates[0] else 1 if best == rates[-1] else 0
    at = LADDER.index(best) + step
    return LADDER[at] if step and 0 <= at < len(LADDER) and LADDER[at] not in grid else None


def run_task(plan: dict, model: str, task: str, task_dir: str, out: str, log: Log, jobs: int) -> dict:
    """{arm: {"lr": best, "grid": {lr: final dev loss}, "runs": [result per seed], "mezo_runs": [...]}} for one
    task: the grid with the first seed (grown past an edge where the best rate sits, `beyond`), the best rate with
    the second seed, and a third seed for the arm and MeZO where the first two disagree on whether the arm ends
    below MeZO's dev loss."""
    first, second, third = plan["seeds"]
    arms = plan["arms"]

    def many(calls: list[tuple[str, float, int]]) -> list[dict]:
        return run_many(jobs, [(out, plan, model, task, task_dir, arm, lr, seed, log) for arm, lr, seed in calls],
                        one_run)

    grid_runs = iter(many([(arm, lr, first) for arm in arms for lr in plan["grid"][arm]]))
    grids = {arm: {lr: next(grid_runs) for lr in plan["grid"][arm]} for arm in arms}
    for _ in range(plan["extend"]):
        more = [(arm, lr) for arm in arms if (lr := beyond(grids[arm])) is not None]
        for (arm, lr), r in zip(more, many([(arm, lr, first) for arm, lr in more])):
            grids[arm][lr] = r
    best = {arm: min(grids[arm], key=lambda lr: final_loss(grids[arm][lr])) for arm in arms}
    runs = {arm: [grids[arm][best[arm]], r] for arm, r in zip(arms, many([(arm, best[arm], second) for arm in arms]))}
    extra = [arm for arm in arms if arm != "mezo" and
             len({final_loss(a) < final_loss(m) for a, m in zip(runs[arm], runs["mezo"])}) > 1]
    extra = (["mezo"] if extra else []) + extra
    for arm, r in zip(extra, many([(arm, best[arm], third) for arm in extra])):
        runs[arm].append(r)
    # An arm is compared with MeZO seed by seed: a third MeZO seed that the arm lacks is left out.
    return {arm: dict(lr=best[arm], grid={lr: final_loss(r) for lr, r in sorted(grids[arm].items())}, runs=runs[arm],
                      mezo_runs=runs["mezo"][:len(runs[arm])]) for arm in arms}


def run_all(plan: dict, model: str, tasks: dict, out: str, log: Log, jobs: int) -> dict:
    """{(task, arm): run_task's entry}, task by task: the first task is complete before the second starts."""
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    return {(task, arm): entry for task in plan["tasks"]
            for arm, entry in run_task(plan, model, task, tasks[task], out, log, jobs).items()}


# ----------------------------------------------------------------------------------------------------------------
# Report


def tables(plan: dict, results: dict) -> list[str]:
    lines = ["| task | arm | lr (dev) | seeds | test accuracy | final dev accuracy | final dev loss | steps to MeZO's "
             "final dev loss / MeZO's | MeZO's steps to this arm's final dev loss / this arm's | B/G | "
             "parameter fraction | s/step | run s |",
             "|---|---|---|---:|---|---|---|---|---|---:|---:|---:|---:|"]
    for task in plan["tasks"]:
        for arm in plan["arms"]:
            res = results[(task, arm)]
            runs, mezo = res["runs"], res["mezo_runs"]
            lines.append(
                f"| {task} | {arm} | {res['lr']:g} | {len(runs)} | {mean_sd([r['test']['accuracy'] for r in runs])} | "
                f"{mean_sd([r['curve'][-1]['accuracy'] for r in runs])} | {mean_sd([final_loss(r) for r in runs])} | "
                f"{reach_ratio(runs, mezo)} | {speedup_at_own_loss(runs, mezo)} | "
                f"{np.mean([r['budget_mean'] for r in runs]):.2f} | "
                f"{np.mean([r['param_fraction_mean'] for r in runs]):.4f} | "
                f"{np.mean([r['step_seconds'] for r in runs]):.2f} | "
                f"{' / '.join(format(r['seconds'], '.0f') for r in runs)} |")
    return lines


def grid_table(plan: dict, results: dict) -> list[str]:
    lines = ["| task | arm | final dev loss per learning rate (seed 0) |", "|---|---|---|"]
    for (task, arm), res in results.items():
        lines.append(f"| {task} | {arm} | " + ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in res["grid"].items())
                     + " |")
    return lines


def cached_runs_table(out: str) -> list[str]:
    """Every run in out/runs so far (a pipeline that has not finished reports what it has): by task, arm, rate
    and seed, with the steps MeZO's run of the same task and seed at its best seed-0 rate needs to reach the final
    dev loss of this run, over the steps this run needs (> 1: faster than that MeZO run)."""
    runs = []
    for name in sorted(os.listdir(os.path.join(out, "runs"))):
        with open(os.path.join(out, "runs", name)) as f:
            runs.append(json.load(f))
    key = {arm: i for i, arm in enumerate(ARMS)}
    runs.sort(key=lambda r: (r["settings"]["task"], key.get(r["settings"]["arm"], len(key)), r["settings"]["arm"],
                             r["settings"]["lr"],
                             r["settings"]["seed"]))
    mezo = {}  # (task, seed) -> the MeZO run at the best seed-0 rate of its task
    for task in {r["settings"]["task"] for r in runs}:
        grid = {r["settings"]["lr"]: r for r in runs if r["settings"]["task"] == task
                and r["settings"]["arm"] == "mezo" and r["settings"]["seed"] == 0}
        if grid:
            best = min(grid, key=lambda lr: final_loss(grid[lr]))
            mezo.update({(task, r["settings"]["seed"]): r for r in runs if r["settings"]["task"] == task
                         and r["settings"]["arm"] == "mezo" and r["settings"]["lr"] == best})
    lines = ["| task | arm | lr | seed | final dev loss | final dev accuracy | test accuracy | MeZO's steps to this "
             "final dev loss / this run's | s/step | run s |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        st = r["settings"]
        ref = mezo.get((st["task"], st["seed"]))
        ratio = speedup_at_own_loss([r], [ref]) if ref is not None and final_loss(r) < math.inf else "-"
        last = r["curve"][-1]
        lines.append(f"| {st['task']} | {st['arm']} | {st['lr']:g} | {st['seed']} | {last['loss']:.4f} | "
                     f"{last['accuracy']:.3f} | {r['test']['accuracy']:.3f} | {ratio} | {r['step_seconds']:.2f} | "
                     f"{r['seconds']:.0f} |")
    return lines


def plot_curves(plan: dict, results: dict, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(plan["tasks"]), figsize=(6 * len(plan["tasks"]), 8), squeeze=False)
    for col, task in enumerate(plan["tasks"]):
        for arm in plan["arms"]:
            runs = results[(task, arm)]["runs"]
            steps = [c["step"] for c in runs[0]["curve"]]
            for row, metric in enumerate(("loss", "accuracy")):
                values = np.array([[c[metric] for c in r["curve"]] for r in runs if len(r["curve"]) == len(steps)])
                line, = axes[row, col].plot(steps, values.mean(0), label=f"{arm} (lr {results[(task, arm)]['lr']:g})")
                if len(values) > 1:
                    axes[row, col].fill_between(steps, values.min(0), values.max(0), alpha=0.15,
                                                color=line.get_color())
                axes[row, col].set(title=f"{task}: dev {metric} (mean, min-max over seeds)", xlabel="step",
                                   ylabel=f"dev {metric}")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "convergence_real.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def run_diagnostic(plan: dict, model: str, tasks: dict, results: dict, out: str) -> list[str]:
    """`curvzo-ds diagnose` with every estimator on the first task, at the CurvZO arm's rate (cached)."""
    task = plan["tasks"][0]
    lr = results[(task, "curvzo")]["lr"]
    cfg = run_config(model, tasks[task], "curvzo", lr, 0, plan["diagnose_steps"])
    estimators = [e for e in SCORE_ESTIMATORS if e != "raw"]
    key = digest(dict(model=os.path.basename(model), task=task, lr=lr, steps=plan["diagnose_steps"],
                      every=plan["diagnose_probe_every"], estimators=estimators, data=DATA))
    sub = os.path.join(out, "diagnose")
    cached = os.path.join(sub, f"table-{key}.md")
    if not os.path.exists(cached):
        torch.set_num_threads(1)
        table = diagnose(cfg, estimators, plan["diagnose_steps"], plan["diagnose_probe_every"], sub)
        with open(cached, "w") as f:
            f.write("\n".join(table) + "\n")
    with open(cached) as f:
        return [f"Diagnostic: task {task}, lr {lr:g}, {plan['diagnose_steps']} steps, backprop every "
                f"{plan['diagnose_probe_every']} (diagnose/):", ""] + f.read().splitlines()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one thread each (default 1)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out-real"))
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"),
                        help="where the GGUF and its Hugging Face conversion are kept (outside the repository)")
    parser.add_argument("--model", help="a Hugging Face model directory instead of SmolLM2 (the CI test's tiny Llama)")
    parser.add_argument("--tasks", help="comma-separated subset of the config's tasks, in its order (default: all; "
                             "the diagnostic runs on the first)")
    parser.add_argument("--stage", choices=["prepare", "all", "report"], default="all",
                        help="prepare: the model and the tasks only (with the zero-shot dev accuracy); report: "
                             "print a table of the runs cached in --out so far and run nothing")
    args = parser.parse_args(argv)
    if args.stage == "report":
        print("\n".join(cached_runs_table(args.out)))
        return
    torch.set_num_threads(1)
    plan = CONFIGS[args.config]
    if args.tasks:
        chosen = args.tasks.split(",")
        if any(t not in plan["tasks"] for t in chosen):
            parser.error(f"--tasks {args.tasks}: choose from {','.join(plan['tasks'])}")
        plan = dict(plan, tasks=[t for t in plan["tasks"] if t in chosen])
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    log(f"config {args.config}: {json.dumps(plan)}")
    if args.model:
        model = args.model
    else:
        os.makedirs(args.cache, exist_ok=True)
        model = convert(fetch_gguf(args.cache, log), args.cache, log)
    tasks = {t: write_task(os.path.join(args.out, "tasks"), t) for t in plan["tasks"]}
    if args.stage == "prepare":
        for task, path in tasks.items():
            run = PlainRun(run_config(model, path, "mezo", 1e-6, 0, 1))
            log(f"zero-shot {task}: dev {run.evaluate('dev')}, test {run.evaluate('test')}")
        return
    start = time.time()
    results = run_all(plan, model, tasks, args.out, log, args.jobs)
    log(f"runs done in {time.time() - start:.0f}s with --jobs {args.jobs}")
    figure = plot_curves(plan, results, args.out)
    diag = run_diagnostic(plan, model, tasks, results, args.out) + [""] + curvature_table(plan, model, tasks, args.out)
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(f"config `{args.config}`: {json.dumps(plan)}\n\ndata: {json.dumps(DATA)}\n\n")
        f.write("\n".join(tables(plan, results)) + "\n\n" + "\n".join(grid_table(plan, results)) + "\n\n")
        f.write("\n".join(diag) + f"\n\nFigure: {os.path.basename(figure)}\n")
    log("tables: " + os.path.join(args.out, "tables.md"))


if __name__ == "__main__":
    main()
