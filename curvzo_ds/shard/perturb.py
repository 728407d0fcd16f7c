"""The passes over the selected weights of a step: perturb, update (one direction or q), snapshot and restore.

The Perturber owns the piece table (docs/architecture.md). A row is one contiguous range of one stored copy of a
selected block (the ZeRO-3 shard, a gathered replica that must follow, the plain tensor, or the fp32 master copy),
with its noise key and global start; noise/rows.py defines the columns.

Rows come in groups, one per (device, kind, target dtype, source dtype): "direct" rows edit a stored copy in place;
"master" rows write a stored copy from the fp32 master copy (w + c z while perturbed, w itself when restored);
"master_self" rows update the master copy in place. The full table of every block is built when the storage
changes (at the first step, or when ZeRO-3 gathers a persistent parameter for good); a step selects its rows with
one vectorised mask and writes the keys. A pass is then a constant number of kernel launches, whatever the number
of tensors: on a GPU one Triton launch per group (noise/gpu.py), on the CPU one C call per thread (noise/cpu.py:
threads over rows, which releases the GIL, so offloaded parameters use every core). The fixed-point sums of z^2
are added per block in the same launch (integer atomics: exact, order-free), and no pass synchronises with the
host: the tables go to the device from pinned memory without blocking.

`step_launches` counts the kernel launches and C calls of each pass of the current step (tests and
benchmarks/gpu.py check that a pass costs the same for 10 and 1,000 tensors).
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np
import torch

from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise import rows as layout
from curvzo_ds.noise.gaussian import NoiseSource, backend, f32
from curvzo_ds.noise.rows import COPY, DST, ENTRY, KEY, KIND, MODES, SRC, START, STAT, N
from curvzo_ds.shard.params import Block, ParamEntry, intersect

ROW_LIMIT = 1 << 30  # elements per row: the GPU kernel indexes within a row in int32


@dataclasses.dataclass
class Group:
    """The rows of one launch: one device, one kind, one (target, source) dtype pair."""

    kind: str  # "direct", "master" or "master_self"
    device: torch.device
    dst_dtype: torch.dtype
    src_dtype: torch.dtype
    rows: np.ndarray  # int64 [R, layout.WIDTH], every block's rows
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
    keys_for: int = -1  # the direction whose keys the device rows hold


class StepPasses(abc.ABC):
    """The passes of a step over the weights, as ZOEngine calls them: begin once per step, then perturb, snapshot
    and restore, and one update. Perturber: the drawn blocks' rows; mask.MaskedPerturber: a static mask's elements."""

    @abc.abstractmethod
    def begin(self, step: int, mask: torch.Tensor, directions: int = 1) -> None:
        """Select the work of step `step` (`mask`: the drawn blocks) for the passes that follow."""

    @abc.abstractmethod
    def perturb(self, at: float, to: float, stats: bool = False, direction: int = 0) -> torch.Tensor | None:
        """Move the selected weights from w + at z to w + to z (z of `direction`); with `stats`, the per-block
        fixed-point sums of z^2."""

    @abc.abstractmethod
    def update(self, steps: torch.Tensor, keeps: torch.Tensor, eps: float, weight_decay: float) -> None:
        """From w - eps z: w <- keep_i w - step_i z (one direction)."""

    @abc.abstractmethod
    def update_directions(self, steps: list[torch.Tensor], keeps: torch.Tensor, weight_decay: float) -> None:
        """From w: w <- keep_i w - sum_d step_d,i z_d (q directions)."""

    @abc.abstractmethod
    def snapshot(self) -> dict | None:
        """What restore() needs to put w back."""

    @abc.abstractmethod
    def restore(self, saved: dict | None) -> None:
        """Put back w from a snapshot()."""

    @abc.abstractmethod
    def owned_low_precision(self) -> list[tuple[int, torch.Tensor]]:
        """(block, view) of the owned bf16/fp16 copies edited without an fp32 copy (the visibility check's)."""


class Perturber(StepPasses):
    """Every pass over the weights a step edits (ZOEngine keeps the step's sequence)."""

    def __init__(self, entries: list[ParamEntry], blocks: list[Block], noise: NoiseSource, device: torch.device,
                 threads: int | None = None):
        self.entries, self.blocks, self.noise = entries, blocks, noise
        self.device = device  # where the block statistics are gathered (the reduction's device)
        self.threads = threads
        self.step_launches: list[int] = []  # per pass of the current step
        self._signature: list | None = None
        self._groups: list[Group] = []
        self._step: tuple | None = None
        self._selected: list[StepRows] = []
        self._block_pieces = [[(ei, *intersect((lo, hi), entries[ei].region)) for ei, lo, hi in b.segments]
                              for b in blocks]
        self._persistent = [i for i, e in enumerate(entries) if e.partitioned and e.region == (0, e.numel)]
        self._names = [e.name for e in entries]

    # ----------------------------------------------------------------- the table
    def _storage_signature(self, only=None) -> list:
        """What the table's addresses depend on (ParamEntry.storage_key)."""
        entries = self.entries
        return [entries[i].storage_key() for i in (range(len(entries)) if only is None else only)]

    def _build(self) -> None:
        """Rows of every block, grouped by launch (built again only when the storage changes)."""
        acc: dict[tuple, tuple[list, list, list, list]] = {}

        def add(kind, dst, dst_off, src, src_off, n, start, block, stat, ei, copy=-1):
            for at in range(0, n, ROW_LIMIT):
                m = min(ROW_LIMIT, n - at)
                key = (kind, dst.device, dst.dtype, src.dtype)
                rows, views, blocks, decays, places = acc.setdefault(key, ([], [], [], [], []))
                row = [0] * layout.WIDTH
                row[DST] = dst.data_ptr() + (dst_off + at) * dst.element_size()
                row[SRC] = src.data_ptr() + (src_off + at) * src.element_size()
                row[N], row[START], row[STAT], row[ENTRY] = m, start + at, block if stat else -1, ei
                row[KIND] = layout.kind(MODES[dst.dtype], MODES[src.dtype])
                rows.append(row)
                views.append((dst, dst_off + at, src, src_off + at, m))
                places.append((ei, start + at, m, copy))
                blocks.append(block)
                decays.append(self.entries[ei].decay)

        for b, pieces in enumerate(self._block_pieces):
            for ei, lo, hi in pieces:
                if hi <= lo:
                    continue
                e = self.entries[ei]
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
        self._groups = []
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
            self._groups.append(g)
        self._groups.sort(key=lambda g: ("direct", "master", "master_self").index(g.kind))

    def begin(self, step: int, mask: torch.Tensor, directions: int = 1) -> None:
        """Select the rows of the blocks in `mask` for step `step` (once per step; the passes reuse them)."""
        signature = self._storage_signature()
        if signature != self._signature:
            self._build()
            self._signature = signature
        if self._step is None or self._step[0] != step:
            self.step_launches = []
        self._step = (step, mask, directions)
        selected = np.asarray(mask.cpu().numpy(), dtype=bool)
        self._selected = []
        for g in self._groups:
            index = np.flatnonzero(selected[g.block])
            if len(index):
                self._selected.append(StepRows(g, index, g.rows[index].copy()))
        self._keys_direction = -1

    def _refresh(self) -> None:
        """A persistent parameter gathered since the table was built (by a forward): rebuild and reselect."""
        if not self._persistent or self._signature is None:
            return
        now = self._storage_signature(self._persistent)
        if now != [self._signature[i] for i in self._persistent]:
            step, mask, directions = self._step
            self.begin(step, mask, directions)

    def _set_direction(self, direction: int) -> None:
        """Write the keys of `direction` into the selected rows."""
        if self._keys_direction == direction:
            return
        step = self._step[0]
        used = sorted({int(i) for s in self._selected for i in np.unique(s.rows[:, ENTRY])})
        keys = np.zeros(len(self.entries), dtype=np.int64)
        keys[used] = self.noise.keys(step, [self._names[i] for i in used], direction)
        for s in self._selected:
            s.rows[:, KEY] = keys[s.rows[:, ENTRY]]
            s.keys_for = -1  # the device copy is stale
        self._keys_direction = direction

    # ----------------------------------------------------------------- passes
    def perturb(self, at: float, to: float, stats: bool = False, direction: int = 0) -> torch.Tensor | None:
        """Move the selected weights from w + at z to w + to z (the fp32 master copy, where kept, is w). With
        `stats`, also return the fixed-point sums of z^2 over the owned elements of each block (int64 [G], on the
        reduction device, not synchronised)."""
        self._refresh()
        self._set_direction(direction)
        passes = []
        for s in self._selected:
            if s.group.kind == "direct":
                passes.append((s, 1.0, to - at, False))
            elif s.group.kind == "master":
                passes.append((s, 1.0, to, to == 0 and not stats))
        return self._run([passes], stats)

    def update(self, steps: torch.Tensor, keeps: torch.Tensor, eps: float, weight_decay: float) -> None:
        """w <- keep_i w - step_i z for the selected blocks (the sampler's Eq. 28 coefficients, one direction).

        The weights are at w - eps z here, so the same pass also adds back eps z. Weight decay (keep_i != 1)
        applies to matrices only, never to biases or norms (MeZO)."""
        self._refresh()
        self._set_direction(0)
        steps, keeps = steps.numpy(), keeps.numpy()
        first, copies = [], []
        for s in self._selected:
            keep = np.where(s.group.decay[s.index] & bool(weight_decay), keeps[s.group.block[s.index]], 1.0)
            step = steps[s.group.block[s.index]]
            if s.group.kind == "direct":
                first.append((s, keep, keep * eps - step, False))
            elif s.group.kind == "master_self":
                first.append((s, keep, -step, False))
            else:
                copies.append((s, 1.0, 0.0, True))
        self._run([first, copies], False)

    def update_directions(self, steps: list[torch.Tensor], keeps: torch.Tensor, weight_decay: float) -> None:
        """From w (restored): w <- keep_i w - sum_d step_d,i z_d, one direction after the other in the order
        d = 0 .. q-1 on every rank and group layout, so that the result is the same bit for bit."""
        keeps = keeps.numpy()
        for d, step_d in enumerate(steps):
            self._refresh()
            self._set_direction(d)
            step_d = step_d.numpy()
            work = []
            for s in self._selected:
                if s.group.kind == "master":
                    continue
                keep = np.where(s.group.decay[s.index] & bool(weight_decay), keeps[s.group.block[s.index]], 1.0)
                work.append((s, keep if d == 0 else 1.0, -step_d[s.group.block[s.index]], False))
            self._run([work], False)
        self._run([[(s, 1.0, 0.0, True) for s in self._selected if s.group.kind == "master"]], False)

    def snapshot(self) -> dict:
        """The values of every stored copy edited in place (the master copy holds w for the others), by place."""
        self._refresh()
        return {s.group.places[i]: _view(s.group.views[i]).clone()
                for s in self._selected if s.group.kind == "direct" for i in s.index}

    def restore(self, saved: dict) -> None:
        """Put back the snapshot's values; stored copies of master-kept tensors are written from the master.

        Matched by place: a gathered copy of a persistent ZeRO-3 tensor that a forward released since the snapshot
        is not there to restore (the next forward gathers it again from the restored shards)."""
        self._refresh()
        pairs = [(_view(s.group.views[i]), saved[s.group.places[i]])
                 for s in self._selected if s.group.kind == "direct" for i in s.index if s.group.places[i] in saved]
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
        self._run([[(s, 1.0, 0.0, True) for s in self._selected if s.group.kind == "master"]], False)

    def owned_low_precision(self) -> list[tuple[int, torch.Tensor]]:
        """(block, view) of the owned bf16/fp16 copies edited without an fp32 copy: where +eps z can vanish."""
        out = []
        for s in self._selected:
            if s.group.kind == "direct" and s.group.dst_dtype in (torch.bfloat16, torch.float16):
                out += [(int(s.group.block[i]), _view(s.group.views[i])) for i, stat in
                        zip(s.index, s.rows[:, STAT] >= 0) if stat]
        return out

    # ----------------------------------------------------------------- launching
    def _run(self, phases: list[list], stats: bool) -> torch.Tensor | None:
        """Run each phase (a list of (selected rows, scale, alpha, copy)) after the previous one."""
        g = len(self.blocks)
        sums = torch.zeros(g, dtype=torch.int64, device=self.device) if stats else None
        cpu_sums = None
        launches = 0
        for phase in phases:
            cpu_rows, cpu_coef = [], []
            for s, scale, alpha, copy in phase:
                backend = s.group.backend
                coef = np.empty((len(s.rows), 2), dtype=np.float64)
                coef[:, 0], coef[:, 1] = scale, alpha
                if backend == "c":
                    rows = s.rows
                    if copy:
                        rows = rows.copy()
                        rows[:, KIND] |= COPY
                    cpu_rows.append(rows)
                    cpu_coef.append(coef)
                elif backend == "triton":
                    launches += 1
                    part = sums if stats and s.group.device == self.device else None
                    if stats and part is None:
                        part = torch.zeros(g, dtype=torch.int64, device=s.group.device)
                    self._launch(s, coef, part, copy)
                    if part is not None and part is not sums:
                        sums += part.to(self.device)  # parameters and reduction on different devices
                else:
                    launches += len(s.rows)
                    part = self._reference(s, coef, copy, stats)
                    if stats:
                        sums += part.to(self.device)
            if cpu_rows:
                threads = self.threads or torch.get_num_threads()
                launches += min(threads, sum(len(r) for r in cpu_rows))
                total = cpu_kernel.run_rows(np.concatenate(cpu_rows), np.concatenate(cpu_coef), g, stats, threads)
                cpu_sums = total if cpu_sums is None else cpu_sums + total
        if stats and cpu_sums is not None:
            sums += _to_device(torch.from_numpy(cpu_sums), self.device)
        self.step_launches.append(launches)
        return sums

    def _launch(self, s: StepRows, coef: np.ndarray, sums: torch.Tensor | None, copy: bool) -> None:
        from curvzo_ds.noise import gpu

        device = s.group.device
        if s.keys_for != self._keys_direction or s.device_rows is None:
            per = gpu.programs_per_row(torch.from_numpy(s.rows[:, N]), torch.from_numpy(s.rows[:, START]))
            prefix = torch.cat([torch.zeros(1, dtype=torch.int64), per.cumsum(0)])
            s.programs = int(prefix[-1])
            s.device_rows = _to_device(torch.from_numpy(s.rows), device)
            s.prefix = _to_device(prefix, device)
            s.keys_for = self._keys_direction
        coef_dev = _to_device(torch.from_numpy(coef.astype(np.float32)), device)
        src_base = None if s.group.kind in ("direct", "master_self") else s.group.src_base
        gpu.launch(s.group.dst_base, src_base, s.device_rows, s.prefix, s.programs, coef_dev, sums, copy=copy)

    def _reference(self, s: StepRows, coef: np.ndarray, copy: bool, stats: bool) -> torch.Tensor:
        """The torch-eager fallback (no compiled kernel for this device or dtype): row by row."""
        total = torch.zeros(len(self.blocks), dtype=torch.int64)
        for row, (scale, alpha), i in zip(s.rows, coef, s.index):
            dst, d_off, src, s_off, n = s.group.views[i]
            target, source = dst.view(-1)[d_off: d_off + n], src.view(-1)[s_off: s_off + n]
            if copy:
                target.copy_(source)
                continue
            key = int(row[KEY]) & 0xFFFFFFFFFFFFFFFF
            z = reference.normals(key & 0xFFFFFFFF, key >> 32, int(row[START]), n, target.device)
            if target.dtype == torch.float64:
                values = source.clone()
                reference.axpy_(values, z, float(scale), float(alpha))
            else:
                values = source.float() if source.dtype != torch.float32 else source.clone()
                reference.axpy_(values, z, f32(scale), f32(alpha))
            target.copy_(values)
            if stats and row[STAT] >= 0:
                total[int(row[STAT])] += reference.fixed_point_sum_of_squares(z).cpu()
        return total


def _view(v) -> torch.Tensor:
    dst, off, _, _, n = v
    return dst.view(-1)[off: off + n]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: through pinned memory, whose buffer torch keeps until
    the copy is done."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


