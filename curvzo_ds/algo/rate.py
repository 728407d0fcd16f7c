"""The learning rate of a step (docs/algorithm.md, "The rate of a normalised step"): the schedule (`constant`,
`linear`, `plateau`), the base rate that `learning_rate: auto` chooses, and the factors that the plateau rule and a
divergence rollback multiply in. Pure Python floats: every rank computes the same values from the same inputs (the
dev loss, which evaluation gives every rank identically; the line probe's rate, which job rank 0 decides and
broadcasts), so the rate is the same at every world size and after a resume (the state is saved in checkpoints).
"""

from __future__ import annotations

import enum
import logging
import math
from typing import NamedTuple

from curvzo_ds.errors import RateRefused

log = logging.getLogger("curvzo_ds")


class Schedule(str, enum.Enum):
    """The `lr_scheduler_type` key."""

    CONSTANT = "constant"
    LINEAR = "linear"  # decay to 0 at max_steps
    PLATEAU = "plateau"  # times plateau_factor after plateau_patience evaluations without a lower dev loss


AUTO = "auto"
# learning_rate: auto (docs/algorithm.md, "The rate of a normalised step"): eta = AUTO_RATE_FRACTION x the greedy
# rate along the step's own direction u, measured before the first step on AUTO_RATE_PROBES directions (each on
# its own train batch) from the batch loss at w and at w -+ tau u: the mean slope over the curvature's upper bound.
# 0.2: on experiments/pipeline.py's model the greedy rate by the mean curvature is 0.027-0.032 (4 seeds, 32 probes),
# and over 16,000 forwards 5.66e-3 (about a fifth) beat MeZO while 1.13e-2 (about 2/5) did not and did harm on
# noisy labels; on SmolLM2-135M issue 47's lattice chose 5.66e-3 at 400 forwards where that rate is about 0.02
# (`sentiment`) and 0.05 (`topic`). The curvature's upper bound (since the noisy-label runs, where the mean alone
# gave 9.3e-3 and 1.75e-2) lowers it where the probes disagree. 16 probes: 8 gave 0.023-0.043 on the small
# model's 4 seeds. experiments/RESULTS.md ("The line rule") has the measurements.
AUTO_RATE_FRACTION = 0.2
AUTO_RATE_PROBES = 16
LINE_SPAN = 3.0  # the line's points w -+ tau u lie LINE_SPAN x zo_eps from w per coordinate (RMS)


def lr_at(step: int, base_lr: float, schedule: str, max_steps: int) -> float:
    """The schedule's rate for update number `step` (0-based) from `base_lr`: constant (and plateau, whose cuts are
    `Rate`'s factor), or linear decay to 0 at max_steps."""
    if Schedule(schedule) is not Schedule.LINEAR or max_steps <= 0:
        return base_lr
    return base_lr * max(0.0, 1.0 - step / max_steps)


def step_rms(step_normalization: str, num_directions: int) -> float:
    """The root mean square, per coordinate, of one normalised step at rate 1: the update sum_k c_k z_k with
    E z^2 = 1 has per-coordinate variance sum_k c_k^2.

    loss_std: c_k = (1/q) (L_k - b_k) / sigma = (L_k - mean) / ((q - 1) sigma), and sum_k (L_k - mean)^2 =
    (q - 1) sigma^2 (ddof 1), so sum_k c_k^2 = 1 / (q - 1) exactly. running_rms: c_k = (1/q) clip(Delta_k / s),
    (Delta_k / s)^2 about 1 once s tracks Delta's RMS, so sum_k c_k^2 is about 1 / q."""
    if step_normalization == "loss_std":
        return 1.0 / math.sqrt(num_directions - 1)
    if step_normalization == "running_rms":
        return 1.0 / math.sqrt(num_directions)
    raise ValueError(f"learning_rate=auto needs a normalised step, not step_normalization={step_normalization}")


def line_tau(step_normalization: str, num_directions: int, eps: float) -> float:
    """The line probe's tau: the points w -+ tau u lie LINE_SPAN eps from w per coordinate (u's RMS is step_rms),
    far enough that the curvature along u shows above the loss's rounding, near enough to stay on one parabola."""
    return LINE_SPAN * eps / step_rms(step_normalization, num_directions)


NUMBER_FIX = "set learning_rate to a number"  # a concave line's fix where nothing in the run's layout causes it


class LineRate(NamedTuple):
    eta: float  # the rate taken: fraction x greedy, 3 significant digits
    greedy: float  # the greedy rate along the line, mean slope / the curvature's upper bound
    reason: str


def line_rate(slopes: list[float], curvatures: list[float], fraction: float = AUTO_RATE_FRACTION,
              concave_fix: str = NUMBER_FIX) -> LineRate:
    """(eta, greedy, reason): eta = fraction x greedy, greedy = mean(slopes) / (mean(curvatures) + 2 se), eta rounded to
    3 significant digits (so the value a log shows is the value used). slope_k = -(d/ds) L(w - s u_k) and curvature_k
    = (d/ds)^2 L(w - s u_k) at s = 0 on probe k's batch. The curvature along a step's direction varies far more from
    probe to probe than the slope (its standard deviation is the size of its mean for RLOO-8 on a small model,
    several times it for a single direction, and label noise lowers its mean): its upper 95% bound (mean + 2 standard
    errors, over 2 or more probes) is what the rule divides by, so that a curvature the probes do not resolve gives a
    smaller rate, never a larger one. Refused, in one line, where the directions do not descend or the mean
    curvature is not positive: where its upper bound is, the probes did not resolve it and more of them can (the
    refusal names auto_rate_probes); where not, the line is concave and the refusal names `concave_fix`."""
    if not slopes:
        raise RateRefused("learning_rate=auto: every probe's loss was non-finite, so no rate could be measured (check "
                          "the model's dtype and zo_eps, or set learning_rate to a number)")
    n = len(slopes)
    a, c = sum(slopes) / n, sum(curvatures) / n
    se = math.sqrt(sum((x - c) ** 2 for x in curvatures) / (n - 1) / n) if n > 1 else 0.0
    if not (math.isfinite(a) and math.isfinite(c) and a > 0):
        raise RateRefused(f"learning_rate=auto: along the step's direction on {n} probes the loss has slope {a:.4g} "
                          f"and curvature {c:.4g} per probe; a rate needs a falling, convex line (raise zo_eps if the "
                          "losses barely differ: a bf16 model's loss can be too coarse for it; or set learning_rate "
                          "to a number)")
    if c <= 0 < c + 2 * se:
        raise RateRefused(f"learning_rate=auto: along the step's direction on {n} probes the loss falls (slope "
                          f"{a:.4g}) but the probes do not resolve the line's curvature ({c:.4g} +- {se:.3g} per "
                          f"probe), so they give no greedy rate: raise auto_rate_probes (these were {n}) to average "
                          "more of them, or set learning_rate to a number")
    if c <= 0:
        raise RateRefused(f"learning_rate=auto: along the step's direction on {n} probes the loss falls (slope "
                          f"{a:.4g}) but the line is concave (curvature {c:.4g} +- {se:.3g} per probe), so it has "
                          f"no greedy rate: {concave_fix}")
    greedy = a / (c + 2 * se)
    eta = float(f"{fraction * greedy:.3g}")
    return LineRate(eta, greedy, f"{fraction:g} x the greedy rate {greedy:.4g} along the step's direction, measured "
                    f"on {n} probes before the first step (mean slope {a:.4g}, curvature {c:.4g} +- {se:.3g}, its "
                    f"upper bound {c + 2 * se:.4g} taken)")


class Rate:
    """One run's learning rate: `at(step)` = base x schedule(step) x plateau factor x rollback factor.

    - `base`: the `learning_rate` key, or the value `choose` set for `learning_rate: auto` (None until then);
    - `observe_dev(loss)`: the plateau rule (only with lr_scheduler_type=plateau): the factor times
      `plateau_factor` after `plateau_patience` evaluations in a row without a dev loss below the best so far;
    - `rolled_back()`: a divergence rollback: the factor times 0.5 (train/divergence.py decides when).
    `state_dict` holds all of it; a rollback keeps the rollback factor across the checkpoint it loads (`carry`)."""

    ROLLBACK_FACTOR = 0.5

    def __init__(self, learning_rate: float | str, schedule: str, max_steps: int, plateau_factor: float = 0.5,
                 plateau_patience: int = 3):
        self.base = None if learning_rate == AUTO else float(learning_rate)
        self.auto = learning_rate == AUTO
        self.schedule = Schedule(schedule)
        self.max_steps = max_steps
        self.plateau_factor, self.plateau_patience = plateau_factor, plateau_patience
        self.plateau_scale, self.best_dev, self.evals_since_best = 1.0, None, 0
        self.rollback_scale, self.rollbacks = 1.0, 0
        self.reason, self.greedy = "the learning_rate key", None

    @property
    def needs_choice(self) -> bool:
        return self.base is None

    def choose(self, value: float, reason: str, greedy: float | None = None) -> None:
        """learning_rate auto's rate, its reason and the greedy rate it is a fraction of."""
        self.base, self.reason, self.greedy = value, reason, greedy
        log.info("learning_rate auto: %g (%s)", value, reason)

    def at(self, step: int) -> float:
        if self.base is None:
            raise RuntimeError("learning_rate=auto has not chosen its rate yet (engine.choose_rate, or the first step)")
        return lr_at(step, self.base, self.schedule.value, self.max_steps) * self.plateau_scale * self.rollback_scale

    def observe_dev(self, step: int, loss: float | None) -> bool:
        """The plateau rule after a dev evaluation at `step`; True when it cut the rate (logged)."""
        if self.schedule is not Schedule.PLATEAU or loss is None or not math.isfinite(loss):
            return False
        if self.best_dev is None or loss < self.best_dev:
            self.best_dev, self.evals_since_best = loss, 0
            return False
        self.evals_since_best += 1
        if self.evals_since_best < self.plateau_patience:
            return False
        self.plateau_scale *= self.plateau_factor
        self.evals_since_best = 0
        log.info("lr_scheduler_type=plateau: step %d: no dev loss below %.6g for %d evaluations; the learning rate "
                 "is now %g (x%g)", step, self.best_dev, self.plateau_patience, self.at(step), self.plateau_factor)
        return True

    def rolled_back(self) -> None:
        self.rollback_scale *= self.ROLLBACK_FACTOR
        self.rollbacks += 1

    def carry(self) -> dict:
        """What a rollback keeps across the checkpoint it loads."""
        return {"rollback_scale": self.rollback_scale, "rollbacks": self.rollbacks}

    def state_dict(self) -> dict:
        return {"learning_rate_chosen": self.base, "learning_rate_reason": self.reason,
                "learning_rate_greedy": self.greedy,
                "plateau_scale": self.plateau_scale, "best_dev_loss": self.best_dev,
                "evals_since_best": self.evals_since_best, **self.carry()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's rate state (one from before these fields: the key's rate, no cuts)."""
        if state.get("learning_rate_chosen") is not None and self.auto:
            self.base, self.reason = float(state["learning_rate_chosen"]), state.get("learning_rate_reason", "")
            self.greedy = state.get("learning_rate_greedy")
        self.plateau_scale = float(state.get("plateau_scale", 1.0))
        self.best_dev = state.get("best_dev_loss")
        self.evals_since_best = int(state.get("evals_since_best", 0))
        self.rollback_scale = float(state.get("rollback_scale", 1.0))
        self.rollbacks = int(state.get("rollbacks", 0))
