"""The pure sampling math: water-filling, the budget rule, scores (paper Sec. 3; docs/algorithm.md)."""

import math

import pytest
import torch

from curvzo_ds.algo import rate, sampling


def test_water_filling_sums_to_budget_and_clips():
    w = torch.tensor([10.0, 5.0, 1.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    for budget in (0.3, 1.0, 2.5, 4.0, 5.9):
        pi = sampling.water_filling(w, budget)
        assert abs(pi.sum().item() - budget) < 1e-12
        assert (pi > 0).all() and (pi <= 1).all()
        free = pi < 1
        # Unclipped blocks are proportional to their weight (the KKT condition of P2).
        ratio = pi[free] / w[free]
        assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-12)
        # Clipped blocks have weights at least as large as any unclipped one.
        if (~free).any() and free.any():
            assert w[~free].min() >= w[free].max()


def test_water_filling_corner_cases():
    ones = torch.ones(5, dtype=torch.float64)
    assert torch.equal(sampling.water_filling(torch.rand(5, dtype=torch.float64), 5.0), ones)
    assert torch.equal(sampling.water_filling(torch.rand(5, dtype=torch.float64), 7.0), ones)
    uniform = sampling.water_filling(torch.zeros(4, dtype=torch.float64), 2.0)
    assert torch.allclose(uniform, torch.full((4,), 0.5, dtype=torch.float64))
    equal = sampling.water_filling(torch.full((4,), 3.0, dtype=torch.float64), 1.0)
    assert torch.allclose(equal, torch.full((4,), 0.25, dtype=torch.float64))
    # Two positive blocks cannot absorb a budget of 3: the rest goes evenly to the zero ones.
    pi = sampling.water_filling(torch.tensor([2.0, 1.0, 0.0, 0.0], dtype=torch.float64), 3.0)
    assert torch.allclose(pi, torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64))


def test_water_filling_minimises_variance_bound():
    """Prop. 3.4 (issue's 'Prop. 3.3'): pi ~ sqrt(F) gives the least sum F_i/pi_i at sum pi = B."""
    gen = torch.Generator().manual_seed(0)
    f = torch.rand(12, generator=gen, dtype=torch.float64) ** 4 + 1e-3
    budget = 4.0
    best = sampling.water_filling(f.sqrt(), budget)
    best_value = (f / best).sum().item()
    for _ in range(2000):
        # Random feasible pi with the same budget: random direction, then water-fill it.
        other = sampling.water_filling(torch.rand(12, generator=gen, dtype=torch.float64) + 1e-3, budget)
        assert abs(other.sum().item() - budget) < 1e-9
        assert (f / other).sum().item() >= best_value - 1e-9
    # Small feasible moves away from the optimum (mass moved between two unclipped blocks) do worse.
    free = (best < 1).nonzero().flatten()
    i, j = free[0].item(), free[1].item()
    for d in (1e-3, -1e-3):
        moved = best.clone()
        moved[i] += d
        moved[j] -= d
        assert (f / moved).sum().item() > best_value


def test_effective_support_and_entropy_ranges():
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        s = torch.rand(9, generator=gen, dtype=torch.float64) ** 6
        d = sampling.effective_support(s)
        h = sampling.normalized_entropy(s)
        assert 1.0 <= d <= 9.0
        assert 0.0 <= h <= 1.0
    one_hot = torch.tensor([0, 0, 5.0, 0], dtype=torch.float64)
    assert sampling.effective_support(one_hot) == pytest.approx(1.0)
    assert sampling.normalized_entropy(one_hot) == pytest.approx(0.0)
    flat = torch.full((4,), 2.0, dtype=torch.float64)
    assert sampling.effective_support(flat) == pytest.approx(4.0)
    assert sampling.normalized_entropy(flat) == pytest.approx(1.0)
    # Undefined corners get defined values: all-zero scores and G = 1 are flat.
    assert sampling.normalized_entropy(torch.zeros(3, dtype=torch.float64)) == 1.0
    assert sampling.normalized_entropy(torch.tensor([0.7], dtype=torch.float64)) == 1.0
    assert sampling.effective_support(torch.zeros(3, dtype=torch.float64)) == 3.0


def test_adaptive_budget_end_points():
    g = 8
    one_hot = torch.zeros(g, dtype=torch.float64)
    one_hot[3] = 1.0
    b, d, h = sampling.adaptive_budget(one_hot, 1.0, 6.0, 0.5)
    # d_eff = 1, H = 0: B = B_min + (B_max - B_min) * 0.5 / G.
    assert b == pytest.approx(1.0 + 5.0 * 0.5 / g)
    b, d, h = sampling.adaptive_budget(torch.ones(g, dtype=torch.float64), 1.0, 6.0, 0.3)
    assert b == pytest.approx(6.0) and d == pytest.approx(g) and h == pytest.approx(1.0)
    b, _, _ = sampling.adaptive_budget(one_hot, 1.0, 6.0, 0.0)
    assert b == pytest.approx(1.0)


def test_ema_and_guards():
    s = torch.tensor([1.0, 2.0], dtype=torch.float64)
    new = torch.tensor([3.0, 0.0], dtype=torch.float64)
    out = sampling.ema(s, new, 0.25)
    assert torch.allclose(out, torch.tensor([1.5, 1.5], dtype=torch.float64))
    assert torch.equal(sampling.ema(s, torch.tensor([math.nan, 1.0], dtype=torch.float64), 0.5), s)


def test_floor_bounds_inverse_probability():
    s = torch.tensor([1e6, 1.0, 1e-30, 0.0, 0.0], dtype=torch.float64)
    for budget, gamma in ((1.0, 0.1), (2.0, 0.05), (0.5, 0.2)):
        pi = sampling.inclusion_probabilities(s, budget, gamma)
        assert abs(pi.sum().item() - budget) < 1e-12
        assert (1 / pi).max().item() <= len(s) / (gamma * budget) * (1 + 1e-12)


def test_budget_in_parameters():
    s = torch.tensor([4.0, 1.0, 1.0, 0.25], dtype=torch.float64)
    sizes = torch.tensor([1000.0, 10.0, 10.0, 5000.0], dtype=torch.float64)
    b = sampling.budget_for_param_fraction(s, sizes, 0.3, 0.1)
    pi = sampling.inclusion_probabilities(s, b, 0.1)
    assert (pi * sizes).sum().item() / sizes.sum().item() == pytest.approx(0.3, rel=1e-9)


def test_learning_rate_schedules():
    assert rate.lr_at(0, 1e-3, "constant", 100) == 1e-3
    assert rate.lr_at(50, 1e-3, "linear", 100) == pytest.approx(5e-4)
    assert rate.lr_at(100, 1e-3, "linear", 100) == 0.0
