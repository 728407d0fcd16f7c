"""The finite-difference estimators: how a step's forwards are placed and what the update reads from their losses
(docs/algorithm.md, "Several directions per step"). Pure: Python floats in and out, nothing about ranks or
tensors, so every rank computes the same values from the same float64 losses of the step's one all-reduce.

`DIFFERENCE_SPECS` is the table the `difference` key names and the engine reads (like `sampling.METHOD_SPECS`):
where each forward of a direction evaluates (in units of eps along z_k), how many directions the estimator needs,
and its estimate. `StepNormalization` gives the step a length in units of z: loss_std divides RLOO's step by the
spread of its q losses, running_rms MeZO's by a running RMS of its Delta. A new estimator is a member of
`Difference` and its row here; a new normalisation a member of `StepNormalization`, the rows that serve it and its
case in `FiniteDifference.estimate`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Difference(str, enum.Enum):
    """The `difference` key."""

    CENTRAL = "central"  # (L(w + eps z) - L(w - eps z)) / (2 eps) per direction: MeZO's SPSA
    RLOO = "rloo"  # one forward L_k = L(w + eps z_k) per direction, the mean of the others' losses as baseline


class StepNormalization(str, enum.Enum):
    """The `step_normalization` key."""

    NONE = "none"  # the update's coefficient of z_k is (lr / q) Delta_k
    LOSS_STD = "loss_std"  # (eta / q) (L_k - b_k) / sigma: the step in units of z, sigma the spread of the q losses
    RUNNING_RMS = "running_rms"  # (eta / q) clip(Delta_k / s, -3, 3), s a running RMS of Delta: MeZO normalised


SIGMA_FLOOR = 1e-3  # loss_std: sigma is floored at this fraction of its running mean
SIGMA_RATE = 0.1  # loss_std: the running mean of sigma is an EMA with this rate (its first value the first sigma)
RMS_RATE = 0.1  # running_rms: s_t^2 = (1 - RMS_RATE) s_{t-1}^2 + RMS_RATE Delta_t^2
RMS_CLIP = 3.0  # running_rms: Delta_t / s_{t-1} is clipped to [-RMS_CLIP, RMS_CLIP]


@dataclass(frozen=True)
class Estimate:
    """What one step's losses give: `deltas[k]` is direction k's coefficient in the update, which is
    w <- w - (lr / q) sum_k deltas[k] z_k (the sampler adds 1/pi and the decay); `score_deltas[k]` what the block
    scores read for direction k (Eq. 27's Delta); `delta` the logged projected gradient."""

    deltas: list[float]
    score_deltas: list[float]
    loss: float
    delta: float
    loss_plus: float | None = None  # central: the mean over directions of L(w + eps z_k), and of L(w - eps z_k)
    loss_minus: float | None = None
    loss_spread: float | None = None  # rloo: max - min of the q losses
    loss_std: float | None = None  # loss_std: sigma, the standard deviation (ddof 1) of the q losses

    @property
    def finite(self) -> bool:
        values = [self.loss, self.delta, *self.deltas]
        values += [x for x in (self.loss_plus, self.loss_minus) if x is not None]
        return all(math.isfinite(x) for x in values)


def central(losses: list[tuple[float, ...]], eps: float) -> Estimate:
    """Delta_k = (L+_k - L-_k) / (2 eps) (SPSA, the paper's step 4) for each direction k; the step's loss is the
    mean of the two sides, averaged over the directions."""
    q = len(losses)
    deltas = [(lp - lm) / (2 * eps) for lp, lm in losses]
    plus, minus = (sum(x[i] for x in losses) / q for i in (0, 1))
    return Estimate(deltas, deltas, 0.5 * (plus + minus), sum(deltas) / q, loss_plus=plus, loss_minus=minus)


def baseline_residuals(values: list[float]) -> list[float]:
    """L_k - b_k for each of the q losses, b_k = mean_{j != k} L_j (the leave-one-out baseline)."""
    q, total = len(values), sum(values)
    return [v - (total - v) / (q - 1) for v in values]


def leave_one_out(losses: list[tuple[float, ...]], eps: float) -> Estimate:
    """Delta_k = (L_k - b_k) / eps with b_k = mean_{j != k} L_j; the scores read sqrt((q - 1) / q) Delta_k, whose
    square has the central Delta^2's mean, ||g_M||^2 (docs/algorithm.md); `delta` (projected_grad) is the root mean
    square of the Delta_k (their mean is 0 identically)."""
    values = [lk for (lk,) in losses]
    q, total = len(values), sum(values)
    deltas = [r / eps for r in baseline_residuals(values)]
    return Estimate(deltas, [math.sqrt((q - 1) / q) * x for x in deltas], total / q,
                    math.sqrt(sum(x * x for x in deltas) / q), loss_spread=max(values) - min(values))


class DifferenceSpec(NamedTuple):
    """One estimator: `offsets`, where each forward of a direction evaluates, in units of eps along z_k (the
    engine's forwards per direction); `min_directions`; `estimate(losses, eps)`, losses being one tuple per
    direction with one loss per offset. The one source of a step's forwards: the engine walks `offsets`, the step's
    all-reduce carries `points` losses per direction (shard/comm.py's StepPacket), and the planner, the bench and
    the experiments count `forwards(q)`."""

    offsets: tuple[int, ...]
    min_directions: int
    estimate: Callable[[list[tuple[float, ...]], float], Estimate]
    normalizations: tuple[StepNormalization, ...]  # the step_normalization values it serves besides none

    @property
    def points(self) -> int:
        """Evaluation points (forwards) per direction."""
        return len(self.offsets)

    def forwards(self, num_directions: int) -> int:
        """Forwards of one step of `num_directions` directions (each forward a pass over the whole model)."""
        return self.points * num_directions


DIFFERENCE_SPECS: dict[Difference, DifferenceSpec] = {
    # running_rms: one scalar of state, Delta's running RMS (two forwards a step suffice)
    Difference.CENTRAL: DifferenceSpec((1, -1), 1, central, normalizations=(StepNormalization.RUNNING_RMS,)),
    # loss_std: the spread of the q one-sided losses of the step itself
    Difference.RLOO: DifferenceSpec((1,), 2, leave_one_out, normalizations=(StepNormalization.LOSS_STD,)),
}


def forwards_per_step(difference: str | Difference, num_directions: int) -> int:
    """Forwards of one step with the `difference` estimator and `num_directions` directions: 2 q for central, q
    for rloo (DIFFERENCE_SPECS, the one source)."""
    return DIFFERENCE_SPECS[Difference(difference)].forwards(num_directions)


class FiniteDifference:
    """The estimator of one run (`difference`, `step_normalization`, eps), with the one scalar of state that a
    normalisation keeps: loss_std's running mean of sigma (an EMA, `SIGMA_RATE`), running_rms's s; saved in
    checkpoints.

    `running_rms` (difference=central: MeZO's step with an adaptive length): with Delta_k the central difference of
    direction k, the update's coefficient of z_k is (eta / q) clip(Delta_k / s_{t-1}, -3, 3), and
    s_t^2 = 0.9 s_{t-1}^2 + 0.1 mean_k Delta_k^2 with s_0 = RMS_k |Delta_k| of the first step (so the first step
    moves eta sign(Delta) per direction). A step whose Deltas are all 0 before s exists moves nothing; a step with a
    non-finite loss leaves s as it was (the engine skips it).

    `loss_std` (FZOO's normalisation): with the q losses L_k, b_k as `leave_one_out`'s and sigma their standard
    deviation (ddof 1) floored at SIGMA_FLOOR times the running mean of sigma (before this step's), the update's
    coefficient of z_k is (eta / q) (L_k - b_k) / sigma, eta being the learning rate: `deltas[k]` =
    (L_k - b_k) / sigma. The update is then invariant to L -> a L + b (a > 0), and a step whose losses are all
    equal (sigma 0 with no running mean yet) moves nothing."""

    def __init__(self, difference: str, step_normalization: str, eps: float):
        self.kind = Difference(difference)
        self.spec = DIFFERENCE_SPECS[self.kind]
        self.normalization = StepNormalization(step_normalization)
        self.eps = eps
        self.sigma_mean: float | None = None
        self.rms: float | None = None  # running_rms's s

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.spec.offsets

    def estimate(self, losses: list[tuple[float, ...]]) -> Estimate:
        """The step's estimate from each direction's losses (one per offset); with loss_std it also updates the
        running mean of sigma (a finite sigma only)."""
        est = self.spec.estimate(losses, self.eps)
        if self.normalization is StepNormalization.NONE:
            return est
        if self.normalization is StepNormalization.RUNNING_RMS:
            return self._running_rms(est)
        values = [lk for (lk,) in losses]
        q = len(values)
        mean = sum(values) / q
        sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / (q - 1))
        floor = SIGMA_FLOOR * self.sigma_mean if self.sigma_mean is not None else 0.0
        scale = max(sigma, floor)
        # a step whose losses are all equal (scale 0, no running mean yet) moves nothing
        deltas = [r / scale if scale > 0 else 0.0 for r in baseline_residuals(values)]
        if math.isfinite(sigma):
            self.sigma_mean = sigma if self.sigma_mean is None else (
                (1 - SIGMA_RATE) * self.sigma_mean + SIGMA_RATE * sigma)
        return Estimate(deltas, est.score_deltas, est.loss, math.sqrt(sum(x * x for x in deltas) / q),
                        loss_spread=est.loss_spread, loss_std=sigma)

    def _running_rms(self, est: Estimate) -> Estimate:
        if not est.finite:
            return est
        mean_square = sum(x * x for x in est.deltas) / len(est.deltas)
        s = self.rms if self.rms is not None else math.sqrt(mean_square)  # s_0 = |Delta_1|
        if s > 0:
            deltas = [max(-RMS_CLIP, min(RMS_CLIP, x / s)) for x in est.deltas]
            self.rms = math.sqrt((1 - RMS_RATE) * s * s + RMS_RATE * mean_square)
        else:
            deltas = [0.0] * len(est.deltas)
        return Estimate(deltas, est.score_deltas, est.loss, est.delta, loss_plus=est.loss_plus,
                        loss_minus=est.loss_minus)

    def state_dict(self) -> dict:
        if self.normalization is StepNormalization.LOSS_STD:
            return {"sigma_mean": self.sigma_mean}
        return {"running_rms": self.rms} if self.normalization is StepNormalization.RUNNING_RMS else {}

    def load_state_dict(self, state: dict) -> None:
        if self.normalization is StepNormalization.LOSS_STD:
            self.sigma_mean = state.get("sigma_mean")
        elif self.normalization is StepNormalization.RUNNING_RMS:
            self.rms = state.get("running_rms")
