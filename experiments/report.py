"""Issue 47's report (`python -m experiments.protocol --report`): each arm's fresh seeds against MeZO's with
experiments/verdict.py's metrics, the loss_std prediction, and the pilot grids, from the cached runs."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments import verdict as V
from experiments.rate_rule import Cache, curve_of, diverged, pilot_state, pilot_tail
from experiments.stats import mean_sd


def fresh_runs(cache: Cache, task: str, arm: str) -> tuple[float | None, list[dict]]:
    st = pilot_state(cache, task, arm)
    if st["chosen"] is None:
        return None, []
    runs = [cache.get(task, arm, st["chosen"], s) for s in cache.plan["fresh_seeds"]]
    return st["chosen"], [r for r in runs if r is not None]


def subset_curves(runs: list[dict], forwards: int) -> tuple[np.ndarray, np.ndarray]:
    f = np.array(sorted({int(k) for k in runs[0]["settings"]["evaluation"]}), dtype=float)
    rows = []
    for r in runs:
        got = dict(zip(*curve_of(r, "subset_loss")))
        rows.append(V.log_losses([got.get(x) for x in f]))
    return f, np.stack(rows)


def null_summary(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "not available"
    with open(path) as f:
        s = json.load(f)["summary"].get("subset: null")
    if s is None:
        return "not available"
    return (f"factor {s['factor'][1]:.2f} [{s['factor'][0]:.2f}, {s['factor'][2]:.2f}], upper bound "
            f"{s['upper'][1]:.2f} [{s['upper'][0]:.2f}, {s['upper'][2]:.2f}], rule's false positives "
            f"{s['fpr_or_power']:.3f}")


def tail_means(f: np.ndarray, y: np.ndarray, forwards: int) -> np.ndarray:
    """Each run's tail mean log dev loss from subset_curves' (forwards, log losses)."""
    return np.array([V.tail_mean(f, np.exp(row), forwards) for row in y])


def compare(plan: dict, runs: list[dict], mezo: list[dict]) -> dict:
    """An arm's fresh runs against MeZO's: the Welch cell, the time-warp cell (and its bootstrap), the paired
    forwards-to-MeZO's-final cell."""
    f, y = subset_curves(runs, plan["forwards"])
    fm, ym = subset_curves(mezo, plan["forwards"])
    w = V.welch(tail_means(f, y, plan["forwards"]), tail_means(fm, ym, plan["forwards"]))
    point = V.warp(f, y, fm, ym, plan["forwards"])
    boot = V.warp_bootstrap(f, y, fm, ym, plan["forwards"])
    mezo_seed = {r["settings"]["seed"]: row for r, row in zip(mezo, ym)}
    pairs = [V.forwards_to_final(f, np.exp(row), fm, np.exp(mezo_seed[r["settings"]["seed"]]))
             for r, row in zip(runs, y) if r["settings"]["seed"] in mezo_seed]
    flag = ((f" (extrapolated; capped: MeZO's curve, extended, does not reach some of the arm's tail points within "
             f"{V.CAP:g}x its forwards, so the factor is at most this)") if point["capped"] else
            " (extrapolated)" if point["extrapolated"] else "")
    return dict(boot=boot, welch=f"{w['diff']:+.4f} [{w['low']:+.4f}, {w['high']:+.4f}]",
                warp=f"{point['factor']:.3f} [{boot['low']:.3f}, {boot['high']:.3f}]{flag}",
                pairs=V.forwards_to_final_summary(pairs))


def no_extrapolation_lines(cache: Cache, tasks: list[str], arms: list[str]) -> list[str]:
    """Issue 57's reading of the same runs: the time-warp factor that never extrapolates (`verdict.warp_interpolated`,
    F = MeZO's evaluation points in the last half of the forwards), over every seed and over the seeds that did not
    diverge, and the test accuracy against MeZO's (Welch 95%)."""
    plan = cache.plan
    half = [x for x in range(plan["forwards"] // 2, plan["forwards"] + 1, plan["eval_every"])]
    rows = []
    for task in tasks:
        _, mezo = fresh_runs(cache, task, "mezo")
        for arm in [a for a in arms if a != "mezo"]:
            _, runs = fresh_runs(cache, task, arm)
            if not runs or not mezo:
                continue
            cells = []
            for mine, theirs in ((runs, mezo), ([r for r in runs if not diverged(r)],
                                                [r for r in mezo if not diverged(r)])):
                if not mine or not theirs:
                    cells.append(f"{len(mine)} vs {len(theirs)}: -")
                    continue
                f, y = subset_curves(mine, plan["forwards"])
                fm, ym = subset_curves(theirs, plan["forwards"])
                w = V.warp_interpolated(f, y, fm, ym, half)
                cells.append(f"{len(mine)} vs {len(theirs)}: " + (
                    "refused (no point reached)" if w["factor"] is None else
                    f"{w['factor']:.2f} [{w['low']:.2f}, {w['high']:.2f}] ({w['reached']}/{w['points']})"))
            acc = V.welch([r["test"]["accuracy"] for r in runs], [r["test"]["accuracy"] for r in mezo])
            rows.append(f"| {task} | {arm} | {cells[0]} | {cells[1]} | {acc['diff']:+.3f} [{acc['low']:+.3f}, "
                        f"{acc['high']:+.3f}] |")
    if not rows:
        return []
    return ["The time-warp factor that never extrapolates (issue 57: for each F in the last half of the forwards, "
            "MeZO's mean log dev loss at F, the forwards at which the arm's mean curve first reaches it; the "
            "geometric mean of their ratios; bootstrap 95% over both arms' seeds; (points reached/points)) and the "
            "test accuracy against MeZO's:", "",
            "| task | arm | time-warp, every seed | time-warp, seeds that did not diverge | test accuracy − MeZO's, "
            "Welch 95% |", "|---|---|---|---|---|", *rows]


def report_lines(cache: Cache, tasks: list[str], arms: list[str], null_path: str | None) -> list[str]:
    plan, n = cache.plan, len(cache.plan["fresh_seeds"])
    null = null_summary(null_path)
    lines = [f"Fresh seeds {plan['fresh_seeds'][0]}-{plan['fresh_seeds'][-1]} at each arm's chosen rate; the "
             f"{plan['subset']}-example dev subset every {plan['eval_every']} forwards; tail = the last "
             f"{V.TAIL:.0%} of {plan['forwards']} forwards. MeZO-vs-MeZO null (item B, 8 vs 8 seeds, median "
             f"[2.5%, 97.5%]): {null}.", "",
             "| task | arm | rate (pilot rule) | fresh seeds (diverged) | tail mean log dev loss, mean ± sd | "
             "− MeZO's, Welch 95% | time-warp factor [bootstrap 95%] | forwards to MeZO's final dev loss "
             "(issue 37's, paired by seed) | full dev loss at 400, mean ± sd | test accuracy | "
             "fewer forwards than MeZO? |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    sensitivity = []
    for task in tasks:
        mezo_lr, mezo = fresh_runs(cache, task, "mezo")
        for arm in arms:
            lr, runs = (mezo_lr, mezo) if arm == "mezo" else fresh_runs(cache, task, arm)
            st = pilot_state(cache, task, arm)
            if not runs:
                lines.append(f"| {task} | {arm} | {'undecided' if lr is None else format(lr, 'g')} ({st['why']}) | "
                             "0 | - | - | - | - | - | - | - |")
                continue
            f, y = subset_curves(runs, plan["forwards"])
            tails = tail_means(f, y, plan["forwards"])
            bad = sum(diverged(r) for r in runs)
            finals = [r["curve"][-1].get("loss", math.nan) for r in runs]
            acc = [r["test"]["accuracy"] for r in runs]
            row = (f"| {task} | {arm} | {lr:g} ({st['why']}) | {len(runs)} ({bad}) | "
                   f"{mean_sd(tails)} | ")
            if arm == "mezo" or not mezo:
                row += f"- | - | - | {mean_sd(finals)} | "
                row += f"{np.mean(acc):.3f} | - |"
                lines.append(row)
                continue
            c = compare(plan, runs, mezo)
            verdict = ("yes" if V.fewer_forwards(c["boot"]["high"]) else "no") if len(runs) == len(mezo) == n else (
                f"pending ({len(runs)} and MeZO's {len(mezo)} of {n} seeds)")
            row += f"{c['welch']} | {c['warp']} | {c['pairs']} | {mean_sd(finals)} | {np.mean(acc):.3f} | {verdict} |"
            lines.append(row)
            kept, mezo_kept = [r for r in runs if not diverged(r)], [r for r in mezo if not diverged(r)]
            if (len(kept), len(mezo_kept)) != (len(runs), len(mezo)) and kept and mezo_kept:
                c = compare(plan, kept, mezo_kept)
                sensitivity.append(f"| {task} | {arm} | {len(kept)} of {len(runs)} | {len(mezo_kept)} of "
                                   f"{len(mezo)} | {c['welch']} | {c['warp']} |")
    if sensitivity:
        lines += ["", "Without the diverged fresh seeds (a sensitivity check, not the rule: the verdict above counts "
                  "every seed, and a diverged MeZO seed raises MeZO's mean curve, which favours the arm):", "",
                  "| task | arm | arm's seeds kept | MeZO's seeds kept | tail mean − MeZO's, Welch 95% | "
                  "time-warp factor [bootstrap 95%] |", "|---|---|---|---|---|---|", *sensitivity]
    prediction = []
    for task in tasks if {"rloo-8", "rloo-8-std"} <= set(arms) else []:
        (_, plain), (_, std) = fresh_runs(cache, task, "rloo-8"), fresh_runs(cache, task, "rloo-8-std")
        if plain and std:
            w = V.welch(*(tail_means(*subset_curves(r, plan["forwards"]), plan["forwards"]) for r in (std, plain)))
            held = ("yes" if w["high"] <= -0.1 else "no") if len(plain) == len(std) == n else "pending"
            prediction.append(f"| {task} | {len(std)} | {len(plain)} | {w['diff']:+.4f} [{w['low']:+.4f}, "
                              f"{w['high']:+.4f}] | {held} |")
    if prediction:
        lines += ["", "The issue's prediction for `loss_std`: a tail mean at least 0.1 below RLOO-8's (the upper 95% "
                  "bound of the difference <= -0.1):", "",
                  "| task | rloo-8-std seeds | rloo-8 seeds | tail mean, rloo-8-std − rloo-8, Welch 95% | "
                  "at least 0.1 below? |", "|---|---|---|---|---|", *prediction]
    lines += ["", *no_extrapolation_lines(cache, tasks, arms)]
    lines += ["", "Pilot grids (mean tail log dev loss over the pilot seeds; the full dev set):", ""]
    pilot_rows = ["", "Pilot runs (the full dev set):", "",
                  "| task | arm | rate | seed | dev loss at 0 / 200 / 400 forwards | tail mean log dev loss | from |",
                  "|---|---|---|---|---|---|---|"]
    for task in tasks:
        for arm in arms:
            st = pilot_state(cache, task, arm)
            cells = []
            for lr, runs in st["grid"]:
                got = [r for r in runs.values() if r is not None]
                if any(diverged(r) for r in got):
                    cells.append(f"{lr:g}: diverged")
                elif got:
                    cells.append(f"{lr:g}: {np.mean([pilot_tail(r) for r in got]):.3f} ({len(got)} seeds)")
                for seed, r in runs.items():
                    if r is not None:
                        f, loss = curve_of(r)
                        at = [f"{loss[f == x][0]:.4f}" if (f == x).any() else "-" for x in (0, 200, 400)]
                        tail = "diverged" if diverged(r) else f"{pilot_tail(r):.3f}"
                        pilot_rows.append(f"| {task} | {arm} | {lr:g} | {seed} | {' / '.join(at)} | {tail} | "
                                          f"{r['source']} |")
            lines.append(f"- {task} / {arm} (start {st['start']:g}): {', '.join(cells)}; {st['why']}")
    return lines + pilot_rows + perturbation_lines(cache, tasks)


def perturbation_lines(cache: Cache, tasks: list[str]) -> list[str]:
    """Issue 58's pilots: each base arm at the rule's rate on its pilot seeds with Gaussian and with +-1 directions
    (the `-pm1` arm), paired by seed. +-1 is no worse when the mean paired difference of the tail mean log dev loss
    is within the Gaussian pilots' spread (their sd over the seeds)."""
    rows = []
    for task in tasks:
        for arm in ("mezo", "rloo-8-std"):
            lr = pilot_state(cache, task, arm)["chosen"]
            pairs = [(cache.get(task, arm, lr, s), cache.get(task, f"{arm}-pm1", lr, s))
                     for s in cache.plan["pilot_seeds"]] if lr is not None else []
            pairs = [(g, r) for g, r in pairs if g is not None and r is not None]
            if not pairs:
                continue
            tails = np.array([[math.inf if diverged(x) else pilot_tail(x) for x in pair] for pair in pairs])
            diff, spread = tails[:, 1] - tails[:, 0], float(np.std(tails[:, 0], ddof=1)) if len(pairs) > 1 else 0.0
            secs = [[x.get("step_seconds", math.nan) for x in pair] for pair in pairs]
            acc = [[x["test"]["accuracy"] for x in pair] for pair in pairs]
            mean = float(np.mean(diff))
            ok = "yes" if mean <= spread else "no"  # better, or worse by no more than the spread
            rows.append(f"| {task} | {arm} | {lr:g} | {len(pairs)} | {finite_tails(tails[:, 0])} | "
                        f"{finite_tails(tails[:, 1])} | "
                        f"{mean:+.3f} ({', '.join(f'{d:+.3f}' for d in diff)}) | {spread:.3f} | "
                        f"{np.mean([a for a, _ in acc]):.3f} / {np.mean([b for _, b in acc]):.3f} | "
                        f"{np.mean([a for a, _ in secs]):.2f} / {np.mean([b for _, b in secs]):.2f} | {ok} |")
    if not rows:
        return []
    return ["", "Issue 58's pilots: Gaussian against +-1 directions (the `-pm1` arms), each base arm at its chosen "
            "rate, paired by pilot seed (the full dev set; tail = mean log dev loss over the pilot's points in the "
            "last 40% of its forwards):", "",
            "| task | arm | rate | seeds | tail, Gaussian | tail, +-1 | +-1 - Gaussian, mean (per seed) | Gaussian "
            "tails' sd | test accuracy, Gaussian / +-1 | seconds a step, Gaussian / +-1 | +-1 no worse? |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def finite_tails(tails: np.ndarray) -> str:
    """mean ± sd of the seeds that did not diverge, and how many did."""
    ok = tails[np.isfinite(tails)]
    bad = len(tails) - len(ok)
    return (mean_sd(ok) if len(ok) else "-") + (f"; {bad} diverged" if bad else "")
