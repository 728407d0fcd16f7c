"""`curvzo-ds diagnose`: do CurvZO's block scores follow curvature, or block size? (issue 19)

Two instruments, both driving the real `CurvZOSampler`:
- a simulated layout, block sizes n_i and known gradient energies a_i = ||g_i||^2: `fixed_point` is where
  the sampler settles when each step's score is replaced by its mean (the mean-field fixed point), and
  `simulate` runs it on exact draws of Delta and ||v_Gi||^2 (a linear loss, eps -> 0);
- a model and a task: `diagnose` takes CurvZO steps and, at chosen steps, the backprop gradient on the same
  batch, then compares pi and S with the first-order energies and draws the figures.
docs/algorithm.md ("Scores that track curvature?") derives the means used here and reads the results.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os

import numpy as np
import torch

from curvzo_ds.algo.estimators import ESTIMATORS, expected_scores
from curvzo_ds.algo.sampling import CurvZOSampler, adaptive_budget
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.train.plain import PlainRun

log = logging.getLogger("curvzo_ds")


def corr_log(x, y) -> float:
    """Pearson correlation of log x and log y over the entries where both are > 0; nan when either is constant."""
    x, y = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in (x, y))
    keep = (x > 0) & (y > 0)
    lx, ly = x[keep].log(), y[keep].log()
    lx, ly = lx - lx.mean(), ly - ly.mean()
    den = (lx.norm() * ly.norm()).item()
    return (lx * ly).sum().item() / den if den > 0 else math.nan


def _sampler(cfg, sizes: torch.Tensor, uniforms=None) -> CurvZOSampler:
    cfg = copy.deepcopy(cfg)
    cfg = dataclasses.replace(cfg, score_init=0.0)  # the callers set the scores themselves
    return CurvZOSampler(section(cfg, "sampler"), section(cfg, "engine"), sizes,
                         uniforms or (lambda step, g: torch.zeros(g, dtype=torch.float64)), cfg.perturbation)


def fixed_point(sizes: torch.Tensor, energy: torch.Tensor, cfg, iters: int = 100, draws: int = 2000,
                seed: int = 0) -> dict:
    """Where the sampler settles when each step's score is its mean: S <- (S + E[s~ | pi(S)]) / 2.

    Starts from the warm-up's S (uniform pi at the budget rule's value for S = 0). Returns pi, the budget
    B (blocks), d_eff, H and S at the end.
    """
    gen = torch.Generator().manual_seed(seed)
    g = sizes.numel()
    sampler = _sampler(cfg, sizes)
    pi = sampler.probabilities(0).pi  # S = 0: uniform pi at the rule's value, as in the warm-up
    for k in range(iters + 1):
        masks = torch.rand(draws, g, generator=gen, dtype=torch.float64) < pi
        new = expected_scores(pi, sizes, energy, cfg.score_estimator, masks, cfg.perturbation)
        sampler.scores = new if k == 0 else 0.5 * (sampler.scores + new)
        pi, budget, d_eff, h = sampler.probabilities(1 << 30)
    return dict(pi=pi, budget=budget, d_eff=d_eff, entropy=h, scores=sampler.scores)


def simulate(sizes: torch.Tensor, energy: torch.Tensor, cfg, steps: int, seed: int = 0) -> dict:
    """`steps` steps of the real sampler on a linear loss with block gradients of energy a_i (eps -> 0).

    Per step and drawn block, with u_i = <g_i, z_i>/||g_i|| ~ N(0, 1) and an independent chi^2(n_i - 1):
    ||v_Gi||^2 = u_i^2 + chi^2 and Delta = sum_i m_i sqrt(a_i) u_i, exactly as z ~ N(0, I) gives them. With
    perturbation=rademacher ||v_Gi||^2 = n_i exactly, and u_i is drawn N(0, 1) (its law under +-1 z depends on g_i's
    entries; N(0, 1) is its limit when no entry dominates).
    Returns pi per step [steps, G] and the budget, d_eff and H per step.
    """
    rng = np.random.default_rng(seed)
    g = sizes.numel()
    root = energy.to(torch.float64).sqrt()
    rest = (sizes - 1).clamp(min=0).numpy()
    sampler = CurvZOSampler(section(cfg, "sampler"), section(cfg, "engine"), sizes,
                            lambda step, k: torch.from_numpy(rng.random(k)), cfg.perturbation)
    signs = cfg.perturbation == "rademacher"
    pis, budgets, d_effs, hs = [], [], [], []
    for t in range(steps):
        plan = sampler.plan(t)
        pis.append(plan.pi)
        budgets.append(plan.budget)
        d_effs.append(plan.d_eff)
        hs.append(plan.entropy)
        if plan.n_selected == 0:
            sampler.skip(plan)
            continue
        u = torch.from_numpy(rng.standard_normal(g))
        if signs:
            block_sq = torch.where(plan.mask, sizes.to(torch.float64), torch.zeros_like(u))
        else:
            chi2 = torch.from_numpy(np.where(rest > 0, rng.chisquare(np.maximum(rest, 1)), 0.0))
            block_sq = torch.where(plan.mask, u * u + chi2, torch.zeros_like(u))
        delta = float((plan.mask * root * u).sum())
        sampler.observe(plan, delta, block_sq)
    return dict(pi=torch.stack(pis), budget=budgets, d_eff=d_effs, entropy=hs, scores=sampler.scores)


# ----------------------------------------------------------------------------------------------------
# On a model: CurvZO steps with the backprop gradient on the same batches.


def probe_steps(steps: int, every: int) -> list[int]:
    return sorted({t for t in range(0, steps, max(every, 1))} | {steps - 1})


def trace(cfg: TrainConfig, steps: int, probe_every: int) -> dict:
    """One estimator's run: pi, B, d_eff, H and the loss per step; S and the backprop energies at the probes."""
    run = PlainRun(cfg)
    engine = run.engine
    probes = set(probe_steps(steps, probe_every))
    rec = dict(estimator=cfg.score_estimator, names=[b.name for b in engine.blocks], sizes=engine.sizes.tolist(),
               pi=[], budget=[], d_eff=[], entropy=[], loss=[], probe_step=[], energy=[], scores=[])
    for t in range(steps):
        batch = run.batch(t)
        if t in probes:
            rec["probe_step"].append(t)
            rec["energy"].append(run.block_energy(batch).tolist())
            rec["scores"].append(engine.sampler.scores.tolist())
        r = engine.step(batch)
        rec["pi"].append(r.pi.tolist())  # the pi the step drew from
        for key, value in (("budget", r.budget), ("d_eff", r.d_eff), ("entropy", r.score_entropy), ("loss", r.loss)):
            rec[key].append(value)
    rec["warmup_steps"] = cfg.score_warmup_steps if cfg.score_init == "warmup" else 0
    rec.update(summarize(rec, cfg))
    return rec


def summarize(rec: dict, cfg) -> dict:
    """The issue's correlations over the probes after warm-up (pi and S averaged over them, the energies too)."""
    sizes = torch.tensor(rec["sizes"], dtype=torch.float64)
    g = sizes.numel()
    after = [k for k, t in enumerate(rec["probe_step"]) if t >= rec["warmup_steps"]] or list(range(len(rec["energy"])))
    energy = torch.tensor([rec["energy"][k] for k in after], dtype=torch.float64)
    scores = torch.tensor([rec["scores"][k] for k in after], dtype=torch.float64)
    pi = torch.tensor([rec["pi"][rec["probe_step"][k]] for k in after], dtype=torch.float64)
    a, s, p = energy.mean(0), scores.mean(0), pi.mean(0)
    rule = lambda x: adaptive_budget(x, cfg.budget_min * g, cfg.budget_max * g, cfg.budget_alpha)[0] / g
    steps = [b / g for t, b in enumerate(rec["budget"]) if t >= rec["warmup_steps"] and b is not None]
    per_probe = [corr_log(pi[j], energy[j] / sizes) for j in range(len(after))]
    return dict(corr_pi_energy_per_element=corr_log(p, a / sizes), corr_pi_size=corr_log(p, sizes),
                corr_scores_energy=corr_log(s, a), corr_scores_energy_per_element=corr_log(s, a / sizes),
                corr_pi_energy_per_element_per_probe=per_probe,
                budget_mean=float(np.mean(steps)) if steps else None, budget_sd=float(np.std(steps)) if steps else None,
                budget_on_true_energy=rule(a), budget_on_true_energy_per_element=rule(a / sizes),
                energy_mean=a.tolist(), pi_mean=p.tolist())


def diagnose(cfg: TrainConfig, estimators: list[str], steps: int, probe_every: int, out_dir: str) -> list[str]:
    """Run each estimator from the same start, write diagnose.json and one PNG per estimator; return the table."""
    bad = [e for e in estimators if e not in ESTIMATORS] or ([] if estimators else ["(none)"])
    if bad or steps < 1 or probe_every < 1:
        raise ConfigError(f"--estimators {','.join(estimators)} --steps {steps} --probe-every {probe_every}: use "
                          f"estimators from {', '.join(ESTIMATORS)} and integers >= 1")
    os.makedirs(out_dir, exist_ok=True)
    records = []
    for est in estimators:
        log.info("diagnose: %s, %d steps", est, steps)
        records.append(trace(dataclasses.replace(cfg, score_estimator=est), steps, probe_every))
        plot_trace(records[-1], os.path.join(out_dir, f"diagnose_{est}.png"))
    write_json_atomic(os.path.join(out_dir, "diagnose.json"), records)
    lines = ["| estimator | corr(log pi, log ||g_i||^2/n_i) | corr(log pi, log n_i) | corr(log S_i, log ||g_i||^2) | "
             "corr(log S_i, log ||g_i||^2/n_i) | B/G after warm-up: mean (sd) | B/G on the true energies: a, a/n | "
             "last loss |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        budget = f"{r['budget_mean']:.3f} ({r['budget_sd']:.3f})" if r["budget_mean"] is not None else "-"
        lines.append(f"| {r['estimator']} | {r['corr_pi_energy_per_element']:+.2f} | {r['corr_pi_size']:+.2f} | "
                     f"{r['corr_scores_energy']:+.2f} | {r['corr_scores_energy_per_element']:+.2f} | {budget} | "
                     f"{r['budget_on_true_energy']:.3f}, {r['budget_on_true_energy_per_element']:.3f} | "
                     f"{r['loss'][-1]:.4f} |")
    return lines


def plot_trace(rec: dict, path: str) -> None:
    """pi against block size and against per-element energy, B/G, d_eff/G and H against the step, pi's heat map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = np.array(rec["sizes"])
    g = len(sizes)
    pi = np.array(rec["pi"])
    per_element = np.array(rec["energy_mean"]) / sizes
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    ax[0, 0].scatter(sizes, rec["pi_mean"])
    ax[0, 0].set(xscale="log", yscale="log", xlabel="block size n_i", ylabel="pi (mean after warm-up)",
                 title=f"corr(log pi, log n) = {rec['corr_pi_size']:+.2f}")
    ax[0, 1].scatter(np.maximum(per_element, 1e-30), rec["pi_mean"])
    ax[0, 1].set(xscale="log", yscale="log", xlabel="||g_i||^2 / n_i (backprop, same batches)", ylabel="pi",
                 title=f"corr(log pi, log ||g||^2/n) = {rec['corr_pi_energy_per_element']:+.2f}")
    t = np.arange(len(rec["budget"]))
    for key, scale in (("budget", g), ("d_eff", g), ("entropy", 1)):
        values = np.array([np.nan if v is None else v / scale for v in rec[key]])
        ax[1, 0].plot(t, values, label={"budget": "B/G", "d_eff": "d_eff/G", "entropy": "H"}[key])
    ax[1, 0].axhline(rec["budget_on_true_energy"], ls="--", c="k", lw=0.8, label="B/G on true ||g_i||^2")
    ax[1, 0].set(xlabel="step", ylim=(0, 1.05), title="the budget rule")
    ax[1, 0].legend(fontsize=8)
    im = ax[1, 1].imshow(pi.T, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
    ax[1, 1].set(xlabel="step", ylabel="block", title="pi per block")
    fig.colorbar(im, ax=ax[1, 1])
    fig.suptitle(f"score_estimator = {rec['estimator']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# The command: its parser and its handler (cli.py builds the parser from every command's `register`).


def register(sub) -> None:
    p = sub.add_parser("diagnose", help="do the scores track curvature? CurvZO steps next to the backprop gradient",
                       description="One process, plain model (no DeepSpeed): for each estimator, --steps CurvZO steps "
                                   "of the configured run; every --probe-every steps, the backprop gradient on the "
                                   "same batch. Prints the correlations of pi and S with the block energies and "
                                   "writes diagnose.json and one PNG per estimator to --out (docs/algorithm.md).")
    p.add_argument("--config", action="append", metavar="FILE",
                   help="a YAML file of key: value; repeat it to merge several in order (a later file wins)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key")
    p.add_argument("--estimators", default="normalized,unbiased_element",
                   help="score_estimator values, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="steps per estimator")
    p.add_argument("--probe-every", type=int, default=10, help="steps between two backprop probes")
    p.add_argument("--out", required=True, help="directory for diagnose.json and the PNGs")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    from curvzo_ds.config.load import load_config

    # CurvZO steps whatever the library's default method (mezo: pi = 1, no scores to diagnose); a later --set wins.
    cfg = load_config(args.config, ["method=curvzo", *args.set], None)
    for line in diagnose(cfg, [x.strip() for x in args.estimators.split(",") if x.strip()], args.steps,
                         args.probe_every, args.out):
        print(line)
