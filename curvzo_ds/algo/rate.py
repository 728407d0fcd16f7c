"""The learning rate of a step (docs/algorithm.md, "The rate of a normalised step"): the schedule (`constant`,
`linear`, `plateau`), the base rate that `learning_rate: auto` chooses, and the factors that the plateau rule and a
divergence rollback multiply in. Pure Python floats: every rank computes the same values from the same inputs (the
dev loss, which evaluation gives every rank identically; the weights' RMS, taken over the full tensors), so the
rate is the same at every world size and after a resume (the state is saved in checkpoints).
"""

from __future__ import annotations

import enum
import logging
import math

from curvzo_ds.errors import ConfigError

log = logging.getLogger("curvzo_ds")


class Schedule(str, enum.Enum):
    """The `lr_scheduler_type` key."""

    CONSTANT = "constant"
    LINEAR = "linear"  # decay to 0 at max_steps
    PLATEAU = "plateau"  # times plateau_factor after plateau_patience evaluations without a lower dev loss


AUTO = "auto"
# learning_rate: auto holds the per-coordinate random walk of the whole horizon at this fraction of the trainable
# weights' root mean square (the default of the `auto_walk_fraction` key). 0.08: issue 47's lattice chose
# eta = 5.66e-3 for 50 steps of q = 8 on SmolLM2-135M (weights' RMS 0.183) on both of its tasks, which is 0.083;
# docs/algorithm.md and experiments/RESULTS.md ("The horizon protocol") have its check on experiments/pipeline.py's
# model and at other horizons.
AUTO_WALK_FRACTION = 0.08


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


def auto_rate(weights_rms: float, step_normalization: str, num_directions: int, horizon: int,
              fraction: float = AUTO_WALK_FRACTION) -> float:
    """eta such that the per-coordinate random walk of `horizon` steps, eta step_rms sqrt(horizon), is `fraction`
    of the weights' RMS: eta = fraction rms(w) / (step_rms sqrt(horizon)), rounded to 3 significant digits (so the
    value a log shows is the value used). A normalised step has a fixed length, so a fixed eta does not converge:
    the horizon sets it (eta ~ 1/sqrt(T), the standard rate of a method with a known horizon)."""
    if not (weights_rms > 0 and math.isfinite(weights_rms)):
        raise ConfigError(f"learning_rate=auto: the trainable weights' RMS is {weights_rms}; it needs weights that are "
                         "not all zero (set learning_rate to a number)")
    eta = fraction * weights_rms / (step_rms(step_normalization, num_directions) * math.sqrt(max(horizon, 1)))
    return float(f"{eta:.3g}")


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
        self.reason = "the learning_rate key"

    @property
    def needs_choice(self) -> bool:
        return self.base is None

    def choose(self, value: float, reason: str) -> None:
        self.base, self.reason = value, reason
        log.info("learning_rate auto: %g (%s)", value, reason)

    def at(self, step: int) -> float:
        if self.base is None:
            raise RuntimeError("learning_rate=auto has not chosen its rate yet (the engine does at its first step)")
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
                "plateau_scale": self.plateau_scale, "best_dev_loss": self.best_dev,
                "evals_since_best": self.evals_since_best, **self.carry()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's rate state (one from before these fields: the key's rate, no cuts)."""
        if state.get("learning_rate_chosen") is not None and self.auto:
            self.base, self.reason = float(state["learning_rate_chosen"]), state.get("learning_rate_reason", "")
        self.plateau_scale = float(state.get("plateau_scale", 1.0))
        self.best_dev = state.get("best_dev_loss")
        self.evals_since_best = int(state.get("evals_since_best", 0))
        self.rollback_scale = float(state.get("rollback_scale", 1.0))
        self.rollbacks = int(state.get("rollbacks", 0))
