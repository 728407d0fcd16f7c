"""The run lifecycle around checkpoints (format.py holds the format itself): `CheckpointManager` saves when due,
rotates to save_total_limit keeping the best, tracks the best evaluation and the stateful components, and resolves
`--resume` (`resume_path`, the one resolver). Shared by the CLI, `from_accelerator` and `ZOTrainer`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Callable

from curvzo_ds.checkpoint.format import load_checkpoint, verify_checkpoint
from curvzo_ds.checkpoint.write import write_checkpoint
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import replace_atomic

log = logging.getLogger("curvzo_ds")
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def save_checkpoint(engine: ZOEngine, output_dir: str, trainer_state: dict | None = None,
                    write_extra: Callable[[str], None] | None = None, tokenizer=None) -> str:
    """Collective: every rank writes its owned slices to `output_dir/checkpoint-<step>` (write_checkpoint, with
    `write_extra` and `tokenizer`); returns that path."""
    return write_checkpoint(engine, checkpoint_dir(output_dir, engine.step_count), trainer_state, write_extra,
                            tokenizer)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints (a manifest, no .tmp suffix), oldest first."""
    out = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            m = _NAME.match(name)
            path = os.path.join(output_dir, name)
            if m and os.path.isfile(os.path.join(path, "manifest.json")):
                out.append((int(m.group(1)), path))
    return sorted(out)


def rotate_checkpoints(output_dir: str, keep: int | None, protect: str | list | None = None) -> None:
    """Keep the newest `keep` checkpoints, and never delete `protect` (the best-dev one; a list: each of them)."""
    if not keep:
        return
    kept = {os.path.abspath(p) for p in ([protect] if isinstance(protect, str) else protect or []) if p}
    found = list_checkpoints(output_dir)
    doomed = found[:-keep] if len(found) > keep else []
    for _, path in doomed:
        if os.path.abspath(path) not in kept:
            shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    """One run's checkpoints, shared by the CLI, `from_accelerator` and `ZOTrainer` (torchtitan's shape).

    - `save(engine)`: collective; writes `output_dir/checkpoint-<step>` (or `path`): the weights, the engine's ZO
      state, the model files (write_model_files, with `tokenizer`), the front end's own files (`write_extra(dir)`,
      rank 0) and the trainer state: the manager's own `state_dict()` (the best evaluation) and that of each
      component in `states` (objects with `state_dict()` / `load_state_dict()`), under their names. Then rank 0
      rotates to `save_total_limit`, never deleting the best checkpoint, and every rank meets at a barrier;
    - `maybe_save(engine, last)`: `save` when `save_steps` divides the step or at the last step, once per step;
    - `track(step, metrics)`: the best evaluation so far by `metric` (higher is better unless
      `greater_is_better=False`; a tie goes to the lower dev `loss`); the best is protected from rotation once
      it is saved;
    - `load(engine, path)`: the weights, the ZO state, and the state of the manager and of every component;
    - `resume_path(resume)`: the checkpoint a `--resume` means (`True`: the newest one that verifies; a path: it,
      verified).
    Collectives run on the engine's job (`engine.topology.job`).
    """

    def __init__(self, output_dir: str, *, save_steps: int = 0, save_total_limit: int | None = None,
                 metric: str | None = None, greater_is_better: bool = True, tokenizer=None,
                 states: dict | None = None, write_extra: Callable[[str], None] | None = None):
        self.output_dir = output_dir
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.tokenizer = tokenizer
        self.states = dict(states or {})
        self.write_extra = write_extra
        self.best: dict | None = None  # {"step", "metrics", "checkpoint": the saved one, protected from rotation}
        self.saved_step: int | None = None  # the step of the last save of this run
        self.initial: str | None = None  # a run's checkpoint-0 (save_initial), kept until the run ends

    def path_for(self, step: int) -> str:
        return checkpoint_dir(self.output_dir, step)

    @classmethod
    def of(cls, checkpoint_cfg, **options) -> CheckpointManager:
        """The manager of a run's `checkpoint` section (config.sections: output_dir, save_steps,
        save_total_limit; overwrite_output_dir is the output-directory policy's, train/outputs.py). `options`:
        the other keyword arguments of the constructor."""
        return cls(checkpoint_cfg.output_dir, save_steps=checkpoint_cfg.save_steps,
                   save_total_limit=checkpoint_cfg.save_total_limit, **options)

    def is_better(self, metrics: dict, than: dict | None = None) -> bool:
        """Whether the evaluation `metrics` is better than the best so far (or than the evaluation `than`)."""
        value = metrics.get(self.metric) if self.metric else None
        if value is None:
            return False
        reference = than if than is not None else self.best and self.best["metrics"]
        if reference is None:
            return True
        best = reference.get(self.metric)
        if best is None:
            return True
        if value == best:  # a tie (F1 or accuracy on a small dev set often ties): the lower dev loss is better
            loss, best_loss = metrics.get("loss"), reference.get("loss")
            return _finite(loss) and (not _finite(best_loss) or loss < best_loss)
        return value > best if self.greater_is_better else value < best

    def track(self, step: int, metrics: dict) -> bool:
        """Record an evaluation at `step`; True when it is the best so far. Its checkpoint is protected from
        rotation once `save` writes the checkpoint of that step (until then the previous best one stays)."""
        if not self.is_better(metrics):
            return False
        self.best = {"step": step, "metrics": dict(metrics), "checkpoint": self.best and self.best["checkpoint"]}
        return True

    def save(self, engine, path: str | None = None, mark_latest: bool = False,
             extra_state: dict | None = None) -> str:
        """Collective: write the checkpoint of the engine's current step, rotate, and meet at a barrier.

        `mark_latest`: also name it in `output_dir/latest` (DeepSpeed's convention, read by `tagged_latest`);
        `extra_state`: more trainer state for this checkpoint only (DeepSpeed's client_state)."""
        step = engine.step_count
        path = path or self.path_for(step)
        if self.best is not None and self.best["step"] == step:
            self.best["checkpoint"] = path
        trainer = {"checkpoints": self.state_dict(), **{name: s.state_dict() for name, s in self.states.items()},
                   **(extra_state or {})}
        path = write_checkpoint(engine, path, trainer, self.write_extra, self.tokenizer)
        job = engine.topology.job
        if job.rank == 0:
            rotate_checkpoints(self.output_dir, self.save_total_limit,
                               protect=[self.best["checkpoint"] if self.best else None, self.initial])
            if mark_latest:
                replace_atomic(os.path.join(self.output_dir, "latest"), os.path.basename(path))
        job.barrier()
        self.saved_step = step
        log.info("saved %s%s", path, " (the best evaluation so far)" if self.best and self.best["step"] == step
                 and self.metric else "")
        return path

    def save_initial(self, engine) -> str:
        """Collective: checkpoint-0, the weights a run starts from, for a divergence rollback to a step before any
        other checkpoint (train/divergence.py). Kept from rotation while the run goes on (a resumed run finds it), and
        removed when the run ends (`drop_initial`), so a finished run's checkpoints are as without it."""
        self.initial = self.save(engine)
        return self.initial

    def keep_initial(self) -> None:
        """A resumed run: the checkpoint-0 of its first start, if it is there, stays its fallback."""
        path = self.path_for(0)
        if os.path.isfile(os.path.join(path, "manifest.json")):
            self.initial = path

    def drop_initial(self, rank: int) -> None:
        """The run ended: checkpoint-0 goes (rank 0), unless it is the best-dev checkpoint."""
        best = self.best and self.best.get("checkpoint")
        if rank == 0 and self.initial and not (best and os.path.abspath(best) == os.path.abspath(self.initial)):
            shutil.rmtree(self.initial, ignore_errors=True)
        self.initial = None

    def maybe_save(self, engine, last: bool = False) -> str | None:
        """Save when `save_steps` divides the step or at the `last` step, unless this step is saved already;
        returns the path written, or None."""
        step = engine.step_count
        due = last or (self.save_steps and step % self.save_steps == 0)
        return self.save(engine) if due and self.saved_step != step else None

    def load(self, engine, path: str) -> dict:
        """Collective: the checkpoint's weights and ZO state into `engine`, and its trainer state into the manager
        and each component; returns the trainer state."""
        trainer = load_checkpoint(engine, path)
        # A checkpoint from before issue 27 holds the same states in one flat mapping ("best_dev", "seconds").
        self.load_state_dict(trainer.get("checkpoints", trainer))
        for name, component in self.states.items():
            component.load_state_dict(trainer.get(name, trainer))
        return trainer

    def tagged_latest(self) -> str:
        """The checkpoint `output_dir/latest` names (DeepSpeed's `load_checkpoint(dir)` with no tag)."""
        latest = os.path.join(self.output_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{self.output_dir} has no 'latest' file: pass tag=<checkpoint name>")
        with open(latest) as f:
            return os.path.join(self.output_dir, f.read().strip())

    def resume_path(self, resume) -> str | None:
        """The checkpoint a `--resume` means: None (no resume), for `True` the newest one in `output_dir` that
        verifies (each newer one that does not is named in a warning and skipped; None when there is none), or the
        given path, which must verify (else a one-line ConfigError)."""
        if not resume:
            return None
        if resume is True:
            for _, path in reversed(list_checkpoints(self.output_dir)):
                try:
                    verify_checkpoint(path)
                    return path
                except ValueError as e:
                    log.warning("skipping checkpoint %s: %s", path, e)
            return None
        if not os.path.isdir(str(resume)):
            raise ConfigError(f"--resume {resume}: no such checkpoint directory")
        try:
            verify_checkpoint(str(resume))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--resume {resume}: {e}") from None
        return str(resume)

    def state_dict(self) -> dict:
        return {"best_dev": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state.get("best_dev")


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
