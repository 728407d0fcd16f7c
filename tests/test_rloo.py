"""difference=rloo and step_normalization=loss_std (docs/algorithm.md, "Several directions per step"): q forwards
L_k = L(w + eps z_k) per step and

    g_hat = (1/q) sum_k Delta_k z_k,   Delta_k = (L_k - mean_{j != k} L_j) / eps     (loss_std: (L_k - b_k) / sigma).

Every check drives the project's own estimator (algo.differences.FiniteDifference, the sampler's direction_updates,
or the ZOEngine), so that a wrong sign or a wrong baseline in it fails here: (a) unbiased on a quadratic; (b) its
second moment is (d + q)/(q - 1) ||g||^2 (derived below); (c) forwards to a target against MeZO; (d) the engine's
update is the formula, from its own losses; (e) the config refusals; then loss_std's invariance, direction, floor
and resume.
"""

import math

import numpy as np
import pytest
import torch

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.algo import differences
from curvzo_ds.algo.differences import SIGMA_FLOOR, FiniteDifference, forwards_per_step
from curvzo_ds.algo.sampling import CurvZOSampler
from curvzo_ds.checkpoint.format import load_checkpoint
from curvzo_ds.checkpoint.manager import save_checkpoint
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.comm import Comm
from curvzo_ds.shard.forwards import reduce_step
from tests.toys import Quadratic, quad_loss


def estimates(g, hess_diag, eps, q, n, rng, normalization="none"):
    """n estimates [n, d] of the gradient of f(w) = g.w + 0.5 w' H w at w = 0 (H diagonal, z Gaussian): the
    losses are computed here; Delta_k comes from the project's FiniteDifference and the update's coefficients from
    MeZO's sampler (pi = 1): g_hat = -(update) / lr."""
    d = g.size
    z = rng.standard_normal((n, q, d))
    losses = eps * z @ g + 0.5 * eps**2 * (z**2) @ hess_diag  # [n, q], L(0) = 0 (it cancels anyway)
    estimator = FiniteDifference("rloo", normalization, eps)
    cfg = ZOConfig(method="mezo", learning_rate=1.0)
    sampler = CurvZOSampler(section(cfg, "sampler"), section(cfg, "engine"), torch.ones(1), lambda s, g: torch.zeros(g))
    plan = sampler.plan(0)
    coef = np.empty((n, q))
    for i in range(n):
        deltas = estimator.estimate([(float(x),) for x in losses[i]]).deltas
        coefs, _ = sampler.direction_updates(plan, deltas, 1.0)
        coef[i] = [float(c[0]) for c in coefs]
    return (coef[:, :, None] * z).sum(1)


def test_rloo_is_unbiased_on_a_quadratic():
    """(a) The mean of N estimates is within 5 standard errors of g in every coordinate (the standard error from the
    sample variance: se_i = std_i / sqrt(N)); the curvature term, even in z, has no mean effect. A flipped sign gives
    -g, a baseline that includes L_k gives (q - 1)/q g: both miss by more than 5 standard errors (|g_i| >= 0.8, se
    about 0.02)."""
    rng = np.random.default_rng(0)
    d, q, n = 6, 4, 20_000
    g = np.array([1.2, -0.8, 0.9, -1.5, 1.0, 0.8])
    est = estimates(g, np.linspace(1.0, 30.0, d), 0.1, q, n, rng)
    se = est.std(0, ddof=1) / math.sqrt(n)
    assert np.all(np.abs(est.mean(0) - g) < 5 * se), (est.mean(0), g, se)
    assert np.all(0.25 * np.abs(g) > 5 * se)  # the wrong baseline would be caught


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
    d, n = 10, 10_000
    g = rng.standard_normal(d)
    for q in (2, 3, 8):
        sq = (estimates(g, np.linspace(1.0, 5.0, d), 1e-6, q, n, rng) ** 2).sum(1)
        expected = (d + q) / (q - 1) * (g @ g)
        se = sq.std(ddof=1) / math.sqrt(n)
        assert abs(sq.mean() - expected) < 5 * se, (q, sq.mean(), expected, se)


def forwards_to_target(q, lr, hess, w0, target, rng, max_steps):
    """Forwards until 0.5 w' H w <= target (central with one direction when q = 1, rloo with q), or None. Both arms'
    Delta_k come from the project's FiniteDifference, on the quadratic's exact losses."""
    w = w0.copy()
    eps = 1e-3
    estimator = FiniteDifference("central" if q == 1 else "rloo", "none", eps)
    for step in range(1, max_steps + 1):
        z = rng.standard_normal((q, w.size))
        loss_at = lambda v: 0.5 * float((hess * v * v).sum())  # noqa: E731
        if q == 1:
            losses = [(loss_at(w + eps * z[0]), loss_at(w - eps * z[0]))]
        else:
            losses = [(loss_at(w + eps * zk),) for zk in z]
        deltas = estimator.estimate(losses).deltas
        w -= lr / q * (np.array(deltas)[:, None] * z).sum(0)
        loss = loss_at(w)
        if not math.isfinite(loss) or loss > 1e6:
            return None
        if loss <= target:
            return step * estimator.spec.forwards(q)
    return None


def test_rloo_reaches_a_target_with_about_q_over_2_q_minus_1_of_mezos_forwards():
    """(c) A diagonal quadratic (d = 200, curvatures in [1, 2]), from the same start to 2% of the initial loss, each
    arm at its best rate of the grid c / (h_max d) x 2^(k/4), the forwards averaged over 4 seeds. MeZO's over
    RLOO q = 4's is within 10% of 2(q - 1)/q = 1.5 (the large-d limit, docs/algorithm.md; at d = 200 the ratio's
    spread over 4 seeds is a few per cent)."""
    d, q = 200, 4
    rng = np.random.default_rng(7)
    hess = np.linspace(1.0, 2.0, d)
    w0 = rng.standard_normal(d)
    target = 0.02 * 0.5 * (hess * w0 * w0).sum()
    grid = [1.0 / (2.0 * d) * 2 ** (k / 4) for k in range(0, 11)]

    def best(arm_q):
        out = {}
        for lr in grid:
            runs = [forwards_to_target(arm_q, lr, hess, w0, target, np.random.default_rng(100 + s), 50_000)
                    for s in range(4)]
            if all(r is not None for r in runs):
                out[lr] = sum(runs) / len(runs)
        return min(out.values())

    ratio = best(1) / best(q)
    assert abs(ratio / (2 * (q - 1) / q) - 1) < 0.10, ratio


# ------------------------------------------------------------------ the engine


def capture_losses(engine) -> list:
    """The losses of each step as the engine's all-reduce returned them."""
    seen = []
    real = engine._reduce

    def wrapped(*a, **k):
        red = real(*a, **k)
        seen.append(red.losses)
        return red

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


@pytest.mark.parametrize("method", ["mezo", "curvzo", "mezo-loss_std"])
def test_engine_update_equals_the_hand_computation_from_its_losses(method):
    """(d) One step of difference=rloo, q = 3, on the float64 quadratic: the losses the engine reduced are
    L(w + eps z_k), and the weights move by -(lr / q) sum_k c_k z_k / pi_i with c_k = (L_k - mean_{j != k} L_j) / eps
    (loss_std: divided by the losses' standard deviation instead of eps), z_k read from the noise and c_k computed
    here (the rate times min pi, rate_correction's default: 1 for MeZO). The step's loss is the mean L_k,
    loss_plus and loss_minus are None, loss_spread is max - min, loss_std the standard deviation."""
    q, lr, eps = 3, 1e-2, 1e-3
    method, _, normalization = method.partition("-")
    cfg = ZOConfig(method=method, learning_rate=lr, zo_eps=eps, num_directions=q, difference="rloo",
                   step_normalization=normalization or "none", score_warmup_steps=0, score_init=1.0,
                   budget_floor=0.3)
    model = Quadratic()
    engine = ZOEngine(model, quad_loss, cfg)
    seen = capture_losses(engine)
    w0 = [p.detach().clone() for p in model.parameters()]
    plan = engine.sampler.plan(0)
    zs = directions_of(engine, Quadratic, q)
    r = engine.step(None)
    losses = [lk for (lk,) in seen[0]]
    for k in range(q):
        by_hand = sum(0.5 * a * ((w + eps * z) ** 2).sum() for a, w, z in zip(model.curv, w0, zs[k])).item()
        assert losses[k] == pytest.approx(by_hand, rel=1e-14, abs=0)
    assert r.loss == pytest.approx(sum(losses) / q, rel=1e-15) and r.loss_plus is None and r.loss_minus is None
    assert r.loss_spread == max(losses) - min(losses)
    mean = sum(losses) / q
    sigma = math.sqrt(sum((x - mean) ** 2 for x in losses) / (q - 1))
    scale = sigma if normalization else eps
    assert r.loss_std == (pytest.approx(sigma, rel=1e-12) if normalization else None)
    coef = [(losses[k] - (sum(losses) - losses[k]) / (q - 1)) / scale for k in range(q)]
    for i, (w, p) in enumerate(zip(w0, model.parameters())):
        if not plan.mask[i]:
            assert torch.equal(p.detach(), w)
            continue
        expected = w - lr * plan.rate_scale / q * sum(c * z[i] for c, z in zip(coef, zs)) / plan.pi[i].item()
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12 * max(1.0, lr / scale))
    assert plan.mask.any() and plan.rate_scale == (1.0 if method == "mezo" else plan.pi.min().item())


def test_scores_read_the_scaled_leave_one_out_delta():
    """The scores read sqrt((q-1)/q) Delta_k, whose square's mean over directions is the central Delta's mean
    ||g||^2; loss_std changes the update's coefficients, not what the scores read."""
    losses = [(1.0,), (2.0,), (4.0,)]
    est = FiniteDifference("rloo", "none", 0.5).estimate(losses)
    assert est.deltas == [(1.0 - 3.0) / 0.5, (2.0 - 2.5) / 0.5, (4.0 - 1.5) / 0.5]
    assert est.score_deltas == pytest.approx([math.sqrt(2 / 3) * x for x in est.deltas])
    assert abs(sum(est.deltas)) < 1e-12 and est.loss == 7 / 3 and est.loss_spread == 3.0 and est.loss_std is None
    normed = FiniteDifference("rloo", "loss_std", 0.5).estimate(losses)
    sigma = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert normed.loss_std == pytest.approx(sigma) and normed.score_deltas == est.score_deltas
    assert normed.deltas == pytest.approx([x * 0.5 / sigma for x in est.deltas])
    central = FiniteDifference("central", "none", 0.5).estimate([(1.0, 0.5)])
    assert central.loss_spread is None and central.score_deltas == central.deltas == [0.5]
    assert central.loss_plus == 1.0 and central.loss_minus == 0.5 and central.loss == 0.75


def test_rloo_lowers_the_loss_and_a_zero_rate_changes_the_weights_only_by_the_moves():
    """With a rate, the quadratic's loss falls; at a zero rate the weights come back to w within a few ulps per
    step (the perturbation is put back, exactly or by a move whose rounding is an ulp)."""
    model = Quadratic()
    w0 = [p.detach().clone() for p in model.parameters()]
    engine = ZOEngine(model, quad_loss, ZOConfig(method="mezo", learning_rate=0.0, zo_eps=1e-2, num_directions=4,
                                                 difference="rloo"))
    for _ in range(3):
        engine.step(None)
    for p, w in zip(model.parameters(), w0):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-15)
    engine = ZOEngine(model, quad_loss, ZOConfig(method="mezo", learning_rate=2e-3, zo_eps=1e-3, num_directions=4,
                                                 difference="rloo"))
    first = engine.loss(None)
    for _ in range(100):
        engine.step(None)
    assert engine.loss(None) < 0.5 * first


def test_a_step_has_the_forwards_its_spec_names():
    """DIFFERENCE_SPECS is the one count of a step's forwards: central 2 q, rloo q, and the engine runs as many."""
    assert [forwards_per_step("central", q) for q in (1, 4)] == [2, 8]
    assert [forwards_per_step("rloo", q) for q in (2, 8)] == [2, 8]
    for difference, q in (("central", 2), ("rloo", 3)):
        calls = []
        engine = ZOEngine(Quadratic(), lambda m, b, calls=calls: (calls.append(1), quad_loss(m, b))[1],
                          ZOConfig(method="mezo", difference=difference, num_directions=q))
        engine.step(None)
        assert len(calls) == forwards_per_step(difference, q)


def test_a_spec_with_three_points_per_direction_reduces_each_loss(monkeypatch):
    """The step's all-reduce carries as many losses per direction as the spec has points: a spec evaluating at
    +eps, w and -eps (q = 2) gets three distinct losses per direction in its order, L(w + eps z_k) and
    L(w - eps z_k) those of the central spec, the middle one L(w); a direction packed with fewer rows than the
    spec's points is refused."""
    seen = []

    def record(losses, eps):
        seen.append(losses)
        return differences.central([(lp, lm) for lp, _, lm in losses], eps)

    def run(spec):
        monkeypatch.setitem(differences.DIFFERENCE_SPECS, differences.Difference.CENTRAL, spec)
        model = Quadratic()
        engine = ZOEngine(model, quad_loss, ZOConfig(method="mezo", learning_rate=1e-2, zo_eps=1e-2,
                                                     num_directions=2))
        start = engine.loss(None)
        reduced = capture_losses(engine)
        engine.step(None)
        return start, reduced[0], [p.detach().clone() for p in model.parameters()]

    central = differences.DIFFERENCE_SPECS[differences.Difference.CENTRAL]
    _, two, w_two = run(central)
    start, three, w_three = run(central._replace(offsets=(1, 0, -1), estimate=record))
    assert seen == [three] and [len(x) for x in three] == [3, 3]
    for (lp, lm), (lp3, mid, lm3) in zip(two, three):
        assert lp3 == pytest.approx(lp, rel=1e-12) and lm3 == pytest.approx(lm, rel=1e-12)
        assert mid == pytest.approx(start, rel=1e-12)
        assert len({lp3, mid, lm3}) == 3
    for a, b in zip(w_two, w_three):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    row = torch.tensor([1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="direction 0: 2 evaluations, the estimator has 3 points"):
        reduce_step(Comm(None), [(0, None, [[(0, row)], [(0, row)]])], 1, directions=1, evaluations=3)


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


def test_loss_std_needs_rloo_and_a_known_name():
    for bad, match in ((dict(step_normalization="loss_std"), "step_normalization=loss_std needs difference=rloo"),
                       (dict(step_normalization="std", difference="rloo", num_directions=4),
                        "step_normalization='std' is invalid: it must be none or loss_std")):
        with pytest.raises(ConfigError, match=match) as e:
            ZOConfig(**bad).validate()
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ loss_std through the engine


def std_engine(model, loss_fn, **kw):
    cfg = dict(method="mezo", learning_rate=1e-2, zo_eps=1e-3, num_directions=4, difference="rloo",
               step_normalization="loss_std")
    return ZOEngine(model, loss_fn, ZOConfig(**{**cfg, **kw}))


def test_loss_std_update_is_invariant_to_an_affine_loss():
    """L -> a L + b (a > 0) leaves the engine's update the same: 5 steps with quad_loss and with 7 quad_loss - 3 end
    at the same weights (float64: within 1e-12 of each other, the rounding of the rescaled losses)."""
    ends = []
    for a, b in ((1.0, 0.0), (7.0, -3.0)):
        model = Quadratic()
        engine = std_engine(model, lambda m, batch, a=a, b=b: (a * m() + b, 1))
        for _ in range(5):
            engine.step(None)
        ends.append([p.detach().clone() for p in model.parameters()])
    moved = sum(float((x - w.detach()).abs().max()) for x, w in zip(ends[0], Quadratic().parameters()))
    assert moved > 1e-4  # the steps did move the weights
    for x, y in zip(*ends):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_loss_std_expected_update_is_parallel_to_the_gradient():
    """Monte Carlo through the engine on the quadratic: the mean of N one-step updates from the same w (the weights
    put back after each; each step draws new noise) is parallel to the gradient: its component orthogonal to g is
    within 5 standard errors of 0, and its component along g is positive and larger than 10 standard errors."""
    model = Quadratic()
    w0 = [p.detach().clone() for p in model.parameters()]
    g = torch.cat(model.grad())
    engine = std_engine(model, quad_loss, learning_rate=1e-3)
    n = 1000
    updates = torch.empty(n, g.numel(), dtype=torch.float64)
    for t in range(n):
        engine.step(None)
        updates[t] = torch.cat([w - p.detach() for p, w in zip(model.parameters(), w0)])
        with torch.no_grad():
            for p, w in zip(model.parameters(), w0):
                p.copy_(w)
    unit = g / g.norm()
    along = updates @ unit
    across = updates - along[:, None] * unit
    se_along = along.std() / math.sqrt(n)
    assert along.mean() > 10 * se_along
    se_across = across.std(0) / math.sqrt(n)
    assert bool((across.mean(0).abs() < 5 * se_across + 1e-15).all()), (across.mean(0), se_across)


def test_loss_std_floor_gives_a_finite_step_on_equal_losses():
    """Equal losses (a constant loss): sigma 0 gives no step and no NaN; after steps with a running mean of sigma,
    the floor (SIGMA_FLOOR of it) keeps the step finite (and 0, since L_k - b_k is 0)."""
    est = FiniteDifference("rloo", "loss_std", 1e-3)
    first = est.estimate([(2.0,)] * 4)
    assert first.deltas == [0.0] * 4 and first.loss_std == 0.0 and first.finite
    est.estimate([(1.0,), (2.0,), (3.0,), (4.0,)])
    mean = est.sigma_mean
    again = est.estimate([(2.0,)] * 4)
    assert again.finite and again.deltas == [0.0] * 4 and est.sigma_mean == pytest.approx(0.9 * mean)
    assert SIGMA_FLOOR * est.sigma_mean > 0
    model = Quadratic()
    w0 = [p.detach().clone() for p in model.parameters()]
    engine = std_engine(model, lambda m, batch: (torch.tensor(1.5, dtype=torch.float64), 1))
    r = engine.step(None)
    assert r.skipped is None and r.loss_std == 0.0 and r.projected_grad == 0.0
    for p, w in zip(model.parameters(), w0):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-15)


def test_loss_std_floor_bounds_the_step_when_the_losses_barely_differ():
    """Unequal losses whose spread is below the floor: after a step with sigma about 1.3, losses 1e-9 apart have
    sigma about 1e-9, far below SIGMA_FLOOR times the running mean (about 1.3e-3). The coefficients are
    (L_k - b_k) / floor, about 1e-6, not (L_k - b_k) / sigma, of order 1 (which is what an unfloored step gives)."""
    est = FiniteDifference("rloo", "loss_std", 1e-3)
    est.estimate([(1.0,), (2.0,), (3.0,), (4.0,)])
    floor = SIGMA_FLOOR * est.sigma_mean
    losses = [2.0, 2.0 + 1e-9, 2.0 + 3e-9, 2.0 + 4e-9]
    step = est.estimate([(x,) for x in losses])
    assert 0 < step.loss_std < 1e-5 * floor
    q, total = len(losses), sum(losses)
    expected = [(x - (total - x) / (q - 1)) / floor for x in losses]
    assert step.deltas == pytest.approx(expected, rel=1e-6)
    assert max(abs(x) for x in step.deltas) < 1e-5


def test_loss_std_resume_is_exact(tmp_path):
    """The running mean of sigma is saved in the checkpoint: 3 steps, a checkpoint, 3 more steps give the same
    weights bit for bit as a fresh engine loaded from the checkpoint that runs the last 3."""
    model = Quadratic()
    engine = std_engine(model, quad_loss)
    for _ in range(3):
        engine.step(None)
    path = save_checkpoint(engine, str(tmp_path))
    saved_sigma = engine.estimator.sigma_mean
    assert engine.state_dict()["sigma_mean"] == saved_sigma > 0
    for _ in range(3):
        engine.step(None)
    fresh = Quadratic()
    other = std_engine(fresh, quad_loss)
    load_checkpoint(other, path)
    assert other.estimator.sigma_mean == saved_sigma and other.step_count == 3
    for _ in range(3):
        other.step(None)
    for p, w in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p.detach(), w.detach())
