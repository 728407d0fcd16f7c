"""CurvZO's sampling math, as pure tensor functions (paper Section 3; DESIGN.md §1).

Nothing here knows about ranks, models or DeepSpeed: every function takes and returns
float64 tensors of length G (the number of blocks), so it can be read against the paper and
tested on its own. Equation, proposition and appendix numbers are those of the typeset paper
(../shared/paper/curvzo_paper.tex: equations numbered in one sequence, propositions per section).
"""

from __future__ import annotations

import math

import torch


def score_distribution(scores: torch.Tensor) -> torch.Tensor:
    """p_i = sqrt(S_i) / sum_j sqrt(S_j) (Sec. 3.3, after Eq. 19). Uniform when every score is 0."""
    root = scores.clamp(min=0).sqrt()
    total = root.sum()
    if not torch.isfinite(total) or total <= 0:
        return torch.full_like(scores, 1.0 / scores.numel())
    return root / total


def effective_support(scores: torch.Tensor) -> float:
    """d_eff = (sum sqrt S)^2 / sum S in [1, G] (Eq. 18). G when every score is 0."""
    s = scores.clamp(min=0)
    total = s.sum().item()
    if total <= 0 or not math.isfinite(total):
        return float(scores.numel())
    d_eff = s.sqrt().sum().item() ** 2 / total
    return min(max(d_eff, 1.0), float(scores.numel()))


def normalized_entropy(scores: torch.Tensor) -> float:
    """H = -(1/log G) sum p log p in [0, 1] with p from `score_distribution` (Eq. 19).

    G = 1 or all-zero scores give H = 1 (a flat distribution), DESIGN.md §1.
    """
    g = scores.numel()
    if g == 1 or not (scores.clamp(min=0).sum() > 0):
        return 1.0
    p = score_distribution(scores)
    nz = p[p > 0]
    h = -(nz * nz.log()).sum().item() / math.log(g)
    return min(max(h, 0.0), 1.0)


def adaptive_budget(scores: torch.Tensor, budget_min: float, budget_max: float,
                    alpha: float) -> tuple[float, float, float]:
    """B = B_min + (B_max - B_min)(alpha d_eff/G + (1 - alpha) H) (Eq. 20), in blocks.

    Returns (B, d_eff, H): the last two are the rule's inputs, logged for study.
    """
    g = scores.numel()
    d_eff = effective_support(scores)
    h = normalized_entropy(scores)
    b = budget_min + (budget_max - budget_min) * (alpha * d_eff / g + (1 - alpha) * h)
    return b, d_eff, h


def water_filling(weights: torch.Tensor, budget: float) -> torch.Tensor:
    """pi_i = min(1, c w_i) with sum pi = B (Problem (P2), Prop. 3.10 / Eq. 31; per coordinate: Prop. 3.4 / Eq. 16).

    `weights` are the sqrt-scores. Blocks clipped at 1 hand their excess to the rest. If the
    positive weights cannot absorb B even at 1 each, the remainder is spread evenly over the
    zero-weight blocks. B >= G gives all ones; all-zero weights give uniform pi = B/G.
    """
    g = weights.numel()
    w = weights.to(torch.float64).clamp(min=0)
    if budget >= g:
        return torch.ones(g, dtype=torch.float64)
    if budget <= 0:
        return torch.zeros(g, dtype=torch.float64)
    pos = w > 0
    n_pos = int(pos.sum())
    if n_pos == 0:
        return torch.full((g,), budget / g, dtype=torch.float64)
    if budget >= n_pos:
        # Every positive block at 1; the rest of the budget goes evenly to zero-weight blocks.
        pi = torch.where(pos, torch.ones_like(w), torch.full_like(w, (budget - n_pos) / (g - n_pos)))
        return pi
    # Sort descending; find the number k of clipped blocks such that c = (B - k) / sum(rest)
    # keeps every unclipped block below 1 and every clipped one at or above 1.
    order = torch.argsort(w, descending=True, stable=True)
    ws = w[order]
    tail = torch.flip(torch.cumsum(torch.flip(ws, [0]), 0), [0])  # tail[k] = sum ws[k:]
    pi_sorted = torch.empty_like(ws)
    for k in range(n_pos):
        c = (budget - k) / tail[k].item()
        if ws[k].item() * c <= 1.0:
            pi_sorted[:k] = 1.0
            pi_sorted[k:] = (ws[k:] * c).clamp(max=1.0)
            break
    pi = torch.empty_like(w)
    pi[order] = pi_sorted
    return pi


def mix_floor(pi: torch.Tensor, budget: float, gamma: float) -> torch.Tensor:
    """pi = (1 - gamma) pi_curv + gamma B/G (DESIGN.md §5): keeps sum pi = B and pi >= gamma B/G.

    The floor keeps every block reachable, bounds the Horvitz-Thompson weight 1/pi by
    G/(gamma B), and lets a block whose score decayed be found again.
    """
    g = pi.numel()
    return ((1 - gamma) * pi + gamma * min(budget, g) / g).clamp(max=1.0)


def inclusion_probabilities(scores: torch.Tensor, budget: float, gamma: float) -> torch.Tensor:
    """pi proportional to sqrt(S) by water-filling, then mixed with the uniform floor."""
    return mix_floor(water_filling(scores.clamp(min=0).sqrt(), budget), budget, gamma)


def budget_for_param_fraction(scores: torch.Tensor, sizes: torch.Tensor, fraction: float, gamma: float) -> float:
    """The block budget B whose pi perturbs `fraction` of all parameters in expectation.

    Used when `budget_unit = params` (the paper's ablation B = rho d counts parameters).
    sum_i pi_i(B) n_i is increasing in B, so bisection finds B.
    """
    sizes = sizes.to(torch.float64)
    target = fraction * sizes.sum().item()
    lo, hi = 0.0, float(scores.numel())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if (inclusion_probabilities(scores, mid, gamma) * sizes).sum().item() < target:
            lo = mid
        else:
            hi = mid
    return hi


def block_scores(delta: float, block_sq: torch.Tensor, mask: torch.Tensor, pi: torch.Tensor,
                 sizes: torch.Tensor, estimator: str) -> torch.Tensor:
    """One step's block scores from Delta and ||v_Gi||^2 (0 for unselected blocks).

    - "normalized": s~_i = ||v_Gi||^2 / ||v||^2 Delta^2 (Eq. 27, the block form of Eq. 7; the paper's default);
    - "raw": s_i = Delta^2 ||v_Gi||^2 (the block form of Eq. 5, whose mean is Eq. 6);
    - "unbiased": (Delta^2 ||v_Gi||^2 - pi_i n_i Delta^2) / (pi_i (n_i + 2 - pi_i n_i)), the block
      form of Appendix B's s'_i, whose mean is ||g_i||^2. It can be negative (clamped later).
    An empty mask gives all zeros.
    """
    d2 = delta * delta
    v_sq = torch.where(mask, block_sq, torch.zeros_like(block_sq))
    if estimator == "normalized":
        total = v_sq.sum()
        if total <= 0:
            return torch.zeros_like(v_sq)
        return v_sq / total * d2
    if estimator == "raw":
        return v_sq * d2
    if estimator == "unbiased":
        n = sizes.to(torch.float64)
        return (d2 * v_sq - pi * n * d2) / (pi * (n + 2 - pi * n))
    raise ValueError(f"score_estimator={estimator!r}: use normalized, raw or unbiased")


def ema(scores: torch.Tensor, new: torch.Tensor, beta: float) -> torch.Tensor:
    """S_i <- (1 - beta) S_i + beta s~_i (Eq. 8). Non-finite inputs leave S unchanged."""
    if not torch.isfinite(new).all():
        return scores
    return (1 - beta) * scores + beta * new


def lr_at(step: int, base_lr: float, schedule: str, max_steps: int) -> float:
    """Learning rate for update number `step` (0-based): constant, or linear decay to 0."""
    if schedule == "constant" or max_steps <= 0:
        return base_lr
    if schedule == "linear":
        return base_lr * max(0.0, 1.0 - step / max_steps)
    raise ValueError(f"lr_scheduler_type={schedule!r}: use constant or linear")
