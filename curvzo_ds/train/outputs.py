"""The files of a run's output_dir and its last log line.

- `prepare_output_dir`: the output-directory policy (take the directory's lock, `RunLock`, held for the run; refuse a
  file, a directory inside a checkpoint, a live run's directory, another run unless continued or overwritten, and a
  --resume with nothing to continue; empty it when overwriting; probe a write), before anything else goes there;
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
import sys
import time

from curvzo_ds.checkpoint.format import checkpoint_containing
from curvzo_ds.config.fields import to_dict
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import dumps, write_json_atomic
from curvzo_ds.sysinfo import device_name, peak_rss_bytes, versions

log = logging.getLogger("curvzo_ds")
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "tensorboard", "eval.json", "logs")


def held_run_files(out: str) -> list[str]:
    """The names in `out` that belong to a run (RUN_FILES and checkpoint-*), sorted."""
    return sorted(n for n in (os.listdir(out) if os.path.isdir(out) else [])
                  if n in RUN_FILES or n.startswith("checkpoint-"))


def prepare_output_dir(cfg: TrainConfig, resume, checkpoint: str | None, comm) -> RunLock | None:
    """Take output_dir's lock (rank 0; refused while another run holds it), then refuse an output_dir that is a file,
    that lies inside a checkpoint, or that holds another run, unless this run continues it from one of its
    checkpoints (`checkpoint`, resolved from `resume`) or overwrite_output_dir is set; a `--resume` into a directory
    that holds a run but no complete checkpoint is refused too. Then make the directory (emptied of the old run when
    overwriting) and check that it takes a small write, all before training. Returns the lock on rank 0 (held for
    the run; `RunLock.release`), None on the other ranks."""
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output_dir={out} is a file: choose a directory")
    inside = checkpoint_containing(out)
    if inside:
        raise ConfigError(f"output_dir={out} is inside the checkpoint {inside}: a run there would write into the "
                          "checkpoint; choose a directory outside it")
    # Rank 0 alone looks and decides: another rank that looked later could find the logs/ that a faster rank
    # made after the check, and refuse a fresh directory.
    error, lock = None, None
    if comm.rank == 0:
        try:
            os.makedirs(out, exist_ok=True)
            lock = RunLock.take(out)
            error = output_dir_refusal(cfg, resume, checkpoint)
            if error is None:
                held = held_run_files(out)
                if held and not continues(checkpoint, out):  # overwrite_output_dir: the old run goes
                    for name in held:
                        target = os.path.join(out, name)
                        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
                    log.warning("overwrite_output_dir: removed %s from %s", ", ".join(held), out)
                probe_write(out)
        except ConfigError as e:
            error = str(e)
        except OSError as e:
            error = (f"output_dir={out} cannot be written ({e.strerror or e}): free space, fix its permissions, "
                     "or choose another output_dir")
        if error and lock is not None:
            lock.release()
            lock = None
    error = comm.broadcast_object(error)
    if error:
        raise ConfigError(error)
    return lock


def continues(checkpoint: str | None, out: str) -> bool:
    """Whether a run resumed from `checkpoint` continues the run of `out` (the checkpoint is one of out's own)."""
    return checkpoint is not None and os.path.realpath(os.path.dirname(os.path.abspath(checkpoint))) == \
        os.path.realpath(out)


def output_dir_refusal(cfg: TrainConfig, resume, checkpoint: str | None) -> str | None:
    """Why a run may not write into output_dir as it holds it now, or None: another run (without --resume or
    overwrite_output_dir), a run without a complete checkpoint (under a bare --resume), or a run other than the
    one a --resume CHECKPOINT continues. A run is never written over, nor two runs' files mixed."""
    out = cfg.output_dir
    held = held_run_files(out)
    if not held or continues(checkpoint, out) or cfg.overwrite_output_dir:
        return None
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if resume is True:
        partial = [n for n in held if n.startswith("checkpoint-")]  # a .tmp, or one that did not verify (warned)
        why = f" ({', '.join(partial[:3])}: partial or damaged)" if partial else ""
        return (f"--resume: output_dir={out} holds a run ({shown}) but no complete checkpoint{why}: nothing to "
                "continue; set overwrite_output_dir=true to replace that run with a new one, or choose another "
                "output_dir")
    if resume:
        return (f"--resume {checkpoint}: output_dir={out} already holds another run ({shown}), and continuing "
                f"{checkpoint} there would mix the two runs' files: choose an empty output_dir, or set "
                "overwrite_output_dir=true to replace that run")
    return (f"output_dir={out} already holds a run ({shown}): pass --resume to continue it, set "
            "overwrite_output_dir=true to replace it, or choose another output_dir")


class RunLock:
    """An exclusive lock on output_dir for the life of a run, held by rank 0: `flock` on output_dir/.curvzo-ds.lock,
    which names the holder (pid, host, command, start). The kernel drops an flock when its process ends in any
    way (an exit, a crash, SIGKILL, a lost node's NFS lease), so a lock is never stale: the file that a killed run
    leaves behind holds no lock, and the next run takes it. `release` removes the file while still holding it."""

    NAME = ".curvzo-ds.lock"

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def take(cls, directory: str, refusal=None) -> RunLock | None:
        """The lock of `directory`, or a ConfigError naming the live run that holds it (`refusal(holder, pid)`, the
        line of a command other than train). None (with a warning) where the file system has no locks (some network
        and FUSE file systems)."""
        import fcntl

        path = os.path.join(directory, cls.NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder, pid = _holder(_read_fd(fd))
                os.close(fd)
                if refusal is not None:
                    raise ConfigError(refusal(holder, pid)) from None
                raise ConfigError(f"output_dir={directory} is in use by a live run ({holder}): a second run, resume "
                                  "or overwrite_output_dir there would mix or lose its files; wait for it to end, or "
                                  f"stop it (kill -INT {pid} saves a checkpoint) and then --resume, or choose another "
                                  "output_dir") from None
            except OSError as e:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.remove(path)
                log.warning("output_dir=%s: no lock (%s): this file system has no flock, so a second run into the "
                            "same directory would not be refused", directory, e.strerror or e)
                return None
            # the previous holder may have removed the file between our open and our flock: lock the one in place
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        command = " ".join(["curvzo-ds", *sys.argv[1:]])
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": command if len(command) <= 160 else command[:157] + "..."}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return cls(fd, path)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # while still held: a run that opens it now locks a removed file and
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):  # tries again; and only our own file (an
                os.remove(self.path)  # export's directory is renamed away with it, and a new run may lock a new one)
        os.close(self.fd)
        self.fd = None


def _read_fd(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    return ""


def _holder(text: str) -> tuple[str, str]:
    """(the holder of a lock in words, its pid) from the lock file, which the holder may still be writing; the
    file's `command` is there for whoever reads it."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}", str(h["pid"])
    except (ValueError, KeyError, TypeError):
        return "a process that has not named itself yet", "PID"


def check_writable(directory: str, what: str) -> None:
    """A one-line ConfigError unless `directory` exists as a directory, or can be made, and takes a file (for a
    command's output, before its work)."""
    try:
        probe_write(directory, size=1)
    except OSError as e:
        raise ConfigError(f"{what}={directory} cannot be written ({e.strerror or e}): fix its permissions, free space, "
                          f"or choose another {what}") from None


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


def end_counts(engine) -> dict:
    """The run's counters at its last step, taken before the final evaluations: they may load the best-dev
    checkpoint, and with it that step's counters (a rollback after it would go uncounted)."""
    return {"skipped_steps": engine.skipped_total,
            "learning_rate_chosen": engine.rate.base,  # learning_rate auto's choice (else the key's value)
            "rollbacks": engine.rate.rollbacks}  # divergence rollbacks (train/divergence.py)


def write_summary(job, manager, step: int, digest: str, final: dict, best: dict | None, test: dict | None,
                  wall_seconds: float, counts: dict) -> dict:
    """The summary of a train Job (train/build.py) that ended at `step`, gathered from every rank: rank 0 writes
    output_dir/summary.json and logs the done line; every rank returns the summary (after a barrier). `counts`:
    end_counts() at the last step."""
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
        **counts,
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
        "perturbation": engine.cfg.perturbation,  # a resumed run's is its checkpoint's (ZOEngine.load_state_dict)
        "config_hash": config_hash(to_dict(cfg)),
        "layout": job.layout,  # layout/choice.py's choose_layout: zero_stage, shard_group_size, replicas, reason
    }
    if job.rank == 0:
        write_json_atomic(os.path.join(cfg.output_dir, "summary.json"), summary)
        log.info("%s", done_line(manager.metric, step, best, test, final, manager.path_for(step), digest))
    comm.barrier()
    return summary


def write_eval(output_dir: str, results: dict) -> None:
    """output_dir/eval.json (made if absent): an `eval --resume` result. A write that fails is a one-line
    ConfigError (run_eval checked the directory before the evaluation: check_writable)."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        write_json_atomic(os.path.join(output_dir, "eval.json"), results)
    except OSError as e:
        raise ConfigError(f"output_dir={output_dir}: eval.json cannot be written ({e.strerror or e}): free space, "
                          "fix its permissions, or choose another output_dir") from None
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
