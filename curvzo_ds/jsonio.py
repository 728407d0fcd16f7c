"""Strict JSON (no NaN or Infinity: a value that is not finite is written as `null`, docs/contracts.md) and
atomic file writes: a reader sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any


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
    replace_atomic(path, dumps(obj, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def honour_umask(path: str) -> None:
    """Give a file the mode a plain open() would: safetensors' save_file creates 0600 whatever the umask."""
    os.chmod(path, 0o666 & ~_umask())


def replace_atomic(path: str, text: str) -> None:
    """A reader sees the old file or the new one, never a half-written one (os.replace is atomic)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open() would honour the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
