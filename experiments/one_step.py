"""Issue 37's one-step test: each estimator's expected one-step progress on one batch, with no learning-rate grid
and no training noise.

    nice -n 19 python -m experiments.one_step --config full          # SmolLM2-135M (experiments/RESULTS.md)
    python -m experiments.one_step --config ci --model DIR --out /tmp/x   # the CI test's: a tiny Llama, 2 draws

With a step w <- w - lr ĝ, the descent lemma gives E L(w - lr ĝ) ≈ L - lr g·E ĝ + (lr²/2) E ĝᵀHĝ; at the best rate the
expected decrease is (g·E ĝ)² / (2 E ĝᵀHĝ). For each checkpoint (zero-shot, and MeZO's weights after 100 of its 200
steps on `sentiment`) and one training batch:
- one backprop gives g, and so the numerator (g·E ĝ)²: ‖g‖⁴ for the unbiased arms, ‖Pg‖⁴ for a static mask P;
- for each draw of ĝ (the arm's own forwards), the second difference [L(w + ηĝ) + L(w - ηĝ) - 2L(w)] / η² gives
  ĝᵀHĝ, with η = τ / ‖ĝ‖ (a step of norm τ; on SmolLM2 the curvature along a random direction is the same at
  τ = 1 and 3, 1.02e-5 and 1.03e-5, and lost in float32 rounding below 0.3; MeZO's own steps at its rate have
  norm about 20);
- progress ratio against MeZO = [(g·E ĝ)² / E ĝᵀHĝ] / [MeZO's], times 2 / (the arm's forwards per step).
Common random numbers: draw k uses the same z for every single-direction arm (and as RLOO's first direction) and the
same block uniforms for every π arm. Standard errors by the delta method on the paired draws.

Arms: MeZO; CurvZO's π (the paper's sampler after `warmup` steps from the checkpoint at its best rate, 1e-5; the
weights are put back); the oracle √(energy) rule (π ∝ √a_i by water-filling at CurvZO's budget, a_i = ‖g_i‖²); the
best Horvitz–Thompson π of docs/algorithm.md §2 (the numerical optimum of Eq. V with h = e = a_i/n_i at the same
budget); static masks of the top 0.1% and 1% of elements by squared gradient on the first training batches (no 1/π
weights); RLOO with q = 4 one-sided directions. The "conditional" column removes the scalar's chi-square noise,
from the same forwards: for a single-direction arm ĝ = c u (c = Δ / 2ε) it is E[c² | mask] ĝᵀHĝ / c², with
E[c² | mask] = Σ over drawn blocks of a_i (ε → 0); for RLOO ĝ = Σ_k c_k z_k it is E[S] ĝᵀHĝ / S with S = Σ_k c_k² and
E[S] = ‖g‖² / (q − 1). What it assumes: the scalar is independent of the curvature along the direction, which drops
the terms in gᵀHg (MeZO's 2gᵀHg, RLOO's cross terms); they are not small on SmolLM2, so the conditional column is
biased where x = gᵀHg / (‖g‖² tr H) is not near 0, and `along_g` measures x. The plain column assumes nothing; with
few draws it carries MeZO's own chi-square noise into every ratio.
Every draw is cached in --out/draws-<key>.jsonl, so an interrupted measurement resumes and more draws can be added.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from curvzo_ds.algo.sampling import inclusion_probabilities
from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.shard.forwards import eval_mode
from curvzo_ds.shard.mask import fit as fit_mask
from curvzo_ds.train.plain import PlainRun
from experiments.core import Log, digest
from experiments.simulate_estimators import optimum, second_moment
from experiments.smollm import DATA, base_config, convert, fetch_gguf, write_task
from experiments.stats import rloo_moment

ARMS = ("mezo", "curvzo", "oracle", "best-pi", "static-0.1%", "static-1%", "rloo-4")
FORWARDS = {"rloo-4": 4}  # forwards per step; every other arm: 2
Q = 4
# Predictions of the issue (docs/algorithm.md §2 and the simulation of experiments/simulate_estimators.py).
PREDICTED = {"mezo": "1", "curvzo": "0.25-0.51", "oracle": "0.69-0.93", "best-pi": "<= 1.02", "static-0.1%": "1",
             "static-1%": "1", "rloo-4": "about 1.5"}
CONFIGS = {
    "full": dict(task="sentiment", draws=24, warmup=40, mezo_steps=100, mezo_of=200, mezo_lr=1e-4, curvzo_lr=1e-5,
                 tau=3.0, batch_step=10),
    "ci": dict(task="sentiment", draws=2, warmup=3, mezo_steps=2, mezo_of=4, mezo_lr=1e-2, curvzo_lr=1e-3, tau=1.0,
               batch_step=5),
}


def batch_loss(run, batch) -> float:
    with torch.no_grad(), eval_mode(run.model):
        sums = [run.loss(run.model, mb) for mb in batch.items]
    return float(sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums))


def gradient(run, batch, params) -> list[torch.Tensor]:
    run.model.zero_grad(set_to_none=True)
    with eval_mode(run.model), torch.enable_grad():
        sums = [run.loss(run.model, mb) for mb in batch.items]
        (sum(s for s, _ in sums) / sum(float(c) for _, c in sums)).backward()
    g = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    run.model.zero_grad(set_to_none=True)
    return g


class Point:
    """The weights w0 of one checkpoint and the loss at w0 + s v for any v (the weights are always rebuilt from w0, so
    no rounding accumulates)."""

    def __init__(self, run, batch):
        self.run, self.batch = run, batch
        self.params = [e.param for e in run.engine.entries]
        self.w0 = [p.detach().clone() for p in self.params]
        self.forwards = 0

    def loss(self, v: list[torch.Tensor] | None = None, s: float = 0.0) -> float:
        with torch.no_grad():
            for p, w, x in zip(self.params, self.w0, v or [None] * len(self.params)):
                p.copy_(w) if x is None else torch.add(w, x, alpha=s, out=p.data)
        self.forwards += 1
        out = batch_loss(self.run, self.batch)
        self.restore()
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.w0):
                p.copy_(w)


def block_coefficients(engine, params, per_block: torch.Tensor) -> list[torch.Tensor]:
    """One tensor per parameter holding each block's coefficient on its elements."""
    out = [torch.zeros_like(p) for p in params]
    for b, block in enumerate(engine.blocks):
        for ei, lo, hi in block.segments:
            out[ei].view(-1)[lo:hi] = float(per_block[b])
    return out


def block_energy(engine, g: list[torch.Tensor]) -> torch.Tensor:
    a = torch.zeros(engine.num_blocks, dtype=torch.float64)
    for b, block in enumerate(engine.blocks):
        for ei, lo, hi in block.segments:
            a[b] += g[ei].reshape(-1)[lo:hi].double().pow(2).sum()
    return a


def normal(params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def dot(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
    return float(sum(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()) for a, b in zip(x, y)))


def curvzo_pi(run, plan: dict, log: Log) -> tuple[torch.Tensor, float]:
    """CurvZO's π and budget B after `warmup` steps of its own sampler from the current weights (put back after)."""
    engine = run.engine
    saved = [e.param.detach().clone() for e in engine.entries]
    start = time.time()
    for t in range(plan["warmup"]):
        engine.step(run.batch(t))
    probs = engine.sampler.probabilities(plan["warmup"])
    with torch.no_grad():
        for e, w in zip(engine.entries, saved):
            e.param.copy_(w)
    log(f"CurvZO's pi after {plan['warmup']} steps: B/G {probs.budget / engine.num_blocks:.3f}, max 1/pi "
        f"{float(1 / probs.pi.min()):.1f} ({time.time() - start:.0f}s)")
    return probs.pi, probs.budget


def arm_setup(run, point: Point, g, plan: dict, log: Log, cached_pi=None) -> dict:
    """Each arm's per-block π (π arms) or element mask (static arms); `cached_pi`: CurvZO's (π, B) of an earlier
    run of the same settings."""
    engine = run.engine
    a = block_energy(engine, g)
    n = engine.sizes.double()
    pi_c, budget = curvzo_pi(run, plan, log) if cached_pi is None else cached_pi
    gamma = engine.cfg.budget_floor
    best = optimum(n, a, a / n, budget)
    setup = {"curvzo": dict(pi=pi_c), "oracle": dict(pi=inclusion_probabilities(a, budget, gamma)),
             "best-pi": dict(pi=best.clamp(min=1e-6)), "budget": budget}
    ones = torch.ones_like(n)
    for arm in ("curvzo", "oracle", "best-pi"):  # J(pi)/J(1) of Eq. V with h = e: true a, and a ∝ n (no knowledge)
        pi = setup[arm]["pi"]
        setup[arm]["j_true"] = float(second_moment(pi, n, a, a / n) / second_moment(ones, n, a, a / n))
        setup[arm]["j_flat"] = float(second_moment(pi, n, n, ones) / second_moment(ones, n, n, ones))
    for arm, fraction in (("static-0.1%", 0.001), ("static-1%", 0.01)):
        chosen = fit_mask(engine, [run.batch(t) for t in range(DATA["probe_batches"])], fraction)
        mask = [torch.zeros_like(p) for p in point.params]
        for i, idx in enumerate(chosen.index):  # the product's static mask (shard/mask.py), one entry per tensor
            mask[i].view(-1)[idx] = 1.0
        setup[arm] = dict(mask=mask)
    point.restore()
    return setup


def draw(point: Point, engine, g, setup: dict, k: int, seed: int, eps: float, tau: float, l0: float) -> dict:
    """One draw of every arm: {arm: (D = ĝᵀHĝ, c², E[c² | mask] or None, g·ĝ)}."""
    params = point.params
    z = normal(params, seed * 1_000_003 + k * 16)
    uniforms = torch.rand(engine.num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + k * 16 + 15),
                          dtype=torch.float64)
    a = block_energy(engine, g)
    out = {}

    def second(ghat) -> float:
        norm = math.sqrt(dot(ghat, ghat))
        if norm == 0:
            return 0.0
        eta = tau / norm
        return (point.loss(ghat, eta) + point.loss(ghat, -eta) - 2 * l0) / eta ** 2

    def single(v, weight, expected_c2) -> tuple:
        """SPSA along v; ĝ = Δ/(2ε) (weight ⊙ z)."""
        c = (point.loss(v, eps) - point.loss(v, -eps)) / (2 * eps)
        ghat = [c * w * x for w, x in zip(weight, z)] if weight is not None else [c * x for x in z]
        d = second(ghat)
        return dict(d=d, c2=c * c, ec2=expected_c2, g_dot=dot(g, ghat))

    out["mezo"] = single(z, None, float(a.sum()))
    for arm in ("curvzo", "oracle", "best-pi"):
        pi = setup[arm]["pi"]
        m = (uniforms < pi).double()
        if m.sum() == 0:
            out[arm] = dict(d=0.0, c2=0.0, ec2=0.0, g_dot=0.0)
            continue
        m_coef = block_coefficients(engine, params, m)
        w_coef = block_coefficients(engine, params, m / pi)
        out[arm] = single([mc * x for mc, x in zip(m_coef, z)], w_coef, float((a * m).sum()))
    for arm in ("static-0.1%", "static-1%"):
        mask = setup[arm]["mask"]
        v = [mk * x for mk, x in zip(mask, z)]
        out[arm] = single(v, mask, float(sum((mk * x).pow(2).sum() for mk, x in zip(mask, g))))
    zs, coef = rloo_coefficients(point, z, k, seed, eps)
    ghat = [sum(c * zk[i] for c, zk in zip(coef, zs)) for i in range(len(params))]
    out["rloo-4"] = dict(d=second(ghat), c2=sum(c * c for c in coef), ec2=float(a.sum()) / (Q - 1),
                         g_dot=dot(g, ghat))
    return out


def rloo_coefficients(point: Point, z, k: int, seed: int, eps: float) -> tuple[list, list[float]]:
    """RLOO's q directions of draw k (the first is the single-direction arms' z) and ĝ's coefficients c_k =
    (L_k - mean_{j≠k} L_j) / (q ε)."""
    zs = [z] + [normal(point.params, seed * 1_000_003 + k * 16 + j) for j in range(1, Q)]
    losses = [point.loss(zk, eps) for zk in zs]
    return zs, [(losses[j] - (sum(losses) - losses[j]) / (Q - 1)) / eps / Q for j in range(Q)]


def ratio(num_a: float, d_a: np.ndarray, num_m: float, d_m: np.ndarray, forwards: int) -> tuple[float, float]:
    """[(num_a / mean d_a) / (num_m / mean d_m)] * 2 / forwards, and its standard error (delta method, paired draws)."""
    n = len(d_a)
    ma, mm = d_a.mean(), d_m.mean()
    r = (num_a / ma) / (num_m / mm) * 2 / forwards
    if n < 2:
        return r, float("nan")
    cov = np.cov(np.stack([d_a, d_m]), ddof=1) / n
    var_log = cov[0, 0] / ma ** 2 + cov[1, 1] / mm ** 2 - 2 * cov[0, 1] / (ma * mm)
    return r, r * math.sqrt(max(var_log, 0.0))


def table(name: str, g_norm2: float, numerators: dict, draws: list[dict]) -> list[str]:
    rows = [f"Checkpoint `{name}`: {len(draws)} draws, ‖g‖² = {g_norm2:.4g}.", "",
            "| arm | forwards/step | (g·E ĝ)² / ‖g‖⁴ | g·ĝ / (g·E ĝ), mean ± se | E ĝᵀHĝ (mean ± se) | "
            "progress ratio vs MeZO, per forward ± se | conditional ratio ± se | predicted |",
            "|---|---:|---:|---|---|---|---|---|"]
    d = {arm: np.array([x[arm]["d"] for x in draws]) for arm in ARMS}
    cond = {arm: np.array([x[arm]["d"] * x[arm]["ec2"] / x[arm]["c2"] if x[arm]["c2"] else 0.0 for x in draws])
            for arm in ARMS}
    se = (lambda v: v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else float("nan"))
    for arm in ARMS:
        f = FORWARDS.get(arm, 2)
        num = numerators[arm]
        gd = np.array([x[arm]["g_dot"] for x in draws]) / math.sqrt(num)
        r, r_se = ratio(num, d[arm], numerators["mezo"], d["mezo"], f)
        c = "-"
        if arm in cond:
            rc, rc_se = ratio(num, cond[arm], numerators["mezo"], cond["mezo"], f)
            c = f"{rc:.3f} ± {rc_se:.3f}"
        rows.append(f"| {arm} | {f} | {num / g_norm2 ** 2:.4f} | {gd.mean():.3f} ± {se(gd):.3f} | "
                    f"{d[arm].mean():.4g} ± {se(d[arm]):.2g} | {r:.3f} ± {r_se:.3f} | {c} | {PREDICTED[arm]} |")
    return rows


def along_g(point: Point, g, g_norm2: float, l0: float, tau: float, draws: list[dict]) -> list[str]:
    """What the plain ratios are made of, measured with little noise: tr H as the mean of MeZO's zᵀHz = D / c²
    (exact per draw: ĝ = c z), and the curvature along g, gᵀHg / ‖g‖², by second differences at the scale the
    draws probe along g (τ / √d: a step of norm τ along ĝ moves about that far along g / ‖g‖) and larger ones.
    With x = gᵀHg / (‖g‖² tr H), MeZO's E ĝᵀHĝ = ‖g‖² tr H (1 + 2x) and RLOO's is `rloo_moment`: the progress ratio
    per forward of RLOO q = 4 is 0.5 (1 + 2x) / (1/3 + 4x/3), 1.5 at x = 0 (the quadratic simulation's regime)."""
    zhz = np.array([x["mezo"]["d"] / x["mezo"]["c2"] for x in draws if x["mezo"]["c2"]])
    trace, trace_se = zhz.mean(), zhz.std(ddof=1) / math.sqrt(len(zhz)) if len(zhz) > 1 else float("nan")
    d = sum(p.numel() for p in point.params)
    unit = [x / math.sqrt(g_norm2) for x in g]
    rows = [f"tr H (mean zᵀHz over {len(zhz)} draws, sd {zhz.std(ddof=1) if len(zhz) > 1 else 0:.4g}) = "
            f"{trace:.4g} ± {trace_se:.2g}; d = {d}.", "",
            "| step along g/‖g‖ | gᵀHg / ‖g‖² | x = gᵀHg / (‖g‖² tr H) | RLOO q = 4 ratio per forward, predicted |",
            "|---|---|---|---|"]
    for scale in (tau / math.sqrt(d), 10 * tau / math.sqrt(d), 1e-2, 1e-1):
        curv = (point.loss(unit, scale) + point.loss(unit, -scale) - 2 * l0) / scale ** 2
        x = curv / trace
        predicted = 0.5 * g_norm2 * trace * (1 + 2 * x) / rloo_moment(Q, trace, curv * g_norm2, g_norm2)
        rows.append(f"| {scale:.3g} | {curv:.4g} | {x:.3f} | {predicted:.3f} |")
    return rows


def checkpoint(run, model: str, task_dir: str, plan: dict, name: str, seed: int, cache: str, log: Log) -> None:
    """Load the checkpoint's weights into `run` (zero-shot: as loaded; mezo-100: MeZO's weights after `mezo_steps`
    steps of its run, cached as a file)."""
    if name == "zero-shot":
        return
    settings = dict(model=os.path.basename(model), task=plan["task"], lr=plan["mezo_lr"], seed=seed,
                    steps=plan["mezo_steps"], of=plan["mezo_of"], data=DATA)
    path = os.path.join(cache, f"mezo-{plan['mezo_steps']}-{digest(settings)}.pt")
    if not os.path.exists(path):
        start = time.time()
        mezo_run = PlainRun(base_config(model, task_dir, plan["mezo_lr"], seed, plan["mezo_of"], method="mezo"))
        for t in range(plan["mezo_steps"]):
            mezo_run.engine.step(mezo_run.batch(t))
        torch.save({e.name: e.param.detach().clone() for e in mezo_run.engine.entries}, path + ".tmp")
        os.replace(path + ".tmp", path)
        log(f"MeZO's {plan['mezo_steps']} steps at lr {plan['mezo_lr']:g}: {time.time() - start:.0f}s -> {path}")
    state = torch.load(path)
    with torch.no_grad():
        for e in run.engine.entries:
            e.param.copy_(state[e.name])


def write_jsonl_atomic(path: str, records: list[dict]) -> None:
    with open(path + ".tmp", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    os.replace(path + ".tmp", path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--model", help="a Hugging Face directory (default: SmolLM2-135M from --cache)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/curvzo_ds/real_model"))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "one-step"))
    parser.add_argument("--draws", type=int, help="draws per checkpoint (default: the config's)")
    parser.add_argument("--checkpoints", nargs="*", choices=["zero-shot", "mezo-100"],
                        default=["zero-shot", "mezo-100"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plan = dict(CONFIGS[args.config])
    if args.draws:
        plan["draws"] = args.draws
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    model = args.model or convert(fetch_gguf(args.cache, log), args.cache, log)
    task_dir = write_task(os.path.join(args.out, "tasks"), plan["task"])
    lines = [f"Config `{args.config}`: {json.dumps(plan)}; model {os.path.basename(model)}; seed {args.seed}.", ""]
    for name in args.checkpoints:
        # A fresh run per checkpoint: CurvZO's sampler starts from its own warm-up at each.
        run = PlainRun(base_config(model, task_dir, plan["curvzo_lr"], args.seed, plan["mezo_of"],
                                     method="curvzo"))
        checkpoint(run, model, task_dir, plan, name, args.seed, args.cache if not args.model else args.out, log)
        batch = run.batch(plan["batch_step"])
        point = Point(run, batch)
        g = gradient(run, batch, point.params)
        key = digest(dict(model=os.path.basename(model), name=name, plan=plan | {"draws": 0}, seed=args.seed,
                          data=DATA))
        path = os.path.join(args.out, f"draws-{name}-{key}.jsonl")
        pi_path = path.replace("draws-", "curvzo-pi-").replace(".jsonl", ".json")
        cached = None
        if os.path.exists(pi_path):
            with open(pi_path) as f:
                rec = json.load(f)
            cached = (torch.tensor(rec["pi"], dtype=torch.float64), rec["budget"])
        setup = arm_setup(run, point, g, plan, log, cached)
        write_json_atomic(pi_path, dict(pi=setup["curvzo"]["pi"].tolist(), budget=setup["budget"]))
        l0 = point.loss()
        draws = []
        if os.path.exists(path):
            with open(path) as f:
                draws = [json.loads(x) for x in f]
            if any(x["rloo-4"].get("c2") is None for x in draws):  # cached before RLOO's S was kept: 4 forwards
                for k, x in enumerate(draws):
                    if x["rloo-4"].get("c2") is None:
                        _, coef = rloo_coefficients(point, normal(point.params, args.seed * 1_000_003 + k * 16), k,
                                                    args.seed, DATA["eps"])
                        x["rloo-4"].update(c2=sum(c * c for c in coef), ec2=dot(g, g) / (Q - 1))
                write_jsonl_atomic(path, draws)
                log(f"{name}: RLOO's S filled in for the cached draws")
        for k in range(len(draws), plan["draws"]):
            start, before = time.time(), point.forwards
            rec = draw(point, run.engine, g, setup, k, args.seed, DATA["eps"], plan["tau"], l0)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            draws.append(rec)
            log(f"{name} draw {k}: {point.forwards - before} forwards, {time.time() - start:.0f}s")
        g_norm2 = dot(g, g)
        masked = {arm: float(sum((mk * x).pow(2).sum() for mk, x in zip(setup[arm]["mask"], g))) ** 2
                  for arm in ("static-0.1%", "static-1%")}
        numerators = {arm: masked.get(arm, g_norm2 ** 2) for arm in ARMS}
        lines += table(name, g_norm2, numerators, draws[:plan["draws"]])
        lines += ["", *along_g(point, g, g_norm2, l0, plan["tau"], draws[:plan["draws"]])]
        lines += ["", f"Budget B/G {setup['budget'] / run.engine.num_blocks:.3f}; max 1/π: curvzo "
                  f"{float(1 / setup['curvzo']['pi'].min()):.1f}, oracle {float(1 / setup['oracle']['pi'].min()):.1f},"
                  f" best-pi {float(1 / setup['best-pi']['pi'].min()):.1f}; loss at w {l0:.4f}; τ = {plan['tau']}.",
                  "J(π)/J(1) of Eq. V with h = e, on the true block energies a / with a ∝ n: "
                  + ", ".join(f"{arm} {setup[arm]['j_true']:.3f} / {setup[arm]['j_flat']:.3f}"
                              for arm in ("curvzo", "oracle", "best-pi")) + ".", ""]
    with open(os.path.join(args.out, f"table-{args.config}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
