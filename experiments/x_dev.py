"""Issue 47, item C: x_dev = gᵀHg / (‖g‖² tr H), the curvature along the gradient relative to the mean curvature, on
the dev loss of SmolLM2-135M, grid-free, at three checkpoints per task.

    nice -n 19 python -m experiments.x_dev --out experiments/results/x-dev                  # both tasks
    python -m experiments.x_dev --out experiments/results/x-dev --stage report              # the table only
    python -m experiments.x_dev --config ci --model DIR --out /tmp/x                        # the test's: tiny

L(w) is the dev loss exactly as the training curves report it (experiments/real_model.py's tasks and data: the
mean classification loss over the 256 dev examples, in evaluation mode), here on micro-batches collated once.
Checkpoints: the zero-shot weights, and MeZO's weights after 100 and 200 steps of its run with real_model.py's
settings at its best rate over 3 seeds (`sentiment` 1e-4, `topic` 5e-5; seed 0, the same steps as the cached
400-forward run of that rate and seed, whose dev loss at steps 100 and 200 is printed beside ours as a check).
At each checkpoint:
- g = ∇L by backprop over the dev set (summed micro-batch losses over the example count);
- gᵀHg / ‖g‖² = the second difference of L along u = g / ‖g‖, [L(w + s u) + L(w − s u) − 2 L(w)] / s², at the
  steps `steps_g`; the figure used is the one at `step_g`, and the table shows the others beside it (the quadratic
  range: they agree);
- tr H = E zᵀHz over Gaussian z ~ N(0, I), each zᵀHz = ‖z‖² × the second difference along z / ‖z‖ at the step of
  norm `tau` (on SmolLM2, one_step.py found the curvature along a random direction the same at norms 1 and 3 and
  lost to float32 rounding below 0.3); `draws` draws, its standard error the sample sd / √draws; the first `checks`
  draws are also measured at norms `tau_checks` (paired, the same z);
- x_dev with its standard error (from tr H's; gᵀHg's finite-difference error is shown by its steps), and what
  docs/algorithm.md §2's formula predicts for RLOO with q directions against MeZO: progress per forward
  (2/q) (1 + 2x) / (1/(q − 1) + c_q x), c_q = 2/q + ((q − 1)/q)(1 + 1/(q − 1)²), and its inverse, the forwards to a
  target as a fraction of MeZO's.
Each checkpoint's figures are cached in --out/<task>-<checkpoint>-<hash>.json (draws appended as they finish, so an
interrupted measurement resumes); MeZO's checkpoint weights in --cache (outside the repository).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import numpy as np
import torch

from curvzo_ds import data as D
from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.shard.forwards import eval_mode
from curvzo_ds.train.plain import PlainRun
from experiments.core import Log, digest
from experiments.smollm import DATA, GGUF_SHA256, base_config, convert, fetch_gguf, write_task
from experiments.stats import rloo_per_forward

RATES = {"sentiment": 1e-4, "topic": 5e-5}  # MeZO's rate with the lowest mean final dev loss over 3 seeds
CONFIGS = {
    "full": dict(tasks=["sentiment", "topic"], checkpoints=[0, 100, 200], of=200, draws=16, tau=3.0,
                 tau_checks=[1.0, 10.0], checks=1, steps_g=[1e-3, 3e-3, 1e-2], step_g=3e-3, seed=0),
    "ci": dict(tasks=["sentiment"], checkpoints=[0, 2], of=4, draws=3, tau=1.0, tau_checks=[0.3], checks=1,
               steps_g=[1e-3, 1e-2], step_g=1e-3, seed=0),
}


def x_for_ratio(target: float, qs=range(2, 65)) -> float:
    """The x above which no RLOO q in `qs` reaches a per-forward ratio of `target` (bisection; the ratio falls with
    x for every q)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if max(rloo_per_forward(q, mid) for q in qs) >= target else (lo, mid)
    return lo


class DevLoss:
    """L(w0 + s v) on the dev set for any direction v (the weights are rebuilt from w0 each time, then put back)."""

    def __init__(self, run: PlainRun, size: int | None = None):
        self.run = run
        self.params = [e.param for e in run.engine.entries]
        self.w0 = [p.detach().clone() for p in self.params]
        dev = run.eval_data["dev"]
        size = size or run.cfg.micro_batch_size  # the evaluation's micro-batches: the same loss to the last bit
        self.batches = [D.collate(dev[i:i + size], run.tokenizer.pad_token_id) for i in range(0, len(dev), size)]
        self.forwards = 0

    def __call__(self, v: list[torch.Tensor] | None = None, s: float = 0.0) -> float:
        if v is not None:
            with torch.no_grad():
                for p, w, x in zip(self.params, self.w0, v):
                    torch.add(w, x, alpha=s, out=p.data)
        try:
            with torch.no_grad(), eval_mode(self.run.model):
                sums = [D.classification_loss(self.run.model, b) for b in self.batches]
        finally:
            if v is not None:
                self.restore()
        self.forwards += 1
        return float(sum(float(x) for x, _ in sums) / sum(float(c) for _, c in sums))

    def restore(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.w0):
                p.copy_(w)

    def gradient(self) -> list[torch.Tensor]:
        model = self.run.model
        model.zero_grad(set_to_none=True)
        count = sum(float(b["num_examples"]) for b in self.batches)
        with eval_mode(model), torch.enable_grad():
            for b in self.batches:
                loss_sum, _ = D.classification_loss(model, b)
                (loss_sum / count).backward()
        g = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        model.zero_grad(set_to_none=True)
        return g


def dot(x, y) -> float:
    return float(sum(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()) for a, b in zip(x, y)))


def second(loss: DevLoss, v, s: float, l0: float) -> float:
    return (loss(v, s) + loss(v, -s) - 2 * l0) / s ** 2


def mezo_weights(model: str, task: str, task_dir: str, plan: dict, step: int, cache: str, log: Log) -> str | None:
    """MeZO's weights after `step` of its steps (seed plan's, real_model.py's run_config), cached as a file; the run
    saves every checkpoint of the plan on its way."""
    if step == 0:
        return None
    settings = dict(model=os.path.basename(model), task=task, lr=RATES[task], seed=plan["seed"], of=plan["of"],
                    data=DATA)
    path = lambda k: os.path.join(cache, f"mezo-{task}-{k}-{digest(settings)}.pt")  # noqa: E731
    if not os.path.exists(path(step)):
        torch.set_num_threads(1)
        start = time.time()
        run = PlainRun(base_config(model, task_dir, RATES[task], plan["seed"], plan["of"], method="mezo"))
        for t in range(max(plan["checkpoints"])):
            run.engine.step(run.batch(t))
            if t + 1 in plan["checkpoints"]:
                torch.save({e.name: e.param.detach().clone() for e in run.engine.entries}, path(t + 1) + ".tmp")
                os.replace(path(t + 1) + ".tmp", path(t + 1))
                log(f"{task}: MeZO's {t + 1} steps at lr {RATES[task]:g} ({time.time() - start:.0f}s) -> "
                    f"{path(t + 1)}")
    return path(step)


def measure(model: str, task: str, task_dir: str, plan: dict, step: int, out: str, cache: str, log: Log) -> dict:
    """One checkpoint's figures, from (and appended to) its cache file."""
    key = digest(dict(model=os.path.basename(model), task=task, step=step, lr=RATES[task],
                      plan={k: v for k, v in plan.items() if k not in ("draws", "tasks")}, data=DATA))
    path = os.path.join(out, f"{task}-{step}-{key}.json")
    rec = None
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        if len(rec["draws"]) >= plan["draws"]:
            return rec
    torch.set_num_threads(1)
    run = PlainRun(base_config(model, task_dir, RATES[task], plan["seed"], plan["of"], method="mezo"))
    weights = mezo_weights(model, task, task_dir, plan, step, cache, log)
    if weights:
        state = torch.load(weights)
        with torch.no_grad():
            for e in run.engine.entries:
                e.param.copy_(state[e.name])
    loss = DevLoss(run)
    start = time.time()
    l0 = loss()
    if rec is None:
        evaluated = run.evaluate("dev") if step == 0 else None  # once per task: L is the curves' dev loss
        g = loss.gradient()
        g2 = dot(g, g)
        unit = [x / math.sqrt(g2) for x in g]
        along = {f"{s:g}": second(loss, unit, s, l0) for s in plan["steps_g"]}
        rec = dict(task=task, step=step, lr=RATES[task], seed=plan["seed"], loss=l0, evaluate=evaluated,
                   g_norm2=g2, along_g=along, d=sum(p.numel() for p in loss.params), draws=[], checks=[],
                   seconds=dict(gradient_and_along=time.time() - start))
        write_json_atomic(path, rec)
        log(f"{task} step {step}: dev loss {l0:.8f} (evaluate: {evaluated['loss'] if evaluated else '-'}), ‖g‖² "
            f"{g2:.4g}, gᵀHg/‖g‖² "
            + ", ".join(f"{k}: {v:.4g}" for k, v in along.items()) + f" ({time.time() - start:.0f}s)")
    elif abs(l0 - rec["loss"]) > 1e-6 * max(1.0, abs(l0)):
        raise SystemExit(f"{path}: the cached dev loss {rec['loss']} is not this checkpoint's {l0}")
    gen_seed = 1_000_003 * (plan["seed"] + 1) + step
    for k in range(len(rec["draws"]), plan["draws"]):
        t0 = time.time()
        gen = torch.Generator().manual_seed(gen_seed * 1000 + k)
        z = [torch.randn(p.shape, generator=gen) for p in loss.params]
        z2 = dot(z, z)
        unit = [x / math.sqrt(z2) for x in z]
        c = second(loss, unit, plan["tau"], l0)
        rec["draws"].append(dict(z_norm2=z2, curvature=c, zhz=z2 * c))
        if k < plan["checks"]:
            rec["checks"].append({f"{t:g}": second(loss, unit, t, l0) for t in plan["tau_checks"]} |
                                 {f"{plan['tau']:g}": c})
        rec["seconds"][f"draw {k}"] = time.time() - t0
        write_json_atomic(path, rec)
        log(f"{task} step {step} draw {k}: zᵀHz {z2 * c:.4g} ({time.time() - t0:.0f}s)")
    return rec


def summary(rec: dict, plan: dict) -> dict:
    zhz = np.array([d["zhz"] for d in rec["draws"]])
    trace, trace_se = zhz.mean(), zhz.std(ddof=1) / math.sqrt(len(zhz))
    along = rec["along_g"][f"{plan['step_g']:g}"]
    x = along / trace
    return dict(trace=trace, trace_se=trace_se, trace_sd=zhz.std(ddof=1), along=along, x=x,
                x_se=x * trace_se / trace, draws=len(zhz))


def table(recs: list[dict], plan: dict, reference: dict) -> list[str]:
    threshold = x_for_ratio(1 / 0.6)
    lines = [f"Config: {json.dumps({k: v for k, v in plan.items()})}. gᵀHg/‖g‖² at step {plan['step_g']:g} along "
             f"g/‖g‖ (the other steps beside it); tr H = mean zᵀHz over Gaussian draws at a step of norm "
             f"{plan['tau']:g}; x_dev = (gᵀHg/‖g‖²) / tr H, ± its standard error from tr H's. Predicted (docs/"
             "algorithm.md §2): RLOO's progress per forward against MeZO, and in brackets its forwards to a target "
             f"as a fraction of MeZO's. No q reaches x0.6 of MeZO's forwards when x > {threshold:.4f}.", "",
             "| task | checkpoint | dev loss (cached run's) | ‖g‖² | gᵀHg/‖g‖² by step | tr H ± se (sd; draws) | "
             "x_dev ± se | RLOO q = 4, predicted | RLOO q = 8, predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        s = summary(rec, plan)
        name = "zero-shot" if rec["step"] == 0 else f"MeZO step {rec['step']}"
        ref = reference.get((rec["task"], rec["step"]))
        by_step = ", ".join(f"{k}: {v:.4g}" for k, v in rec["along_g"].items())
        pred = []
        for q in (4, 8):
            r = [rloo_per_forward(q, max(s["x"] + d * s["x_se"], 0.0)) for d in (0, 1, -1)]
            pred.append(f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}] (x{1 / r[0]:.2f})")
        lines.append(f"| {rec['task']} | {name} | {rec['loss']:.4f} ({ref:.4f}) | {rec['g_norm2']:.4g} | {by_step} | "
                     if ref is not None else
                     f"| {rec['task']} | {name} | {rec['loss']:.4f} | {rec['g_norm2']:.4g} | {by_step} | ")
        lines[-1] += (f"{s['trace']:.4g} ± {s['trace_se']:.2g} ({s['trace_sd']:.3g}; {s['draws']}) | "
                      f"{s['x']:.4f} ± {s['x_se']:.4f} | {pred[0]} | {pred[1]} |")
    lines += ["", "Predicted ranges in brackets: at x_dev + se and x_dev − se. The quadratic range of tr H's draws, "
              "the curvature along z/‖z‖ at each step norm on the first draws (paired):", "",
              "| task | checkpoint | " + " | ".join(f"norm {t}" for t in sorted(
                  {plan['tau'], *plan['tau_checks']})) + " |", "|---|---|" + "---|" * (1 + len(plan["tau_checks"]))]
    for rec in recs:
        name = "zero-shot" if rec["step"] == 0 else f"MeZO step {rec['step']}"
        for check in rec["checks"]:
            lines.append(f"| {rec['task']} | {name} | " + " | ".join(
                f"{check[f'{t:g}']:.4g}" for t in sorted({plan['tau'], *plan['tau_checks']})) + " |")
    return lines


def cached_reference(runs_dir: str, model: str) -> dict:
    """{(task, step): dev loss} of the cached MeZO runs of `model` (a directory's name) at RATES, seed 0, 200 steps
    (issue 37's, real_model.py's)."""
    out = {}
    if not os.path.isdir(runs_dir):
        return out
    for name in os.listdir(runs_dir):
        with open(os.path.join(runs_dir, name)) as f:
            run = json.load(f)
        s = run["settings"]
        if (s.get("model"), s.get("arm"), s["seed"], s["steps"]) == (model, "mezo", 0, 200) \
                and RATES.get(s["task"]) == s["lr"]:
            out.update({(s["task"], c["step"]): c["loss"] for c in run["curve"]})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--model", help="a Hugging Face directory (default: SmolLM2-135M from --cache)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "x-dev"))
    parser.add_argument("--reference", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                            "real-model", "runs"),
                        help="issue 37's cached runs, for the dev loss check")
    parser.add_argument("--tasks", nargs="*", help="a subset of the config's tasks")
    parser.add_argument("--draws", type=int, help="draws per checkpoint (default: the config's)")
    parser.add_argument("--checkpoints", nargs="*", type=int, help="a subset of the config's checkpoints (MeZO steps)")
    parser.add_argument("--stage", choices=["all", "report"], default="all")
    args = parser.parse_args(argv)
    plan = dict(CONFIGS[args.config])
    if args.draws:
        plan["draws"] = args.draws
    tasks = args.tasks or plan["tasks"]
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    recs = []
    if args.stage == "all":
        torch.set_num_threads(1)
        import curvzo_ds

        log(f"x_dev: curvzo_ds from {os.path.dirname(curvzo_ds.__file__)}; plan {json.dumps(plan)}")
        model = args.model or convert(fetch_gguf(args.cache, log), args.cache, log)
        cache = args.cache if not args.model else args.out
        for task in tasks:
            with tempfile.TemporaryDirectory(prefix="x-dev-tasks-") as tmp:  # generated again, identical, each time
                task_dir = write_task(tmp, task)
                recs += [measure(model, task, task_dir, plan, step, args.out, cache, log)
                         for step in args.checkpoints or plan["checkpoints"]]
    else:
        for name in sorted(os.listdir(args.out)):
            if name.endswith(".json"):
                with open(os.path.join(args.out, name)) as f:
                    rec = json.load(f)
                if rec["task"] in tasks and rec["step"] in plan["checkpoints"] and len(rec["draws"]) >= 2:
                    recs.append(rec)
        recs.sort(key=lambda r: (tasks.index(r["task"]), r["step"]))
    name = os.path.basename(os.path.normpath(args.model)) if args.model else f"smollm2-135m-{GGUF_SHA256[:16]}"
    lines = table(recs, plan, cached_reference(args.reference, name))
    with open(os.path.join(args.out, f"table-{args.config}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
