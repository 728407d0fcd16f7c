"""Issue 58's one-step check: the cosine of MeZO's estimate with the true gradient, Gaussian against ±1 directions.

    nice -n 19 python experiments/one_step_perturbation.py --draws 60          # SmolLM2-135M, issue 37's setting
    python experiments/one_step_perturbation.py --model DIR --draws 4 --out /tmp/x   # any Hugging Face directory

Issue 37's one-step setting (experiments/one_step.py: the zero-shot SmolLM2-135M, `sentiment`, the training batch of
step 10, one backprop for g). For each perturbation and draw k, z is the library's own noise of step k (NoiseSource
with that perturbation, keyed by each tensor's canonical name, as a run draws it), c = (L(w + εz) - L(w - εz)) / 2ε
(ε = 1e-3, MeZO's), and ĝ = c z. Per draw: cos(ĝ, g) = sign(c) g·z / (‖g‖ ‖z‖), g·ĝ / ‖g‖² (mean 1: unbiased) and
‖ĝ‖² / ‖g‖² (mean d + 2 for Gaussian z, d for ±1 z, as ε -> 0: docs/algorithm.md, "Rademacher directions").
As ε -> 0, c = g·z and cos = |g·z| / (‖g‖ ‖z‖), whose mean is sqrt(2 / (π d)) for both laws up to O(1/d): the
prediction is that the two columns agree within their standard errors.
Every draw is cached in --out/draws-<perturbation>-<key>.jsonl (an interrupted run resumes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_model as R  # noqa: E402
from one_step import CONFIGS, Point, batch_loss, gradient  # noqa: E402
from pipeline import Log, digest  # noqa: E402

from curvzo_ds.noise.gaussian import NoiseSource  # noqa: E402


def draw(point: Point, g: list[torch.Tensor], names: list[str], noise: NoiseSource, k: int, eps: float) -> dict:
    z = [noise.slice(k, name, p.numel(), 0, p.numel()).view_as(p).to(p.dtype) for name, p in zip(names,
                                                                                                 point.params)]
    c = (point.loss(z, eps) - point.loss(z, -eps)) / (2 * eps)
    g_dot_z = float(sum(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()) for a, b in zip(g, z)))
    z_sq = float(sum(x.double().pow(2).sum() for x in z))
    return dict(c=c, g_dot_z=g_dot_z, z_sq=z_sq)


def summary(records: list[dict], g_norm2: float, d: int) -> dict:
    g_norm = math.sqrt(g_norm2)
    cos = [math.copysign(1.0, r["c"]) * r["g_dot_z"] / (g_norm * math.sqrt(r["z_sq"])) for r in records]
    along = [r["c"] * r["g_dot_z"] / g_norm2 for r in records]
    second = [r["c"] ** 2 * r["z_sq"] / g_norm2 for r in records]
    agree = [math.copysign(1.0, r["c"]) == math.copysign(1.0, r["g_dot_z"]) for r in records]

    def mean_se(x):
        m = sum(x) / len(x)
        sd = math.sqrt(sum((v - m) ** 2 for v in x) / max(1, len(x) - 1))
        return m, sd / math.sqrt(len(x))

    return {"draws": len(records), "cos": mean_se(cos), "g_dot_ghat_over_g2": mean_se(along),
            "ghat2_over_g2_over_d": tuple(v / d for v in mean_se(second)), "sign_agrees": sum(agree) / len(agree),
            "predicted_cos": math.sqrt(2 / (math.pi * d))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face directory (default: SmolLM2-135M from --cache)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "one-step-perturbation"))
    parser.add_argument("--draws", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plan = CONFIGS["full"]
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    model = args.model or R.convert(R.fetch_gguf(args.cache, log), args.cache, log)
    task_dir = R.write_task(os.path.join(args.out, "tasks"), plan["task"])
    run = R.PlainRun(R.run_config(model, task_dir, "mezo", plan["mezo_lr"], args.seed, plan["mezo_of"]))
    batch = run.batch(plan["batch_step"])
    point = Point(run, batch)
    names = [e.name for e in run.engine.entries]
    g = gradient(run, batch, point.params)
    g_norm2 = float(sum(x.double().pow(2).sum() for x in g))
    d = sum(p.numel() for p in point.params)
    eps = R.DATA["eps"]
    report = {"model": os.path.basename(model), "task": plan["task"], "batch_step": plan["batch_step"], "eps": eps,
              "seed": args.seed, "parameters": d, "g_norm2": g_norm2, "loss": batch_loss(run, batch)}
    for perturbation in ("gaussian", "rademacher"):
        noise = NoiseSource(args.seed, perturbation)
        key = digest(dict(model=report["model"], seed=args.seed, perturbation=perturbation, data=R.DATA,
                          batch_step=plan["batch_step"]))
        path = os.path.join(args.out, f"draws-{perturbation}-{key}.jsonl")
        records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        for k in range(len(records), args.draws):
            start = time.time()
            rec = draw(point, g, names, noise, k, eps)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            records.append(rec)
            log(f"{perturbation} draw {k}: c {rec['c']:.4g}, g.z {rec['g_dot_z']:.4g}, {time.time() - start:.1f}s")
        report[perturbation] = summary(records[:args.draws], g_norm2, d)
    text = json.dumps(report, indent=1)
    with open(os.path.join(args.out, f"summary-{args.draws}.json"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
