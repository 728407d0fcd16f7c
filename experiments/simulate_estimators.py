"""The tables of docs/algorithm.md, "Scores that track curvature?": where each score estimator leaves pi, on
layouts shaped like real models, with known block gradient energies (no model is run).

    python -m experiments.simulate_estimators [--steps 1500] [--long] > /tmp/tables.md

Layouts: the tensors of the demo Llama, OPT-125M and OPT-2.7B (built on the meta device, no weights).
Energies: a_i = n_i e_i, per-element energies e_i log-normal with sigma 0, 1, 2, independent of the sizes.
Table 1: the mean-field fixed point (`diagnose.fixed_point`); table 2: the real sampler on exact draws
(`diagnose.simulate`), pi averaged over the last fifth of the steps; table 3: the exact second moment of the
block estimator (docs/algorithm.md, Eq. V) for rules at B = 0.4 G, relative to MeZO.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, OPTConfig

from curvzo_ds.algo.sampling import water_filling
from curvzo_ds.commands.diagnose import corr_log, fixed_point, simulate
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.tasks import demo_model_config

ESTIMATORS = ("normalized", "per_element", "ht", "unbiased", "unbiased_element")


def layouts() -> dict[str, torch.Tensor]:
    configs = {"demo-llama": demo_model_config("llama"), "opt-125m": OPTConfig(),
               "opt-2.7b": OPTConfig(hidden_size=2560, ffn_dim=10240, num_hidden_layers=32, num_attention_heads=32,
                                     word_embed_proj_dim=2560)}
    sizes = {}
    with torch.device("meta"):
        for name, conf in configs.items():
            sizes[name] = [p.numel() for p in AutoModelForCausalLM.from_config(conf).parameters()]
    return {name: torch.tensor(n, dtype=torch.float64) for name, n in sizes.items()}


def energies(g: int, sigma: float, seed: int = 0) -> torch.Tensor:
    return torch.exp(sigma * torch.randn(g, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


def second_moment(pi, n, a, h):
    """E[sum_i h_i ||g~_i||^2] = sum_i h_i ((n_i + 2) a_i + n_i sum_{k != i} pi_k a_k) / pi_i (Eq. V)."""
    return (h * ((n + 2) * a + n * ((pi * a).sum() - pi * a)) / pi).sum()


def optimum(n, a, h, budget, iters=1500):
    """min over pi of Eq. V at sum pi = B, pi <= 1 (pi = water_filling(exp x, B), Adam on x)."""
    x = torch.zeros_like(n, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    ref = second_moment(torch.ones_like(n), n, a, h)
    for _ in range(iters):
        w = x.exp()
        pi = (w / w.sum() * budget).clamp(max=1.0)
        loss = second_moment(pi, n, a, h) / ref + 10 * (pi.sum() / budget - 1) ** 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return water_filling(x.detach().exp(), budget)


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--long", action="store_true", help="also table 4: beta 2e-4 over 25000 steps (demo layout)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = layouts()

    print("Table 1: mean-field fixed point (method curvzo, defaults; B in blocks / G)\n")
    print(row("layout", "sigma", "estimator", "corr(log pi, log e)", "corr(log pi, log n)", "corr(log pi, log a)",
              "sd(log pi)", "B/G", "d_eff/G", "H"))
    print(row(*["---"] * 10))
    for name, n in shapes.items():
        for sigma in (0.0, 1.0, 2.0):
            e = energies(n.numel(), sigma)
            for est in ESTIMATORS:
                fp = fixed_point(n, n * e, ZOConfig(method="curvzo", score_estimator=est))
                pi, g = fp["pi"], n.numel()
                print(row(name, sigma, est, f"{corr_log(pi, e):+.2f}" if sigma else "-", f"{corr_log(pi, n):+.2f}",
                          f"{corr_log(pi, n * e):+.2f}" if sigma else "-", f"{pi.log().std():.2f}",
                          f"{fp['budget'] / g:.3f}", f"{fp['d_eff'] / g:.3f}", f"{fp['entropy']:.3f}"), flush=True)

    print(f"\nTable 2: the sampler on exact draws, {args.steps} steps, seed 1 (pi: mean over the last fifth; "
          "B/G after warm-up: mean and standard deviation over steps)\n")
    print(row("layout", "sigma", "estimator", "beta", "corr(log pi, log e)", "corr(log pi, log n)",
              "corr(log pi, log a)", "B/G mean", "B/G sd"))
    print(row(*["---"] * 9))
    runs = [("normalized", 0.1), ("per_element", 0.1), ("ht", 0.1), ("unbiased", 0.1), ("unbiased", 0.01),
            ("unbiased_element", 0.1), ("unbiased_element", 0.02), ("unbiased_element", 0.01)]
    for name in ("demo-llama", "opt-125m"):
        n = shapes[name]
        for sigma in (0.0, 2.0) if name == "opt-125m" else (1.0,):
            e = energies(n.numel(), sigma)
            for est, beta in runs:
                r = simulate(n, n * e, ZOConfig(method="curvzo", score_estimator=est, score_beta=beta), args.steps,
                             seed=1)
                pi = r["pi"][-args.steps // 5:].mean(0)
                b = torch.tensor(r["budget"][20:], dtype=torch.float64) / n.numel()
                print(row(name, sigma, est, beta, f"{corr_log(pi, e):+.2f}" if sigma else "-",
                          f"{corr_log(pi, n):+.2f}", f"{corr_log(pi, n * e):+.2f}" if sigma else "-",
                          f"{b.mean():.3f}", f"{b.std():.3f}"), flush=True)

    print("\nTable 3: second moment of the block estimator (Eq. V) at B = 0.4 G relative to MeZO (pi = 1); "
          "h = 1: E||g~||^2; h = e: weighted by the per-element energy (Fisher as the curvature)\n")
    rules = ("uniform", "sqrt(a)", "sqrt(e)", "n", "1/sqrt(e)", "optimum")
    print(row("layout", "sigma", "weight", *rules, "optimum: corr(log pi, log e)", "corr(log pi, log a)"))
    print(row(*["---"] * (5 + len(rules))))
    for name in ("demo-llama", "opt-125m"):
        n = shapes[name]
        g = n.numel()
        budget = 0.4 * g
        for sigma in (1.0, 2.0):
            e = energies(g, sigma)
            a = n * e
            for weight, h in (("h=1", torch.ones(g, dtype=torch.float64)), ("h=e", e / e.mean())):
                pis = {"uniform": torch.full((g,), 0.4, dtype=torch.float64),
                       "sqrt(a)": water_filling(a.sqrt(), budget), "sqrt(e)": water_filling(e.sqrt(), budget),
                       "n": water_filling(n, budget),
                       "1/sqrt(e)": water_filling(e.rsqrt(), budget), "optimum": optimum(n, a, h, budget)}
                ref = second_moment(torch.ones(g, dtype=torch.float64), n, a, h)
                best = pis["optimum"]
                print(row(name, sigma, weight, *(f"{float(second_moment(p, n, a, h) / ref):.2f}" for p in pis.values()),
                          f"{corr_log(best, e):+.2f}", f"{corr_log(best, a):+.2f}"), flush=True)
    if args.long:
        print("\nTable 4: demo layout, sigma 1, beta 2e-4, 25000 steps (pi: mean over the last 5000)\n")
        print(row("estimator", "corr(log pi, log e)", "corr(log pi, log n)", "corr(log pi, log a)"))
        print(row(*["---"] * 4))
        n = shapes["demo-llama"]
        e = energies(n.numel(), 1.0)
        for est in ("unbiased", "unbiased_element"):
            r = simulate(n, n * e, ZOConfig(method="curvzo", score_estimator=est, score_beta=2e-4), 25000, seed=1)
            pi = r["pi"][-5000:].mean(0)
            print(row(est, f"{corr_log(pi, e):+.2f}", f"{corr_log(pi, n):+.2f}", f"{corr_log(pi, n * e):+.2f}"),
                  flush=True)


if __name__ == "__main__":
    main()
