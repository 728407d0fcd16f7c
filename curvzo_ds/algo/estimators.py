"""The score estimators of CurvZO (paper Eq. 5, 7, 27 and App. B; docs/algorithm.md, "Scores that track
curvature?"): each turns one step's Delta^2 and block sums ||v_Gi||^2 into block scores, and gives its mean for
known block energies. `ESTIMATORS` is the registry the `score_estimator` key, the sampler and `curvzo-ds diagnose`
read. Pure: float64 tensors of length G in and out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _normalized(d2, v_sq):
    """s~_i = ||v_Gi||^2 / ||v||^2 Delta^2 (Eq. 27, the block form of Eq. 7); 0 where nothing was drawn."""
    total = v_sq.sum(-1, keepdim=True)
    return torch.where(total > 0, v_sq / total * d2, torch.zeros_like(v_sq))


def _unbiased(d2, v_sq, pi, n):
    """Appendix B's s'_i in block form: (Delta^2 ||v_Gi||^2 - pi_i n_i Delta^2) / (pi_i (n_i + 2 - pi_i n_i))."""
    return (d2 * v_sq - pi * n * d2) / (pi * (n + 2 - pi * n))


def _mask_mean(pi, n, a, masks):
    """Eq. 27's mean given the mask M, m_i (n_i ||g_M||^2 + 2 a_i) / (N_M + 2), averaged over `masks` ([K, G])."""
    m = masks.to(torch.float64)
    return (m * (n * (m @ a)[:, None] + 2 * a) / ((m @ n)[:, None] + 2)).mean(0)


@dataclass(frozen=True)
class ScoreEstimator:
    """One block-score estimator, the one place it is defined (the `score_estimator` key names it).

    `score(d2, v_sq, pi, n, mask)`: one step's block scores from Delta^2 and ||v_Gi||^2 (0 for blocks not drawn),
    pi, the block sizes n and the mask. `mean(pi, n, a, masks)`: their expectation for block energies
    a_i = ||g_i||^2 (exact, or averaged over the [K, G] `masks` drawn at pi for the Eq. 27 family), which
    `curvzo-ds diagnose` uses for the mean-field fixed point. docs/algorithm.md derives each mean.
    """

    score: Callable
    mean: Callable


ESTIMATORS: dict[str, ScoreEstimator] = {
    # Eq. 27, the paper's default
    "normalized": ScoreEstimator(lambda d2, v_sq, pi, n, mask: _normalized(d2, v_sq), _mask_mean),
    # Eq. 5 in block form, whose mean is Eq. 6
    "raw": ScoreEstimator(lambda d2, v_sq, pi, n, mask: v_sq * d2,
                          lambda pi, n, a, masks: pi * n * ((pi * a).sum() - pi * a) + pi * (n + 2) * a),
    # Appendix B, whose mean is ||g_i||^2; it can be negative (clamped later)
    "unbiased": ScoreEstimator(lambda d2, v_sq, pi, n, mask: _unbiased(d2, v_sq, pi, n),
                               lambda pi, n, a, masks: a.clone()),
    # the same per element: mean ||g_i||^2 / n_i
    "unbiased_element": ScoreEstimator(lambda d2, v_sq, pi, n, mask: _unbiased(d2, v_sq, pi, n) / n,
                                       lambda pi, n, a, masks: a / n),
    # Eq. 27 per element
    "per_element": ScoreEstimator(lambda d2, v_sq, pi, n, mask: _normalized(d2, v_sq) / n,
                                  lambda pi, n, a, masks: _mask_mean(pi, n, a, masks) / n),
    # Eq. 27 / pi_i (Horvitz-Thompson on the score: its mean given that block i is drawn); 0 where not drawn,
    # also where pi = 0 (budget_floor = 0)
    "ht": ScoreEstimator(lambda d2, v_sq, pi, n, mask: torch.where(mask, _normalized(d2, v_sq) / pi,
                                                                   torch.zeros_like(v_sq)),
                         lambda pi, n, a, masks: _mask_mean(pi, n, a, masks) / pi),
}


def block_scores(delta: float, block_sq: torch.Tensor, mask: torch.Tensor, pi: torch.Tensor,
                 sizes: torch.Tensor, estimator: str) -> torch.Tensor:
    """One step's block scores from Delta and ||v_Gi||^2 (0 for unselected blocks), by the estimator named in
    ESTIMATORS. An empty mask gives zeros for the estimators that scale Delta^2 by the drawn blocks' share (the
    engine never scores such a step: it is skipped). Leading dimensions are steps: [N, G] inputs with [N, 1] deltas
    give N steps' scores at once (the statistical tests use that); one step is [G] and a float.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"score_estimator={estimator!r}: use one of {', '.join(ESTIMATORS)}")
    v_sq = torch.where(mask, block_sq, torch.zeros_like(block_sq))
    return ESTIMATORS[estimator].score(delta * delta, v_sq, pi, sizes.to(torch.float64), mask)


def expected_scores(pi: torch.Tensor, sizes: torch.Tensor, energy: torch.Tensor, estimator: str,
                    masks: torch.Tensor) -> torch.Tensor:
    """The mean of one step's block scores at inclusion probabilities pi, for block energies a = ||g_i||^2 (exact
    for raw, unbiased and unbiased_element; averaged over `masks`, [K, G] draws at pi, for the Eq. 27 family)."""
    return ESTIMATORS[estimator].mean(pi, sizes.to(torch.float64), energy.to(torch.float64), masks)
