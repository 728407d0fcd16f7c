"""Issue 47's protocol: does RLOO (with or without `step_normalization=loss_std`) need fewer forwards than MeZO on
SmolLM2-135M? One rate rule for every arm, 8 fresh seeds per arm at its chosen rate, experiments/verdict.py's metrics.

    python -m experiments.protocol --plan --out DIR                       # the runs still missing, and their commands
    nice -n 19 python -m experiments.protocol --run --arm rloo-8 --task topic --runs 4e-4:3 4e-4:4 --out DIR
    nice -n 19 python -m experiments.protocol --work --out DIR            # what --plan lists; one worker per core
    python -m experiments.protocol --report --out DIR                     # the tables (experiments/report.py)
    python -m experiments.protocol --config ci --model TINY --out DIR ... # the test's: 16 forwards, a tiny Llama

Runs are meant to execute from a pinned checkout (`cd CHECKOUT && PYTHONPATH=. nice -n 19 python -m
experiments.protocol --run ... --out RESULTS`): every path is an option, the defaults are relative to this file's
checkout, and each run records the commit and dirty state of the checkout it ran from (of this file and of the
imported curvzo_ds), the machine and its wall time (experiments/core.py's `record_run`).

Model, tasks, data, batches and the step are experiments/smollm.py's (its `base_config`; each arm a row of config keys
run by experiments/core.py's `run_curve`, through the project's own ZO step); tasks `sentiment` and `topic`; 400
forwards per run. Arms (experiments/rate_rule.py's `ARMS`): `mezo` (central, q = 1: 200 steps of 2 forwards),
`rloo-8` (difference=rloo, num_directions=8: 50 steps of 8 forwards), `rloo-8-std` (rloo-8 with
step_normalization=loss_std: `learning_rate` is then η, a step length in units of z).

**Evaluation.** Fresh runs (seeds 3-10): the dev loss on a fixed 64-example subset every 40 forwards (verdict.py's
`dev_subset`: the first 64 of numpy default_rng(47)'s permutation of the dev examples sorted by their JSON text, the
same examples in every run whatever the seed's order), the full dev set (256) at 0, 200 and 400 forwards, test at
the end. The metrics use the subset's curve (11 points; the tail is 240-400). Pilot runs (seeds 0-2) only pick
rates, and evaluate as issue 37's runs did, so that its cached runs serve as pilots: the full dev set every 50
forwards for MeZO (real_model.py's 25 steps) and every 40 forwards for the RLOO arms; their tail is the points in
[240, 400].

**The rate rule** (experiments/rate_rule.py's `pilot_state`) picks each arm's rate from pilot seeds 0-2.

Then 8 fresh seeds (3-10) per arm at its chosen rate; `--report` compares each arm's fresh seeds with MeZO's.
`--work` runs what `--plan` lists (task by task, arm by arm in the order of --arms), reading the plan again after each
run; each run is claimed by an flock in --out/.claims/, so two workers (one per core) share the queue.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import tempfile

import numpy as np

from experiments.core import Log, record_run, run_curve
from experiments.rate_rule import (
    ARMS,
    CONFIGS,
    PROTOCOL_ARMS,
    TASKS,
    Cache,
    diverged,
    pilot_state,
    pilot_tail,
    round3,
    settings_of,
)
from experiments.report import report_lines
from experiments.smollm import GGUF_SHA256, base_config, convert, fetch_gguf, write_task

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------------------------
# One run


def one_run(cache: Cache, model_dir: str, task: str, task_dir: str, arm: str, lr: float, seed: int, log: Log) -> dict:
    """A run from the cache (the protocol's or issue 37's), or `run_curve`'s, written to --out/runs: at each evaluation
    point (in forwards) the splits it asks for; test at the end. A non-finite dev loss stops the run (the rest of its
    curve is missing)."""
    cached = cache.get(task, arm, lr, seed)
    if cached is not None:
        log(f"cached ({cached['source']}): {task} {arm} lr={lr:g} seed={seed}")
        return cached
    settings = settings_of(cache.plan, cache.model, task, arm, lr, seed)
    points = {int(f): s for f, s in settings["evaluation"].items()}
    result = record_run(cache.path(task, arm, lr, seed), settings, lambda: run_curve(
        base_config(model_dir, task_dir, lr, seed, settings["steps"]), ARMS[arm], points, subset=settings["subset"],
        name=arm))
    last = result["curve"][-1]
    shown = f"dev loss {last['loss']:.4f}" if "loss" in last else f"subset loss {last.get('subset_loss', math.nan):.4f}"
    log(f"run {task} {arm} lr={lr:g} seed={seed} ({settings['stage']}): {shown}, test acc "
        f"{result['test']['accuracy']:.3f} ({result['seconds']:.0f}s, {result['step_seconds']:.2f}s/step)")
    return result


# ----------------------------------------------------------------------------------------------------------------
# --plan and --work


def minutes(cache: Cache, task: str, arm: str) -> str:
    """The median wall time of the cached runs of this task and arm (issue 37's and the protocol's)."""
    secs = []
    for path in ([os.path.join(cache.out, "runs")] + ([cache.reuse] if cache.reuse else [])):
        if os.path.isdir(path):
            for name in os.listdir(path):
                with open(os.path.join(path, name)) as f:
                    run = json.load(f)
                if run["settings"].get("task") == task and run["settings"].get("arm") == arm:
                    secs.append(run["seconds"])
    return (f"about {np.median(secs) / 60:.0f} min each (the median of {len(secs)} cached runs)" if secs else
            "no run of this arm cached yet")


def needed(cache: Cache, task: str, arm: str, st: dict | None = None) -> list[tuple[float, int]]:
    """The runs (lr, seed) this task and arm need next: the pilots the rate rule is missing, else the fresh seeds of
    its chosen rate that have not run."""
    st = st or pilot_state(cache, task, arm)
    fresh = [] if st["chosen"] is None else [
        (st["chosen"], s) for s in cache.plan["fresh_seeds"] if cache.get(task, arm, st["chosen"], s) is None]
    return st["missing"] + fresh


def claim(cache: Cache, task: str, arm: str, lr: float, seed: int):
    """An open file holding an exclusive flock on --out/.claims/<run>.lock, or None when another worker holds it (the
    kernel drops the lock when a worker dies, so a claim is never stale)."""
    os.makedirs(os.path.join(cache.out, ".claims"), exist_ok=True)
    f = open(os.path.join(cache.out, ".claims", f"{task}-{arm}-{lr:g}-{seed}.lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def work(cache: Cache, tasks: list[str], arms: list[str], model_dir: str, task_dirs: dict, log: Log) -> int:
    """Run what the plan needs next, one run at a time, until nothing is left that no other worker is running: task
    by task, arm by arm (the order of --arms), each run claimed so that one worker per core shares the queue. The
    plan is read again after every run (a finished pilot grid chooses its rate, and its fresh seeds follow).
    Returns the number of runs trained."""
    done = 0
    while True:
        for task, arm, lr, seed in [(t, a, lr, s) for t in tasks for a in arms for lr, s in needed(cache, t, a)]:
            lock = claim(cache, task, arm, lr, seed)
            if lock is None:
                continue
            with lock:
                if cache.get(task, arm, lr, seed) is None:  # another worker may have finished it since
                    one_run(cache, model_dir, task, task_dirs[task], arm, lr, seed, log)
                    done += 1
            break
        else:
            log(f"work: {done} runs; nothing left that another worker is not running")
            return done


def plan_lines(cache: Cache, tasks: list[str], arms: list[str], out_arg: str) -> list[str]:
    lines = []
    for task in tasks:
        for arm in arms:
            st = pilot_state(cache, task, arm)
            lines += ["", f"## {task} / {arm}: start {st['start']:g}; {st['why']}; chosen: "
                      f"{'undecided' if st['chosen'] is None else format(st['chosen'], 'g')}"]
            for lr, runs in st["grid"]:
                cells = []
                for s, r in runs.items():
                    cells.append(f"seed {s}: missing" if r is None else
                                 f"seed {s}: {'diverged' if diverged(r) else format(pilot_tail(r), '.3f')} "
                                 f"({r['source']})")
                lines.append(f"- {lr:g}: " + "; ".join(cells))
            todo = [f"{lr:g}:{s}" for lr, s in needed(cache, task, arm, st)]
            kind = "pilot" if st["missing"] else "fresh"
            lines.append(f"- still to run ({kind}): {' '.join(todo) if todo else 'none'}"
                         + (f"; {len(todo)} runs, {minutes(cache, task, arm)}" if todo else ""))
            if todo:
                lines.append(f"  `nice -n 19 python -m experiments.protocol --run --arm {arm} --task {task} --runs "
                             f"{' '.join(todo)} --out {out_arg}`")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action="store_true", help="print the runs still missing and their commands")
    what.add_argument("--run", action="store_true", help="run --runs LR:SEED of --arm on --task (cached)")
    what.add_argument("--report", action="store_true", help="print the tables from the cached runs")
    what.add_argument("--work", action="store_true",
                      help="run what --plan lists, one run after another, claimed (start one worker per core)")
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--arm", choices=list(ARMS))
    parser.add_argument("--task", choices=TASKS)
    parser.add_argument("--runs", nargs="*", default=[], metavar="LR:SEED")
    parser.add_argument("--arms", nargs="*", choices=list(ARMS), default=PROTOCOL_ARMS, help="for --plan and --report")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "protocol"),
                        help="where runs/ and progress.log go")
    parser.add_argument("--reuse", default=os.path.join(HERE, "results", "real-model", "runs"),
                        help="issue 37's cached runs, used as pilots where they match ('' for none)")
    parser.add_argument("--null", default=os.path.join(HERE, "results", "calibration", "results-full.json"),
                        help="item B's calibration results (experiments/calibrate.py)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"),
                        help="the GGUF and its conversion (outside the repository)")
    parser.add_argument("--model", help="a Hugging Face directory instead of SmolLM2 (the test's tiny Llama)")
    args = parser.parse_args(argv)
    plan = CONFIGS[args.config]
    name = os.path.basename(os.path.normpath(args.model)) if args.model else f"smollm2-135m-{GGUF_SHA256[:16]}"
    cache = Cache(plan, args.config, name, args.out, args.reuse or None)
    tasks = [args.task] if args.task else plan["tasks"]
    if args.plan:
        print("\n".join(plan_lines(cache, tasks, args.arms, args.out)))
        return
    if args.report:
        print("\n".join(report_lines(cache, tasks, args.arms, args.null)))
        return
    if args.run and (not args.arm or not args.task):
        parser.error("--run needs --arm and --task")
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    if args.model:
        model_dir = args.model
    else:
        model_dir = convert(fetch_gguf(args.cache, log), args.cache, log)
    with tempfile.TemporaryDirectory(prefix="protocol-tasks-") as tmp:  # a process's own copy: no race on the files
        if args.work:
            work(cache, tasks, args.arms, model_dir, {t: write_task(tmp, t) for t in tasks}, log)
            return
        task_dir = write_task(tmp, args.task)
        for item in args.runs:
            lr, seed = item.split(":")
            one_run(cache, model_dir, args.task, task_dir, args.arm, round3(float(lr)), int(seed), log)


if __name__ == "__main__":
    main()
