"""`metrics.jsonl` (one strict-JSON object per line, docs/outputs.md) and its mirror in the trackers of report_to;
console and file logging; progress. `RunLog` is what a training run records as it goes (metrics, the pi side file,
progress).

Only rank 0 writes: other ranks build a `MetricsWriter(..., enabled=False)`, whose calls do nothing.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
import time

from curvzo_ds.config.report_to import resolve_report_to
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import dumps, replace_atomic
from curvzo_ds.startup import take_captured
from curvzo_ds.train.pilog import PiWriter
from curvzo_ds.train.trackers import Trackers

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger("curvzo_ds")


class MetricsWriter:
    """Appends rows to `<output_dir>/metrics.jsonl`, flushed per line, and mirrors their numbers to the trackers of
    `report_to` (train/trackers.py).

    A row with a `split` is logged to the trackers as `<split>/<key>`, any other row as `train/<key>`, at the row's
    `step`. TensorBoard files go to `tensorboard_dir` (default `<output_dir>/tensorboard`). `tensorboard=True`
    is `trackers=["tensorboard"]`; `run_config` is given to the trackers other than TensorBoard as hyperparameters.
    """

    def __init__(self, output_dir: str, enabled: bool = True, tensorboard: bool = False,
                 tensorboard_dir: str | None = None, trackers: list[str] | None = None,
                 run_config: dict | None = None):
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.enabled = enabled
        names = list(trackers or [])
        if tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        self.tensorboard = "tensorboard" in names and enabled
        self.tensorboard_dir = tensorboard_dir or os.path.join(output_dir, "tensorboard")
        self._file = None
        self.trackers = Trackers(names if enabled else [], output_dir, self.tensorboard_dir, run_config)
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError:
                raise ConfigError("report_to=tensorboard needs the tensorboard package: pip install tensorboard, "
                                  "or remove tensorboard from report_to") from None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        line = dumps(row)
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # kept open for the run
        self._file.write(line + "\n")
        self._file.flush()
        if self.trackers.names:  # the values as written: a non-finite number is null, left out
            self.trackers.log(json.loads(line))

    def truncate_after(self, step: int) -> int:
        """On resume from `step`: keep the lines with step <= `step`, drop the rest; return how many went.

        The end-of-run evaluation lines (`"final": true`) are dropped too: a run that goes on would
        not have written them.

        A line that does not parse (a crash in the middle of a write) is dropped too, with a warning
        naming it, so a resumed run's file matches the straight run's. TensorBoard events after `step`
        are purged on the next write.
        """
        if not self.enabled:
            return 0
        self.close()
        self.trackers.purge_after(step)
        if not os.path.exists(self.path):
            return 0
        kept, dropped, torn = [], 0, []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    dropped += 1
                    torn.append(number)
                    continue
                row_step = row.get("step") if isinstance(row, dict) else None
                final_eval = isinstance(row, dict) and row.get("final") is True
                if isinstance(row_step, int | float) and row_step > step or final_eval:
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if torn:  # said, not silent: the last line is a crash's torn write, any other a damaged file
            log.warning("%s: dropped line%s %s, which %s not JSON (a write cut short by a crash, or a damaged file)",
                        self.path, "s" * (len(torn) > 1), ", ".join(map(str, torn[:5])) + ", ..." * (len(torn) > 5),
                        "are" if len(torn) > 1 else "is")
        if dropped:
            replace_atomic(self.path, "".join(kept))
        return dropped

    def split_off_after(self, step: int, side_path: str) -> int:
        """A rollback to `step`: the lines after it move to `side_path` (kept, appended), so that metrics.jsonl
        holds one trajectory whose steps never go back; returns how many moved."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        self.close()
        moved = [row for row in read_metrics(self.path) if isinstance(row.get("step"), int | float)
                 and row["step"] > step]
        with open(side_path, "a", encoding="utf-8") as f:
            f.writelines(dumps(row) + "\n" for row in moved)
        self.truncate_after(step)
        return len(moved)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.trackers.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str, skipped: list[int] | None = None) -> list[dict]:
    """The rows of a metrics.jsonl file (a directory is taken to hold one). A line that is not a JSON object is left
    out, and its number (from 1) appended to `skipped` when given, for the caller to say so."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            elif line.strip() and skipped is not None:
                skipped.append(number)
    return rows


def setup_logging(rank: int, level: str) -> None:
    """The console shows `level` on rank 0 and warnings on the other ranks. Every rank keeps its records at `level`
    (up to 10000 of them) until log_to_file opens its own log file, once the output directory has been checked."""
    lvl = getattr(logging, level.upper())
    logging.basicConfig(level=lvl, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", force=True)
    root = logging.getLogger()
    console = root.handlers[0]
    console.setLevel(lvl if rank == 0 else logging.WARNING)
    pending = PendingRecords()
    pending.setFormatter(console.formatter)
    root.addHandler(pending)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for line in take_captured():  # DeepSpeed's start-up prints, kept off stdout (startup.py)
        log.info("deepspeed: %s", line)


class PendingRecords(logging.Handler):
    """Holds the records logged before this rank's log file opens (the newest `limit`)."""

    def __init__(self, limit: int = 10000):
        super().__init__()
        self.records: collections.deque = collections.deque(maxlen=limit)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def log_to_file(path: str, append: bool) -> None:
    """Send this rank's records, at the level setup_logging set, to `path` too (appended to on a resume), starting
    with those logged before (in setup_logging's format)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    root = logging.getLogger()
    handler = logging.FileHandler(path, mode="a" if append else "w", encoding="utf-8")
    for pending in [h for h in root.handlers if isinstance(h, PendingRecords)]:
        root.removeHandler(pending)
        handler.setFormatter(pending.formatter)
        for record in pending.records:
            handler.handle(record)
    root.addHandler(handler)


class LogProgress:
    """The progress bar's figures as a log line every `interval` seconds, for logs that are files (cluster jobs):
    a tqdm bar there is one endless line of carriage returns."""

    def __init__(self, total: int, start: int, interval: float):
        self.total, self.n, self.start, self.interval = total, start, start, interval
        self.t0 = self.last = time.time()
        self.postfix = {}

    def update(self, n: int) -> None:
        self.n += n
        now = time.time()
        if now - self.last >= self.interval or self.n == self.total:
            self.last = now
            rate = (self.n - self.start) / max(now - self.t0, 1e-9)
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            log.info("step %d/%d (%.0f%%) %s, %.2f steps/s, ETA %s", self.n, self.total, 100 * self.n / self.total,
                     extra, rate, time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 8.64e4 else f"{eta:.0f}s")

    def set_postfix(self, refresh: bool = True, **kw) -> None:
        self.postfix = kw

    def close(self) -> None:
        pass


def progress_logging(bar):
    """While a tqdm bar is open in a terminal, log records are written through it (tqdm.write), so they do not
    end up glued onto the bar's line."""
    if bar is None or isinstance(bar, LogProgress):
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def make_progress(logging_cfg, max_steps: int, rank: int, start: int):
    """A tqdm bar on rank 0 when stderr is a terminal with a width, else log lines (every `progress_interval`
    seconds): a terminal that reports 0 columns (some container and CI consoles) shows no tqdm bar at all.
    `logging_cfg`: the config's `logging` section (its `disable_tqdm`, `progress_interval`)."""
    if rank != 0 or logging_cfg.disable_tqdm:
        return None
    if not sys.stderr.isatty() or terminal_columns() == 0:
        return LogProgress(max_steps, start, logging_cfg.progress_interval)
    from tqdm.auto import tqdm

    return tqdm(total=max_steps, initial=start, desc="curvzo", unit="step", dynamic_ncols=True)


def terminal_columns() -> int:
    """The width of the terminal on stderr (0 when it reports none)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


class RunLog:
    """What a training run records as it goes, on rank 0 (docs/outputs.md): a metrics.jsonl line every
    `logging_steps`, at the last step and at a stop; the pi side file on the same logging steps (not for MeZO,
    whose pi is all 1); eval lines; the progress bar or progress lines. On resume from `start` the files drop
    what came after it. Build it only once the output directory has been checked: it writes there.

    `logging_cfg` is the config's `logging` section (config.sections: logging_steps, report_to, the progress
    keys); the keys of other sections it needs are passed as values: `output_dir` (checkpoint), `max_steps`
    (engine), `pi_file` (false for the sampler's method mezo), `run_config` (the whole run's keys, which trackers
    other than TensorBoard record as hyperparameters)."""

    def __init__(self, logging_cfg, *, output_dir: str, max_steps: int, pi_file: bool, rank: int,
                 block_names: list[str], start: int, run_config: dict | None = None):
        self.logging_steps, self.max_steps = logging_cfg.logging_steps, max_steps
        self.metrics = MetricsWriter(output_dir, enabled=rank == 0,
                                     trackers=resolve_report_to(logging_cfg.report_to) if rank == 0 else [],
                                     run_config=run_config if rank == 0 else None)
        self.metrics.truncate_after(start)
        self.pi = PiWriter(output_dir, block_names, enabled=rank == 0 and pi_file)
        self.pi.truncate_after(start)
        self.bar = make_progress(logging_cfg, max_steps, rank, start)

    def step(self, r, seconds: float) -> None:
        """A finished update (an engine StepResult)."""
        due = r.step % self.logging_steps == 0 or r.step == self.max_steps
        if due or r.stop:
            self.metrics.write({**r.as_dict(), "seconds": seconds})
        if due and self.pi.enabled:
            self.pi.write(r.step, r.pi)  # the pi that this update drew its mask from
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{r.loss:.4f}" if r.loss is not None else "-", budget=f"{r.budget:.1f}",
                                 blocks=r.n_selected, refresh=False)
            self.bar.update(1)

    def evaluation(self, step: int, split: str, metrics: dict, final: bool = False, best_dev: bool = False) -> None:
        """An eval line; `final`: one of the end-of-run evaluations (a resumed run drops them); `best_dev`: the test
        metrics of the best-dev checkpoint (an earlier step's), summary.json's `test`."""
        marks = {**({"final": True} if final else {}), **({"best_dev": True} if best_dev else {})}
        self.metrics.write({"step": step, "split": split, **marks, **metrics})

    def rollback(self, diverged_at: int, to_step: int, learning_rate: float, rollbacks: int, reason: str) -> None:
        """A divergence rollback (train/divergence.py): the lines after `to_step` move to
        metrics-diverged-<rollbacks>.jsonl beside metrics.jsonl, which gains the event row; the pi file and the
        progress go back to `to_step`."""
        side = os.path.join(os.path.dirname(self.metrics.path), f"metrics-diverged-{rollbacks}.jsonl")
        self.metrics.split_off_after(to_step, side)
        self.pi.truncate_after(to_step)
        self.metrics.write({"event": "rollback", "step": to_step, "diverged_at": diverged_at,
                            "learning_rate": learning_rate, "rollbacks": rollbacks, "reason": reason})
        if self.bar is not None:
            self.bar.n = to_step

    def progress(self):
        """The context of the loop: log lines go through the bar in a terminal."""
        return progress_logging(self.bar)

    def end_steps(self) -> None:
        """The loop is over: the pi file and the bar close (the metrics stay open for the final evaluations)."""
        self.pi.close()
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        self.end_steps()
        self.metrics.close()
