"""Issue 47's metrics (experiments/verdict.py) on made-up curves with known answers: no training, milliseconds."""

import math

import numpy as np
import pytest

from experiments import verdict as V

F = np.arange(0, 401, 40, dtype=float)  # the protocol's evaluation points


def power_law(f, scale=1.0):
    """log loss of loss = 0.7 (1 + f/40)^-0.8 at forwards f / scale: a MeZO-like curve whose tail is a power law."""
    return np.log(0.7) - 0.8 * np.log1p(np.asarray(f, dtype=float) / scale / 40)


def pure_power(f, scale=1.0):
    """Exactly linear in log-log for f > 0 (so log-log interpolation and extrapolation are exact), 0.7 at 0."""
    f = np.asarray(f, dtype=float) / scale
    return np.where(f > 0, np.log(2.0) - 0.5 * np.log(np.where(f > 0, f, 1.0)), np.log(0.7))


def seeds(curve, n=8, sd=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return curve[None, :] + sd * rng.standard_normal((n, len(curve)))


def test_tail_is_the_last_40_percent_of_forwards():
    assert F[V.tail_mask(F)].tolist() == [240, 280, 320, 360, 400]
    losses = np.exp(power_law(F))
    assert V.tail_mean(F, losses) == pytest.approx(power_law(F)[6:].mean())
    assert V.tail_mean(F, [*losses[:-1], float("nan")]) == math.inf  # a diverged point
    assert V.tail_mean(F, losses[:8]) == math.inf  # a run that stopped early: the missing points count as +inf


def test_identical_curves_give_a_factor_of_one():
    y = seeds(power_law(F), sd=0.01)
    r = V.warp(F, y, F, y)
    assert r["factor"] == pytest.approx(1.0, abs=1e-12) and not r["extrapolated"]
    boot = V.warp_bootstrap(F, y, F, y, resamples=500)
    assert boot["low"] < 1 < boot["high"]  # the resamples differ, the point is inside


def test_a_curve_warped_by_0_6_gives_0_6():
    """The arm's curve is MeZO's read at f / 0.6: it goes below MeZO's lowest point, so MeZO's curve is extended by
    its tail's log-log slope (exact for a power law) and the figure is flagged."""
    mezo, arm = seeds(pure_power(F)), seeds(pure_power(F, 0.6))
    r = V.warp(F, arm, F, mezo)
    assert r["factor"] == pytest.approx(0.6, rel=1e-9)
    assert np.allclose(r["per_point"], 0.6) and r["extrapolated"] and not r["capped"]
    boot = V.warp_bootstrap(F, arm, F, mezo, resamples=200)
    assert boot["low"] == pytest.approx(0.6) and boot["high"] == pytest.approx(0.6) and boot["extrapolated"] == 1.0
    assert V.fewer_forwards(boot["high"])


def test_a_smooth_curve_warped_inside_mezos_range():
    """A slower arm (x1.5, its tail read at 160-267 forwards of MeZO's curve), on a curve that is not a power law:
    log-log interpolation between points 20 forwards apart gives the warp to 1%, with no extrapolation."""
    fine = np.arange(0, 401, 20, dtype=float)
    curve = lambda f: np.log(0.1 + 0.6 * np.exp(-np.asarray(f) / 150))  # noqa: E731
    r = V.warp(F, seeds(curve(F / 1.5)), fine, seeds(curve(fine)))
    assert r["factor"] == pytest.approx(1.5, rel=0.01) and not r["extrapolated"]
    assert not V.fewer_forwards(r["factor"])


def test_noisy_seeds_warped_by_0_6_are_found_and_the_interval_covers_it():
    mezo = seeds(power_law(F), sd=0.02, seed=1)
    arm = seeds(power_law(F, 0.6), sd=0.02, seed=2)
    r = V.warp(F, arm, F, mezo)
    assert r["factor"] == pytest.approx(0.6, abs=0.1)
    boot = V.warp_bootstrap(F, arm, F, mezo)
    assert boot["low"] < 0.6 < boot["high"] and boot["resamples"] == V.RESAMPLES
    assert V.warp_bootstrap(F, arm, F, mezo) == boot  # a fixed RNG seed: the same interval every time


def test_invert_flags_start_interpolation_extrapolation_and_cap():
    y = np.log([0.7, 0.5, 0.4, 0.35, 0.34, 0.33])
    f = np.array([0, 40, 80, 120, 160, 200], dtype=float)
    F_, how = V.invert(f, y, np.log([0.8, 0.6, 0.45, 0.3]), total=200)
    assert how[0].tolist() == [3, 0, 0, 1] and F_[0, 0] == 0
    # between 0 and the first point: log loss linear in forwards
    assert F_[0, 1] == pytest.approx(40 * (math.log(0.7) - math.log(0.6)) / (math.log(0.7) - math.log(0.5)))
    # between 40 and 80: log loss linear in log forwards
    w = (math.log(0.5) - math.log(0.45)) / (math.log(0.5) - math.log(0.4))
    assert F_[0, 2] == pytest.approx(math.exp(math.log(40) + w * math.log(2)))
    assert F_[0, 3] > 200
    flat = np.log([0.7, 0.5, 0.4, 0.4, 0.4, 0.4])  # a flat tail: MeZO would never get lower
    F_, how = V.invert(f, flat, np.log([0.39]), total=200)
    assert how.tolist() == [[2]] and F_[0, 0] == V.CAP * 200
    r = V.warp(f, seeds(np.log([0.7, 0.5, 0.4, 0.39, 0.38, 0.37])), f, seeds(flat), total=200)
    assert r["capped"] and r["extrapolated"]


def test_a_diverged_arm_never_shows_fewer_forwards():
    mezo = seeds(power_law(F))
    arm = seeds(power_law(F, 0.5))
    arm[3, 7:] = np.inf  # one seed diverged at 280 forwards
    r = V.warp(F, arm, F, mezo)
    assert r["factor"] == math.inf
    boot = V.warp_bootstrap(F, arm, F, mezo, resamples=300)
    assert boot["high"] == math.inf and not V.fewer_forwards(boot["high"])


def test_welch_matches_scipy():
    from scipy import stats

    a, b = [0.1, 0.3, 0.25, 0.4, 0.2], [0.5, 0.45, 0.7, 0.6, 0.52, 0.58, 0.66]
    w = V.welch(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert w["diff"] == pytest.approx(np.mean(a) - np.mean(b))
    assert (w["low"], w["high"]) == pytest.approx((ci.low, ci.high), rel=1e-12)
    # by hand: se² = var(a)/5 + var(b)/7, Welch-Satterthwaite df
    va, vb = np.var(a, ddof=1) / 5, np.var(b, ddof=1) / 7
    assert w["df"] == pytest.approx((va + vb) ** 2 / (va ** 2 / 4 + vb ** 2 / 6))
    assert V.welch([1.0, math.inf], b)["diff"] == math.inf and math.isnan(V.welch([1.0, math.inf], b)["low"])
    one = V.welch([0.3], b)  # one seed a side: a difference, no interval (not a zero-width one)
    assert one["diff"] == pytest.approx(0.3 - np.mean(b)) and math.isnan(one["low"]) and math.isnan(one["high"])


def test_the_rule_and_issue_37s_column():
    assert V.fewer_forwards(0.75) and not V.fewer_forwards(0.7500001)
    mezo = np.exp(power_law(F))
    run = np.exp(power_law(F, 0.6))
    assert V.forwards_to_final(F, run, F, mezo) == (240.0, 400.0)
    assert V.forwards_to_final(F, mezo * 2, F, mezo) == (None, 400.0)
    assert V.forwards_to_final_summary([(240.0, 400.0), (None, 400.0), (320.0, 400.0)]) == "median x0.80 (2/3 reach)"


def test_percentile_keeps_infinities():
    assert V.percentile([1.0, 2.0, math.inf, math.inf], [0, 100]).tolist() == [1.0, math.inf]
    assert V.percentile([1.0, float("nan")], [100]).tolist() == [math.inf]
    # 97.5% of 40 values, one infinite: between the 39th (finite) and the infinite one, so infinite, not 2.5e298
    assert V.percentile([0.1] * 39 + [math.inf], [2.5, 97.5]).tolist() == [0.1, math.inf]


def test_the_dev_subset_is_fixed():
    idx = V.dev_subset(256)
    assert idx == V.dev_subset(256) == sorted(idx) and len(set(idx)) == 64 and max(idx) < 256
    assert V.dev_subset(10) == list(range(10))


def test_the_time_warp_that_never_extrapolates_reads_a_known_warp():
    """Issue 57's factor: MeZO's log loss falls linearly in forwards; an arm whose curve is MeZO's at twice the
    forwards reaches each of MeZO's targets at half the forwards (0.5, exactly: both curves are linear between their
    points); MeZO against itself is 1; an arm that stops improving never reaches the late targets (+inf), and one
    that reaches none is refused. Nothing past the arm's own last point is read."""
    f = np.arange(0, 401, 40, dtype=float)
    mezo = np.tile(-f / 400, (3, 1))  # log loss from 0 to -1
    grid = list(range(200, 401, 40))
    fast = np.tile(-np.minimum(2 * f / 400, 2.0), (3, 1))
    assert V.warp_interpolated(f, fast, f, mezo, grid, resamples=50)["factor"] == pytest.approx(0.5)
    same = V.warp_interpolated(f, mezo, f, mezo, grid, resamples=50)
    assert same["factor"] == pytest.approx(1.0) and same["reached"] == same["points"] == 6
    stalls = np.tile(-np.minimum(f / 400, 0.6), (3, 1))  # reaches MeZO's -0.5 and -0.6, never -0.7 and below
    r = V.warp_interpolated(f, stalls, f, mezo, grid, resamples=50)
    assert r["factor"] == math.inf and r["reached"] == 2 and r["high"] == math.inf
    flat = np.zeros((3, len(f)))
    assert V.warp_interpolated(f, flat, f, mezo, grid, resamples=50)["factor"] is None
