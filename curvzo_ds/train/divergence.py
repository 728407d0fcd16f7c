"""A diverging run is detected, named and recovered (docs/reliability.md, "A run that diverges").

The detector reads only numbers every rank has identically: the step's all-reduced train loss and the dev loss
(evaluation gives every rank the same metrics), so every rank decides at the same step, and the run stays
bit-identical at every world size and across a resume (its state is a checkpoint component). A run has diverged
when
- its dev loss is not finite, or the engine stopped after `max_consecutive_skips` non-finite train losses in a row;
- after a warm-up of 20 counted steps, the running mean of its train loss (an EMA, rate 0.02, started at the
  warm-up's plain mean) is above twice the larger of its lowest value since and a quarter of the first step's loss
  (the floor keeps a run whose loss went to nearly 0 from stopping on minibatch noise). One batch's loss, or the
  lowest value of a fast mean, is too noisy a reference: issue 47's MeZO seed 4 on SmolLM2 (batch 8) stopped at
  step 3 on the old rule (a first batch's loss, rate 0.1; experiments/RESULTS.md, "The diverged seed replayed");
- its dev loss is above twice the better of the zero-shot dev loss (a fresh run evaluates dev before its first step,
  an eval line at step 0) and the best dev loss so far: a slow drift that the train loss hides, or a run that went
  bad inside the train rule's warm-up. The reference is at least FLOOR x the zero-shot loss, as the train rule's
  is: without it a dev loss near 0 rolled back on one example's margin (issue 57's SmolLM2 `sentiment` run of the
  auto normalised step, seed 3: 4e-4 at 1,000 forwards, then 1.0e-2, 25x "the best", while it went on to 1e-7).
The two ratio rules need a positive loss: with `objective` accuracy or f1 (the loss is minus the metric, <= 0) only a
non-finite loss counts.
`on_divergence=rollback` (the default) goes back to the newest checkpoint saved before the run went bad (at or before
the step of the lowest running mean and of the best dev loss) at half the rate, at most `max_rollbacks` times;
`stop`, or a rollback beyond them, ends the run with exit code 4 (`Diverged`), its checkpoints intact. The
checkpoints of an abandoned stretch move to output_dir/diverged-<n>/, beside its metrics
(metrics-diverged-<n>.jsonl). A fresh run with `rollback` saves checkpoint-0 first, so that a run that diverges
before its first save has a checkpoint to return to; it is kept from rotation until the run ends, then removed.
"""

from __future__ import annotations

import logging
import math
import os

from curvzo_ds.checkpoint.manager import list_checkpoints
from curvzo_ds.errors import Diverged
from curvzo_ds.train.outputs import fmt_metrics

log = logging.getLogger("curvzo_ds")

RATE = 0.02  # the EMA's rate: about 100 steps' losses, so that its lowest value does not drift down with the noise
WARMUP = 20  # counted steps whose plain mean starts the EMA; the train rule decides nothing before (a batch is noisy)
FACTOR = 2.0  # a running mean (or a dev loss) above FACTOR x its reference has diverged
FLOOR = 0.25  # the train reference is at least FLOOR x the first step's loss, the dev one x the zero-shot loss


class DivergenceWatch:
    """The detector's state (a checkpoint component): the steps counted, the train losses' running mean, its lowest
    value and the step of it, the first loss; the best dev loss (the zero-shot one included) and its step; the
    zero-shot dev metrics (summary.json's `zero_shot_dev`). `good_step()`: the last step before the run went bad."""

    def __init__(self):
        self.first = self.mean = self.lowest = self.best_dev = self.zero_shot = None
        self.counted = self.lowest_step = self.best_dev_step = 0

    def observe_step(self, step: int, loss: float | None) -> str | None:
        """The reason the run has diverged at `step`, or None (a skipped step's loss is None: not counted)."""
        if loss is None:
            return None
        if self.first is None:
            self.first = loss
        self.counted += 1
        if self.counted <= WARMUP:  # the warm-up's plain mean; no decision yet
            self.mean = loss if self.mean is None else self.mean + (loss - self.mean) / self.counted
            return None
        self.mean = (1 - RATE) * self.mean + RATE * loss
        if self.lowest is None or self.mean <= self.lowest:
            self.lowest, self.lowest_step = self.mean, step
        reference = max(self.lowest, FLOOR * self.first)
        if reference > 0 and self.mean > FACTOR * reference:  # a loss <= 0 (objective accuracy, f1): no ratio
            return (f"the train loss's running mean {self.mean:.4g} is above {FACTOR:g}x {reference:.4g}, its lowest "
                    f"(at step {self.lowest_step}, floored at {FLOOR:g}x the first loss {self.first:.4g})")
        return None

    def start(self, dev: dict) -> str | None:
        """The zero-shot evaluation (step 0's dev metrics): the dev rule's reference and floor; its reason, if any."""
        self.zero_shot = dict(dev)
        return self.observe_dev(0, dev.get("loss"))

    def observe_dev(self, step: int, loss: float | None) -> str | None:
        if loss is None or not math.isfinite(loss):
            return f"the dev loss is {loss}"
        zero = (self.zero_shot or {}).get("loss")
        floor = FLOOR * zero if zero is not None and math.isfinite(zero) and zero > 0 else None
        if self.best_dev is not None and self.best_dev > 0 and loss > FACTOR * max(self.best_dev, floor or 0):
            return (f"the dev loss {loss:.4g} is above {FACTOR:g}x the best so far, {self.best_dev:.4g} (at step "
                    f"{self.best_dev_step}{', the zero-shot loss' if self.best_dev_step == 0 else ''}"
                    + (f"; floored at {FLOOR:g}x the zero-shot loss {zero:.4g}" if floor and floor > self.best_dev
                       else "") + ")")
        if self.best_dev is None or loss < self.best_dev:
            self.best_dev, self.best_dev_step = loss, step
        return None

    def good_step(self, step: int) -> int:
        """The last step at which the run was still good: that of the lowest running mean, and of the best dev loss
        when there was an evaluation (the earlier of the two), before `step`."""
        good = min(self.lowest_step, step - 1) if self.lowest is not None else step - 1
        return min(good, self.best_dev_step) if self.best_dev is not None else good

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("first", "mean", "lowest", "lowest_step", "best_dev", "best_dev_step",
                                              "counted", "zero_shot")}

    def load_state_dict(self, state: dict) -> None:
        for k in ("first", "mean", "lowest", "best_dev", "zero_shot"):  # zero_shot: None in an older checkpoint
            setattr(self, k, state.get(k))
        self.lowest_step, self.best_dev_step = int(state.get("lowest_step", 0)), int(state.get("best_dev_step", 0))
        # a checkpoint of the old rule (no count): its mean is past any warm-up
        self.counted = int(state.get("counted", WARMUP if self.mean is not None else 0))


def zero_shot(job, record, watch: DivergenceWatch) -> None:
    """A fresh run with dev evaluations evaluates dev before its first step (collective): an eval line at step 0,
    the curve's first point and the dev rule's reference. A loss that is not finite already is said, not acted on
    (there is nothing to roll back to); the run's own steps meet it."""
    dev = job.evaluator.evaluate("dev", 0)
    record.evaluation(0, "dev", dev)
    log.info("step 0: dev %s (before the first step: the zero-shot reference of the divergence watch)",
             fmt_metrics(dev))
    reason = watch.start(dev)
    if reason:
        log.warning("step 0: %s before any step: the model's zero-shot loss is not finite; check the model's dtype "
                    "and the task's inputs", reason)


def rollback_target(output_dir: str, good_step: int) -> str | None:
    """The checkpoint a rollback returns to: the newest complete one at or before `good_step` (checkpoint-0, which a
    fresh run with on_divergence=rollback saves, at the latest)."""
    earlier = [path for at, path in list_checkpoints(output_dir) if at <= good_step]
    return earlier[-1] if earlier else None


def set_aside(output_dir: str, after: int, rollbacks: int) -> None:
    """The checkpoints of the abandoned stretch (steps after `after`) move to output_dir/diverged-<rollbacks>/: kept,
    but no longer a `checkpoint-*` that `--resume`, a later rollback or the rotation would take for this run's."""
    later = [path for at, path in list_checkpoints(output_dir) if at > after]
    if later:
        aside = os.path.join(output_dir, f"diverged-{rollbacks}")
        os.makedirs(aside, exist_ok=True)
        for path in later:
            os.replace(path, os.path.join(aside, os.path.basename(path)))


def recover(job, manager, record, clock, watch: DivergenceWatch, reason: str, step: int) -> None:
    """Roll back (on_divergence=rollback, within max_rollbacks) or raise Diverged. Collective: every rank calls it
    at the same step, having seen the same losses; the checkpoint to return to is rank 0's choice, broadcast (ranks
    on a shared file system may list a directory differently)."""
    cfg, engine, comm = job.cfg, job.engine, job.topology.job
    rate = engine.rate
    lr = rate.at(max(step - 1, 0))
    target = comm.broadcast_object(rollback_target(manager.output_dir, watch.good_step(step)) if comm.rank == 0
                                   and cfg.on_divergence == "rollback" else None)
    if cfg.on_divergence == "stop" or rate.rollbacks >= cfg.max_rollbacks or target is None:
        why = ("on_divergence=stop" if cfg.on_divergence == "stop" else
               f"max_rollbacks={cfg.max_rollbacks} spent" if rate.rollbacks >= cfg.max_rollbacks else
               "no checkpoint to roll back to")
        best = manager.best and manager.best.get("checkpoint")
        raise Diverged(f"the run diverged at step {step} at learning rate {lr:g}: {reason} ({why}); "
                       f"{'its best-dev checkpoint ' + best + ' is intact' if best else 'its checkpoints are intact'}"
                       ": lower learning_rate (or use lr_scheduler_type=plateau) and start again, or resume from a "
                       "checkpoint")
    carry, seconds = rate.carry(), clock.seconds()
    manager.load(engine, target)  # the weights, the ZO state, the rate, the detector, the best evaluation
    clock.load_state_dict({"seconds": seconds})
    rate.load_state_dict({**rate.state_dict(), **carry})
    rate.rolled_back()
    manager.saved_step = None  # the steps ahead are new: their checkpoints are written again
    if comm.rank == 0:
        set_aside(manager.output_dir, engine.step_count, rate.rollbacks)
    comm.barrier()
    new_lr = rate.at(engine.step_count)
    log.warning("step %d: the run diverged (%s); rolled back to %s (step %d) with the learning rate halved to %g "
                "(rollback %d of at most %d)", step, reason, target, engine.step_count, new_lr, rate.rollbacks,
                cfg.max_rollbacks)
    record.rollback(step, engine.step_count, new_lr, rate.rollbacks, reason)


def no_gain(manager, zero: dict | None, best: dict | None) -> str | None:
    """Why the run's best dev evaluation is no better than the zero-shot one (by the manager's best-dev rule), or
    None: the end-of-run warning that training made the base model worse on dev (on noisy train labels it does,
    MeZO's too: experiments/RESULTS.md, issue 57's noisy task)."""
    if not zero or not best or not manager.metric or manager.is_better(best["metrics"], than=zero):
        return None
    return (f"the best dev evaluation (step {best['step']}: {fmt_metrics(best['metrics'])}) is no better by "
            f"{manager.metric} than the zero-shot one (before the first step: {fmt_metrics(zero)}): the base model is "
            "the better one on dev. Lower learning_rate or max_steps, or check the train labels (noisy labels do this)")
