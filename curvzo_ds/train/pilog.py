"""`pi.bin` and `pi.json`: the sampling probabilities pi of every block, one row every `logging_steps`.

A side file for `curvzo-ds plot`'s heat map (docs/outputs.md): G numbers a row are too many for metrics.jsonl.
`pi.json` is the header (block names, G, dtype); `pi.bin` holds the rows, each a little-endian int64 step
followed by G values of that dtype (float16 by default: 2 bytes a block). A row with step k holds the pi that
step k's update drew its mask from, so it sits beside the metrics.jsonl train line of step k.

Only rank 0 writes: other ranks build a `PiWriter(..., enabled=False)`, whose calls do nothing.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from curvzo_ds.jsonio import write_json_atomic

PI_HEADER = "pi.json"
PI_FILE = "pi.bin"
FORMAT = "curvzo_ds pi 1"
DTYPES = ("float16", "float32")


def _row(dtype: str, num_blocks: int) -> np.dtype:
    return np.dtype([("step", "<i8"), ("pi", np.dtype(dtype).newbyteorder("<"), (num_blocks,))])


class PiWriter:
    """Appends rows to `<output_dir>/pi.bin` (flushed per row), after writing the header `pi.json`."""

    def __init__(self, output_dir: str, names: list[str], enabled: bool = True, dtype: str = "float16"):
        if dtype not in DTYPES:
            raise ValueError(f"PiWriter dtype={dtype!r}: use one of {', '.join(DTYPES)}")
        self.header_path = os.path.join(output_dir, PI_HEADER)
        self.path = os.path.join(output_dir, PI_FILE)
        self.names = [str(n) for n in names]
        self.enabled = enabled
        self.header = {"format": FORMAT, "num_blocks": len(self.names), "dtype": dtype,
                       "row": f"little-endian int64 step, then num_blocks {dtype} values", "names": self.names}
        self.row = _row(dtype, len(self.names))
        self._file = None

    def write(self, step: int, pi) -> None:
        """One row: `pi` (a torch tensor or array of G probabilities) as used by step `step`."""
        if not self.enabled:
            return
        values = np.asarray(pi.detach().cpu() if hasattr(pi, "detach") else pi, dtype=np.float64)
        if values.shape != (len(self.names),):
            raise ValueError(f"pi has shape {tuple(values.shape)}; the header names {len(self.names)} blocks")
        if self._file is None:
            self._prepare()
            if os.path.exists(self.path) and os.path.getsize(self.path) % self.row.itemsize:
                self.truncate_after(step - 1)  # a torn last row (a crash), and no truncate_after before
            self._file = open(self.path, "ab")  # kept open for the run
        row = np.zeros(1, dtype=self.row)
        row["step"], row["pi"][0] = step, values
        self._file.write(row.tobytes())
        self._file.flush()

    def truncate_after(self, step: int) -> int:
        """On resume from `step`: keep the rows with step <= `step`, drop the rest; return how many went.

        A partly written last row (a crash in the middle of a write) goes too, and so do the rows of another
        run (another header: other blocks or dtype) left in the directory.
        """
        if not self.enabled:
            return 0
        self.close()
        dropped = self._prepare()
        if not os.path.exists(self.path):
            return dropped
        size = os.path.getsize(self.path)
        steps = np.fromfile(self.path, dtype=self.row, count=size // self.row.itemsize)["step"]
        over = np.flatnonzero(steps > step)  # rows are in step order: the kept ones are a prefix
        keep = int(over[0]) if len(over) else len(steps)
        if keep * self.row.itemsize != size:
            os.truncate(self.path, keep * self.row.itemsize)
        return dropped + len(steps) - keep + (size % self.row.itemsize > 0)

    def _prepare(self) -> int:
        """Write the header unless the directory has ours; the rows of another header go. Returns how many."""
        old = _load_header(self.header_path)
        if old == self.header:
            return 0
        dropped = 0
        if os.path.exists(self.path):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                dropped = os.path.getsize(self.path) // _row(old["dtype"], int(old["num_blocks"])).itemsize
            os.remove(self.path)
        write_json_atomic(self.header_path, self.header)
        return dropped

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> PiWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load_header(path: str):
    """The parsed header at `path`, or None when there is none or it does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def has_pi(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, PI_HEADER))


def read_pi(run_dir: str) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(steps int64 [N], block names [G], pi float32 [N, G]) of a run directory's pi file.

    A partly written last row is left out. Raises FileNotFoundError without `pi.json`, ValueError when it is
    not a pi header.
    """
    header_path = os.path.join(run_dir, PI_HEADER)
    if not os.path.isfile(header_path):
        raise FileNotFoundError(f"{header_path}: no such file")
    header = _load_header(header_path)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{header_path} is not a curvzo_ds pi header (format {FORMAT!r})")
    names = list(header["names"])
    row = _row(header["dtype"], int(header["num_blocks"]))
    path = os.path.join(run_dir, PI_FILE)
    count = os.path.getsize(path) // row.itemsize if os.path.exists(path) else 0
    rows = np.fromfile(path, dtype=row, count=count) if count else np.zeros(0, dtype=row)
    return rows["step"].astype(np.int64), names, rows["pi"].astype(np.float32).reshape(count, len(names))


__all__ = ["PI_FILE", "PI_HEADER", "PiWriter", "has_pi", "read_pi"]
