"""The figures the experiments' tables share: `mean_sd`, the RLOO second-moment constant `c_q` and the predicted rate
ratio of RLOO against MeZO (docs/algorithm.md §2), and issue 19's steps-to-a-loss ratios over seeds."""

from __future__ import annotations

import math

import numpy as np


def mean_sd(values) -> str:
    """"mean ± sd" (ddof 1) to 4 places; one value has no sd: "mean (1 seed)", not a zero one."""
    return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" if len(values) > 1 else f"{values[0]:.4f} (1 seed)"


def c_q(q: int) -> float:
    """The constant of gᵀHg in RLOO's E ĝᵀHĝ with q directions (Gaussian z, ε → 0): 2/q + ((q − 1)/q)(1 + 1/(q − 1)²),
    the diagonal terms' 2gᵀHg/q and the cross terms E[Δ_j Δ_k z_jᵀHz_k]."""
    return 2 / q + (q - 1) / q * (1 + 1 / (q - 1) ** 2)


def rloo_moment(q: int, trace: float, ghg: float, g_norm2: float) -> float:
    """E ĝᵀHĝ of RLOO with q directions (ε → 0, Gaussian z): ‖g‖² tr H / (q − 1) + c_q gᵀHg."""
    return g_norm2 * trace / (q - 1) + c_q(q) * ghg


def rloo_rate_ratio(q: int, x: float) -> float:
    """RLOO q's best rate over MeZO's, E ĝᵀHĝ_MeZO / E ĝᵀHĝ_RLOO (docs/algorithm.md §2: both have E ĝ = g, so the
    best rate g·E ĝ / E ĝᵀHĝ scales with the inverse second moment along H), x = gᵀHg / (‖g‖² tr H):
    (1 + 2x) / (1/(q − 1) + c_q x), which is q − 1 at x = 0."""
    return (1 + 2 * x) / (1 / (q - 1) + c_q(q) * x)


def rloo_per_forward(q: int, x: float) -> float:
    """RLOO q's progress per forward against MeZO's, each at its best rate: the rate ratio times MeZO's 2 forwards
    over RLOO's q."""
    return (2 / q) * rloo_rate_ratio(q, x)


# ----------------------------------------------------------------------------------------------------------------
# Issue 19's figures: steps to reach a dev loss, per seed against MeZO's run of the same seed

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student t, two-sided 95%, by degrees of freedom


def steps_to_reach(curve: list[dict], target: float) -> float:
    """The first evaluated step whose dev loss is <= target (inf if none)."""
    return next((c["step"] for c in curve if c["loss"] <= target), math.inf)


def interval(values: list[float]) -> str:
    """Mean ± the half-width of a 95% t interval [min, max] (the value alone for one)."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    half = T975[len(values) - 1] * np.std(values, ddof=1) / math.sqrt(len(values))
    return f"{np.mean(values):.2f} ± {half:.2f} [{min(values):.2f}, {max(values):.2f}]"


def reach_ratio(runs: list[dict], mezo_runs: list[dict]) -> str:
    """Per seed: steps to reach the final dev loss of MeZO's run with the same seed (same data order), over the
    steps MeZO took to reach it; mean ± the half-width of a 95% t interval over seeds [min, max], or how many
    seeds reach it."""
    ratios = []
    for run, ref in zip(runs, mezo_runs):
        target = ref["curve"][-1]["loss"]
        if steps_to_reach(ref["curve"], target) == 0:
            return "- (MeZO ends no lower than it starts)"
        ratios.append(steps_to_reach(run["curve"], target) / steps_to_reach(ref["curve"], target))
    finite = [r for r in ratios if math.isfinite(r)]
    if len(finite) < len(ratios):
        return f"{len(finite)}/{len(ratios)} seeds reach it"
    return interval(finite)


def speedup_at_own_loss(runs: list[dict], mezo_runs: list[dict]) -> str:
    """Per seed, the other way round: the steps MeZO's run needs to reach this run's final dev loss, over the steps
    this run needs for it (> 1: faster than MeZO to that level). Seeds where MeZO never reaches it are counted
    apart (this run ended lower than MeZO ever was)."""
    ratios, never = [], 0
    for run, ref in zip(runs, mezo_runs):
        target = run["curve"][-1]["loss"]
        own, mezo = steps_to_reach(run["curve"], target), steps_to_reach(ref["curve"], target)
        if not math.isfinite(mezo):
            never += 1
        elif own > 0:
            ratios.append(mezo / own)
    parts = [interval(ratios)] if ratios else []
    if never:
        parts.append(f"{never}/{len(runs)} seeds below MeZO's curve")
    return "; ".join(parts) or "-"
