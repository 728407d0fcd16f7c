"""The algorithm's statistics, on the sampler and the math, vectorised: many steps at once, in seconds.

A quadratic loss in the limit eps -> 0 gives the SPSA difference exactly: Delta = g . v with v = m ⊙ z.
The masks come from `CurvZOSampler.plan`'s rule (uniform < pi), the Horvitz-Thompson step from
`update_coefficients`, and the scores from `block_scores`, on [N, G] batches of N independent steps.
Tolerances: 4.5 standard errors of the Monte-Carlo mean, with the standard error estimated from the
same draws; over the few dozen coordinates checked, a false failure has probability below 1e-3.
The end-to-end engine versions of these tests are in test_engine.py (slow tier).
"""

import itertools
import math

import pytest
import torch

from curvzo_ds.algo import estimators, sampling
from curvzo_ds.algo.sampling import CurvZOSampler, StepPlan
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.config.sections import section

SIZES = (3, 5, 2, 6)
N = 200_000


def layout(sizes=SIZES, seed=0):
    """Block sizes, a known gradient per block (flat), and the block of each coordinate."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(sum(sizes), generator=gen, dtype=torch.float64) * torch.repeat_interleave(
        torch.tensor([1.0, 0.3, 2.0, 0.7, 1.5, 0.2, 0.9, 0.4][:len(sizes)], dtype=torch.float64), torch.tensor(sizes))
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.tensor(sizes, dtype=torch.float64), g, owner


def sampler_with(scores, sizes, **cfg) -> CurvZOSampler:
    base = dict(method="fixed", budget=0.5, score_init=1.0, score_warmup_steps=0, budget_floor=0.1)
    base.update(cfg)
    cfg = ZOConfig(**base)
    s = CurvZOSampler(section(cfg, "sampler"), section(cfg, "engine"), sizes,
                      lambda step, g: torch.rand(g, dtype=torch.float64), cfg.perturbation)
    s.scores = torch.tensor(scores, dtype=torch.float64)
    return s


def draw(sampler: CurvZOSampler, g: torch.Tensor, owner: torch.Tensor, n: int, seed: int = 1):
    """n independent steps at the sampler's current pi: (plan with [n, G] mask, z [n, d], Delta [n, 1], ||v_i||^2)."""
    pi, budget, d_eff, h = sampler.probabilities(0)
    plan, z, delta, block_sq = draw_at(pi, g, owner, n, seed)
    return StepPlan(0, pi, budget, d_eff, h, plan.mask, False), z, delta, block_sq


def draw_at(pi: torch.Tensor, g: torch.Tensor, owner: torch.Tensor, n: int, seed: int = 1):
    """`draw` at a given pi (no sampler): the plan's budget is sum pi, its d_eff and H are None."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, len(pi), generator=gen, dtype=torch.float64) < pi
    z = torch.randn(n, g.numel(), generator=gen, dtype=torch.float64)
    v = z * mask[:, owner]
    delta = (v @ g)[:, None]
    block_sq = torch.zeros(n, len(pi), dtype=torch.float64).index_add_(1, owner, v * v)
    return StepPlan(0, pi, float(pi.sum()), None, None, mask, False), z, delta, block_sq


def assert_mean(samples: torch.Tensor, expected: torch.Tensor, k: float = 4.5) -> None:
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(samples.shape[0])
    assert ((mean - expected).abs() <= k * se + 1e-12).all(), (mean, expected, se)


@pytest.mark.parametrize("floor", [0.0, 0.2])
def test_horvitz_thompson_estimate_is_unbiased(floor):
    """Prop. 3.2 (the issue's 'Prop. 3.1'): E[g~] = g for non-uniform pi, with and without the floor."""
    sizes, g, owner = layout()
    sampler = sampler_with([1.0, 0.05, 9.0, 0.3], sizes, budget_floor=floor)
    plan, z, delta, _ = draw(sampler, g, owner, N)
    assert plan.pi.max() - plan.pi.min() > 0.3  # really non-uniform
    step, keep = sampler.update_coefficients(plan, delta, lr=1.0)  # [N, G]: Delta / pi_i on drawn blocks
    estimate = step[:, owner] * z
    assert_mean(estimate, g)
    assert torch.equal(keep, torch.ones_like(keep))  # no weight decay asked


def test_weight_decay_is_unbiased_and_leaves_the_blocks_not_drawn():
    """The decay factor of a step (MeZO-style, with Horvitz-Thompson weights): exactly 1 on blocks not drawn, and
    over the masks its mean is 1 - lr wd on every block, the decay of a step that draws every block."""
    sizes, g, owner = layout()
    sampler = sampler_with([1.0, 0.05, 9.0, 0.3], sizes)
    plan, _, delta, _ = draw(sampler, g, owner, N)
    assert plan.pi.max() - plan.pi.min() > 0.3 and plan.pi.max() < 1  # non-uniform, every block sometimes left out
    _, keep = sampler.update_coefficients(plan, delta, lr=0.1, weight_decay=0.5)
    assert (keep[~plan.mask] == 1).all() and (keep[plan.mask] < 1).all()
    assert_mean(keep, torch.full((len(SIZES),), 1 - 0.1 * 0.5, dtype=torch.float64))


# A layout worked by hand for the moment tests: pi given directly, block sizes n = (1, 2, 1, 2), the gradient
# g = ((1), (1, -1), (2), (1/2, 1/2)) by block, so the block energies a_i = ||g_i||^2 are (1, 2, 4, 1/2).
HAND_PI = (0.5, 0.25, 1.0, 0.75)
HAND_SIZES = (1, 2, 1, 2)
HAND_G = (1.0, 1.0, -1.0, 2.0, 0.5, 0.5)
HAND_ENERGY = (1.0, 2.0, 4.0, 0.5)
# E[Delta^2 ||v_Gi||^2] on that layout, worked in test_raw_score_mixed_moment below.
HAND_RAW_MEAN = (3.9375, 4.4375, 13.375, 9.0)


def hand_layout(sizes, g):
    """(pi, sizes, flat gradient, owner of each coordinate) as float64 tensors, from the literal numbers."""
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return (torch.tensor(HAND_PI, dtype=torch.float64), torch.tensor(sizes, dtype=torch.float64),
            torch.tensor(g, dtype=torch.float64), owner)


def test_q_directions_share_the_rate_and_decay_once():
    """direction_updates: direction d's step is Eq. 28's with rate lr/q, so the q steps sum to the step of the mean
    Delta; the decay factor is the one-direction one (applied once); with q = 1 it is update_coefficients."""
    sizes, g, owner = layout()
    sampler = sampler_with([1.0, 0.05, 9.0, 0.3], sizes)
    plan = sampler.plan(0)
    deltas = [0.3, -1.2, 0.7]
    steps, keep = sampler.direction_updates(plan, deltas, lr=0.1, weight_decay=0.5)
    mean_step, one_keep = sampler.update_coefficients(plan, sum(deltas) / 3, lr=0.1, weight_decay=0.5)
    assert len(steps) == 3 and torch.allclose(sum(steps), mean_step, rtol=1e-12, atol=0)
    assert torch.equal(keep, one_keep)
    (single,), _ = sampler.direction_updates(plan, [0.3], lr=0.1)
    assert torch.equal(single, sampler.update_coefficients(plan, 0.3, lr=0.1)[0])
    named = sampler.probabilities(0)
    assert torch.equal(named.pi, plan.pi) and named.budget == plan.budget and named.entropy == plan.entropy


@pytest.mark.parametrize("one_element_blocks", [True, False])
def test_raw_score_mixed_moment(one_element_blocks):
    """E[Delta^2 ||v_Gi||^2] = pi_i n_i sum_{k != i} pi_k a_k + pi_i (n_i + 2) a_i (the block form of Eq. 6, the
    issue's 'Eq. 7'), worked by hand at pi = (1/2, 1/4, 1, 3/4): the raw score's Monte-Carlo mean, and
    `expected_scores`'s exact mean, against the literal numbers."""
    if one_element_blocks:
        # Eq. 6 as the paper writes it, pi_i sum_j pi_j g_j^2 + pi_i (3 - pi_i) g_i^2, with g = (1, 2, -1, 1/2):
        # g^2 = (1, 4, 1, 1/4), sum_j pi_j g_j^2 = 1/2 + 1 + 1 + 3/16 = 2.6875;
        # block 0: 2.6875 / 2 + (1/2)(5/2)(1) = 1.34375 + 1.25 = 2.59375
        # block 1: 2.6875 / 4 + (1/4)(11/4)(4) = 0.671875 + 2.75 = 3.421875
        # block 2: 2.6875 + (1)(2)(1) = 4.6875
        # block 3: (3/4) 2.6875 + (3/4)(9/4)(1/4) = 2.015625 + 0.421875 = 2.4375
        sizes_t, g_t, energy = (1, 1, 1, 1), (1.0, 2.0, -1.0, 0.5), (1.0, 4.0, 1.0, 0.25)
        expected = torch.tensor([2.59375, 3.421875, 4.6875, 2.4375], dtype=torch.float64)
    else:
        # HAND_*: pi_k a_k = (1/2, 1/2, 4, 3/8), sum 5.375;
        # block 0: (1/2)(1)(5.375 - 0.5) + (1/2)(1 + 2)(1) = 2.4375 + 1.5 = 3.9375
        # block 1: (1/4)(2)(5.375 - 0.5) + (1/4)(2 + 2)(2) = 2.4375 + 2 = 4.4375
        # block 2: (1)(1)(5.375 - 4) + (1)(1 + 2)(4) = 1.375 + 12 = 13.375
        # block 3: (3/4)(2)(5.375 - 0.375) + (3/4)(2 + 2)(1/2) = 7.5 + 1.5 = 9
        sizes_t, g_t, energy = HAND_SIZES, HAND_G, HAND_ENERGY
        expected = torch.tensor(HAND_RAW_MEAN, dtype=torch.float64)
    pi, sizes, g, owner = hand_layout(sizes_t, g_t)
    plan, _, delta, block_sq = draw_at(pi, g, owner, N)
    assert_mean(estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "raw"), expected)
    energy = torch.tensor(energy, dtype=torch.float64)
    torch.testing.assert_close(estimators.expected_scores(pi, sizes, energy, "raw", None), expected, rtol=1e-15, atol=0)


def test_unbiased_score_has_mean_the_squared_block_gradient():
    """Appendix B's s'_i in block form has mean ||g_i||^2 = (1, 2, 4, 1/2) on the hand layout; the raw score's mean
    there (3.9375, 4.4375, 13.375, 9) differs measurably."""
    pi, sizes, g, owner = hand_layout(HAND_SIZES, HAND_G)
    plan, _, delta, block_sq = draw_at(pi, g, owner, N)
    scores = estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "unbiased")
    assert_mean(scores, torch.tensor(HAND_ENERGY, dtype=torch.float64))
    se = scores.std(0) / math.sqrt(N)
    assert ((scores.mean(0) - torch.tensor(HAND_RAW_MEAN, dtype=torch.float64)).abs() > 4.5 * se).all()


def normalized_mean(pi, sizes, g_sq):
    """The exact mean of the normalised block score (Eq. 27), by enumerating the 2^G masks.

    Given the mask M, v is Gaussian on the N_M selected coordinates: v = R u with R^2 ~ chi^2(N_M)
    independent of u, uniform on the sphere. s_i = ||v_i||^2 / ||v||^2 Delta^2 = R^2 ||u_i||^2 (g . u)^2, and
    E[u_a^2 u_b^2] = (1 + 2 [a = b]) / (N_M (N_M + 2)), so E[s_i | M] = (n_i ||g_M||^2 + 2 ||g_i||^2) / (N_M + 2).
    """
    g = len(pi)
    out = torch.zeros(g, dtype=torch.float64)
    for bits in itertools.product((0, 1), repeat=g):
        m = torch.tensor(bits, dtype=torch.bool)
        if not m.any():
            continue
        prob = torch.where(m, pi, 1 - pi).prod()
        n_m, g_m = sizes[m].sum(), g_sq[m].sum()
        out += prob * torch.where(m, (sizes * g_m + 2 * g_sq) / (n_m + 2), torch.zeros_like(pi))
    return out


def test_normalized_score_mean_is_the_exact_sphere_formula():
    """The default estimator (Eq. 27): the mean the equations give, including its size term n_i ||g_M||^2."""
    sizes, g, owner = layout(seed=5)
    sampler = sampler_with([1.0, 0.2, 4.0, 0.5], sizes)
    plan, _, delta, block_sq = draw(sampler, g, owner, N)
    scores = estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "normalized")
    g_sq = torch.zeros(4, dtype=torch.float64).index_add_(0, owner, g * g)
    assert_mean(scores, normalized_mean(plan.pi, sizes, g_sq))


def test_pi_follows_the_square_root_of_the_scores():
    """pi ∝ sqrt(S) (Prop. 3.4): S = [4, 1, 1/4, 1/16] at B = 1.5 and no floor gives pi ∝ [8, 4, 2, 1] (no block
    clipped), and not pi ∝ S = [64, 16, 4, 1]."""
    s = torch.tensor([4.0, 1.0, 0.25, 0.0625], dtype=torch.float64)
    pi = sampling.inclusion_probabilities(s, 1.5, gamma=0.0)
    assert torch.allclose(pi, torch.tensor([8.0, 4.0, 2.0, 1.0], dtype=torch.float64) * 1.5 / 15)
    sampler = sampler_with(s.tolist(), torch.ones(4), budget=1.5 / 4, budget_floor=0.0)
    assert torch.allclose(sampler.probabilities(0).pi, pi)


def test_effective_support_and_entropy_use_the_square_root():
    """S = [4, 1]: d_eff = (2 + 1)^2 / 5 = 1.8 (with S itself: 25/17 = 1.47); p = [2/3, 1/3] gives
    H = 0.9183 (p ∝ S = [0.8, 0.2] would give 0.7219)."""
    s = torch.tensor([4.0, 1.0], dtype=torch.float64)
    assert sampling.effective_support(s) == pytest.approx(1.8, rel=1e-12)
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(2)
    assert sampling.normalized_entropy(s) == pytest.approx(h, rel=1e-12)
    b, d_eff, entropy = sampling.adaptive_budget(s, 0.2, 1.4, 0.5)
    assert b == pytest.approx(0.2 + 1.2 * (0.5 * 1.8 / 2 + 0.5 * h), rel=1e-12)


def test_observe_averages_the_warmup_then_follows_the_ema():
    sizes = torch.ones(3, dtype=torch.float64)
    cfg = ZOConfig(method="curvzo", score_warmup_steps=2, score_beta=0.25)
    sampler = CurvZOSampler(section(cfg, "sampler"), section(cfg, "engine"), sizes,
                            lambda step, g: torch.zeros(g, dtype=torch.float64))  # all drawn
    first = sampler.plan(0)
    assert first.warmup and torch.allclose(first.pi, torch.full((3,), cfg.budget_max, dtype=torch.float64))
    sampler.observe(first, 2.0, torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))  # normalised: [1, 1, 2]
    sampler.skip(sampler.plan(1))  # the last warm-up step ends even when skipped: mean over 2 steps
    assert torch.equal(sampler.scores, torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64))
    third = sampler.plan(2)
    assert not third.warmup
    sampler.observe(third, 2.0, torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    assert torch.allclose(sampler.scores, 0.75 * torch.tensor([0.5, 0.5, 1.0]).double()
                          + 0.25 * torch.tensor([1.0, 1.0, 2.0]).double())


def test_methods_mezo_and_us_ab():
    sizes = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mezo = sampler_with([9.0, 1.0, 0.0, 0.0], sizes, method="mezo")
    assert torch.equal(mezo.plan(0).pi, torch.ones(4, dtype=torch.float64)) and mezo.plan(0).n_selected == 4
    us_ab = sampler_with([9.0, 1.0, 0.0, 0.0], sizes, method="us_ab", budget_min=0.25, budget_max=0.75)
    # Eq. 20 by hand: S = (9, 1, 0, 0), G = 4, B_min = 1, B_max = 3, alpha = 0.5. sqrt S = (3, 1, 0, 0), so
    # p = (3/4, 1/4, 0, 0), d_eff = (3 + 1)^2 / (9 + 1) = 1.6, H = -(3/4 ln 3/4 + 1/4 ln 1/4) / ln 4 = 0.40563906...;
    # B = 1 + (3 - 1)(0.5 * 1.6 / 4 + 0.5 H) = 1.4 + H = 1.8056390622295664, and pi = B / 4 on every block.
    plan = us_ab.plan(0)
    assert plan.budget == pytest.approx(1.8056390622295664, rel=1e-12)
    assert plan.d_eff == pytest.approx(1.6, rel=1e-12) and plan.entropy == pytest.approx(0.4056390622295664, rel=1e-12)
    torch.testing.assert_close(plan.pi, torch.full((4,), 1.8056390622295664 / 4, dtype=torch.float64), rtol=1e-12,
                               atol=0)
