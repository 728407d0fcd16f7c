"""difference=rloo (docs/algorithm.md, "The leave-one-out difference"): q forwards L_k = L(w + eps z_k) per step and

    g_hat = (1/q) sum_k Delta_k z_k,   Delta_k = (L_k - mean_{j != k} L_j) / eps.

(a) unbiased on a quadratic; (b) its second moment is (d + q)/(q - 1) ||g||^2 (derived below); (c) forwards to a
target against MeZO (4 s); (d) the engine's update is this formula, from its own losses; (e) the config refusal.
"""

import math

import numpy as np
import pytest
import torch

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.forwards import Reduced
from tests.toys import Quadratic, quad_loss


def rloo_estimates(g, hess_diag, eps, q, n, rng):
    """n RLOO estimates [n, d] on f(w) = g.w + 0.5 w' H w at w = 0 (H diagonal), z Gaussian, in float64."""
    d = g.size
    z = rng.standard_normal((n, q, d))
    losses = eps * z @ g + 0.5 * eps**2 * (z**2) @ hess_diag  # [n, q], L(0) = 0 (it cancels anyway)
    baseline = (losses.sum(1, keepdims=True) - losses) / (q - 1)
    delta = (losses - baseline) / eps
    return (delta[:, :, None] * z).mean(1)


def test_rloo_is_unbiased_on_a_quadratic():
    """(a) The mean of N estimates is within 5 standard errors of g in every coordinate (the standard error from the
    sample variance: se_i = std_i / sqrt(N)); the curvature term, even in z, has no mean effect."""
    rng = np.random.default_rng(0)
    d, q, n = 6, 4, 200_000
    g = rng.standard_normal(d)
    est = rloo_estimates(g, np.linspace(1.0, 30.0, d), 0.1, q, n, rng)
    se = est.std(0, ddof=1) / math.sqrt(n)
    assert np.all(np.abs(est.mean(0) - g) < 5 * se), (est.mean(0), g, se)


def test_rloo_second_moment_matches_the_closed_form():
    """(b) For a linear loss (the quadratic's leading term as eps -> 0) and z ~ N(0, I_d):

        E ||g_hat||^2 = (d + q) / (q - 1) ||g||^2,

    the second moment of the central estimator averaged over q - 1 directions, (1 + (d + 1)/(q - 1)) ||g||^2.
    Derivation: g_hat = 1/(q-1) sum_k (a_k - a_bar) z_k with a_k = g.z_k; expand with C = I - J/q and the
    moments E[a_k^2 ||z_k||^2] = (d+2)||g||^2, E[a_m^2 ||z_k||^2] = d ||g||^2 (m != k), E[a_k a_l z_k.z_l] = ||g||^2
    (k != l), the rest 0: q[((q-1)/q)^2 (d+2) + (q-1) d / q^2] + q(q-1)[((q-1)/q)^2 + 1/q^2] = (q-1)(d+q).
    Checked at eps = 1e-6 with curvature present (its share is O(eps^2)), within 5 standard errors of the sample
    mean of ||g_hat||^2, for q = 2, 3, 8."""
    rng = np.random.default_rng(1)
    d, n = 10, 200_000
    g = rng.standard_normal(d)
    for q in (2, 3, 8):
        sq = (rloo_estimates(g, np.linspace(1.0, 5.0, d), 1e-6, q, n, rng) ** 2).sum(1)
        expected = (d + q) / (q - 1) * (g @ g)
        se = sq.std(ddof=1) / math.sqrt(n)
        assert abs(sq.mean() - expected) < 5 * se, (q, sq.mean(), expected, se)


def forwards_to_target(q, lr, hess, w0, target, rng, max_steps):
    """Forwards until 0.5 w' H w <= target (central with one direction when q = 1, rloo with q), or None."""
    w = w0.copy()
    cost = 2 if q == 1 else q
    for step in range(1, max_steps + 1):
        z = rng.standard_normal((q, w.size))
        g = hess * w
        if q == 1:
            est = (z[0] @ g) * z[0]  # the exact central difference of a quadratic
        else:
            a = z @ g  # the quadratic's curvature term cancels in expectation; left out (eps -> 0)
            est = ((a - (a.sum() - a) / (q - 1))[:, None] * z).mean(0)
        w -= lr * est
        loss = 0.5 * (hess * w * w).sum()
        if not math.isfinite(loss) or loss > 1e6:
            return None
        if loss <= target:
            return step * cost
    return None


def test_rloo_reaches_a_target_with_about_q_over_2_q_minus_1_of_mezos_forwards():
    """(c) A diagonal quadratic (d = 400, curvatures in [1, 2]), from the same start to 1% of the initial loss, each
    arm at its best rate of the grid c / (h_max d) x 2^(k/4), the forwards averaged over 4 seeds. MeZO's over
    RLOO q = 4's is within 5% of 2(q - 1)/q = 1.5 (the large-d limit; docs/algorithm.md). Measured: 3757.5 / 2519 =
    1.492 (MeZO best at 1.41 / (2d), RLOO at 4.0 / (2d), both inside the grid)."""
    d, q = 400, 4
    rng = np.random.default_rng(7)
    hess = np.linspace(1.0, 2.0, d)
    w0 = rng.standard_normal(d)
    target = 0.01 * 0.5 * (hess * w0 * w0).sum()
    grid = [1.0 / (2.0 * d) * 2 ** (k / 4) for k in range(-2, 11)]

    def best(arm_q):
        out = {}
        for lr in grid:
            runs = [forwards_to_target(arm_q, lr, hess, w0, target, np.random.default_rng(100 + s), 200_000)
                    for s in range(4)]
            if all(r is not None for r in runs):
                out[lr] = sum(runs) / len(runs)
        return min(out.values())

    ratio = best(1) / best(q)
    assert abs(ratio / (2 * (q - 1) / q) - 1) < 0.05, ratio


# ------------------------------------------------------------------ the engine


def capture_reduced(engine) -> list[Reduced]:
    seen = []
    real = engine._reduce

    def wrapped(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    engine._reduce = wrapped
    return seen


def directions_of(engine, model_cls, q) -> list[list[torch.Tensor]]:
    """z_k of step 0 for every trainable tensor, read exactly by perturbing zero weights by 1 z_k (float64)."""
    zero = model_cls()
    for p in zero.parameters():
        p.data.zero_()
    other = ZOEngine(zero, quad_loss, engine.cfg)
    plan = other.sampler.plan(0)
    other.perturber.begin(0, plan.mask, q)
    out = []
    for k in range(q):
        other.perturber.perturb(0.0, 1.0, direction=k)
        out.append([p.detach().clone() for p in zero.parameters()])
        other.perturber.perturb(1.0, 0.0, direction=k)
        assert all(torch.equal(p, torch.zeros_like(p)) for p in zero.parameters())
    return out


@pytest.mark.parametrize("method", ["mezo", "curvzo"])
def test_engine_update_equals_the_hand_computation_from_its_losses(method):
    """(d) One step of difference=rloo, q = 3, on the float64 quadratic: the losses the engine reduced are
    L(w + eps z_k), and the weights move by -(lr / q) sum_k (L_k - mean_{j != k} L_j) / eps z_k / pi_i, with z_k
    read from the noise and the coefficient computed here (the rate times min pi, rate_correction's default: 1 for
    MeZO). The step's loss is the mean L_k, loss_plus and
    loss_minus are None, loss_spread is max - min."""
    q, lr, eps = 3, 1e-2, 1e-3
    cfg = ZOConfig(method=method, learning_rate=lr, zo_eps=eps, num_directions=q, difference="rloo",
                   score_warmup_steps=0, score_init=1.0, budget_floor=0.3)
    model = Quadratic()
    engine = ZOEngine(model, quad_loss, cfg)
    seen = capture_reduced(engine)
    w0 = [p.detach().clone() for p in model.parameters()]
    plan = engine.sampler.plan(0)
    zs = directions_of(engine, Quadratic, q)
    r = engine.step(None)
    red = seen[0]
    losses = [lp for lp, _ in red.losses]
    for k in range(q):
        by_hand = sum(0.5 * a * ((w + eps * z) ** 2).sum() for a, w, z in zip(model.curv, w0, zs[k])).item()
        assert losses[k] == pytest.approx(by_hand, rel=1e-14, abs=0)
    assert r.loss == pytest.approx(sum(losses) / q, rel=1e-15) and r.loss_plus is None and r.loss_minus is None
    assert r.loss_spread == max(losses) - min(losses)
    coef = [(losses[k] - (sum(losses) - losses[k]) / (q - 1)) / eps for k in range(q)]
    for i, (w, p) in enumerate(zip(w0, model.parameters())):
        if not plan.mask[i]:
            assert torch.equal(p.detach(), w)
            continue
        expected = w - lr * plan.rate_scale / q * sum(c * z[i] for c, z in zip(coef, zs)) / plan.pi[i].item()
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)
    assert plan.mask.any() and plan.rate_scale == (1.0 if method == "mezo" else plan.pi.min().item())


def test_scores_read_the_scaled_leave_one_out_delta():
    """The scores read sqrt((q-1)/q) Delta_k: with a quadratic loss in which every L_k is known, the square's mean
    over directions is the central Delta's mean ||g||^2 (checked on the Reduced directly)."""
    red = Reduced([(1.0, 1.0), (2.0, 2.0), (4.0, 4.0)], torch.zeros(3), None, False, 0.5, "rloo")
    assert red.deltas == [(1.0 - 3.0) / 0.5, (2.0 - 2.5) / 0.5, (4.0 - 1.5) / 0.5]
    assert red.score_deltas == pytest.approx([math.sqrt(2 / 3) * x for x in red.deltas])
    assert abs(sum(red.deltas)) < 1e-12 and red.loss == 7 / 3 and red.loss_spread == 3.0
    central = Reduced([(1.0, 0.5)], torch.zeros(1), None, False, 0.5)
    assert central.loss_spread is None and central.score_deltas == central.deltas == [0.5]


def test_rloo_restores_w_between_directions_and_lowers_the_loss():
    """Weights are put back exactly after each direction (the snapshot): a zero learning rate leaves them bit for
    bit; with a rate, the quadratic's loss falls."""
    model = Quadratic()
    w0 = [p.detach().clone() for p in model.parameters()]
    engine = ZOEngine(model, quad_loss, ZOConfig(method="mezo", learning_rate=0.0, zo_eps=1e-2, num_directions=4,
                                                 difference="rloo"))
    for _ in range(3):
        engine.step(None)
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), w0))
    engine = ZOEngine(model, quad_loss, ZOConfig(method="mezo", learning_rate=2e-3, zo_eps=1e-3, num_directions=4,
                                                 difference="rloo"))
    first = engine.loss(None)
    for _ in range(100):
        engine.step(None)
    assert engine.loss(None) < 0.5 * first


@pytest.mark.parametrize("q", [0, 1])
def test_rloo_with_one_direction_is_refused_in_one_line(q):
    """(e) rloo needs a second direction for its baseline; the message names the fix."""
    with pytest.raises(ConfigError) as e:
        ZOConfig(difference="rloo", num_directions=q).validate()
    msg = str(e.value)
    assert "\n" not in msg
    assert ("num_directions=0 is invalid" in msg) if q == 0 else ("set num_directions=2 or more" in msg)
    with pytest.raises(ConfigError, match="difference='forward' is invalid"):
        ZOConfig(difference="forward").validate()
