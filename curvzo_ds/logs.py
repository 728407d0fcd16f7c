"""Run outputs: `metrics.jsonl` (one strict-JSON object per line), TensorBoard, `summary.json`.

JSON has no NaN or Infinity, so every value that is not finite is written as `null`
(CONTRACTS.md), in nested lists and mappings too. numpy and torch scalars become Python numbers.
Only rank 0 writes: other ranks build a `MetricsWriter(..., enabled=False)`, whose calls do nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import sys
import tempfile
from importlib import metadata
from typing import Any

from .config import ConfigError

METRICS_FILE = "metrics.jsonl"


def to_jsonable(value: Any) -> Any:
    """`value` with non-finite floats as None and numpy/torch scalars and arrays as Python values."""
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays, torch tensors
        return to_jsonable(value.tolist())
    raise TypeError(f"{type(value).__name__} value {value!r} cannot be written as JSON")


def dumps(value: Any, **kwargs) -> str:
    return json.dumps(to_jsonable(value), allow_nan=False, **kwargs)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write strict JSON (nulls for non-finite numbers) to a temp file, then rename it over `path`."""
    _replace_atomic(path, dumps(obj, indent=2) + "\n")


def _replace_atomic(path: str, text: str) -> None:
    """A reader sees the old file or the new one, never a half-written one (os.replace is atomic)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be read by others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class MetricsWriter:
    """Appends rows to `<output_dir>/metrics.jsonl`, flushed per line, and mirrors numbers to TensorBoard.

    A row with `"split": "dev"` is logged to TensorBoard as `dev/<key>`, any other row as
    `train/<key>`, at the row's `step`. TensorBoard files go to `tensorboard_dir`
    (default `<output_dir>/tensorboard`).
    """

    def __init__(self, output_dir: str, enabled: bool = True, tensorboard: bool = False,
                 tensorboard_dir: str | None = None):
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.enabled = enabled
        self.tensorboard = tensorboard and enabled
        self.tensorboard_dir = tensorboard_dir or os.path.join(output_dir, "tensorboard")
        self._file = None
        self._summary = None
        self._purge_step: int | None = None
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError:
                raise ConfigError("report_to=tensorboard needs the tensorboard package: pip install tensorboard, "
                                  "or set report_to=none") from None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        line = dumps(row)
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # kept open for the run
        self._file.write(line + "\n")
        self._file.flush()
        if self.tensorboard:
            self._log_tensorboard(json.loads(line))

    def _log_tensorboard(self, row: dict) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        if self._summary is None:
            from torch.utils.tensorboard import SummaryWriter

            self._summary = SummaryWriter(log_dir=self.tensorboard_dir, purge_step=self._purge_step)
        prefix = row.get("split") or "train"
        for key, value in row.items():
            if key in ("step", "split") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self._summary.add_scalar(f"{prefix}/{key}", value, global_step=step)
        self._summary.flush()

    def truncate_after(self, step: int) -> int:
        """On resume from `step`: keep the lines with step <= `step`, drop the rest; return how many went.

        The end-of-run evaluation lines (`"final": true`) are dropped too: a run that goes on would
        not have written them.

        A line that does not parse (a crash in the middle of a write) is dropped too, so a resumed
        run's file matches the straight run's. TensorBoard events after `step` are purged on the
        next write.
        """
        if not self.enabled:
            return 0
        self.close()
        self._purge_step = step + 1
        if not os.path.exists(self.path):
            return 0
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    dropped += 1
                    continue
                row_step = row.get("step") if isinstance(row, dict) else None
                final_eval = isinstance(row, dict) and row.get("final") is True
                if isinstance(row_step, int | float) and row_step > step or final_eval:
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            _replace_atomic(self.path, "".join(kept))
        return dropped

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._summary is not None:
            self._summary.close()
            self._summary = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file (a directory is taken to hold one), skipping unparsable lines."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def rss_bytes(trim: bool = False) -> int | None:
    """This process's resident set size now (Linux /proc; None elsewhere).

    trim: first return freed heap memory to the system (glibc malloc_trim), so the figure counts
    live memory rather than what the allocator keeps for reuse.
    """
    if trim:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages a run's numbers depend on (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("curvzo_ds", "torch", "deepspeed", "transformers", "accelerate", "peft"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if found["curvzo_ds"] is None:
        found["curvzo_ds"] = getattr(sys.modules.get(__package__), "__version__", None)
    return found


__all__ = ["MetricsWriter", "write_json_atomic", "read_metrics", "peak_rss_bytes", "versions", "to_jsonable",
           "dumps", "METRICS_FILE"]
