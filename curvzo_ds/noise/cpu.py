"""The CPU noise kernel: philox.c, compiled with the system C compiler at first use, called through ctypes.

Like DeepSpeed's ops, the kernel is built on the machine that runs it, once, and cached under
`~/.cache/curvzo_ds/kernels/` (or `$CURVZO_DS_CACHE`), keyed by a hash of the source, the compiler's
version, the flags and this CPU's feature flags, so several ranks, edits, or a cluster of mixed CPUs
never load a wrong library (each build goes to a temporary file that is renamed into place). It needs
no torch headers, so a build takes about a second.

Flags: `-march=native` for the widest vectors; `-ffp-contract=off -fno-fast-math` keep every float
operation separately rounded (no FMA contraction), which is what makes the values bit-identical to the
torch reference and to the GPU kernel; `-fno-math-errno` only lets gcc vectorise sqrtf. Every build also gets the
row format and the element modes as -D flags (rows.c_defines()).
Without a compiler, `available()` is False and the backend chooser (gaussian.backend) picks the torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from curvzo_ds.environment import cache_dir, noise_kernel
from curvzo_ds.noise import rows as row_abi
from curvzo_ds.noise.rows import ElementMode

log = logging.getLogger("curvzo_ds")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "philox.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_failed: str | None = None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(flags: list[str] | None = None) -> str:
    """Path of the compiled library for `flags` (default FLAGS) and the row format, building it if it is not cached."""
    flags = list(FLAGS if flags is None else flags) + row_abi.c_defines()
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc}) to build the noise kernel")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    with open(SOURCE, "rb") as f:
        source = f.read()
    tag = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    directory = os.path.join(cache_dir(), "kernels")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"philox-{tag}.so")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, SOURCE, "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, path)
        except subprocess.CalledProcessError as e:
            os.unlink(tmp)
            raise RuntimeError(f"building the noise kernel failed: {e.stderr.strip()[-500:]}") from None
    return path


def load(flags: list[str] | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(build(flags))
    lib.noise_run.restype = ctypes.c_int64
    lib.noise_run.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.noise_run64.restype = ctypes.c_int64
    lib.noise_run64.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_double, ctypes.c_double, ctypes.c_int]
    lib.noise_rows.restype = None
    lib.noise_rows.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.noise_rows_keys.restype = None
    lib.noise_rows_keys.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> bool:
    """True when the kernel is built and loaded (once per process); False, with one warning, when it cannot be."""
    global _lib, _failed
    if _lib is None and _failed is None:
        if noise_kernel() == "torch":
            _failed = "CURVZO_DS_NOISE_KERNEL=torch"
        else:
            try:
                _lib = load()
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                _failed = str(e)
                log.warning("noise: the compiled CPU kernel is unavailable (%s); using the torch reference, which "
                            "gives the same values about 50 times slower", _failed)
    return _lib is not None


def run(k0: int, k1: int, start: int, out: torch.Tensor, mode: ElementMode, scale: float, alpha: float,
        want_sq: bool, rademacher: bool = False) -> int:
    """out[i] <- z[start + i] (WRITE_Z) or out * scale + alpha * z (the dtype modes); returns sum round(z^2 2^24).
    z: normals, or +-1 signs with `rademacher`."""
    if not out.is_contiguous():
        raise ValueError("the noise kernel needs a contiguous tensor")
    if mode == ElementMode.FLOAT64 and rademacher:  # noise_run64 draws normals: a one-row table
        row = np.zeros((1, row_abi.WIDTH), dtype=np.int64)
        row[0, [row_abi.DST, row_abi.SRC]] = out.data_ptr()
        key = k1 << 32 | k0
        row[0, row_abi.N], row[0, row_abi.START] = out.numel(), start
        row[0, row_abi.KEY] = key - (1 << 64) if key >= 1 << 63 else key  # the two words as one int64
        row[0, row_abi.STAT] = 0
        row[0, row_abi.KIND] = row_abi.kind(mode, mode)
        return int(run_rows(row, np.array([[scale, alpha]]), 1, want_sq, rademacher=True)[0])
    if mode == ElementMode.FLOAT64:
        return _lib.noise_run64(k0, k1, start, out.numel(), out.data_ptr(), scale, alpha, int(want_sq))
    return _lib.noise_run(k0, k1, start, out.numel(), out.data_ptr(), mode | (row_abi.RADEMACHER if rademacher else 0),
                          scale, alpha, int(want_sq))


_pool: ThreadPoolExecutor | None = None


def run_rows(rows: np.ndarray, coef: np.ndarray, num_blocks: int, want_sq: bool, threads: int = 1,
             keys: np.ndarray | None = None, rademacher: bool = False) -> np.ndarray:
    """One pass over a row table (rows.py's format: int64 [R, WIDTH]); returns the int64 sums of round(z^2 2^24) per
    block [num_blocks] (zeros without want_sq).

    keys None: each row's noise key is its KEY column and coef is float64 [R, 2] = (scale, alpha): a row does
    dst = src * scale + alpha * z. keys int64 [R, K] (each k0 | k1 << 32, K >= 1; the KEY column is then not read):
    coef is float64 [R, 1 + K] = (scale, alpha_0 .. alpha_{K-1}) and a row does dst = src * scale + acc with
    acc = alpha_0 z_0, then acc = acc + alpha_k z_k for k = 1 .. K-1 (each op rounded separately, in float32; float64
    rows in float64), every z_k drawn at the row's START; the statistics are the last key's z. K = 1 gives the bits
    of keys None. Copy rows ignore the keys. `rademacher`: every row's z are +-1 signs (the KIND column's RADEMACHER
    flag, set here on a copy of the table; a row that has it already keeps it).

    With threads > 1 the rows are cut into `threads` parts of about equal element counts, each run by one thread:
    the ctypes call releases the GIL, so offloaded parameters get every core. The values do not depend on the
    cut (each element is a function of its global index; the integer sums are order-free)."""
    global _pool
    sums = np.zeros(num_blocks, dtype=np.int64)
    if len(rows) == 0:
        return sums
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rademacher:
        rows = rows.copy()
        rows[:, row_abi.KIND] |= row_abi.RADEMACHER
    coef = np.ascontiguousarray(coef, dtype=np.float64)
    if keys is not None:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if keys.ndim != 2 or keys.shape[0] != len(rows) or keys.shape[1] < 1:
            raise ValueError(f"keys must be int64 [{len(rows)}, K] with K >= 1, not {list(keys.shape)}")
        if coef.shape != (len(rows), 1 + keys.shape[1]):
            raise ValueError(f"with {keys.shape[1]} keys per row coef must be [{len(rows)}, {1 + keys.shape[1]}] "
                             f"(scale, alpha_0 .. alpha_{keys.shape[1] - 1}), not {list(coef.shape)}")

    def call(r: np.ndarray, c: np.ndarray, k: np.ndarray | None, out: np.ndarray) -> None:
        if k is None:
            _lib.noise_rows(len(r), r.ctypes.data, c.ctypes.data, out.ctypes.data, int(want_sq))
        else:
            _lib.noise_rows_keys(len(r), r.ctypes.data, c.ctypes.data, k.shape[1], k.ctypes.data, out.ctypes.data,
                                 int(want_sq))

    if threads <= 1 or len(rows) == 1 and rows[0, row_abi.N] < (1 << 16):
        call(rows, coef, keys, sums)
        return sums
    parts = split_rows(rows, coef, threads, keys)
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="curvzo-noise")
    part_sums = [np.zeros(num_blocks, dtype=np.int64) for _ in parts]
    futures = [_pool.submit(call, part[0], part[1], part[2] if keys is not None else None, ps)
               for part, ps in zip(parts, part_sums)]
    for f in futures:
        f.result()
    for ps in part_sums:
        sums += ps
    return sums


def split_rows(rows: np.ndarray, coef: np.ndarray, parts: int, keys: np.ndarray | None = None) -> list[tuple]:
    """The table cut into `parts` tables of about equal element counts (a row may be cut in two): (rows, coef)
    tuples, or (rows, coef, keys) tuples when `keys` (int64 [R, K], run_rows's) is given, each piece of a row
    keeping the row's coef and keys."""
    total = int(rows[:, row_abi.N].sum())
    target = -(-total // parts)
    out, cur_r, cur_c, cur_k, filled = [], [], [], [], 0
    row_keys = keys if keys is not None else [None] * len(rows)

    def flush() -> None:
        piece = (np.array(cur_r, dtype=np.int64), np.array(cur_c, dtype=np.float64))
        out.append(piece if keys is None else (*piece, np.array(cur_k, dtype=np.int64).reshape(len(cur_r), -1)))

    for row, c, k in zip(rows, coef, row_keys):
        n, at = int(row[row_abi.N]), 0
        while n - at > 0:
            take = min(n - at, target - filled)
            piece = row.copy()
            piece[row_abi.DST] += at * row_abi.ELEMENT_SIZE[row_abi.dst_mode(int(row[row_abi.KIND]))]
            if row[row_abi.SRC]:
                piece[row_abi.SRC] += at * row_abi.ELEMENT_SIZE[row_abi.src_mode(int(row[row_abi.KIND]))]
            piece[row_abi.N], piece[row_abi.START] = take, row[row_abi.START] + at
            cur_r.append(piece)
            cur_c.append(c)
            cur_k.append(k)
            filled += take
            at += take
            if filled >= target:
                flush()
                cur_r, cur_c, cur_k, filled = [], [], [], 0
    if cur_r:
        flush()
    return out
