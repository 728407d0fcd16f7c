"""Issue 47's protocol (experiments/protocol.py), what decides its runs: the arms (one row of config keys each), the
configs, the start rates and the lattice, a run's settings and cache, and the rate rule.

**The rate rule** (`pilot_state`), the same for every arm: rates on a x√2 lattice from the arm's start rate,
r_k = start x 2^(k/2) rounded to 3 significant digits; each rate runs pilot seeds 0, 1, 2. A run has *diverged* if a
dev loss is not finite or its final dev loss is above its zero-shot dev loss. Going up from k = 0: stop at the
first rate where some seed diverged, or whose mean tail log dev loss (over the 3 seeds) is higher than the previous
rate's, or after `max_grid` rates; the chosen rate is the one with the lowest mean tail log loss among the rates at
which all 3 seeds stayed stable. If the start rate itself diverges on some seed, the lattice goes down instead
(k = -1, -2, ...) and the first rate stable on all 3 seeds is chosen. Start rates (`START`): MeZO its rate known
stable on 3 seeds (issue 37: `sentiment` 1e-4, `topic` 5e-5); RLOO-8 MeZO's start rate times the predicted rate ratio
(`rloo_rate_ratio`), rounded down to the lattice anchored at MeZO's rate (so that the grid goes up from below the
predicted optimum and meets issue 37's x2 rates); loss_std η₀ = 1e-3 (the estimate q·lr_MeZO·‖g‖/√(q − 1) on
SmolLM2 mid-run). Issue 37's cached runs (experiments/results/real-model/runs/) serve wherever they match exactly
(model, task, arm, rate, seed, 400 forwards, evaluation, data).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments import real_model as R
from experiments import verdict as V
from experiments.core import cache_path, digest, forwards_per_step
from experiments.smollm import DATA
from experiments.stats import rloo_rate_ratio

ARMS = {"mezo": dict(method="mezo"),  # one row of config keys each; a run's settings hold its row as `spec`
        "rloo-8": dict(method="mezo", difference="rloo", num_directions=8),
        "rloo-8-std": dict(method="mezo", difference="rloo", num_directions=8, step_normalization="loss_std")}
PROTOCOL_ARMS = list(ARMS)  # the protocol's; the rows below are issue 58's pilots with +-1 directions (--run only)
ARMS.update({f"{arm}-pm1": dict(ARMS[arm], perturbation="rademacher") for arm in ("mezo", "rloo-8-std")})
TASKS = ["sentiment", "topic"]
# x_dev at MeZO's step 100 (experiments/x_dev.py, experiments/results/x-dev/): the predicted RLOO rate ratio's x.
X_DEV = {"sentiment": 0.142, "topic": 0.036}  # ± 0.013 and ± 0.005 (2026-11-28, experiments/RESULTS.md)
MEZO_START = {"sentiment": 1e-4, "topic": 5e-5}
STD_START = 1e-3
CONFIGS = {
    "full": dict(forwards=400, eval_every=40, full_at=[0, 200, 400], subset=V.SUBSET,
                 pilot_eval={"mezo": 50, "rloo-8": 40, "rloo-8-std": 40, "mezo-pm1": 50, "rloo-8-std-pm1": 40},
                 pilot_seeds=[0, 1, 2],
                 fresh_seeds=list(range(3, 11)), max_grid=8, tasks=TASKS),
    "ci": dict(forwards=16, eval_every=8, full_at=[0, 8, 16], subset=8, pilot_eval={"mezo": 8, "rloo-8": 8,
                                                                                    "rloo-8-std": 8, "mezo-pm1": 8,
                                                                                    "rloo-8-std-pm1": 8},
               pilot_seeds=[0, 1], fresh_seeds=[2, 3], max_grid=3, tasks=["sentiment"]),
}
CI_START = {"mezo": 1e-3, "rloo-8": 4e-3, "rloo-8-std": 1e-3}


def round3(x: float) -> float:
    return float(f"{x:.3g}")


def start_point(config: str, task: str, arm: str) -> tuple[float, int]:
    """(anchor, m): the arm's start rate is anchor x 2^(m/2), and its lattice anchor x 2^((m + k)/2)."""
    if config == "ci":
        return CI_START[arm], 0
    if arm == "mezo":
        return MEZO_START[task], 0
    if arm == "rloo-8-std":
        return STD_START, 0
    x = X_DEV[task]
    ratio = rloo_rate_ratio(ARMS[arm]["num_directions"], 0.0 if x is None else x)
    return MEZO_START[task], math.floor(2 * math.log2(ratio))


def lattice(config: str, task: str, arm: str, k: int) -> float:
    """The arm's k-th rate from its start (k < 0: below it), rounded to 3 significant digits."""
    anchor, m = start_point(config, task, arm)
    return round3(anchor * 2 ** ((m + k) / 2))


# ----------------------------------------------------------------------------------------------------------------
# Settings, the cache, and issue 37's runs


def steps_of(plan: dict, arm: str) -> int:
    return plan["forwards"] // forwards_per_step(ARMS[arm])


def stage_of(plan: dict, seed: int) -> str:
    return "pilot" if seed in plan["pilot_seeds"] else "fresh"


def evaluation(plan: dict, arm: str, stage: str) -> dict:
    """{forwards: [splits]}: what each evaluation point measures ("dev" the full dev set, "subset" the fixed one)."""
    if stage == "pilot":
        every = plan["pilot_eval"][arm]
        points = {f: ["dev"] for f in range(0, plan["forwards"] + 1, every)}
        points[plan["forwards"]] = ["dev"]
        return points
    points = {f: ["subset"] for f in range(0, plan["forwards"] + 1, plan["eval_every"])}
    for f in plan["full_at"]:
        points[f] = ["dev", "subset"]
    return points


def settings_of(plan: dict, model: str, task: str, arm: str, lr: float, seed: int) -> dict:
    stage = stage_of(plan, seed)
    ev = evaluation(plan, arm, stage)
    return dict(protocol="issue-47", model=model, task=task, arm=arm, spec=ARMS[arm], lr=lr, seed=seed,
                forwards=plan["forwards"], steps=steps_of(plan, arm), stage=stage,
                evaluation={str(f): s for f, s in sorted(ev.items())},
                subset=dict(size=plan["subset"], seed=V.SUBSET_SEED) if stage == "fresh" else None, data=DATA)


def issue37_settings(model: str, task: str, arm: str, lr: float, seed: int) -> dict | None:
    """The settings under which issue 37 cached the same run (real_model.py's `one_run` for MeZO, rloo_real.py's
    `settings_of` for RLOO q = 8), or None for an arm it did not run."""
    if arm == "mezo":
        return dict(model=model, task=task, arm="mezo", spec=R.ARMS["mezo"], lr=lr, seed=seed, steps=200,
                    eval_every=25, data=DATA)
    if arm == "rloo-8":
        return dict(model=model, task=task, arm=arm, spec=dict(method="mezo", difference="rloo", num_directions=8),
                    lr=lr, seed=seed, steps=50, eval_every=5, data=DATA)
    return None


class Cache:
    """The protocol's runs (--out/runs/<hash of settings>.json) and issue 37's (--reuse/<hash>.json)."""

    def __init__(self, plan: dict, config: str, model: str, out: str, reuse: str | None):
        self.plan, self.config, self.model, self.out, self.reuse = plan, config, model, out, reuse

    def path(self, task: str, arm: str, lr: float, seed: int) -> str:
        return cache_path(self.out, settings_of(self.plan, self.model, task, arm, lr, seed))

    def reused_path(self, task: str, arm: str, lr: float, seed: int) -> str | None:
        if self.reuse is None or self.config != "full" or stage_of(self.plan, seed) != "pilot":
            return None
        old = issue37_settings(self.model, task, arm, lr, seed)
        return os.path.join(self.reuse, digest(old) + ".json") if old is not None else None

    def get(self, task: str, arm: str, lr: float, seed: int) -> dict | None:
        for path in (self.path(task, arm, lr, seed), self.reused_path(task, arm, lr, seed)):
            if path and os.path.exists(path):
                with open(path) as f:
                    run = json.load(f)
                run.setdefault("source", "issue 37" if path != self.path(task, arm, lr, seed) else "protocol")
                return run
        return None


def curve_of(run: dict, key: str = "loss") -> tuple[np.ndarray, np.ndarray]:
    """(forwards, losses) of a run's points that have `key` (issue 37's runs: forwards from steps)."""
    per_step = forwards_per_step(ARMS[run["settings"]["arm"]])
    pts = [(c.get("forwards", c["step"] * per_step), c[key]) for c in run["curve"] if c.get(key) is not None]
    return np.array([f for f, _ in pts], dtype=float), np.array([x for _, x in pts], dtype=float)


def diverged(run: dict) -> bool:
    """A dev loss that is not finite, or a final dev loss above the zero-shot one (or a run stopped short)."""
    f, loss = curve_of(run)
    forwards = run["settings"].get("forwards", 400)
    return bool(not np.isfinite(loss).all() or loss[-1] > loss[0] or f[-1] < forwards)


def pilot_tail(run: dict) -> float:
    f, loss = curve_of(run)
    return V.tail_mean(f, loss, run["settings"].get("forwards", 400))


# ----------------------------------------------------------------------------------------------------------------
# The rate rule


def pilot_state(cache: Cache, task: str, arm: str) -> dict:
    """The rule's state for one task and arm: `grid` [(lr, {seed: run or None})], `chosen` (a rate, or None while
    pilots are missing), `missing` [(lr, seed)] (the pilot runs the rule needs next), `why` (a sentence)."""
    plan = cache.plan
    start = lattice(cache.config, task, arm, 0)
    seeds = plan["pilot_seeds"]
    grid, stable = [], {}  # stable: lr -> mean tail log loss of a rate stable on every pilot seed
    k, down = 0, False
    while True:
        lr = lattice(cache.config, task, arm, k)
        runs = {s: cache.get(task, arm, lr, s) for s in seeds}
        grid.append((lr, runs))
        bad = [s for s, r in runs.items() if r is not None and diverged(r)]
        missing = [(lr, s) for s, r in runs.items() if r is None]
        best = min(stable, key=stable.get) if stable else None
        if bad and not stable:
            if len(grid) >= plan["max_grid"]:
                return dict(grid=grid, chosen=None, missing=[], start=start,
                            why=f"no rate stable on every pilot seed within {plan['max_grid']} rates")
            down, k = True, k - 1  # k <= 0 here: every rate above this one diverged
            continue
        if bad:
            return dict(grid=grid, chosen=best, missing=[], start=start,
                        why=f"{lr:g} diverged on seed {', '.join(map(str, bad))}")
        if missing:
            return dict(grid=grid, chosen=None, missing=missing, start=start, why=f"pilots of {lr:g} missing")
        stable[lr] = float(np.mean([pilot_tail(r) for r in runs.values()]))
        if down:
            return dict(grid=grid, chosen=lr, missing=[], start=start,
                        why=f"the start rate diverged; {lr:g} is the first stable rate below it")
        if best is not None and stable[lr] > stable[best]:
            return dict(grid=grid, chosen=best, missing=[], start=start,
                        why=f"{lr:g}'s mean tail log loss is worse than {best:g}'s")
        if len(grid) >= plan["max_grid"]:
            return dict(grid=grid, chosen=min(stable, key=stable.get), missing=[], start=start,
                        why=f"the grid stops at {plan['max_grid']} rates")
        k += 1


