"""`curvzo-ds train` / `eval`: the two commands' bodies, one call per rank (or the whole job in one process).

`run_train`: build the Job (build.py), check the resume target and the output directory, resume, loop (loop.py),
evaluate at the end, write summary.json (outputs.py). `run_eval`: build the Job, load a checkpoint, evaluate dev and
test, and write eval.json. `start` holds everything that `--resume` decides.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from curvzo_ds.algo.sampling import METHOD_SPECS, Method
from curvzo_ds.checkpoint.format import check_model, read_manifest
from curvzo_ds.checkpoint.manager import CheckpointManager, load_checkpoint
from curvzo_ds.config.fields import field_names, to_dict
from curvzo_ds.config.load import RESUME_MAY_CHANGE, differences, read_run_config
from curvzo_ds.config.schema import TrainConfig, freeze
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.shard.distributed import launcher_kind
from curvzo_ds.train.build import Job, build
from curvzo_ds.train.divergence import DivergenceWatch, no_gain, zero_shot
from curvzo_ds.train.logs import RunLog, log_to_file
from curvzo_ds.train.loop import Clock, final_evaluations, train_loop, with_digest
from curvzo_ds.train.outputs import (
    RunLock,
    check_writable,
    end_counts,
    prepare_output_dir,
    refuse_untrained_eval_of_a_run,
    write_config,
    write_eval,
    write_summary,
)
from curvzo_ds.train.signals import StopRequest

log = logging.getLogger("curvzo_ds")


def run_train(cfg: TrainConfig, resume: str | bool | None = None) -> dict:
    """The training run: set up (resume and output directory checked first), loop, final evaluations, summary."""
    started = time.time()
    launched = launcher_kind() != "single"  # before build, which sets a lone process's RANK and WORLD_SIZE
    job = build(cfg)
    cfg, engine = job.cfg, job.engine
    clock, watch = Clock(), DivergenceWatch()
    manager = job.checkpoints(states={"clock": clock, "divergence": watch})
    # From here a signal is a stop request (train/signals.py); before, nothing was written, and Python's defaults
    # end the rank (a Ctrl-C is cli.entry's one line).
    with StopRequest(watch_parent=launched) as stop:
        resumed_from, lock = start(job, manager, resume)
        cfg = job.cfg  # a resumed run's perturbation is its checkpoint's (start)
        try:
            warn_missing_splits(job)
            record = RunLog(section(cfg, "logging"), output_dir=cfg.output_dir, max_steps=cfg.max_steps,
                            pi_file=not METHOD_SPECS[Method(cfg.method)].every_block, rank=job.rank,
                            block_names=[b.name for b in engine.blocks], start=engine.step_count,
                            run_config=to_dict(cfg))
            rollback = cfg.on_divergence == "rollback"
            if engine.step_count == 0:
                if rollback:
                    engine.gather_persistent()  # before any forward: the regions a checkpoint reads
                if job.evaluator.should_eval(0):
                    zero_shot(job, record, watch)  # the dev rule's reference, in checkpoint-0's watch state
                if rollback:
                    manager.save_initial(engine)  # checkpoint-0: a run that diverges early returns here
            elif rollback:
                manager.keep_initial()  # a resumed run: its first start's checkpoint-0, if there
            try:
                with record.progress():
                    train_loop(job, manager, record, clock, stop, watch)
            finally:
                record.end_steps()
            # the last step is saved (a resume that took no step does not write its checkpoint again)
            if not resumed_at(resumed_from, manager.path_for(engine.step_count)):
                manager.maybe_save(engine, last=True)
            step = engine.step_count  # the weights' steps: the best checkpoint may be loaded below to evaluate test
            digest, counts = params_digest(engine.entries, job.topology.job), end_counts(engine)
            counts["zero_shot_dev"] = watch.zero_shot  # the dev metrics before the first step (None: none taken)
            final, best, test = final_evaluations(job, manager, record)
            best = with_digest(job, best, step, digest)
            reason = no_gain(manager, counts["zero_shot_dev"], best)
            if reason and job.rank == 0:
                log.warning("%s", reason)
            manager.drop_initial(job.rank)  # the run is over: checkpoint-0 was its fallback only
            record.close()
            return write_summary(job, manager, step, digest, final, best, test, time.time() - started, counts)
        finally:
            if lock is not None:
                lock.release()  # on every way out; a process that dies holds no lock either (outputs.RunLock)


def start(job: Job, manager: CheckpointManager, resume) -> tuple[str | None, RunLock | None]:
    """Everything is checked before the first byte goes to output_dir: the resume target and its compatibility,
    the directory itself (a live run's lock, another run, a file, no space, no permission). Then the log file, the
    resumed state (the weights, the ZO state and the manager's components), the static mask of a fresh run, and
    config.json (rank 0). Returns the checkpoint resumed from (or None) and the output directory's lock (rank 0's;
    None on the other ranks)."""
    cfg, engine = job.cfg, job.engine
    path = manager.resume_path(resume)
    if path:
        check_resume(job, path)
    lock = prepare_output_dir(cfg, resume, path, job.topology.job)
    try:
        log_to_file(os.path.join(cfg.output_dir, "logs", f"rank-{job.rank:05d}.log"), append=bool(resume))
        if path:
            manager.load(engine, path)
            log.info("resumed from %s at step %d", path, engine.step_count)
            if engine.cfg.perturbation != cfg.perturbation:  # the checkpoint's (ZOEngine.load_state_dict): recorded
                job.cfg = cfg = freeze(dataclasses.replace(cfg, perturbation=engine.cfg.perturbation))
        elif resume:  # prepare_output_dir refused a directory that holds a run without a complete checkpoint
            log.warning("--resume: %s holds no run yet, starting from step 0", cfg.output_dir)
        if cfg.static_mask and engine.static_mask is None:  # a resumed run has the checkpoint's mask
            engine.fit_static_mask([job.batch(t) for t in range(cfg.static_mask_batches)])
        if engine.rate.needs_choice:  # learning_rate: auto (a resumed run has the checkpoint's rate)
            engine.choose_rate([job.batch(t) for t in range(cfg.auto_rate_probes)])
        if job.rank == 0:
            write_config(cfg)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return path, lock


def check_resume(job: Job, path: str) -> None:
    """Check that the checkpoint can continue this run: the keys that change the trajectory match its run config
    (config.RESUME_MAY_CHANGE lists those that may differ), its tensors are this model's trainable ones, and max_steps
    is not below its step. Each mismatch is a one-line ConfigError naming the key. `path` verified already
    (CheckpointManager.resume_path): its files are not hashed again here."""
    manifest = read_manifest(path)
    saved = read_run_config(path, required=False)
    if saved is not None:  # first: a changed key says more than the tensors that it changed
        # perturbation: the run keeps the checkpoint's (ZOEngine.load_state_dict), whatever is asked now
        keys = [k for k in field_names() if k not in RESUME_MAY_CHANGE and k != "perturbation"]
        # under the plateau schedule the evaluations are part of the trajectory: their steps may not change
        keys += ["eval_steps"] if job.cfg.lr_scheduler_type == "plateau" else []
        changed = differences(saved, to_dict(job.cfg), keys)
        if changed:
            raise ConfigError(f"--resume {path}: {'; '.join(changed)}: these keys change the trajectory and must "
                              "match the checkpoint's run (max_steps, eval_steps, logging and the like may change)")
    check_model(path, manifest, job.engine.entries)
    step = manifest["step"]
    if step > job.cfg.max_steps:
        raise ConfigError(f"--resume {path}: max_steps={job.cfg.max_steps} is below the checkpoint's step {step}: "
                          f"set max_steps >= {step}")
    try:
        job.engine.check_state(manifest["engine"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {path}: {e}") from None


def warn_missing_splits(job: Job) -> None:
    """A run without a dev split evaluates nothing on dev (summary.json's best_dev is null), and one without a test
    split reports no test score: said once, on rank 0, unless the user asked for it (num_dev=0, num_eval=0)."""
    cfg = job.cfg
    for split, key in (("dev", "num_dev"), ("test", "num_eval")):
        if split not in job.eval_data and getattr(cfg, key) != 0 and job.rank == 0:
            log.warning("no %s examples (the task's %s split or %s.jsonl is empty): the run makes no %s evaluation%s",
                        split, split, split, split, ", and summary.json's best_dev is null" if split == "dev" else "")


def resumed_at(loaded: str | None, checkpoint: str) -> bool:
    """Whether the run resumed from `checkpoint` itself: a resume that took no step (max_steps equal to the
    checkpoint's step) does not write it again (its eval.json stays)."""
    # the loaded checkpoint may have been rotated away by the steps taken since
    return (bool(loaded) and os.path.isdir(loaded) and os.path.isdir(checkpoint)
            and os.path.samefile(loaded, checkpoint))


def run_eval(cfg: TrainConfig, checkpoint: str | None = None) -> dict | None:
    """Evaluate `checkpoint` (resolved and verified by the caller: commands/eval.py) on dev and test; rank 0 writes
    output_dir/eval.json and returns the results (other ranks return None). Without a checkpoint it evaluates the
    untrained model and writes nothing (only the CLI's stdout has the result), and it refuses an output_dir that
    holds a run: there the result would pass for the run's."""
    if not checkpoint:
        refuse_untrained_eval_of_a_run(cfg.output_dir)
    else:
        check_writable(cfg.output_dir, "output_dir")  # eval.json goes there: refused before the model is built
    job = build(cfg)
    if checkpoint:
        load_checkpoint(job.engine, checkpoint)  # a checkpoint of another model is a one-line ConfigError
    results = {s: job.evaluate(s) for s in job.eval_data}
    results["step"] = job.engine.step_count
    results["params_digest"] = params_digest(job.engine.entries, job.topology.job)
    if job.rank == 0:
        if not checkpoint:
            log.info("evaluated the untrained model (no --resume); nothing written: pass --resume CHECKPOINT to "
                     "evaluate a checkpoint")
            return results
        write_eval(job.cfg.output_dir, results)
        return results
    return None
