"""Issue 57's protocol at a horizon and on noise: the normalised step with `learning_rate: auto` and each schedule,
the control `running_rms`, MeZO, plain RLOO-8 and the preset as it was (a fixed eta), on clean and noisy labels.

    nice -n 19 python -m experiments.horizon --config small --work      # a worker: runs what the plan lists, cached
    nice -n 19 python -m experiments.horizon --config smollm --work     # SmolLM2-135M at 2,000 forwards
    python -m experiments.horizon --config small --plan                 # the runs still missing
    python -m experiments.horizon --config small --report               # the tables, from the cached runs
    python -m experiments.horizon --config small --adopt                # runs cached before the rollback setting
    python -m experiments.horizon --config ci --work --out /tmp/x       # the test's: a tiny model, 32 forwards
    python -m experiments.horizon --config smollm --work --device cuda  # on a GPU (tools/gpu_horizon.sh: a lent one)

Configs: `small` is experiments/pipeline.py's pre-trained model (about 1M parameters, 3000 steps of pre-training, as
experiments/calibrate.py; its weights ship in experiments/assets/, pipeline.SHIPPED, since a pretraining gives another
model on another CPU) on `sentiment`, 16,000 forwards, the full dev set every 800; `smollm` is SmolLM2-135M
(experiments/smollm.py) on `sentiment`, `topic` and `sentiment` with 20% of its train labels flipped (dev and test
clean), 2,000 forwards, the full dev set every 200. Each run is one row of ARMS at its rate (RATES: the rates the
400-forward protocol's rule chose on SmolLM2; on the small model MeZO's calibrated 1e-4 and RLOO-8 at 4x it) and
one seed; `auto` arms choose their own rate (algo/rate.py). Every run goes through experiments/core.py's
`run_curve` and is cached in --out/runs/<hash of its settings>.json; a worker claims a run with an flock in
--out/.claims/, so one worker per core shares the queue. A worker first checks that its model is the cached runs'
(`check_model`: the same zero-shot dev loss; a pretraining gives another model on another CPU) and refuses if not.

Every run of `small`, `smollm` and `ci` rolls back as `curvzo-ds train` does when it diverges (experiments/core.py's
`_train`: the CLI's dev rule at each evaluation, back to the best evaluation's state at half the rate, at most 3
times; its curve counts every forward spent), so that each arm, MeZO included, is compared as a user runs it (a user's
run rolls back by default). Runs cached before the setting that never met the rule are those runs step for step:
`--adopt` moves them to their keys (a run that met it stays, " (no rollback)" in the report, and its seed runs again).

The report compares each arm with MeZO per task and variant, by verdict.py's metrics: the tail mean log dev loss
(Welch 95%), the time-warp factor that never extrapolates (`verdict.warp_interpolated`, F over the last half of the
horizon on the evaluation grid, bootstrap 95%) beside the old one (refused where every point is extrapolated or
capped), and the test accuracy difference (Welch 95%). The decision rule (issue 57, item 5): upper bound of the
non-extrapolated factor <= 0.75 and the test accuracy difference's lower bound >= -0.01, on every SmolLM2 task; the
report ends with the decision it gives (running_rms first, then the auto normalised step, else `mezo` stays),
provisional while a cell lacks seeds, unless the arms ahead are out: an arm that fails a cell holding all its seeds
(and MeZO's) can pass no more, whatever its other cells' later seeds give. The rule counts every seed; where
`curvzo-ds train` would have rolled one of MeZO's seeds back (`unstable`: its divergence rule's dev test), a second
table compares against MeZO's other seeds, for information, as issue 47's report did beside its rule.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import tempfile

import numpy as np

from curvzo_ds.errors import RateRefused
from curvzo_ds.train.divergence import DivergenceWatch
from experiments import verdict as V
from experiments.core import Log, cached, digest, every, forwards_per_step, record_run, run_curve

HERE = os.path.dirname(os.path.abspath(__file__))
RLOO8 = dict(method="mezo", difference="rloo", num_directions=8)
STD_AUTO = dict(RLOO8, step_normalization="loss_std", learning_rate="auto")
ARMS = {  # one row of config keys each (the rate of the rows without `learning_rate` comes from RATES)
    "mezo": dict(method="mezo"),
    "rloo-8": dict(RLOO8),
    "std-auto-plateau": dict(STD_AUTO, lr_scheduler_type="plateau"),
    "rms-auto-plateau": dict(method="mezo", step_normalization="running_rms", learning_rate="auto",
                             lr_scheduler_type="plateau"),
    "std-auto-constant": dict(STD_AUTO),
    "std-auto-linear": dict(STD_AUTO, lr_scheduler_type="linear"),
    "preset-fixed": dict(RLOO8, step_normalization="loss_std", learning_rate=5.66e-3),  # configs/ as of issue 47
}
ARMS["mezo-3e-4"] = dict(method="mezo", learning_rate=3e-4)  # MeZO's rate x3 on the small model (its pilot)
ARMS.update({"mezo-lora": dict(method="mezo", lora=True), "std-auto-plateau-lora": dict(ARMS["std-auto-plateau"],
                                                                                         lora=True)})
RHOS = (0.02, 0.04, 0.08, 0.16, 0.32)  # auto_walk_fraction's lattice (x2) on the small model
ARMS.update({f"std-rho-{rho:g}": dict(STD_AUTO, auto_walk_fraction=rho) for rho in RHOS})
FIXED = (1.13e-2, 2.83e-3, 5.66e-3)  # loss_std at a fixed rate under plateau: where is the rate a rule should find?
ARMS.update({f"std-{eta:g}-plateau": dict(RLOO8, step_normalization="loss_std", learning_rate=eta,
                                           lr_scheduler_type="plateau") for eta in FIXED})
RATES = {"small": {"mezo": 1e-4, "rloo-8": 4e-4}, "small-rho": {"mezo": 1e-4}, "small-rate": {},
         "small-rho-400": {"mezo": 1e-4},
         # mezo-lora: MeZO's LoRA rate (the CLI's preset 5e-5, MeZO's paper)
         "smollm": {"mezo": {"sentiment": 1.41e-4, "topic": 7.07e-5}, "rloo-8": {"sentiment": 8e-4, "topic": 4e-4},
                    "mezo-lora": 5e-5},
         "ci": {"mezo": 1e-3, "rloo-8": 4e-3}}
NOISY = {"label_noise": 0.2}
ROLLBACK = "dev"  # a run's divergence rollback: the CLI's dev rule at each evaluation (experiments/core.py's `_train`)
CONFIGS = {
    "small": dict(model="pipeline", cells=[("sentiment", "clean"), ("sentiment", "noisy")], horizon=16000,
                  eval_every=800, seeds=list(range(8)), first_seeds=2, rollback=True,
                  arms=["mezo", "std-auto-plateau", "rms-auto-plateau", "rloo-8", "std-auto-constant",
                        "std-auto-linear", "preset-fixed"]),
    # rho's calibration on the small model: loss_std at a constant auto rate over auto_walk_fraction's lattice, at
    # issue 47's horizon (400 forwards) and at 16,000: does the best rho stay where SmolLM2's lattice put it?
    "small-rho": dict(model="pipeline", cells=[("sentiment", "clean")], horizon=16000, eval_every=800, seeds=[0, 1],
                      first_seeds=1, arms=["mezo", "mezo-3e-4"] + [f"std-rho-{rho:g}" for rho in RHOS[1:]]),
    "small-rate": dict(model="pipeline", cells=[("sentiment", "clean"), ("sentiment", "noisy")], horizon=16000,
                       eval_every=800, seeds=[0, 1], first_seeds=1,
                       arms=[f"std-{eta:g}-plateau" for eta in FIXED]),
    "small-rho-400": dict(model="pipeline", cells=[("sentiment", "clean")], horizon=400, eval_every=40,
                          seeds=[0, 1, 2], first_seeds=3, arms=["mezo"] + [f"std-rho-{rho:g}" for rho in RHOS]),
    "smollm": dict(model="smollm", cells=[("sentiment", "noisy"), ("sentiment", "clean"), ("topic", "clean")],
                   horizon=2000, eval_every=200, seeds=list(range(3, 7)), first_seeds=2, rollback=True,
                   arms=["mezo", "preset-fixed", "std-auto-plateau", "rms-auto-plateau"],
                   decision=["rms-auto-plateau", "std-auto-plateau"],  # item 5: running_rms first (2 forwards a step)
                   lora_cell=("sentiment", "clean"), lora_arms=["mezo-lora", "std-auto-plateau-lora"],
                   lora_seeds=[3, 4, 5]),
    "ci": dict(model="tiny", cells=[("sentiment", "noisy")], horizon=32, eval_every=16,
               seeds=[0, 1], first_seeds=2, rollback=True, arms=["mezo", "std-auto-plateau", "rms-auto-plateau"],
               decision=["rms-auto-plateau", "std-auto-plateau"]),
}


def rate_of(config: str, arm: str, task: str) -> float | None:
    """An arm's rate, or None where the row sets its own (`auto`, the preset's)."""
    if "learning_rate" in ARMS[arm]:
        return None
    rate = RATES[config][arm]
    return rate[task] if isinstance(rate, dict) else rate


def settings_of(config: str, model: str, task: str, variant: str, arm: str, seed: int) -> dict:
    plan = CONFIGS[config]
    return dict(protocol="horizon", config=config, model=os.path.basename(os.path.normpath(model)), task=task,
                variant=variant, arm=arm, spec=ARMS[arm], lr=rate_of(config, arm, task), seed=seed,
                horizon=plan["horizon"], eval_every=plan["eval_every"], **auto_settings(arm),
                **(dict(rollback=ROLLBACK) if plan.get("rollback") else {}))


AUTO_RULE = "line-upper"  # the line rule dividing by the curvature's upper bound ("line": by its mean, until 23:10)


def auto_settings(arm: str) -> dict:
    """What decides an `auto` arm's rate, part of its settings (so a run of another rule is another run): the line
    rule's fraction and probes (algo/rate.py), or, for the rows that still name `auto_walk_fraction`, the walk rule's
    rho (the rule before 2026-11-29 22:00, whose runs these settings keep finding; this checkout cannot run them)."""
    from curvzo_ds.algo.rate import AUTO_RATE_FRACTION, AUTO_RATE_PROBES

    spec = ARMS[arm]
    if spec.get("learning_rate") != "auto":
        return {}
    if "auto_walk_fraction" in spec:
        return dict(auto_fraction=spec["auto_walk_fraction"])
    return dict(auto_rule=AUTO_RULE, auto_rate_fraction=spec.get("auto_rate_fraction", AUTO_RATE_FRACTION),
                auto_rate_probes=spec.get("auto_rate_probes", AUTO_RATE_PROBES))


def plan_runs(config: str) -> list[tuple[str, str, str, int]]:
    """(task, variant, arm, seed) in the order the workers take them: the first seeds of every arm and cell, then
    the rest, so that an interrupted protocol has every arm on every cell; arm by arm in the order of `arms`."""
    plan = CONFIGS[config]
    first, rest = plan["seeds"][:plan["first_seeds"]], plan["seeds"][plan["first_seeds"]:]
    runs = [(task, variant, arm, seed) for seeds in (first, rest) for arm in plan["arms"]
            for task, variant in plan["cells"] for seed in seeds]
    if "lora_cell" in plan:  # the LoRA cell: one task, MeZO against the auto normalised step
        runs += [(*plan["lora_cell"], arm, seed) for arm in plan["lora_arms"] for seed in plan["lora_seeds"]]
    return runs


class Setup:
    """The model directory and the task directories of a config, made once per worker."""

    def __init__(self, config: str, cache: str, model: str | None, tmp: str, log: Log):
        self.config, self.tmp = config, tmp
        if config == "smollm":
            from experiments import smollm

            self.model = model or smollm.convert(smollm.fetch_gguf(cache, log), cache, log)
            self.write, self.base = (lambda task: smollm.write_task(tmp, task)), smollm.base_config
        else:
            from experiments import language, pipeline

            self.model = model or pipeline.pretrain(cache, 10 if config == "ci" else 3000, log)
            sizes = (pipeline.DATA["num_train"], pipeline.DATA["num_dev"], pipeline.DATA["num_test"])
            self.write = lambda task: language.write_task(tmp, task, 0, *sizes)
            self.base = pipeline.base_config
        self.tasks: dict[str, str] = {}

    def task_dir(self, task: str) -> str:
        if task not in self.tasks:
            self.tasks[task] = self.write(task)
        return self.tasks[task]


def one_run(setup: Setup, out: str, task: str, variant: str, arm: str, seed: int, log: Log,
            device: str = "cpu") -> dict:
    config = setup.config
    plan = CONFIGS[config]
    settings = settings_of(config, setup.model, task, variant, arm, seed)
    path, done = cached(out, settings)
    if done is not None:
        return done
    base = setup.base(setup.model, setup.task_dir(task), settings["lr"] or 1e-3, seed, 1)

    def train() -> dict:
        try:
            return run_curve(base, ARMS[arm], every(plan["eval_every"], plan["horizon"]), name=arm, device=device,
                             variant=NOISY if variant == "noisy" else None, rollback="rollback" in settings)
        except RateRefused as e:  # an `auto` rate the rule refuses on this seed: an outcome, kept like a run's
            return dict(refused=str(e), curve=[], test={})

    result = record_run(path, settings, train)
    if "refused" in result:
        log(f"{task}/{variant} {arm} seed {seed}: refused: {result['refused']}")
        return result
    last = result["curve"][-1]
    log(f"{task}/{variant} {arm} seed {seed}: dev loss {last.get('loss')}, test {result['test'].get('accuracy')} "
        f"({result['seconds']:.0f}s)")
    return result


def work(config: str, out: str, cache: str, model: str | None, log: Log, arms: list[str] | None = None,
         device: str = "cpu") -> None:
    """Run what the plan lists (of `arms` only, where given) and no other worker holds, one at a time, until
    nothing is left, on `device` (a run's cache key leaves it out: a run on a GPU is the same run to rounding, and
    records where it ran)."""
    import torch

    torch.set_num_threads(1)
    os.makedirs(os.path.join(out, ".claims"), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="horizon-") as tmp:
        setup = Setup(config, cache, model, tmp, log)
        check_model(setup, out, device, log)
        for task, variant, arm, seed in plan_runs(config):
            if arms and arm not in arms:
                continue
            settings = settings_of(config, setup.model, task, variant, arm, seed)
            if cached(out, settings)[1] is not None:
                continue
            with open(os.path.join(out, ".claims", digest(settings)), "w") as claim:
                try:
                    fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another worker runs it
                if cached(out, settings)[1] is None:
                    one_run(setup, out, task, variant, arm, seed, log, device)


def check_model(setup: Setup, out: str, device: str, log: Log) -> None:
    """Refuse to add runs of a different model to `out`'s: for each task with cached runs of this config and model
    name, this model's zero-shot dev loss must be theirs (step 0 of their curves, to a relative 1e-4: a GPU's
    rounding moves it by about 1e-5). The model's name is its settings' digest, and pretraining is not bit-for-bit the
    same on every CPU (experiments/RESULTS.md: 0.5806 and 0.2285 from one pretraining on two machines; the small model's
weights now ship, and the runs of the 0.5806 model are in experiments/results/horizon-small-model-0.5806/)."""
    from curvzo_ds.train.plain import PlainRun

    name = os.path.basename(os.path.normpath(setup.model))
    theirs: dict[str, list[float]] = {}
    for runs in load_runs(out, setup.config).values():
        for r in runs:
            loss = r["curve"][0].get("loss") if r["curve"] and r["curve"][0]["step"] == 0 else None
            if r["settings"]["model"] == name and isinstance(loss, (int, float)) and math.isfinite(loss):
                theirs.setdefault(r["settings"]["task"], []).append(loss)
    for task, losses in sorted(theirs.items()):
        cfg = setup.base(setup.model, setup.task_dir(task), 1e-3, 0, 1)
        mine = PlainRun(cfg, device=device).evaluate("dev")["loss"]
        other = [x for x in losses if not abs(x - mine) <= 1e-4 * abs(mine)]
        log(f"model check: zero-shot dev loss on {task} {mine:.7g}; {len(losses) - len(other)} of the {len(losses)} "
            "cached runs' agree")
        if other:
            raise SystemExit(f"experiments.horizon: this model ({setup.model}) has zero-shot dev loss {mine:.4f} on "
                             f"{task}, {len(other)} of the cached runs in {out} {float(np.median(other)):.4f}: a "
                             "different model of the same name (its pretraining came out different on this "
                             "machine); give --out a new folder for this model's runs, or --model the model the "
                             "cached runs used")


# ------------------------------------------------------------------------------------------------------ the report
REFUSED = " (refused)"  # an arm's label for its runs whose auto rate the rule refused (no curve)

def load_runs(out: str, config: str) -> dict:
    """{(task, variant, arm): [runs by seed]} of the cached runs of `config`."""
    import json

    runs: dict = {}
    folder = os.path.join(out, "runs")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            run = json.load(f)
        s = run["settings"]
        if s.get("protocol") == "horizon" and s["config"] == config:
            runs.setdefault((s["task"], s["variant"], arm_label(s) + (REFUSED if "refused" in run else "")),
                            []).append(run)
    return {k: sorted(v, key=lambda r: r["settings"]["seed"]) for k, v in runs.items()}


def arm_label(s: dict) -> str:
    """A run's arm in the report: its row's name, or, for an `auto` row's run of an earlier rate rule than the one
    its settings would now hold, the name with that rule's: " (walk rule)" (the walk rule's rho, `auto_fraction`),
    " (line rule, mean curvature)"; " (no rollback)" after it for a run of a plan with rollback cached without it
    (one that met the dev rule: `adopt` moved the others)."""
    label = rule_label(s)
    return label + (" (no rollback)" if CONFIGS.get(s["config"], {}).get("rollback") and "rollback" not in s else "")


def rule_label(s: dict) -> str:
    arm = s["arm"]
    if arm not in ARMS or ARMS[arm].get("learning_rate") != "auto":
        return arm
    mine = {k: s[k] for k in ("auto_fraction", "auto_rule", "auto_rate_fraction", "auto_rate_probes") if k in s}
    if mine == auto_settings(arm):
        return arm
    if "auto_fraction" in mine:
        return f"{arm} (walk rule)"
    return f"{arm} (line rule, mean curvature)" if mine.get("auto_rule") == "line" else f"{arm} ({mine})"


def curves(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    f = np.array([p["forwards"] for p in max((r["curve"] for r in runs), key=len)], dtype=float)
    return f, np.array([V.log_losses([p.get("loss") for p in r["curve"]], len(f)) for r in runs])


def diverged(run: dict) -> bool:
    first, last = run["curve"][0].get("loss"), run["curve"][-1].get("loss")
    return last is None or not math.isfinite(last) or (first is not None and last > first)


def unstable(run: dict) -> bool:
    """Whether `curvzo-ds train` would have called the run diverged at one of its evaluations (train/divergence.py's
    dev rule: a dev loss that is not finite, or above 2x the larger of the best so far and a quarter of the zero-shot
    loss) and rolled it back; for a run with rollback, whether it did. Stricter than `diverged` (which a run on noisy
    labels that ends above its start meets by drifting)."""
    if "rollbacks" in run:
        return bool(run["rollbacks"]) or any("diverged" in p for p in run["curve"])
    watch, curve = DivergenceWatch(), run["curve"]
    if curve and curve[0]["step"] == 0 and "loss" in curve[0]:  # the zero-shot evaluation: the rule's reference
        if watch.start({"loss": curve[0]["loss"]}):  # and floor, as the CLI's
            return True
        curve = curve[1:]
    return any(watch.observe_dev(p["step"], p.get("loss")) for p in curve if "loss" in p)


def probe_forwards(settings: dict) -> int:
    """The forwards an `auto` run spent choosing its rate before its first step: auto_rate_probes x (a step's
    forwards + 3), as engine/core.py's `choose_rate` takes them (176 for RLOO-8 at 16 probes, 80 for MeZO's two);
    0 for a run at a given rate (and for the walk rule's, which probed nothing). Not on its curve's axis."""
    if settings["spec"].get("learning_rate") != "auto" or "auto_rate_probes" not in settings:
        return 0
    return settings["auto_rate_probes"] * (forwards_per_step(settings["spec"]) + 3)


def adopt(out: str, config: str) -> int:
    """The runs of `config` (a plan with rollback) cached before `rollback` joined their settings that never met the
    CLI's dev rule are the runs with it, step for step (experiments/core.py's `_train`, tested so): each moves to
    the key of its settings with the rollback, marked `adopted`. A run that met the rule stays where it is, " (no
    rollback)" in the report, and its seed is planned again. Returns how many moved."""
    import json

    from curvzo_ds.jsonio import write_json_atomic

    folder, moved = os.path.join(out, "runs"), 0
    for name in sorted(os.listdir(folder)) if CONFIGS[config].get("rollback") and os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        with open(path) as f:
            run = json.load(f)
        s = run["settings"]
        if s.get("protocol") != "horizon" or s["config"] != config or "rollback" in s or unstable(run):
            continue
        run.update(settings=dict(s, rollback=ROLLBACK), rollbacks=[],
                   adopted=f"cached as {name} without rollback; no evaluation met the dev rule, so the run with "
                           "rollback is this run")
        target, done = cached(out, run["settings"])
        if done is None:
            write_json_atomic(target, run)
        os.remove(path)
        moved += 1
    return moved


def rolled(runs: list[dict]) -> str:
    """The rollbacks the runs took, where they took any (" (n rolled back)")."""
    n = sum(len(r.get("rollbacks", [])) for r in runs)
    return f" ({n} rolled back)" if n else ""


def finals(runs: list[dict]) -> str:
    """The final dev loss of each seed (they span decades; "-" where the run ended non-finite)."""
    losses = [r["curve"][-1].get("loss") for r in runs]
    return " / ".join("-" if v is None else f"{v:.3g}" for v in losses)


def compare(arm_runs: list[dict], mezo_runs: list[dict], horizon: int, eval_every: int) -> dict:
    """The arm against MeZO. The time-warp factors count the arm's probe forwards (its curve moved right by them);
    the tail means read each curve at its own forwards."""
    fa, ya = curves(arm_runs)
    fm, ym = curves(mezo_runs)
    grid = [f for f in range(horizon // 2, horizon + 1, eval_every)]
    tails = [V.tail_mean(fa, [p.get("loss") for p in r["curve"]], horizon) for r in arm_runs]
    mezo_tails = [V.tail_mean(fm, [p.get("loss") for p in r["curve"]], horizon) for r in mezo_runs]
    shift = probe_forwards(arm_runs[0]["settings"])
    fa = fa + shift
    old = V.warp(fa, ya, fm, ym, horizon)
    how = V.warp_from_means(fa, V.mean_curve(ya)[None], fm, V.mean_curve(ym)[None], horizon)["how"][0]
    acc = [r["test"].get("accuracy") for r in arm_runs]
    mezo_acc = [r["test"].get("accuracy") for r in mezo_runs]
    return dict(tail=V.welch(tails, mezo_tails), warp=V.warp_interpolated(fa, ya, fm, ym, grid),
                old=None if ((how == 1) | (how == 2)).all() else old["factor"],
                old_extrapolated=old["extrapolated"], test=V.welch(acc, mezo_acc),
                final=finals(arm_runs), diverged=f"{sum(diverged(r) for r in arm_runs)}{rolled(arm_runs)}",
                seeds=len(arm_runs), probe_forwards=shift)


def interval(d: dict, fmt: str = "{:+.3f}") -> str:
    if not math.isfinite(d["diff"]):
        return f"{d['diff']}"
    return fmt.format(d["diff"]) + (f" [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"
                                    if math.isfinite(d["low"]) else "")


def warp_text(c: dict) -> str:
    w = c["warp"]
    return ("refused (MeZO's mean curve never below the zero-shot loss: no point to reach)" if not w["points"]
            else "refused (no point reached)" if w["factor"] is None else
            f"x{w['factor']:.2f} [{w['low']:.2f}, {w['high']:.2f}] ({w['reached']}/{w['points']})"
            + (f", its {c['probe_forwards']} probe forwards counted" if c["probe_forwards"] else ""))


def passes(c: dict) -> bool:
    """Item 5's rule on one cell: the non-extrapolated factor's upper bound <= 0.75 and the test accuracy
    difference's lower bound >= -0.01."""
    w = c["warp"]
    return (w["factor"] is not None and w["high"] <= V.THRESHOLD and math.isfinite(c["test"]["low"])
            and c["test"]["low"] >= -0.01)


def against_stable(arms: list[str], runs: dict, task: str, variant: str, mezo: list[dict], plan: dict) -> list[str]:
    """Where `curvzo-ds train` would have rolled back some of MeZO's seeds (`unstable`), the arms against MeZO's
    other seeds: a second table, as issue 47's report gave beside its rule, which counts every seed."""
    flags = [unstable(r) for r in mezo]
    bad = [r["settings"]["seed"] for r, flag in zip(mezo, flags) if flag]
    if not bad:
        return []
    stable = [r for r, flag in zip(mezo, flags) if not flag]
    head = (f"MeZO's seed{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} met the CLI's divergence rule (a dev loss "
            "above 2x its best so far: `curvzo-ds train` rolls back at half the rate)")
    if not stable:
        return [head + ", and it has no other seed here: no comparison without them.", ""]
    kept = ", ".join(str(r["settings"]["seed"]) for r in stable)
    lines = [head + f". Against MeZO's seed{'s' * (len(stable) > 1)} {kept} alone (for information; the rule above "
             "counts every seed):", "",
             "| arm | seeds | tail mean log dev loss - MeZO's | time-warp, not extrapolated | test accuracy - MeZO's |",
             "|---|---|---|---|---|"]
    for arm in arms:
        mine = runs.get((task, variant, arm), [])
        if mine and arm != "mezo" and not arm.endswith("-lora"):
            c = compare(mine, stable, plan["horizon"], plan["eval_every"])
            lines.append(f"| {arm} | {c['seeds']} | {interval(c['tail'], '{:+.2f}')} | {warp_text(c)} | "
                         f"{interval(c['test'])} |")
    return lines + [""]


def decision(plan: dict, verdicts: dict) -> list[str]:
    """Item 5: the default for full fine-tuning becomes the first of `plan["decision"]` (running_rms, then the auto
    normalised step) that passes on every cell, else `mezo` stays. An arm that fails a cell holding all its seeds (and
    MeZO's) is out: no later run can change that cell, so the decision can be final before every cell is complete;
    otherwise it is provisional while a cell lacks its seeds."""
    lines, chosen, still_in, done = [], None, [], {}
    for arm in plan["decision"]:
        cells = [verdicts.get((*cell, arm)) for cell in plan["cells"]]
        said = "; ".join(f"{task} {variant}: " + ("no runs" if v is None else v["why"])
                         for (task, variant), v in zip(plan["cells"], cells))
        ok = all(v is not None and v["ok"] for v in cells)
        out = any(v is not None and v["complete"] and not v["ok"] for v in cells)
        done[arm] = all(v is not None and v["complete"] for v in cells)
        lines.append(f"- {arm}: {'passes' if ok else 'out (fails a complete cell)' if out else 'no'} ({said})")
        chosen = chosen or (arm if ok else None)
        still_in += [] if out else [arm]
    # the first arm still in decides once its cells are complete (an arm that is in and complete passes); none: mezo
    final = "mezo" if not still_in else still_in[0] if done[still_in[0]] else None
    head = ("" if all(done.values()) else " (final before every cell is complete: every arm fails a complete cell)"
            if final == "mezo" else " (final: every arm before it is out, its own cells complete)" if final else
            f" (provisional: not every cell has its {len(plan['seeds'])} seeds yet)")
    if final == "mezo":
        said = "So the default for full fine-tuning is `mezo` (no arm passes on every cell)."
    elif final:
        said = f"So the default for full fine-tuning is `{final}`."
    else:
        said = (f"So far the rule points to `{chosen}`." if chosen else
                "So far no arm passes on every cell: `mezo` stays.")
    return ["**Item 5's decision by the rule**" + head, ""] + lines + ["", said, ""]


def report(out: str, config: str) -> list[str]:
    plan = CONFIGS[config]
    runs = load_runs(out, config)
    lines = [f"### Horizon protocol, config `{config}` ({plan['horizon']} forwards, dev every {plan['eval_every']})",
             ""]
    sections = [(cell, plan["arms"], "mezo") for cell in plan["cells"]]
    if "lora_cell" in plan:
        sections.append((plan["lora_cell"], plan["lora_arms"], "mezo-lora"))
    verdicts = {}
    for (task, variant), arms, reference in sections:
        mezo = runs.get((task, variant, reference), [])
        lines += [f"**{task}, {variant}** ({reference}: {len(mezo)} seeds)", "",
                  "| arm | seeds | diverged | final dev loss (per seed) | tail mean log dev loss - MeZO's | time-warp, "
                  "not extrapolated (reached/points) | old time-warp | test accuracy - MeZO's | rule |",
                  "|---|---|---|---|---|---|---|---|---|"]
        older = sorted(k[2] for k in runs if k[:2] == (task, variant) and k[2] not in arms and
                       k[2].split(" (")[0] in arms)
        for arm in arms + older:
            mine = runs.get((task, variant, arm), [])
            if arm.endswith(REFUSED):  # the seeds whose auto rate the rule refused (no curve)
                seeds = ", ".join(str(r["settings"]["seed"]) for r in mine)
                lines.append(f"| {arm} | {len(mine)} | | | | | | | seeds {seeds} |")
                continue
            if arm == reference and mine:  # its own figures: the others' columns are differences from them
                tests = " / ".join(f"{r['test'].get('accuracy'):.3f}" for r in mine)
                lines.append(f"| {arm} | {len(mine)} | {sum(diverged(r) for r in mine)}{rolled(mine)} | "
                             f"{finals(mine)} | | | | test accuracy {tests} | |")
                continue
            if not mine or arm == reference or not mezo:
                lines.append(f"| {arm} | {len(mine)} | | | | | | | |")
                if mine and arm != reference:
                    verdicts[(task, variant, arm)] = dict(ok=False, why=f"{len(mine)} seed(s), MeZO none yet",
                                                          complete=False)
                continue
            c = compare(mine, mezo, plan["horizon"], plan["eval_every"])
            old = "refused (every point extrapolated or capped)" if c["old"] is None else f"x{c['old']:.2f}" + (
                " (extrapolated)" if c["old_extrapolated"] else "")
            refused = len(runs.get((task, variant, arm + REFUSED), []))
            ok = passes(c) and not refused
            lines.append(f"| {arm} | {c['seeds']} | {c['diverged']} | {c['final']} | {interval(c['tail'], '{:+.2f}')}"
                         f" | {warp_text(c)} | {old} | {interval(c['test'])} | {'passes' if ok else 'no'}"
                         + (f" ({refused} refused)" if refused else "") + " |")
            warp = "refused" if c["warp"]["factor"] is None else f"upper bound {c['warp']['high']:.2f}"
            low = f"{c['test']['low']:+.3f}" if math.isfinite(c["test"]["low"]) else "none (one seed)"
            why = (f"time-warp {warp}, test accuracy lower bound {low}"
                   + (f", {refused} refused" if refused else "") + f"; {c['seeds']} and MeZO's {len(mezo)} seeds")
            verdicts[(task, variant, arm)] = dict(ok=ok, why=why, complete=min(c["seeds"] + refused, len(mezo))
                                                  >= len(plan["seeds"]))
        lines.append("")
        lines += against_stable(arms, runs, task, variant, mezo, plan)
    if "decision" in plan:
        lines += decision(plan, verdicts)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="small")
    parser.add_argument("--out", help="default: experiments/results/horizon-<config>")
    parser.add_argument("--cache", help="where the model is kept (default: ~/.cache/curvzo_ds/pipeline or "
                                        "real_model)")
    parser.add_argument("--model", help="a model directory instead (the test's tiny Llama)")
    parser.add_argument("--arms", nargs="+", help="--work: only these arms of the plan (default: all)")
    parser.add_argument("--device", default="cpu", help="--work: where the runs go (cpu, or cuda on a GPU)")
    stage = parser.add_mutually_exclusive_group(required=True)
    stage.add_argument("--work", action="store_true")
    stage.add_argument("--plan", action="store_true")
    stage.add_argument("--report", action="store_true")
    stage.add_argument("--adopt", action="store_true", help="move the runs cached before rollback joined the settings "
                                                            "that never met its rule to their keys with it")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(HERE, "results", f"horizon-{args.config}")
    cache = args.cache or os.path.expanduser("~/.cache/curvzo_ds/" + ("real_model" if args.config == "smollm"
                                                                      else "pipeline"))
    os.makedirs(out, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    log = Log(os.path.join(out, "progress.log"))
    if args.adopt:
        log(f"adopted {adopt(out, args.config)} runs cached without rollback (none met its rule)")
    if args.work:
        work(args.config, out, cache, args.model, log, args.arms, args.device)
    if args.plan:
        done = load_runs(out, args.config)
        missing = [r for r in plan_runs(args.config)  # a refused run is done (it is never rerun)
                   if r[3] not in [x["settings"]["seed"] for x in
                                   done.get(r[:3], []) + done.get((r[0], r[1], r[2] + REFUSED), [])]]
        print("\n".join(" ".join(map(str, r)) for r in missing) or "nothing missing")
    if args.report or args.work:
        lines = report(out, args.config)
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
