"""Issue 47, item B: the null and the power of experiments/verdict.py's metrics, from MeZO against MeZO on the small
pre-trained model of experiments/pipeline.py (seconds per run).

    nice -n 19 python -m experiments.calibrate --out experiments/results/calibration        # runs (cached) + table
    python -m experiments.calibrate --out experiments/results/calibration --stage report     # the table only
    python -m experiments.calibrate --config ci --out /tmp/x                                 # the test's: tiny

1. pipeline.py's model (its `pretrain`, cached under --cache outside the repository), pre-trained for
   `pretrain_steps` (3000: on the machine of 2026-11-28, pipeline.py's 1500 steps left a model at chance on every
   task, zero-shot dev loss 0.679 on `sentiment`, which MeZO at 1e-4 does not move in 400 steps and 1e-3 makes
   diverge; 3000 steps give zero-shot 0.264, accuracy 0.93, like the first model's), and its task `sentiment`;
2. MeZO at pipeline.py's rate for that task (1e-4, full-parameter), `seeds` seeds, each `steps` steps (2 forwards a
   step), with the dev loss every `eval_every` steps on the full dev set (256) and on the protocol's fixed 64-example
   subset (`verdict.dev_subset`); each run cached as runs/<hash of its settings>.json;
3. the analysis at the protocol's horizon (`horizon` forwards = the first horizon/2 steps of every run; MeZO's rate is
   constant, so they are exactly runs of that length), on the evaluation points every `grid` forwards (the protocol's
   40), on the 64-example subset (the protocol's tail points) and on the full dev set:
   - null: `splits` random splits of the seeds into two disjoint groups of 8 ("arm" and "MeZO", both MeZO): the tail
     mean difference with its Welch 95% interval, the time-warp factor with its bootstrap interval (2000 resamples per
     split), issue 37's forwards to MeZO's final dev loss (arm seed i paired with MeZO seed i of the split: different
     seeds, so different data order and directions), and the rule's verdict;
   - power: the same splits with the "arm" group's curves warped in forwards by k (0.6, 0.75): arm seed j's loss at f
     is its own MeZO curve at f / k, interpolated linearly in log loss against log forwards between its evaluation
     points (the runs go to 2 x horizon forwards, so f / k <= horizon / 0.5 needs no extrapolation). A warped curve is
     a real seed's curve, noise included, only read at other forward counts; interpolating between evaluation points
     (every `eval_every` steps) smooths it a little. A run of MeZO at a scaled rate would not be a pure warp (its noise
     and its stability change with the rate), so the warp is what the rule's power is measured against.
4. results.json (the per-split figures) and table.md in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import numpy as np

from experiments import verdict as V
from experiments.core import Log, cached, every, record_run, run_curve

CONFIGS = {
    "full": dict(task="sentiment", lr=1e-4, seeds=32, steps=400, eval_every=20, pretrain_steps=3000, horizon=400,
                 grid=40, group=8, splits=1000, warps=[0.6, 0.75], resamples=V.RESAMPLES),
    "ci": dict(task="sentiment", lr=1e-3, seeds=4, steps=8, eval_every=1, pretrain_steps=10, horizon=8, grid=2,
               group=2, splits=5, warps=[0.6], resamples=200),
}


def check_one_model(runs: list[dict]) -> None:
    """Refuse runs of different pre-trained models. A run's cache key names the model by its settings, and
    pretraining is not bit-reproducible across machines: on 2026-11-28 the same settings gave a model whose
    zero-shot dev loss was 0.679, not 2026-11-27's 0.226 (rerun on the same machine it gives the same bits), and its
    runs were cached beside the first model's. The zero-shot dev loss (every run's first point) tells the models
    apart."""
    zero_shot = sorted({round(r["curve"][0]["loss"], 6) for r in runs})
    if len(zero_shot) > 1:
        raise SystemExit(f"the cached runs come from {len(zero_shot)} pre-trained models (zero-shot dev losses "
                         f"{', '.join(map(str, zero_shot))}): keep the runs of one model in --out")


def one_run(out: str, model: str, task_dir: str, plan: dict, seed: int, log) -> dict:
    """One MeZO run (pipeline.py's config, full-parameter) by `run_curve`, from runs/<hash>.json when cached."""
    from experiments.pipeline import DATA, arm_of, base_config

    settings = dict(model=os.path.basename(model), task=plan["task"], method="mezo", form="full", lr=plan["lr"],
                    seed=seed, steps=plan["steps"], eval_every=plan["eval_every"],
                    subset=dict(size=V.SUBSET, seed=V.SUBSET_SEED), data=DATA)
    path, done = cached(out, settings)
    if done is not None:
        return done
    result = record_run(path, settings, lambda: run_curve(
        base_config(model, task_dir, plan["lr"], seed, plan["steps"]), arm_of("mezo", "full"),
        every(2 * plan["eval_every"], 2 * plan["steps"], ("dev", "subset")), subset=settings["subset"], test=False))
    curve = result["curve"]
    log(f"run seed {seed}: dev loss {curve[-1]['loss']:.4f}, subset {curve[-1]['subset_loss']:.4f} "
        f"({result['seconds']:.1f}s)")
    return result


def curves(runs: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(forwards, log losses [seed, point]) of every run's `key` over its evaluation points."""
    f = np.array([c["forwards"] for c in runs[0]["curve"]], dtype=float)
    return f, np.stack([V.log_losses([c[key] for c in r["curve"]], len(f)) for r in runs])


def warped(f: np.ndarray, y: np.ndarray, at: np.ndarray, k: float) -> np.ndarray:
    """Each row's curve read at forwards at / k (linear in log loss against log forwards; linear in forwards below
    the first evaluation point after 0)."""
    x = at / k
    out = np.empty((len(y), len(at)))
    logf = np.log(np.where(f > 0, f, 1.0))
    for i, row in enumerate(y):
        for p, xp in enumerate(x):
            j = min(max(int(np.searchsorted(f, xp, side="right")) - 1, 0), len(f) - 2)
            if j == 0:
                w = (xp - f[0]) / (f[1] - f[0])
            else:
                w = (math.log(xp) - logf[j]) / (logf[j + 1] - logf[j])
            out[i, p] = row[j] + w * (row[j + 1] - row[j])
    return out


def analyse(runs: list[dict], plan: dict) -> dict:
    """Per split and scenario (null, warp k), per curve (subset, full): the tail-mean difference and its Welch
    interval, the time-warp factor and its bootstrap interval, issue 37's paired median, and the rule's verdict."""
    horizon, grid, group = plan["horizon"], plan["grid"], plan["group"]
    rng = np.random.default_rng(V.RNG_SEED)
    splits = [rng.permutation(len(runs))[:2 * group] for _ in range(plan["splits"])]
    out = {}
    for key, label in (("subset_loss", "subset"), ("loss", "full")):
        f_all, y_all = curves(runs, key)
        keep = (f_all <= horizon + 1e-9) & (np.mod(f_all, grid) < 1e-9)
        f, y = f_all[keep], y_all[:, keep]
        for scenario in ["null"] + [f"warp {k:g}" for k in plan["warps"]]:
            rows = []
            for split in splits:
                arm_idx, mezo_idx = split[:group], split[group:]
                mezo = y[mezo_idx]
                arm = y[arm_idx] if scenario == "null" else warped(f_all, y_all[arm_idx], f, float(scenario[5:]))
                tail = V.tail_mask(f, horizon)
                w = V.welch(arm[:, tail].mean(1), mezo[:, tail].mean(1))
                point = V.warp(f, arm, f, mezo, horizon)
                boot = V.warp_bootstrap(f, arm, f, mezo, horizon, resamples=plan["resamples"])
                pairs = [V.forwards_to_final(f, np.exp(a), f, np.exp(m)) for a, m in zip(arm, mezo)]
                ratios = [(a / b if b else math.inf) if a is not None else math.inf for a, b in pairs]
                rows.append(dict(diff=w["diff"], low=w["low"], high=w["high"], factor=point["factor"],
                                 extrapolated=point["extrapolated"], boot_low=boot["low"], boot_high=boot["high"],
                                 median_ratio=float(np.median(ratios)),
                                 verdict=V.fewer_forwards(boot["high"])))
            out[f"{label}: {scenario}"] = rows
    return out


def quantiles(values) -> str:
    q = V.percentile(values, [2.5, 50, 97.5])
    return f"{q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}]"


def table(results: dict, plan: dict, runs: list[dict]) -> list[str]:
    finals = [r["curve"][-1]["loss"] for r in runs]
    at_h = [next(c["loss"] for c in r["curve"] if c["forwards"] == plan["horizon"]) for r in runs]
    lines = [f"MeZO on pipeline.py's `{plan['task']}`, lr {plan['lr']:g}, {len(runs)} seeds; dev loss at "
             f"{plan['horizon']} forwards {np.mean(at_h):.4f} ± {np.std(at_h, ddof=1):.4f} (sd over seeds), at "
             f"{2 * plan['steps']} forwards {np.mean(finals):.4f} ± {np.std(finals, ddof=1):.4f}; zero-shot "
             f"{runs[0]['curve'][0]['loss']:.4f}. {plan['splits']} random {plan['group']}-vs-{plan['group']} splits, "
             f"horizon {plan['horizon']} forwards, evaluation every {plan['grid']} forwards, tail = the points in "
             f"[{(1 - V.TAIL) * plan['horizon']:g}, {plan['horizon']}]; {plan['resamples']} bootstrap resamples per "
             f"split. Median [2.5%, 97.5%] over splits.", "",
             "| dev curve | scenario | tail mean difference (log loss) | Welch 95% excludes 0 (below / above) | "
             "time-warp factor | its bootstrap upper 95% bound | rule says \"fewer forwards\" (upper <= 0.75) | "
             "extrapolated | issue 37's forwards to MeZO's final (median over paired seeds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        curve, scenario = name.split(": ")
        below = np.mean([r["high"] < 0 for r in rows])
        above = np.mean([r["low"] > 0 for r in rows])
        lines.append(f"| {curve} | {scenario} | {quantiles([r['diff'] for r in rows])} | {below:.3f} / {above:.3f} | "
                     f"{quantiles([r['factor'] for r in rows])} | {quantiles([r['boot_high'] for r in rows])} | "
                     f"{np.mean([r['verdict'] for r in rows]):.3f} | "
                     f"{np.mean([r['extrapolated'] for r in rows]):.2f} | "
                     f"{quantiles([r['median_ratio'] for r in rows])} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "calibration"))
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/pipeline"),
                        help="where pipeline.py's pre-trained model is kept (outside the repository)")
    parser.add_argument("--stage", choices=["all", "report"], default="all",
                        help="report: analyse the cached runs and run nothing")
    args = parser.parse_args(argv)
    plan = CONFIGS[args.config]
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    if args.stage == "all":
        import torch

        from experiments.language import write_task
        from experiments.pipeline import DATA, pretrain

        torch.set_num_threads(1)
        os.makedirs(args.cache, exist_ok=True)
        model = pretrain(args.cache, plan["pretrain_steps"], log)
        with tempfile.TemporaryDirectory(prefix="calibrate-tasks-") as tmp:  # generated again, identical, each time
            task_dir = write_task(tmp, plan["task"], 0, DATA["num_train"], DATA["num_dev"], DATA["num_test"])
            runs = [one_run(args.out, model, task_dir, plan, seed, log) for seed in range(plan["seeds"])]
    else:
        runs = []
        for name in sorted(os.listdir(os.path.join(args.out, "runs"))):
            with open(os.path.join(args.out, "runs", name)) as f:
                run = json.load(f)
            s = run["settings"]
            if (s["lr"], s["steps"], s["eval_every"], s["task"]) == (plan["lr"], plan["steps"], plan["eval_every"],
                                                                     plan["task"]):
                runs.append(run)
        runs.sort(key=lambda r: r["settings"]["seed"])
    check_one_model(runs)
    start = time.time()
    results = analyse(runs, plan)
    lines = table(results, plan, runs)
    summary = {name: dict(fpr_or_power=float(np.mean([r["verdict"] for r in rows])),
                          factor=V.percentile([r["factor"] for r in rows], [2.5, 50, 97.5]).tolist(),
                          upper=V.percentile([r["boot_high"] for r in rows], [2.5, 50, 97.5]).tolist(),
                          diff=V.percentile([r["diff"] for r in rows], [2.5, 50, 97.5]).tolist())
               for name, rows in results.items()}
    from curvzo_ds.jsonio import write_json_atomic

    write_json_atomic(os.path.join(args.out, f"results-{args.config}.json"),
                      dict(plan=plan, seeds=[r["settings"]["seed"] for r in runs], summary=summary, splits=results))
    with open(os.path.join(args.out, f"table-{args.config}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"analysis of {len(runs)} runs: {time.time() - start:.0f}s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
