"""Issue 47's metrics for "does an arm need fewer forwards than MeZO?", from dev-loss curves over seeds.

A curve is (forwards, losses): the dev loss at evaluation points, forwards[0] == 0 (the weights before training).
Every figure works on log losses; a non-finite loss (a diverged run, or a point after the run stopped) counts as +inf.

Primary: the **tail mean**, per run the mean log dev loss over the evaluation points in the last 40% of the run's
forwards ([240, 400] for 400 forwards); across seeds, the arm's mean minus MeZO's with a Welch 95% interval (`welch`).

Secondary: the **time-warp factor** (`warp`). At an evaluation point f of the tail, t = the arm's mean (over seeds) log
dev loss at f; F(t) = the forward count at which MeZO's mean log dev loss curve first equals t (`invert`); the point's
factor is f / F(t) (below 1: the arm needs fewer forwards than MeZO to that loss). The run's factor is the geometric
mean of the per-point factors over the tail points (the mean of their logs): every tail point weighs the same, and a
constant warp (the arm's curve is MeZO's with its forward axis scaled by k) gives k at every point, so the mean gives
k exactly. MeZO's curve is linear in log loss against log forwards between its evaluation points (and linear in
forwards between 0 and its first point). Where the arm goes below MeZO's lowest point, MeZO's curve is extended from
that point with its log-log slope over its own tail points (least squares), and the figure is flagged as
extrapolated; where that slope is not negative, or the extension would pass `CAP` times the run's forwards, F is
capped there and flagged. Its interval: a bootstrap over seeds (`warp_bootstrap`: each arm's seeds resampled with
replacement, both mean curves and the factor recomputed; percentile interval; `RESAMPLES` resamples from a fixed
RNG seed).

Kept as an extra column: issue 37's **forwards to MeZO's final dev loss** (`forwards_to_final`), per seed paired with
MeZO's run of the same seed, at the evaluation points.

The decision rule (`fewer_forwards`): an arm shows "fewer forwards than MeZO" on a task iff the upper 95% bound of
its time-warp factor is <= 0.75.
"""

from __future__ import annotations

import math

import numpy as np

TAIL = 0.4  # the last 40% of a run's forwards
CAP = 10.0  # an extrapolated MeZO forward count stops at CAP x the run's forwards
RESAMPLES = 2000
RNG_SEED = 47
THRESHOLD = 0.75  # the decision rule's bound on the time-warp factor's upper 95% limit
SUBSET, SUBSET_SEED = 64, 47  # the protocol's fixed dev subset: its size and the seed that draws it


def dev_subset(n_dev: int, size: int = SUBSET, seed: int = SUBSET_SEED) -> list[int]:
    """The indices of the fixed dev subset, the same for every run: the first `size` entries of a permutation of
    range(n_dev) drawn by numpy's default_rng(seed), in increasing order (the dev set itself is fixed by its task's
    generator, so the subset is the same examples in every run)."""
    return sorted(int(i) for i in np.random.default_rng(seed).permutation(n_dev)[:min(size, n_dev)])


def add_dev_subset(run, name: str = "dev-subset", size: int = SUBSET, seed: int = SUBSET_SEED) -> list[int]:
    """Put the fixed dev subset into `run`'s evaluator (a PlainRun) as the split `name`, and return its positions in
    the run's dev list. The run's dev list is its task's dev set in an order drawn by the run's seed, so the subset is
    chosen by example, not by position: `dev_subset` indexes the dev examples sorted by their JSON text (an order no
    seed changes), and each chosen example is taken from the run's list (duplicates one for one)."""
    import json

    from curvzo_ds.config.sections import section
    from curvzo_ds.tasks.splits import load_splits

    data_cfg = section(run.cfg, "data")
    drawn = load_splits(run.task, run.cfg.seed, data_cfg.num_train, data_cfg.num_dev, data_cfg.num_eval,
                        data_cfg.data_dir)["dev"]
    dev = run.eval_data["dev"]
    assert len(drawn) == len(dev), "the dev examples do not match the run's encoded dev list"
    keys = [json.dumps(ex, sort_keys=True) for ex in drawn]
    canonical = sorted(keys)
    free: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        free.setdefault(k, []).append(i)
    positions = sorted(free[canonical[i]].pop(0) for i in dev_subset(len(canonical), size, seed))
    run.add_split(name, [dev[i] for i in positions])
    return positions


def log_losses(losses, length: int | None = None) -> np.ndarray:
    """log of each loss, +inf where a loss is missing, non-finite or <= 0; padded with +inf to `length` (a run that
    stopped at a divergence has a shorter curve)."""
    out = np.array([math.log(x) if x is not None and math.isfinite(x) and x > 0 else math.inf for x in losses])
    if length is not None and len(out) < length:
        out = np.concatenate([out, np.full(length - len(out), math.inf)])
    return out


def tail_mask(forwards, total: float | None = None, fraction: float = TAIL) -> np.ndarray:
    """The evaluation points in the last `fraction` of `total` forwards (default: the last point's forwards)."""
    f = np.asarray(forwards, dtype=float)
    total = f[-1] if total is None else total
    return f >= (1 - fraction) * total - 1e-9


def tail_mean(forwards, losses, total: float | None = None) -> float:
    """A run's mean log dev loss over its tail points (+inf if any of them is not finite)."""
    y = log_losses(losses, len(forwards))
    tail = y[tail_mask(forwards, total)]
    return float(tail.mean()) if np.isfinite(tail).all() else math.inf


def welch(a, b, level: float = 0.95) -> dict:
    """mean(a) - mean(b) with its Welch interval (unequal variances, Welch-Satterthwaite degrees of freedom).
    With a non-finite value in a or b, or one value on a side, the difference is that of the means and the interval is
    not computed (nan)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    out = dict(diff=math.nan, low=math.nan, high=math.nan, df=math.nan, se=math.nan, n=(len(a), len(b)))
    if not np.isfinite(a).all() or not np.isfinite(b).all():
        out["diff"] = math.inf if np.isfinite(b).all() else -math.inf if np.isfinite(a).all() else math.nan
        return out
    diff = out["diff"] = float(a.mean() - b.mean())
    if min(len(a), len(b)) < 2:
        return out
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se > 0 else math.inf
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se if se > 0 else 0.0
    out.update(low=diff - half, high=diff + half, df=float(df), se=se)
    return out


def _tail_slope(f: np.ndarray, y: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Least-squares slope of y (rows) on log f over the tail points (f > 0)."""
    keep = tail & (f > 0)
    x = np.log(f[keep])
    x = x - x.mean()
    yy = y[:, keep]
    with np.errstate(invalid="ignore"):
        return (yy - yy.mean(1, keepdims=True)) @ x / (x @ x)


def invert(f, y, t, total: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """F: for each row r of y (mean log-loss curves on forwards f, f[0] == 0) and each target t[r, p], the forward
    count at which curve r first equals t[r, p]; and `how` (same shape): 0 interpolated, 1 extrapolated beyond the
    curve's lowest point by its tail's log-log slope, 2 capped at CAP x total, 3 at the start (t >= y[r, 0]: F = 0).
    Non-finite values propagate: an extrapolation from a curve with a non-finite tail gives nan."""
    f = np.asarray(f, dtype=float)
    y = np.atleast_2d(np.asarray(y, dtype=float))
    t = np.asarray(t, dtype=float).reshape(y.shape[0], -1)
    assert f[0] == 0 and np.all(np.diff(f) > 0), "forwards must start at 0 and increase"
    total = f[-1] if total is None else total
    below = y[:, None, :] <= t[:, :, None]  # (R, P, T)
    hit = below.any(-1)
    j = below.argmax(-1)
    jm = np.maximum(j - 1, 0)
    y_lo, y_hi = np.take_along_axis(y, jm, 1), np.take_along_axis(y, j, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(y_lo > y_hi, (y_lo - t) / (y_lo - y_hi), 0.0)
        logf = np.log(np.where(f > 0, f, 1.0))
        linear = f[jm] + frac * (f[j] - f[jm])
        loglin = np.exp(logf[jm] + frac * (logf[j] - logf[jm]))
    out = np.where(jm == 0, linear, loglin)
    how = np.zeros(t.shape, dtype=int)
    out = np.where(hit & (j == 0), 0.0, out)
    how[hit & (j == 0)] = 3
    # Below the curve's lowest point: extend it from that point by the tail's log-log slope.
    slope = _tail_slope(f, y, tail_mask(f, total))
    low = np.argmin(np.where(np.isfinite(y), y, np.inf), 1)
    y_min, f_min = y[np.arange(len(y)), low], f[low]
    cap = CAP * total
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ext = f_min[:, None] * np.exp((t - y_min[:, None]) / slope[:, None])
    steep = (slope < 0)[:, None]
    ext = np.where(steep, np.minimum(ext, cap), cap)
    ext = np.where(np.isnan(slope)[:, None] | ~np.isfinite(y_min)[:, None], np.nan, ext)
    capped = ~steep | (ext >= cap)
    out = np.where(hit, out, ext)
    how = np.where(hit, how, np.where(capped, 2, 1))
    return out, how


def mean_curve(curves: np.ndarray) -> np.ndarray:
    """Mean over seeds (rows) of log-loss curves; +inf where any seed is +inf."""
    return np.asarray(curves, dtype=float).mean(0)


def warp_from_means(f_arm, y_arm, f_mezo, y_mezo, total: float | None = None) -> dict:
    """The time-warp factor of mean curves: rows of y_arm and y_mezo are paired (one bootstrap resample each)."""
    f_arm = np.asarray(f_arm, dtype=float)
    y_arm = np.atleast_2d(y_arm)
    y_mezo = np.atleast_2d(y_mezo)
    total = f_arm[-1] if total is None else total
    tail = tail_mask(f_arm, total)
    t = y_arm[:, tail]
    F, how = invert(f_mezo, y_mezo, t, total)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(F > 0, f_arm[tail][None, :] / np.where(F > 0, F, 1.0), np.inf)
        k = np.where(np.isnan(F) | np.isnan(t), np.nan, k)
        factor = np.exp(np.log(k).mean(1))
    return dict(factor=factor, per_point=k, how=how, forwards=f_arm[tail])


def warp(f_arm, arm_curves, f_mezo, mezo_curves, total: float | None = None) -> dict:
    """The time-warp factor of an arm's seeds (rows of arm_curves, log losses on f_arm) against MeZO's seeds:
    factor, per-point factors, and the flags `extrapolated` (some point lies below MeZO's lowest mean point) and
    `capped` (some point's MeZO forward count was capped)."""
    r = warp_from_means(f_arm, mean_curve(arm_curves)[None], f_mezo, mean_curve(mezo_curves)[None], total)
    return dict(factor=float(r["factor"][0]), per_point=r["per_point"][0].tolist(), forwards=r["forwards"].tolist(),
                extrapolated=bool((r["how"] == 1).any() | (r["how"] == 2).any()), capped=bool((r["how"] == 2).any()))


def warp_bootstrap(f_arm, arm_curves, f_mezo, mezo_curves, total: float | None = None, resamples: int = RESAMPLES,
                   seed: int = RNG_SEED, level: float = 0.95) -> dict:
    """Percentile bootstrap interval of the time-warp factor over seeds: each arm's seeds (rows) resampled with
    replacement, `resamples` times from numpy's default_rng(seed). A resample whose factor is undefined (nan: a
    diverged MeZO seed) counts as +inf, so it can only raise the upper bound. Also the share of resamples that were
    extrapolated."""
    arm_curves, mezo_curves = np.asarray(arm_curves, dtype=float), np.asarray(mezo_curves, dtype=float)
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(arm_curves), (resamples, len(arm_curves)))
    im = rng.integers(0, len(mezo_curves), (resamples, len(mezo_curves)))
    r = warp_from_means(f_arm, arm_curves[ia].mean(1), f_mezo, mezo_curves[im].mean(1), total)
    low, high = percentile(r["factor"], [50 * (1 - level), 50 * (1 + level)])
    return dict(low=float(low), high=float(high), resamples=resamples, seed=seed,
                extrapolated=float(((r["how"] == 1) | (r["how"] == 2)).any(1).mean()))


def reach(f, y, targets) -> np.ndarray:
    """For each row r of y (mean log-loss curves on forwards f) and each target t[r, p], the forwards at which curve r
    first reaches t[r, p], linear in log loss between its evaluation points, and +inf where it never does within f:
    nothing is extrapolated (issue 57)."""
    f = np.asarray(f, dtype=float)
    y = np.atleast_2d(np.asarray(y, dtype=float))
    t = np.asarray(targets, dtype=float).reshape(y.shape[0], -1)
    below = y[:, None, :] <= t[:, :, None]
    hit, j = below.any(-1), below.argmax(-1)
    jm = np.maximum(j - 1, 0)
    y_lo, y_hi = np.take_along_axis(y, jm, 1), np.take_along_axis(y, j, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(y_lo > y_hi, (y_lo - t) / (y_lo - y_hi), 0.0)
    out = np.where(j == 0, f[0], f[jm] + frac * (f[j] - f[jm]))
    return np.where(hit, out, np.inf)


def warp_interpolated_from_means(f_arm, y_arm, f_mezo, y_mezo, grid) -> np.ndarray:
    """The time-warp factor that never extrapolates (issue 57), per row pair of mean curves: for each F of `grid`
    (points of MeZO's curve), MeZO's mean log loss at F is the target and the arm's mean curve's first forwards to
    it (`reach`) over F is the point's factor; the factor is their geometric mean. A point whose target is at or
    above the arm's starting loss (MeZO has not improved there: every arm reaches it at 0 forwards) says nothing and
    is left out; an arm that never reaches a target within its own forwards has factor +inf there, and so does a
    non-finite MeZO target (a diverged seed). nan when no point is left."""
    f_mezo = np.asarray(f_mezo, dtype=float)
    grid = np.asarray(grid, dtype=float)
    y_arm = np.atleast_2d(np.asarray(y_arm, dtype=float))
    idx = [int(np.flatnonzero(np.isclose(f_mezo, g))[0]) for g in grid]
    targets = np.atleast_2d(y_mezo)[:, idx]
    with np.errstate(invalid="ignore", divide="ignore"):
        k = reach(f_arm, y_arm, targets) / grid[None, :]
        k = np.where(np.isfinite(targets), k, np.inf)
        k = np.where(np.isfinite(targets) & (targets >= y_arm[:, :1]), np.nan, k)
    if not k.size:
        return np.full(len(y_arm), np.nan)
    with np.errstate(divide="ignore"):
        logs = np.log(k)  # nan: a point left out; a row with none left is nan (nansum: no "empty mean" warning)
    n = (~np.isnan(logs)).sum(1)
    return np.where(n > 0, np.exp(np.nansum(logs, 1) / np.maximum(n, 1)), np.nan)


def warp_interpolated(f_arm, arm_curves, f_mezo, mezo_curves, grid, resamples: int = RESAMPLES,
                      seed: int = RNG_SEED, level: float = 0.95) -> dict:
    """`warp_interpolated_from_means` of the seeds' mean curves, with its percentile bootstrap interval (both arms'
    seeds resampled, as `warp_bootstrap`; nan counts as +inf). `reached`: the grid points the arm's mean curve
    reaches; a factor with none reached is refused (None)."""
    arm_curves, mezo_curves = np.asarray(arm_curves, dtype=float), np.asarray(mezo_curves, dtype=float)
    arm_mean, mezo_mean = mean_curve(arm_curves)[None], mean_curve(mezo_curves)[None]
    f_mezo_arr = np.asarray(f_mezo, dtype=float)
    idx = [int(np.flatnonzero(np.isclose(f_mezo_arr, g))[0]) for g in grid]
    targets = mezo_mean[:, idx]
    informative = ~(np.isfinite(targets) & (targets >= arm_mean[:, :1]))
    reached = int((np.isfinite(reach(f_arm, arm_mean, targets)) & informative).sum())
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(arm_curves), (resamples, len(arm_curves)))
    im = rng.integers(0, len(mezo_curves), (resamples, len(mezo_curves)))
    boot = warp_interpolated_from_means(f_arm, arm_curves[ia].mean(1), f_mezo, mezo_curves[im].mean(1), grid)
    low, high = percentile(boot, [50 * (1 - level), 50 * (1 + level)])
    factor = float(warp_interpolated_from_means(f_arm, arm_mean, f_mezo, mezo_mean, grid)[0])
    return dict(factor=factor if reached else None, low=float(low), high=float(high), reached=reached,
                points=int(informative.sum()))


def percentile(values, q) -> np.ndarray:
    """np.percentile that keeps +-inf (numpy's interpolation turns inf - inf into nan): infinities are replaced by
    +-1e300 for the interpolation and restored after; nan counts as +inf. A percentile between a finite value and
    an infinite one is infinite (any share of 1e300 is above 1e200, which no factor reaches), not that share."""
    v = np.asarray(values, dtype=float)
    v = np.clip(np.where(np.isnan(v), np.inf, v), -1e300, 1e300)
    out = np.percentile(v, q)
    return np.where(out >= 1e200, np.inf, np.where(out <= -1e200, -np.inf, out))


def fewer_forwards(upper: float, threshold: float = THRESHOLD) -> bool:
    """The decision rule: the upper 95% bound of the time-warp factor is <= 0.75."""
    return bool(upper <= threshold)


def forwards_to_final(f_run, run_losses, f_mezo, mezo_losses) -> tuple[float | None, float | None]:
    """Issue 37's figure for one seed: the forwards at the first evaluation point where the run's dev loss is at or
    below the final dev loss of MeZO's run of the same seed (None: never), and MeZO's own forwards to it."""
    goal = log_losses(mezo_losses)[-1]
    if not math.isfinite(goal):
        return None, None
    mine = next((f for f, y in zip(f_run, log_losses(run_losses)) if y <= goal), None)
    theirs = next((f for f, y in zip(f_mezo, log_losses(mezo_losses)) if y <= goal), None)
    return mine, theirs


def forwards_to_final_summary(pairs: list[tuple[float | None, float | None]]) -> str:
    """"median xR (k/n reach)" over seeds: the ratio of each seed's forwards to MeZO's final dev loss to MeZO's own
    (a seed that never reaches it counts as infinite in the median)."""
    ratios = [(m / t if t else (0.0 if m == 0 else math.inf)) if m is not None else math.inf for m, t in pairs]
    reached = sum(m is not None for m, _ in pairs)
    median = float(np.median(ratios)) if ratios else math.nan
    shown = f"x{median:.2f}" if math.isfinite(median) else "not reached"
    return f"median {shown} ({reached}/{len(pairs)} reach)"
