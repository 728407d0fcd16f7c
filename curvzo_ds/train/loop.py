"""The training loop of `curvzo-ds train` and the evaluations at its end.

`train_loop` steps a built Job until max_steps: one update per pass, then the step's record, the divergence
watch, the consistency check, pre-emption, dev evaluation (with the plateau rule) and checkpoints, each one call into
its component (the engine, logs.RunLog, divergence.DivergenceWatch, the Evaluator, the CheckpointManager).
`final_evaluations` and `with_digest` give what summary.json reports.
"""

from __future__ import annotations

import logging
import time

from curvzo_ds.checkpoint.manager import CheckpointManager, load_checkpoint
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import NonFiniteLossError, Preempted, RanksDisagree
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.train.build import Job
from curvzo_ds.train.divergence import DivergenceWatch, recover
from curvzo_ds.train.logs import RunLog
from curvzo_ds.train.outputs import fmt_metrics
from curvzo_ds.train.signals import Fault, StopRequest

log = logging.getLogger("curvzo_ds")


class Clock:
    """The wall seconds a run has trained, over resumes: a stateful component of the checkpoints."""

    def __init__(self):
        self.before, self.start = 0.0, time.time()

    def seconds(self) -> float:
        return self.before + time.time() - self.start

    def state_dict(self) -> dict:
        return {"seconds": self.seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.before, self.start = state.get("seconds", 0.0), time.time()


def train_loop(job: Job, manager: CheckpointManager, record: RunLog, clock: Clock, stop: StopRequest,
               watch: DivergenceWatch) -> None:
    """Step until max_steps. On a stop request (any rank's signal or gone launcher, agreed through the step's
    all-reduce) every rank saves the same checkpoint and Preempted is raised. A diverging run rolls back or stops
    (train/divergence.py); every rank decides it from the same all-reduced losses."""
    cfg, engine, evaluator, comm = job.cfg, job.engine, job.evaluator, job.topology.job
    fault = Fault(job.rank)  # tests only (CURVZO_DS_FAULT); does nothing otherwise
    flat = FlatLossWatch(cfg.flat_loss_steps)
    horizon = HorizonWatch(cfg.max_steps, job.rank)
    while engine.step_count < cfg.max_steps:
        # a stop request since the last pass: a signal (the handler only sets a flag), or a launcher that is gone
        stop.poll()
        # the step: for each direction, a move to each of the estimator's points and its forwards (central: +eps z,
        # -eps z; rloo: +eps z_k), one all-reduce (the step's one host sync, which also carries every rank's stop
        # flag), then the update from the last point
        batch = job.batch(engine.step_count)
        with fault.around_step(engine, engine.step_count + 1):
            try:
                r = engine.step(batch, stop_requested=stop.requested)
            except NonFiniteLossError as e:  # max_consecutive_skips non-finite losses in a row: diverged
                recover(job, manager, record, clock, watch, str(e), engine.step_count)
                continue
        step = r.step
        # record the step; warn once if the loss never moves; a diverging run rolls back (or stops)
        record.step(r, clock.seconds())
        flat.observe(r)
        horizon.observe(step)
        reason = watch.observe_step(step, r.loss if r.skipped is None else None)
        if reason:
            recover(job, manager, record, clock, watch, reason, step)
            continue
        # every consistency_steps: the ranks compare a hash of their ZO state
        if cfg.consistency_steps and step % cfg.consistency_steps == 0:
            check_state_agrees(engine, step)
        # evaluate on dev (the divergence watch and the plateau rule read its loss); a new best is saved at once,
        # and protected from rotation
        if evaluator.should_eval(step):
            dev = evaluator.evaluate("dev", step)
            record.evaluation(step, "dev", dev)
            log.info("step %d: dev %s", step, fmt_metrics(dev))
            reason = watch.observe_dev(step, dev.get("loss"))
            if reason:
                recover(job, manager, record, clock, watch, reason, step)
                continue
            engine.rate.observe_dev(step, dev.get("loss"))
            if manager.track(step, dev):
                manager.save(engine)
        # pre-emption: save (unless this step is saved), leave together; after the step's evaluation, which a resumed
        # run would not make again (the plateau rule and the divergence watch read it)
        if r.stop:
            manager.maybe_save(engine, last=True)
            comm.barrier()  # under srun --kill-on-bad-exit the first exit ends the rest
            raise Preempted(f"stopped {stop.reason()} at step {step}, after saving {manager.path_for(step)}: resume "
                            "with --resume")
        # checkpoint every save_steps and at the last step
        manager.maybe_save(engine, last=step == cfg.max_steps)


def check_state_agrees(engine: ZOEngine, step: int) -> None:
    """The ranks compare a hash of their ZO state (engine.state_hash); a difference stops every rank."""
    hashes = engine.topology.job.all_gather_object(engine.state_hash())
    if len(set(hashes)) > 1:
        raise RanksDisagree(f"ranks disagree on the ZO state at step {step} (hashes by rank: {hashes}): a rank has "
                            "another build, data or configuration; the run stops")


class FlatLossWatch:
    """Warns once when the loss stays exactly the same, with a projected gradient of 0, for `steps` steps in a row:
    the perturbation never reaches the loss."""

    def __init__(self, steps: int):
        self.steps, self.run, self.last, self.warned = steps, 0, None, False

    def observe(self, r) -> None:
        if not self.steps or self.warned or r.loss is None:
            return
        self.run = self.run + 1 if (r.projected_grad == 0.0 and r.loss == self.last) else 0
        self.last = r.loss
        if self.run >= self.steps:
            self.warned = True
            log.warning("the loss has been exactly %.6g with a projected gradient of 0 for %d steps: the perturbation "
                        "does not reach the loss. Likely causes: zo_eps below the weights' dtype spacing (raise "
                        "zo_eps or use fp32_master_weights=true), label words that the tokenizer maps to the same "
                        "tokens, or the trained parameters (LoRA targets) not on the loss's path", r.loss, self.run)


class HorizonWatch:
    """Warns once, on rank 0, when max_steps at the measured pace of this run's steps (steps 2 to 1 + PROBE: the first
    carries one-time set-up) would take more than `WARN_DAYS`: an absurd horizon (max_steps=1e8) is legal, but its
    time is said, in days, while there is time to stop it. The run goes on."""

    PROBE, WARN_DAYS = 3, 7.0

    def __init__(self, max_steps: int, rank: int):
        self.max_steps, self.rank, self.start, self.seen, self.done = max_steps, rank, None, 0, rank != 0

    def observe(self, step: int, now: float | None = None) -> None:
        if self.done:
            return
        now = time.monotonic() if now is None else now
        self.seen += 1
        if self.seen == 1:
            self.start = now  # after the first step of this run
            return
        if self.seen <= self.PROBE:
            return
        self.done = True
        per_step = (now - self.start) / (self.seen - 1)
        days = per_step * (self.max_steps - step) / 86400
        if days > self.WARN_DAYS:
            log.warning("max_steps=%d: at %.3g s per step (this run's steps so far) the %d steps left take about %.0f "
                        "days; if that is not meant, stop the run (Ctrl-C saves a checkpoint) and set max_steps to the "
                        "steps you mean to train", self.max_steps, per_step, self.max_steps - step, days)


def final_evaluations(job: Job, manager: CheckpointManager, record: RunLog) -> tuple:
    """(final, best, test): the end-of-run dev and test evaluations (marked "final": a resumed run drops them, a
    longer run has none), the best dev evaluation, and the test metrics at the best-dev checkpoint (MeZO's rule:
    its weights are loaded for that when an earlier step was better, and the result is an eval line of its own at
    the best-dev step, marked `best_dev`; else it is the final test line)."""
    step, evaluator = job.engine.step_count, job.evaluator
    final = {}
    if "dev" in job.eval_data:
        last = evaluator.last.get("dev")
        if last and last[0] == step:
            final["dev"] = last[1]
        else:
            final["dev"] = evaluator.evaluate("dev", step)
            record.evaluation(step, "dev", final["dev"], final=True)
    if "test" in job.eval_data:
        final["test"] = evaluator.evaluate("test", step)
        record.evaluation(step, "test", final["test"], final=True)
    test = final.get("test")
    best = manager.best
    if "dev" in final and (best is None or best["step"] == step or manager.is_better(final["dev"])):
        best = {"step": step, "metrics": final["dev"], "checkpoint": manager.path_for(step)}
    elif best and "test" in job.eval_data:
        load_checkpoint(job.engine, best["checkpoint"])
        test = evaluator.evaluate("test")
        record.evaluation(best["step"], "test", test, final=True, best_dev=True)  # summary.json's `test`, for trackers
    return final, best, test


def with_digest(job: Job, best: dict | None, step: int, digest: str) -> dict | None:
    """The best-dev result with its parameters' digest: the final one, or that of its checkpoint (loaded here unless
    final_evaluations already loaded it to evaluate test)."""
    if best is None or best["step"] == step:
        return best and {**best, "digest": digest}
    if job.engine.step_count != best["step"]:
        load_checkpoint(job.engine, best["checkpoint"])
    return {**best, "digest": params_digest(job.engine.entries, job.topology.job)}
