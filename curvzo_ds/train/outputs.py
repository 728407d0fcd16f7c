"""The files of a run's output_dir and its last log line.

- `prepare_output_dir`: the output-directory policy (refuse a file or another run unless resumed or overwritten,
  empty it when overwriting, probe a write), before anything else goes there;
- `write_config` (output_dir/config.json), `write_run_config` (run_config.json in each checkpoint),
  `write_summary` (output_dir/summary.json, then the done line), `write_eval` (output_dir/eval.json);
- `refuse_untrained_eval_of_a_run`: `eval` without --resume where output_dir holds a run.
The metrics, logs and TensorBoard files are logs.py's; the checkpoints the CheckpointManager's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket

from curvzo_ds.config.schema import TrainConfig, to_dict
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import dumps, write_json_atomic
from curvzo_ds.sysinfo import device_name, peak_rss_bytes, versions

log = logging.getLogger("curvzo_ds")
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "tensorboard", "eval.json", "logs")


def held_run_files(out: str) -> list[str]:
    """The names in `out` that belong to a run (RUN_FILES and checkpoint-*), sorted."""
    return sorted(n for n in (os.listdir(out) if os.path.isdir(out) else [])
                  if n in RUN_FILES or n.startswith("checkpoint-"))


def prepare_output_dir(cfg: TrainConfig, resuming: bool, comm) -> None:
    """Refuse an output_dir that is a file, or that holds another run unless resumed or overwrite_output_dir; make
    it (emptied of the old run when overwriting) and check it takes a small write, all before training."""
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output_dir={out} is a file: choose a directory")
    # Rank 0 alone looks and decides: another rank that looked later could find the logs/ that a faster rank
    # made after the check, and refuse a fresh directory.
    error = None
    if comm.rank == 0:
        held = held_run_files(out)
        if held and not resuming and not cfg.overwrite_output_dir:
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            error = (f"output_dir={out} already holds a run ({shown}): pass --resume to continue it, set "
                     "overwrite_output_dir=true to replace it, or choose another output_dir")
        else:
            try:
                if held and not resuming:  # overwrite_output_dir: the old run goes
                    for name in held:
                        target = os.path.join(out, name)
                        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
                    log.warning("overwrite_output_dir: removed %s from %s", ", ".join(held), out)
                probe_write(out)
            except OSError as e:
                error = (f"output_dir={out} cannot be written ({e.strerror or e}): free space, fix its permissions, "
                         "or choose another output_dir")
    error = comm.broadcast_object(error)
    if error:
        raise ConfigError(error)


def probe_write(directory: str, size: int = 1 << 16) -> None:
    """Create `directory` and write, flush and remove a small file there (raises OSError when it cannot)."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def refuse_untrained_eval_of_a_run(out: str) -> None:
    """`eval` without --resume next to a run: one line that points to --resume (issue 28)."""
    held = held_run_files(out)
    if held:
        raise ConfigError(f"output_dir={out} holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}), "
                          "and without --resume eval would evaluate the untrained model: pass --resume for its newest "
                          "checkpoint (or --resume CHECKPOINT), or set output_dir to another directory to evaluate "
                          "the untrained model")


def write_config(cfg: TrainConfig) -> None:
    """output_dir/config.json: the resolved config (the caller writes it on rank 0)."""
    write_json_atomic(os.path.join(cfg.output_dir, "config.json"), to_dict(cfg))


def write_run_config(cfg: TrainConfig, directory: str) -> None:
    """directory/run_config.json: the resolved config, in a checkpoint (`--resume`, `eval --resume` and export)."""
    with open(os.path.join(directory, "run_config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=1)


def write_summary(job, manager, step: int, digest: str, final: dict, best: dict | None, test: dict | None,
                  wall_seconds: float) -> dict:
    """The summary of a train Job (train/build.py) that ended at `step`, gathered from every rank: rank 0 writes
    output_dir/summary.json and logs the done line; every rank returns the summary (after a barrier)."""
    cfg, engine, comm = job.cfg, job.engine, job.topology.job
    ranks = comm.all_gather_object((peak_rss_bytes(), socket.gethostname(), device_name(job.device)))
    rss, hostnames, device_names = (list(column) for column in zip(*ranks))
    summary = {
        "params_digest": digest,
        "world_size": comm.world_size,
        "method": cfg.method,
        "seed": cfg.seed,
        "steps": step,  # the steps the weights have (a resume past max_steps is refused)
        "final": final,
        "best_dev": ({"step": best["step"], **best["metrics"], "checkpoint": best["checkpoint"],
                      "digest": best["digest"]} if best else None),
        "test": test,
        "skipped_steps": engine.skipped_total,
        "num_blocks": engine.num_blocks,
        "num_params": engine.num_params,
        "checkpoint": manager.path_for(step),
        "wall_seconds": wall_seconds,
        "peak_rss_bytes": rss,
        "threads": job.threads,
        "versions": versions(),
        "hostnames": hostnames,
        "device_names": device_names,
        "noise_generator": engine.noise.ident,
        "config_hash": config_hash(to_dict(cfg)),
        "layout": job.layout,  # train/build.py's choose_layout: zero_stage, shard_group_size, replicas, reason
    }
    if job.rank == 0:
        write_json_atomic(os.path.join(cfg.output_dir, "summary.json"), summary)
        log.info("%s", done_line(manager.metric, step, best, test, final, manager.path_for(step), digest))
    comm.barrier()
    return summary


def write_eval(output_dir: str, results: dict) -> None:
    """output_dir/eval.json (made if absent): an `eval --resume` result."""
    os.makedirs(output_dir, exist_ok=True)
    write_json_atomic(os.path.join(output_dir, "eval.json"), results)
    log.info("wrote %s", os.path.join(output_dir, "eval.json"))


def done_line(metric: str, step: int, best: dict | None, test: dict | None, final: dict, checkpoint: str,
              digest: str) -> str:
    """The run's last log line: the best-dev checkpoint's test score and digest (MeZO's rule), then the final
    weights' (summary.json's `best_dev`, `test`, `final` and `params_digest`)."""
    score = lambda metrics: f"test {metric} {fmt_value((metrics or {}).get(metric))}"  # noqa: E731
    parts = [f"done: {step} steps"]
    if best:
        parts.append(f"best dev at step {best['step']} ({best['checkpoint']}): {score(test)}, digest {best['digest']}")
    parts.append(f"final step {step} ({checkpoint}): {score(final.get('test'))}, digest {digest}")
    return "; ".join(parts)


def config_hash(config: dict) -> str:
    """The run config's hash: "sha256:" + the hex SHA-256 of its canonical JSON (sorted keys, no spaces, ASCII),
    as recomputed from config.json with json.load and json.dumps(..., sort_keys=True, separators=(",", ":"))."""
    return "sha256:" + hashlib.sha256(dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fmt_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def fmt_metrics(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
