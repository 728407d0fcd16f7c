"""The row table's format, defined once: the Perturber builds it (shard/perturb.py), the C kernel (cpu.py, philox.c:
`cpu.build` passes these numbers as -D flags) and the Triton kernel (gpu.py) read it.

A row is int64 [WIDTH], one contiguous range of one stored copy:
    DST    target (CPU: address; GPU: element offset from the group's base tensor)
    SRC    source (the same, for the source)
    N      elements
    START  global index of the first element (the noise counter)
    KEY    noise key, k0 | k1 << 32 (not read by a pass with several keys per row: cpu.run_rows' and
           gpu.launch's `keys`, int64 [R, K], beside the table)
    STAT   block whose fixed-point z^2 sum the row adds to (-1: none)
    KIND   target mode | source mode << SRC_SHIFT | COPY (a copy row: target = source, no noise) | RADEMACHER (the
           row's z are +-1 signs, not normals: the C kernel reads it per row; the Triton kernel takes it per launch)
    ENTRY  index of the row's ParamEntry (the Perturber's; no kernel reads it)

A row does target[i] = source[i] * scale + alpha * z[START + i] with coef (scale, alpha), or, with K keys and coef
(scale, alpha_0 .. alpha_{K-1}), target[i] = source[i] * scale + acc, acc = alpha_0 z_0[START + i] then
acc = acc + alpha_k z_k[START + i] for k = 1 .. K-1 (each op rounded separately; K = 1 is the first form, bit for
bit). Its STAT block counts the fixed-point z^2 of its (last) key's z.
"""

from __future__ import annotations

import enum

import torch

COLUMNS = ("DST", "SRC", "N", "START", "KEY", "STAT", "KIND", "ENTRY")
DST, SRC, N, START, KEY, STAT, KIND, ENTRY = range(len(COLUMNS))
WIDTH = len(COLUMNS)
ROW_BYTES = 8 * WIDTH  # int64 columns
MODE_MASK = 15  # a mode's bits in KIND
SRC_SHIFT = 4
COPY = 256
RADEMACHER = 512


class ElementMode(enum.IntEnum):
    """How a kernel reads and writes elements. WRITE_Z, as a target: store z itself (float32); the others name the
    stored dtype, for out <- source * scale + alpha * z (or + acc, the sum of several keys' terms); a WRITE_Z target
    with several keys gets the last key's z."""

    WRITE_Z = 0
    FLOAT32 = 1
    BFLOAT16 = 2
    FLOAT16 = 3
    FLOAT64 = 4


MODES = {torch.float32: ElementMode.FLOAT32, torch.bfloat16: ElementMode.BFLOAT16, torch.float16: ElementMode.FLOAT16,
         torch.float64: ElementMode.FLOAT64}
ELEMENT_SIZE = {ElementMode.WRITE_Z: 4, ElementMode.FLOAT32: 4, ElementMode.BFLOAT16: 2, ElementMode.FLOAT16: 2,
                ElementMode.FLOAT64: 8}


def kind(dst_mode: int, src_mode: int, copy: bool = False, rademacher: bool = False) -> int:
    """The KIND column of a row."""
    return dst_mode | src_mode << SRC_SHIFT | (COPY if copy else 0) | (RADEMACHER if rademacher else 0)


def dst_mode(kind_code: int) -> int:
    return kind_code & MODE_MASK


def src_mode(kind_code: int) -> int:
    return (kind_code >> SRC_SHIFT) & MODE_MASK


def c_defines() -> list[str]:
    """The row format as C preprocessor flags, for philox.c."""
    names = [(f"ROW_{c}", i) for i, c in enumerate(COLUMNS)] + [("ROW_WIDTH", WIDTH), ("KIND_MODE_MASK", MODE_MASK),
                                                                ("KIND_SRC_SHIFT", SRC_SHIFT), ("KIND_COPY", COPY),
                                                                ("KIND_RADEMACHER", RADEMACHER)]
    names += [(f"MODE_{m.name}", int(m)) for m in ElementMode]
    return [f"-D{name}={value}" for name, value in names]
