"""`curvzo-ds train` / `eval`: the two commands' bodies, one call per rank (or the whole job in one process).

`run_train`: build the Job (build.py), check the resume target and the output directory, resume, loop (loop.py),
evaluate at the end, write summary.json (outputs.py). `run_eval`: build the Job, load a checkpoint, evaluate dev and
test, and write eval.json. `start` holds everything that `--resume` decides.
"""

from __future__ import annotations

import json
import logging
import os
import time

from curvzo_ds.checkpoint.manager import CheckpointManager, load_checkpoint, verify_checkpoint
from curvzo_ds.config.load import RESUME_MAY_CHANGE, differences
from curvzo_ds.config.schema import TrainConfig, field_names, to_dict
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.train.build import Job, build
from curvzo_ds.train.logs import RunLog, log_to_file
from curvzo_ds.train.loop import Clock, final_evaluations, train_loop, with_digest
from curvzo_ds.train.outputs import (
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
    job = build(cfg)
    cfg, engine = job.cfg, job.engine
    clock = Clock()
    manager = job.checkpoints(states={"clock": clock})
    resumed_from = start(job, manager, resume)
    record = RunLog(section(cfg, "logging"), output_dir=cfg.output_dir, max_steps=cfg.max_steps,
                    pi_file=cfg.method != "mezo", rank=job.rank, block_names=[b.name for b in engine.blocks],
                    start=engine.step_count, run_config=to_dict(cfg))
    try:
        with record.progress(), StopRequest() as stop:
            train_loop(job, manager, record, clock, stop)
    finally:
        record.end_steps()
    if not resumed_at(resumed_from, manager.path_for(engine.step_count)):
        manager.maybe_save(engine, last=True)  # the last step is saved (a resume that took no step is not rewritten)
    step = engine.step_count  # the weights' steps: the best checkpoint may be loaded below to evaluate test
    digest = params_digest(engine.entries, job.topology.job)
    final, best, test = final_evaluations(job, manager, record)
    best = with_digest(job, best, step, digest)
    record.close()
    return write_summary(job, manager, step, digest, final, best, test, time.time() - started)


def start(job: Job, manager: CheckpointManager, resume) -> str | None:
    """Everything is checked before the first byte goes to output_dir: the resume target and its compatibility,
    the directory itself (another run, a file, no space, no permission). Then the log file, the resumed state (the
    weights, the ZO state and the manager's components), the static mask of a fresh run, and config.json (rank 0).
    Returns the checkpoint resumed from, or None."""
    cfg, engine = job.cfg, job.engine
    path = manager.resume_path(resume)
    if path:
        check_resume(job, path)
    prepare_output_dir(cfg, bool(resume), job.topology.job)
    log_to_file(os.path.join(cfg.output_dir, "logs", f"rank-{job.rank:05d}.log"), append=bool(resume))
    if path:
        manager.load(engine, path)
        log.info("resumed from %s at step %d", path, engine.step_count)
    elif resume:
        log.warning("--resume: no complete checkpoint in %s, starting from step 0", cfg.output_dir)
    if cfg.static_mask and engine.static_mask is None:  # a resumed run has the checkpoint's mask
        engine.fit_static_mask([job.batch(t) for t in range(cfg.static_mask_batches)])
    if job.rank == 0:
        write_config(cfg)
    return path


def check_resume(job: Job, path: str) -> None:
    """Check that the checkpoint can continue this run: the keys that change the trajectory match its run config
    (config.RESUME_MAY_CHANGE lists those that may differ), and max_steps is not below its step. Each mismatch is a
    one-line ConfigError naming the key."""
    manifest = verify_checkpoint(path)
    config_path = os.path.join(path, "run_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            saved = json.load(f)
        keys = [k for k in field_names() if k not in RESUME_MAY_CHANGE]
        changed = differences(saved, to_dict(job.cfg), keys)
        if changed:
            raise ConfigError(f"--resume {path}: {'; '.join(changed)}: these keys change the trajectory and must "
                              "match the checkpoint's run (max_steps, eval_steps, logging and the like may change)")
    step = int(manifest.get("step", 0))
    if step > job.cfg.max_steps:
        raise ConfigError(f"--resume {path}: max_steps={job.cfg.max_steps} is below the checkpoint's step {step}: "
                          f"set max_steps >= {step}")
    try:
        job.engine.check_state(manifest["engine"])
    except ValueError as e:
        raise ConfigError(f"--resume {path}: {e}") from None


def resumed_at(loaded: str | None, checkpoint: str) -> bool:
    """Whether the run resumed from `checkpoint` itself: a resume that took no step (max_steps equal to the
    checkpoint's step) does not write it again (its eval.json stays)."""
    # the loaded checkpoint may have been rotated away by the steps taken since
    return (bool(loaded) and os.path.isdir(loaded) and os.path.isdir(checkpoint)
            and os.path.samefile(loaded, checkpoint))


def run_eval(cfg: TrainConfig, resume: str | bool | None = None) -> dict | None:
    """Evaluate a checkpoint on dev and test; rank 0 writes output_dir/eval.json and returns the results (other ranks
    return None). Without `resume` it evaluates the untrained model and writes nothing (only the CLI's stdout has the
    result), and it refuses an output_dir that holds a run: there the result would pass for the run's."""
    if not resume:
        refuse_untrained_eval_of_a_run(cfg.output_dir)
    job = build(cfg)
    path = job.checkpoints().resume_path(resume)
    if path:
        load_checkpoint(job.engine, path)
    results = {s: job.evaluate(s) for s in job.eval_data}
    results["step"] = job.engine.step_count
    results["params_digest"] = params_digest(job.engine.entries, job.topology.job)
    if job.rank == 0:
        if not path:
            log.info("evaluated the untrained model (no --resume); nothing written: pass --resume CHECKPOINT to "
                     "evaluate a checkpoint")
            return results
        write_eval(job.cfg.output_dir, results)
        return results
    return None
