"""The experiment trackers of `report_to` (docs/outputs.md, "Trackers"): accelerate.tracking's classes, fed the
numbers of each metrics.jsonl line, on rank 0 only (the writer of metrics.jsonl builds them).

A line is logged at its `step`, each number as `<split>/<field>`: `train/loss`, `dev/accuracy`, `test/f1`, the
field names of metrics.jsonl. Strings, booleans and nulls (a non-finite value) are left out. The test line of the
best-dev checkpoint (`"best_dev": true`, at that earlier step) goes in as `test_at_best_dev/<field>` at the last step
logged: trackers such as W&B take steps in order only.
"""

from __future__ import annotations

import contextlib
import logging
import os

# The metrics.jsonl fields that say where a line belongs rather than measure something.
NOT_METRICS = ("step", "split")


def scalars(row: dict) -> dict[str, int | float]:
    """The numbers of one metrics.jsonl line under their tracker names."""
    prefix = "test_at_best_dev" if row.get("best_dev") is True else row.get("split") or "train"
    return {f"{prefix}/{key}": value for key, value in row.items()
            if key not in NOT_METRICS and not isinstance(value, bool) and isinstance(value, int | float)}


def tracker_kwargs(name: str, output_dir: str, tensorboard_dir: str, purge_step: int | None) -> dict:
    """The arguments of accelerate's tracker class `name`. The project and run names follow Hugging Face's
    integrations: the tracker's own environment variables first, else `curvzo_ds` and the output directory."""
    project = "curvzo_ds"
    if name == "tensorboard":  # <tensorboard_dir>, as before the other trackers came; events after a resume purged
        parent, leaf = os.path.split(os.path.abspath(tensorboard_dir))
        return dict(run_name=leaf, logging_dir=parent, purge_step=purge_step)
    if name == "wandb":
        return dict(run_name=os.environ.get("WANDB_PROJECT", project), name=os.environ.get("WANDB_NAME", output_dir))
    if name == "mlflow":  # MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID, MLFLOW_TAGS win inside the class
        return dict(experiment_name=project, run_name=output_dir)
    if name == "aim":
        return dict(run_name=output_dir, logging_dir=output_dir)
    if name in ("clearml", "dvclive"):
        return dict(run_name=output_dir)
    return dict(run_name=project)  # comet_ml, swanlab, trackio: the project


class Trackers:
    """accelerate.tracking trackers started with the first line logged. `purge_after(step)` on a resume: TensorBoard
    drops its events after `step` (the other trackers start a new run, or go on with the one their environment
    names, such as WANDB_RUN_ID with WANDB_RESUME or MLFLOW_RUN_ID)."""

    def __init__(self, names: list[str], output_dir: str, tensorboard_dir: str, run_config: dict | None = None):
        self.names = list(names)
        self.output_dir, self.tensorboard_dir = output_dir, tensorboard_dir
        self.run_config = run_config
        self.purge_step: int | None = None
        self.last_step = 0  # the largest step logged
        self._started: list = []

    def log(self, row: dict) -> None:
        step = row.get("step")
        if not self.names or not isinstance(step, int):
            return
        step = max(step, self.last_step) if row.get("best_dev") is True else step
        self.last_step = max(self.last_step, step)
        if not self._started:
            self._start()
        values = scalars(row)
        if values:
            with plain_accelerate_logger():
                for tracker in self._started:
                    tracker.log(values, step=step)

    def _start(self) -> None:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        with plain_accelerate_logger():
            for name in self.names:
                self._started.append(self._start_one(LOGGER_TYPE_TO_CLASS[name], name))

    def _start_one(self, cls, name: str):
        tracker = cls(**tracker_kwargs(name, self.output_dir, self.tensorboard_dir, self.purge_step))
        # Only rank 0 builds trackers: no need for accelerate's PartialState to ask which rank this is.
        tracker.main_process_only = False
        tracker.start()
        if self.run_config is not None and name != "tensorboard":  # TensorBoard: config.json is beside it
            tracker.store_init_configuration(hyperparameters(self.run_config))
        return tracker

    def purge_after(self, step: int) -> None:
        self.close()
        self.purge_step = step + 1

    def close(self) -> None:
        with plain_accelerate_logger():
            for tracker in self._started:
                tracker.finish()
        self._started = []


@contextlib.contextmanager
def plain_accelerate_logger():
    """accelerate.tracking's debug lines go through accelerate's multi-process logger, which refuses to log before
    an `Accelerator` or `PartialState` exists. Building a PartialState on rank 0 alone, in a job that DeepSpeed's
    process group runs, is not ours to do: while a tracker is called, the module logs through a plain logger."""
    import accelerate.tracking as tracking
    from accelerate.state import PartialState

    if PartialState._shared_state:
        yield
        return
    adapter = tracking.logger
    tracking.logger = logging.getLogger(tracking.__name__)
    try:
        yield
    finally:
        tracking.logger = adapter


def hyperparameters(config: dict) -> dict:
    """The run config as trackers take hyperparameters: str, bool, int, float or None (lists as text)."""
    return {k: v if v is None or isinstance(v, str | bool | int | float) else str(v) for k, v in config.items()}
