"""The row table of the Perturber (perturb.py): `Group`, the rows of one launch, `StepRows`, one group's rows
selected for a step, and `build_groups`, which builds every block's rows, grouped by launch (one group per device,
kind, target dtype and source dtype). noise/rows.py defines the columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from curvzo_ds.noise import rows as row_abi
from curvzo_ds.noise.gaussian import backend
from curvzo_ds.noise.rows import DST, ENTRY, KIND, MODES, SRC, START, STAT, N
from curvzo_ds.shard.params import ParamEntry, intersect

ROW_LIMIT = 1 << 30  # elements per row: the GPU kernel indexes within a row in int32


@dataclasses.dataclass
class Group:
    """The rows of one launch: one device, one kind, one (target, source) dtype pair."""

    kind: str  # "direct", "master" or "master_self"
    device: torch.device
    dst_dtype: torch.dtype
    src_dtype: torch.dtype
    rows: np.ndarray  # int64 [R, row_abi.WIDTH], every block's rows
    views: list  # per row: (target, offset, source, offset, n): for snapshots and the fallback
    block: np.ndarray  # [R] the block of each row
    decay: np.ndarray  # [R] bool: weight decay applies to the row's tensor
    dst_base: torch.Tensor | None = None  # GPU: the tensors whose addresses the offsets count from
    places: list | None = None  # per row: (entry, first element, n, which copy): a row's place across rebuilds
    src_base: torch.Tensor | None = None

    @property
    def backend(self) -> str:
        return backend(self.device, self.dst_dtype)


@dataclasses.dataclass
class StepRows:
    """One group's rows selected for this step (host arrays, and their device copy for a GPU group)."""

    group: Group
    index: np.ndarray  # rows of group.rows
    rows: np.ndarray
    device_rows: torch.Tensor | None = None
    prefix: torch.Tensor | None = None
    programs: int = 0
    rademacher: bool = False  # the program map of device_rows' prefix (gpu.programs_per_row)


def build_groups(entries: list[ParamEntry], block_pieces: list[list[tuple[int, int, int]]]) -> list[Group]:
    """Rows of every block, grouped by launch (built again only when the storage changes). `block_pieces`: per
    block, (entry, lo, hi) of each piece of it (Perturber._block_pieces)."""
    acc: dict[tuple, tuple[list, list, list, list]] = {}

    def add(kind, dst, dst_off, src, src_off, n, start, block, stat, ei, copy=-1):
        for at in range(0, n, ROW_LIMIT):
            m = min(ROW_LIMIT, n - at)
            key = (kind, dst.device, dst.dtype, src.dtype)
            rows, views, blocks, decays, places = acc.setdefault(key, ([], [], [], [], []))
            row = [0] * row_abi.WIDTH
            row[DST] = dst.data_ptr() + (dst_off + at) * dst.element_size()
            row[SRC] = src.data_ptr() + (src_off + at) * src.element_size()
            row[N], row[START], row[STAT], row[ENTRY] = m, start + at, block if stat else -1, ei
            row[KIND] = row_abi.kind(MODES[dst.dtype], MODES[src.dtype])
            rows.append(row)
            views.append((dst, dst_off + at, src, src_off + at, m))
            places.append((ei, start + at, m, copy))
            blocks.append(block)
            decays.append(entries[ei].decay)

    for b, pieces in enumerate(block_pieces):
        for ei, lo, hi in pieces:
            if hi <= lo:
                continue
            e = entries[ei]
            r_lo = e.region[0]
            for i, (view, off) in enumerate(e.targets()):
                c_lo = r_lo + off
                a, z = intersect((lo, hi), (c_lo, c_lo + view.numel()))
                if z <= a:
                    continue
                # the owned copy counts the statistics: the shard, or the whole tensor on its owner
                stat = i == 0 and intersect((a, z), e.owned) == (a, z)
                if e.master is None:
                    add("direct", view, a - c_lo, view, a - c_lo, z - a, a, b, stat, ei, i)
                else:
                    add("master", view, a - c_lo, e.master, a - r_lo, z - a, a, b, stat, ei)
            if e.master is not None:
                add("master_self", e.master, lo - r_lo, e.master, lo - r_lo, hi - lo, lo, b, False, ei)
    groups: list[Group] = []
    for (kind, device, dst_dtype, src_dtype), (rows, views, blocks, decays, places) in acc.items():
        g = Group(kind, device, dst_dtype, src_dtype, np.array(rows, dtype=np.int64), views,
                  np.array(blocks, dtype=np.int64), np.array(decays, dtype=bool), places=places)
        if g.backend == "triton":  # addresses -> element offsets from one base tensor per dtype
            g.dst_base, g.src_base = views[0][0], views[0][2]
            for col, base in ((DST, g.dst_base), (SRC, g.src_base)):
                delta = g.rows[:, col] - base.data_ptr()
                if (delta % base.element_size()).any():
                    raise RuntimeError("a tensor is not aligned to its element size")
                g.rows[:, col] = delta // base.element_size()
        groups.append(g)
    groups.sort(key=lambda g: ("direct", "master", "master_self").index(g.kind))
    return groups
