"""The score estimators of CurvZO (paper Eq. 5, 7, 27 and App. B; docs/algorithm.md, "Scores that track
curvature?"): each turns one step's Delta^2 and block sums ||v_Gi||^2 into block scores, and gives its mean for
known block energies. `ESTIMATORS` is the registry the `score_estimator` key, the sampler and `curvzo-ds diagnose`
read. Pure: float64 tensors of length G in and out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch


class Perturbation(str, enum.Enum):
    """The `perturbation` key: the law of each coordinate of z (docs/algorithm.md, "Rademacher directions"). Both
    have E z = 0 and E z^2 = 1; they differ in the fourth moment, which the score estimators' means carry."""

    GAUSSIAN = "gaussian"  # z_i ~ N(0, 1): E z^4 = 3, ||z_B||^2 random (chi-square, n_B degrees)
    RADEMACHER = "rademacher"  # z_i = +-1: E z^4 = 1, ||z_B||^2 = n_B exactly

    @property
    def excess(self) -> float:
        """c = E z^4 - 1 = Var(z_i^2): 2 (Gaussian) or 0 (Rademacher), the constant of every mean below."""
        return 2.0 if self is Perturbation.GAUSSIAN else 0.0


def _normalized(d2, v_sq):
    """s~_i = ||v_Gi||^2 / ||v||^2 Delta^2 (Eq. 27, the block form of Eq. 7); 0 where nothing was drawn."""
    total = v_sq.sum(-1, keepdim=True)
    return torch.where(total > 0, v_sq / total * d2, torch.zeros_like(v_sq))


def _unbiased(d2, v_sq, pi, n, c):
    """Appendix B's s'_i in block form: (Delta^2 ||v_Gi||^2 - pi_i n_i Delta^2) / (pi_i (n_i + c - pi_i n_i)), c = E z^4
    - 1 (Gaussian: 2, the paper's; Rademacher: 0, where the denominator is pi_i n_i (1 - pi_i)). A block drawn at
    every step (pi_i = 1) under +-1 has no unbiased score from Delta^2 and ||v_Gi||^2 = n_i: it gets 0 here, and the
    sampler keeps its old score (`informative`)."""
    denominator = pi * (n + c - pi * n)
    score = (d2 * v_sq - pi * n * d2) / denominator
    return score if c else torch.where(denominator > 0, score, torch.zeros_like(score))


def _unbiased_informative(pi, n, c):
    """Where Appendix B's score carries information about block i: its denominator pi_i (n_i + c - pi_i n_i) > 0
    (always for Gaussian z; for +-1 z, where pi_i < 1)."""
    return pi * (n + c - pi * n) > 0


def _mask_mean(pi, n, a, masks, c):
    """Eq. 27's mean given the mask M, m_i (n_i ||g_M||^2 + c a_i) / (N_M + c), averaged over `masks` ([K, G]);
    c = 2 for Gaussian z, 0 for +-1 z (then ||v_Gi||^2 / ||v||^2 = n_i / N_M exactly), 0 where M is empty."""
    m = masks.to(torch.float64)
    total = (m @ n)[:, None] + c
    return torch.where(total > 0, m * (n * (m @ a)[:, None] + c * a) / total, torch.zeros_like(m)).mean(0)


@dataclass(frozen=True)
class ScoreEstimator:
    """One block-score estimator, the one place it is defined (the `score_estimator` key names it).

    `score(d2, v_sq, pi, n, mask, c)`: one step's block scores from Delta^2 and ||v_Gi||^2 (0 for blocks not drawn),
    pi, the block sizes n, the mask and c = E z^4 - 1 (Perturbation.excess). `mean(pi, n, a, masks, c)`: their
    expectation for block energies a_i = ||g_i||^2 (exact, or averaged over the [K, G] `masks` drawn at pi for the
    Eq. 27 family), which `curvzo-ds diagnose` uses for the mean-field fixed point. `informative(pi, n, c)`: the
    blocks whose score says something about them (the others keep their score: CurvZOSampler.observe).
    docs/algorithm.md derives each mean, for Gaussian and for +-1 z.
    """

    score: Callable
    mean: Callable
    informative: Callable = lambda pi, n, c: torch.ones_like(pi, dtype=torch.bool)  # noqa: E731


ESTIMATORS: dict[str, ScoreEstimator] = {
    # Eq. 27, the paper's default
    "normalized": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: _normalized(d2, v_sq), _mask_mean),
    # Eq. 5 in block form, whose mean is Eq. 6 (c = 2; +-1 z: c = 0)
    "raw": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: v_sq * d2,
                          lambda pi, n, a, masks, c: pi * n * ((pi * a).sum() - pi * a) + pi * (n + c) * a),
    # Appendix B, whose mean is ||g_i||^2; it can be negative (clamped later)
    "unbiased": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: _unbiased(d2, v_sq, pi, n, c),
                               lambda pi, n, a, masks, c: a.clone(), _unbiased_informative),
    # the same per element: mean ||g_i||^2 / n_i
    "unbiased_element": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: _unbiased(d2, v_sq, pi, n, c) / n,
                                       lambda pi, n, a, masks, c: a / n, _unbiased_informative),
    # Eq. 27 per element
    "per_element": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: _normalized(d2, v_sq) / n,
                                  lambda pi, n, a, masks, c: _mask_mean(pi, n, a, masks, c) / n),
    # Eq. 27 / pi_i (Horvitz-Thompson on the score: its mean given that block i is drawn); 0 where not drawn,
    # also where pi = 0 (budget_floor = 0)
    "ht": ScoreEstimator(lambda d2, v_sq, pi, n, mask, c: torch.where(mask, _normalized(d2, v_sq) / pi,
                                                                      torch.zeros_like(v_sq)),
                         lambda pi, n, a, masks, c: _mask_mean(pi, n, a, masks, c) / pi),
}


def block_scores(delta: float, block_sq: torch.Tensor, mask: torch.Tensor, pi: torch.Tensor,
                 sizes: torch.Tensor, estimator: str,
                 perturbation: str | Perturbation = Perturbation.GAUSSIAN) -> torch.Tensor:
    """One step's block scores from Delta and ||v_Gi||^2 (0 for unselected blocks), by the estimator named in
    ESTIMATORS, for z of `perturbation`. An empty mask gives zeros for the estimators that scale Delta^2 by the drawn
    blocks' share (the engine never scores such a step: it is skipped). Leading dimensions are steps: [N, G] inputs
    with [N, 1] deltas give N steps' scores at once (the statistical tests use that); one step is [G] and a float.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"score_estimator={estimator!r}: use one of {', '.join(ESTIMATORS)}")
    v_sq = torch.where(mask, block_sq, torch.zeros_like(block_sq))
    return ESTIMATORS[estimator].score(delta * delta, v_sq, pi, sizes.to(torch.float64), mask,
                                       Perturbation(perturbation).excess)


def expected_scores(pi: torch.Tensor, sizes: torch.Tensor, energy: torch.Tensor, estimator: str,
                    masks: torch.Tensor, perturbation: str | Perturbation = Perturbation.GAUSSIAN) -> torch.Tensor:
    """The mean of one step's block scores at inclusion probabilities pi, for block energies a = ||g_i||^2 and z of
    `perturbation` (exact for raw, unbiased and unbiased_element; averaged over `masks`, [K, G] draws at pi, for the
    Eq. 27 family)."""
    return ESTIMATORS[estimator].mean(pi, sizes.to(torch.float64), energy.to(torch.float64), masks,
                                      Perturbation(perturbation).excess)


def informative_blocks(pi: torch.Tensor, sizes: torch.Tensor, estimator: str,
                       perturbation: str | Perturbation = Perturbation.GAUSSIAN) -> torch.Tensor:
    """[G] bool: the blocks whose score from `estimator` carries information at pi (all but, for Appendix B's
    estimators under +-1 z, the blocks with pi_i = 1)."""
    return ESTIMATORS[estimator].informative(pi, sizes.to(torch.float64), Perturbation(perturbation).excess)
