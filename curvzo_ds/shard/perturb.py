"""The passes over the selected weights of a step: moves between the points the forwards evaluate, and the update.

A step with q directions walks one chain of points w + a z_d (a = o eps, o the estimator's offsets): from w to the
first point, from each point to the next in ONE pass (w + a z_d -> w + b z_e: a second noise key in the same pass,
w - a z_d + b z_e, no copy of w), and from the last point to the updated weights in one pass that sums every
direction's term (w <- keep w - sum_k c_k z_k, with the last point's a z_d folded in). So a q-direction RLOO step
reads and writes its weights q + 1 times (central: 2q + 1), and holds no copy of them. Each move rounds once where
a restore would not: in float32 the weights drift by an ulp per move (deterministically: every rank and replica
group walks the same chain, docs/algorithm.md). bfloat16 and float16 copies edited in place would drift by half a
bf16 ulp per move, far more than a step's update, so with q > 1 those rows are written from a copy of their values
taken at the step's start (one copy pass; the memory of those weights once, which `curvzo-ds plan` counts), as
rows kept in fp32 (fp32_master_weights) are written from their master copy.

The Perturber owns the row table (docs/architecture.md), which row_table.py builds. A row is one contiguous range
of one stored copy of a selected block (the ZeRO-3 shard, a gathered replica that must follow, the plain tensor, or
the fp32 master copy), with its global start; noise/rows.py defines the columns. A pass gives each row K noise keys
(one per direction it involves) and K + 1 coefficients (the kernels' keyed rows).

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
benchmarks/gpu.py check that a pass costs the same for 10 and 1,000 tensors); `step_passes` counts the step's passes
over the weights (the copy pass included).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np
import torch

from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise import rows as row_abi
from curvzo_ds.noise.gaussian import NoiseSource, f32
from curvzo_ds.noise.rows import COPY, ENTRY, KIND, MODES, SRC, START, STAT, N
from curvzo_ds.shard.params import Block, ParamEntry, intersect
from curvzo_ds.shard.row_table import Group, StepRows, build_groups

# A point of the step's chain: (direction d, a) for w + a z_d, a in the weights' units (offset x eps); None is w.
Point = tuple[int, float] | None


class StepPasses(abc.ABC):
    """The passes of a step over the weights, as ZOEngine calls them: begin once per step, then moves along the
    chain of points the forwards evaluate, then one update. Perturber: the drawn blocks' rows;
    mask.MaskedPerturber: a static mask's elements."""

    @abc.abstractmethod
    def begin(self, step: int, mask: torch.Tensor, directions: int = 1) -> None:
        """Select the work of step `step` (`mask`: the drawn blocks) for the passes that follow."""

    @abc.abstractmethod
    def move(self, frm: Point, to: Point, stats: bool = False) -> torch.Tensor | None:
        """From the point `frm` to the point `to` in one pass; with `stats`, the per-block fixed-point sums of z^2
        of `to`'s direction."""

    @abc.abstractmethod
    def update(self, coefs: list[torch.Tensor], keep: torch.Tensor, at: Point, weight_decay: float,
               keep_copies: bool = False) -> None:
        """From the point `at`: w <- keep_i w - sum_d coef_d,i z_d (coefs: one [G] per direction), in one pass.
        `keep_copies`: the step's copies of w stay for `line` (the probe's points)."""

    @abc.abstractmethod
    def line(self, coefs: list[torch.Tensor], at: float, to: float) -> None:
        """learning_rate auto's probe (engine/core.py, `choose_rate`): from w - at u to w - to u, u = sum_d coef_d z_d,
        after an `update(..., keep_copies=True)` put the weights at w - at u; to = 0 ends the probe at w. A value
        kept in a copy of w is written from it (one rounding from w at every point)."""

    @abc.abstractmethod
    def owned_low_precision(self) -> list[tuple[int, torch.Tensor]]:
        """(block, view) of the owned bf16/fp16 copies edited without an fp32 copy (the visibility check's)."""

    def perturb(self, at: float, to: float, stats: bool = False, direction: int = 0) -> torch.Tensor | None:
        """Along one direction: from w + at z to w + to z (a move; tools and tests use it)."""
        return self.move((direction, at) if at else None, (direction, to) if to else None, stats)


class Perturber(StepPasses):
    """Every pass over the weights a step edits (ZOEngine keeps the step's sequence)."""

    def __init__(self, entries: list[ParamEntry], blocks: list[Block], noise: NoiseSource, device: torch.device,
                 threads: int | None = None):
        self.entries, self.blocks, self.noise = entries, blocks, noise
        self.device = device  # where the block statistics are gathered (the reduction's device)
        self.threads = threads
        self.step_launches: list[int] = []  # per pass of the current step
        self.step_passes = 0  # passes over the weights in the current step
        self._signature: list | None = None
        self._groups: list[Group] = []
        self._step: tuple | None = None
        self._selected: list[StepRows] = []
        self._copies: dict[int, StepRows] = {}  # q > 1: index in _selected -> rows written from a copy of w
        self._copied: dict | None = None  # q > 1: the step's copy of its bf16/fp16 rows, by row place
        self._keys: dict[int, np.ndarray] = {}  # direction -> the step's key of every entry (0 where unused)
        self._block_pieces = [[(ei, *intersect((lo, hi), entries[ei].region)) for ei, lo, hi in b.segments]
                              for b in blocks]
        self._persistent = [i for i, e in enumerate(entries) if e.partitioned and e.region == (0, e.numel)]
        self._names = [e.name for e in entries]

    # ----------------------------------------------------------------- the table
    def _storage_signature(self, only=None) -> list:
        """What the table's addresses depend on (ParamEntry.storage_key)."""
        entries = self.entries
        return [entries[i].storage_key() for i in (range(len(entries)) if only is None else only)]

    def begin(self, step: int, mask: torch.Tensor, directions: int = 1) -> None:
        """Select the rows of the blocks in `mask` for step `step` (once per step; the passes reuse them). With
        several directions, the selected bf16/fp16 rows edited in place are copied first (`_copy_low_precision`)."""
        signature = self._storage_signature()
        rebuilt = signature != self._signature
        if rebuilt:
            self._groups = build_groups(self.entries, self._block_pieces)
            self._signature = signature
        if self._step is None or self._step[0] != step:
            self.step_launches, self.step_passes, self._keys, self._copies, self._copied = [], 0, {}, {}, None
        elif not rebuilt and self._step[2] == directions:
            return  # the same step again, on the same table
        self._step = (step, mask, directions)
        selected = np.asarray(mask.cpu().numpy(), dtype=bool)
        self._selected = []
        for g in self._groups:
            index = np.flatnonzero(selected[g.block])
            if len(index):
                self._selected.append(StepRows(g, index, g.rows[index].copy()))
        if directions > 1:
            self._copy_low_precision()

    def _refresh(self) -> None:
        """A persistent parameter gathered since the table was built (by a forward): rebuild and reselect."""
        if not self._persistent or self._signature is None:
            return
        now = self._storage_signature(self._persistent)
        if now != [self._signature[i] for i in self._persistent]:
            self.begin(*self._step)

    def _copy_low_precision(self) -> None:
        """For a step with several directions: the values of the selected bf16/fp16 rows edited in place, copied once
        at the step's first selection into one buffer per (device, dtype), and rows that write those targets from
        the copy (as master rows write from the fp32 copy): a move to w + a z_d and the update then round once
        from w, never from a moved value. The copy is kept by row place (entry, first element, n, which copy), so
        that a table rebuilt in the middle of the step (a ZeRO-3 forward released a persistent tensor's gathered
        copy and gathered it again at another address) finds its values."""
        low = [(i, s) for i, s in enumerate(self._selected)
               if s.group.kind == "direct" and s.group.dst_dtype in (torch.bfloat16, torch.float16)]
        if self._copied is None:
            self._copied = {}  # place -> (buffer, offset)
            for _, s in low:
                g = s.group
                counts = s.rows[:, N]
                offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
                buffer = torch.empty(int(counts.sum()), dtype=g.dst_dtype, device=g.device)
                torch._foreach_copy_([buffer[off: off + n] for off, n in zip(offsets, counts)],
                                     [_view(g.views[j]) for j in s.index])
                for j, off in zip(s.index, offsets):
                    self._copied[g.places[j]] = (buffer, int(off))
            if low:
                self.step_passes += 1
        self._copies = {}
        for i, s in low:
            g = s.group
            keep = [k for k, j in enumerate(s.index) if g.places[j] in self._copied]
            if not keep:
                continue
            index = s.index[keep]
            sources = [self._copied[g.places[j]] for j in index]
            buffer = sources[0][0]  # one buffer per (device, dtype): every row of a group is in it
            offsets = np.array([off for _, off in sources], dtype=np.int64)
            rows = s.rows[keep].copy()
            rows[:, KIND] = row_abi.kind(MODES[g.dst_dtype], MODES[g.dst_dtype])
            rows[:, SRC] = offsets if g.backend == "triton" else buffer.data_ptr() + offsets * buffer.element_size()
            views = [(g.views[j][0], g.views[j][1], buffer, int(off), int(g.views[j][4])) for j, off in
                     zip(index, offsets)]
            copy = Group("master", g.device, g.dst_dtype, g.dst_dtype, rows, views, g.block[index], g.decay[index],
                         dst_base=g.dst_base, src_base=buffer)
            self._copies[i] = StepRows(copy, np.arange(len(rows)), rows)

    def _entry_keys(self, direction: int) -> np.ndarray:
        """The step's noise key of every entry for `direction` (int64, k0 | k1 << 32; 0 for entries not drawn)."""
        keys = self._keys.get(direction)
        if keys is None:
            used = sorted({int(i) for s in self._selected for i in np.unique(s.rows[:, ENTRY])})
            keys = np.zeros(len(self.entries), dtype=np.int64)
            keys[used] = self.noise.keys(self._step[0], [self._names[i] for i in used], direction)
            self._keys[direction] = keys
        return keys

    def _sources(self):
        """(rows to run, whether they edit their target in place) for each selected group that a move writes: a
        copy kept in fp32 (master rows) or at the step's start (_copies) is the source of its target's rows."""
        for i, s in enumerate(self._selected):
            if s.group.kind == "master_self":
                continue
            copy = self._copies.get(i)
            if copy is not None:
                yield copy, False
            else:
                yield s, s.group.kind == "direct"

    # ----------------------------------------------------------------- passes
    def move(self, frm: Point, to: Point, stats: bool = False) -> torch.Tensor | None:
        """From w + a z_d (`frm`; None: w) to w + b z_e (`to`; None: w) in one pass: in place, w + a z_d - a z_d +
        b z_e (two keys; one when d = e or either end is w); from a copy of w (an fp32 master copy, or the step's
        copy of bf16/fp16 rows), w + b z_e. With `stats`, also return the fixed-point sums of z_e^2 over the owned
        elements of each block (int64 [G], on the reduction device, not synchronised)."""
        self._refresh()
        work = []
        for s, in_place in self._sources():
            if not in_place:
                work.append((s, 1.0, [to[1]], [to[0]], False) if to is not None and (to[1] or stats)
                            else (s, 1.0, [0.0], [0], True))
            elif frm is None or to is None or frm[0] == to[0]:
                d = (to if to is not None else frm)[0]
                work.append((s, 1.0, [(to[1] if to else 0.0) - (frm[1] if frm else 0.0)], [d], False))
            else:
                work.append((s, 1.0, [-frm[1], to[1]], [frm[0], to[0]], False))
        return self._run([work], stats)

    def update(self, coefs: list[torch.Tensor], keep: torch.Tensor, at: Point, weight_decay: float,
               keep_copies: bool = False) -> None:
        """w <- keep_i w - sum_d coef_d,i z_d for the selected blocks (the sampler's Eq. 28 coefficients, one [G] per
        direction), from the point `at`, in one pass: rows edited in place add -keep a z of `at` in the same pass
        (the coefficient of that direction's key); rows kept in fp32 update the master copy in place and then write
        their stored copies from it (a copy pass); bf16/fp16 rows of a several-direction step are written from the
        step's copy of w. The keys are summed in direction order, on every rank and group layout alike. Weight decay
        (keep_i != 1) applies to matrices only, never to biases or norms (MeZO)."""
        self._refresh()
        q = len(coefs)
        by_block = np.stack([c.numpy() for c in coefs], axis=1)  # [G, q]
        keep_of_block = keep.numpy()

        def item(rows: StepRows, in_place: bool) -> tuple:
            block = rows.group.block[rows.index]
            scale = np.where(rows.group.decay[rows.index] & bool(weight_decay), keep_of_block[block], 1.0)
            alphas = -by_block[block]
            if in_place and rows.group.kind == "direct" and at is not None:
                alphas[:, at[0]] -= scale * at[1]
            return rows, scale, alphas, list(range(q)), False

        self._write_rows(item, drop_copies=not keep_copies)

    def line(self, coefs: list[torch.Tensor], at: float, to: float) -> None:
        """From w - at u to w - to u in one pass, as `update` walks its rows: rows written from the step's copy of w
        (bf16/fp16 edited in place) get w - to u, rows edited in place (fp32, and the fp32 master copies, whose
        stored copies are then written from them) add -(to - at) u. At to = 0 the copies are dropped."""
        self._refresh()
        by_block = np.stack([c.numpy() for c in coefs], axis=1)  # [G, q]

        def item(rows: StepRows, in_place: bool) -> tuple:
            step = to - at if in_place else to
            return rows, 1.0, -step * by_block[rows.group.block[rows.index]], list(range(len(coefs))), False

        self._write_rows(item, drop_copies=to == 0)

    def _write_rows(self, item: Callable[[StepRows, bool], tuple], drop_copies: bool) -> None:
        """The pass of `update` and `line` over the selected rows: each target's rows (or the step's copy of them,
        which is then the source; `item` is told whether the rows are edited in place) get `item`'s work, then the
        fp32 master copies write their stored copies (a copy pass). `drop_copies`: the step's copies end here."""
        first, copies = [], []
        for i, s in enumerate(self._selected):
            if s.group.kind == "master":
                copies.append((s, 1.0, [0.0], [0], True))
                continue
            rows = self._copies.get(i, s)
            first.append(item(rows, rows is s))
        self._run([first, copies], False)
        if drop_copies:
            self._copies, self._copied = {}, None

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
        """Run each phase, a list of (selected rows, scale, alphas, directions, copy), after the previous one: every
        row of an item gets the keys of `directions` (K of them) and the coefficients (scale, alphas); scale is a
        number or one per row, alphas K numbers or [rows, K]. Each phase is one pass over the weights."""
        g = len(self.blocks)
        sums = torch.zeros(g, dtype=torch.int64, device=self.device) if stats else None
        cpu_sums = None
        launches = 0
        for phase in phases:
            if not phase:
                continue
            self.step_passes += 1
            cpu_work: dict[int, list] = {}  # K -> [(rows, coef, keys)]
            for s, scale, alphas, directions, copy in phase:
                n, k = len(s.rows), len(directions)
                coef = np.empty((n, 1 + k), dtype=np.float64)
                coef[:, 0] = scale
                coef[:, 1:] = alphas
                keys = np.stack([self._entry_keys(d)[s.rows[:, ENTRY]] for d in directions], axis=1)
                backend = s.group.backend
                if backend == "c":
                    rows = s.rows
                    if copy:
                        rows = rows.copy()
                        rows[:, KIND] |= COPY
                    cpu_work.setdefault(k, []).append((rows, coef, keys))
                elif backend == "triton":
                    launches += 1
                    part = sums if stats and s.group.device == self.device else None
                    if stats and part is None:
                        part = torch.zeros(g, dtype=torch.int64, device=s.group.device)
                    self._launch(s, coef, keys, part, copy)
                    if part is not None and part is not sums:
                        sums += part.to(self.device)  # parameters and reduction on different devices
                else:
                    launches += len(s.rows)
                    part = self._reference(s, coef, keys, copy, stats)
                    if stats:
                        sums += part.to(self.device)
            threads = self.threads or torch.get_num_threads()
            for work in cpu_work.values():
                rows = np.concatenate([w[0] for w in work])  # a new table: its KIND column is this pass's
                if self.noise.rademacher:
                    rows[:, KIND] |= row_abi.RADEMACHER
                launches += min(threads, len(rows))
                total = cpu_kernel.run_rows(rows, np.concatenate([w[1] for w in work]), g, stats, threads,
                                            keys=np.concatenate([w[2] for w in work]))
                cpu_sums = total if cpu_sums is None else cpu_sums + total
        if stats and cpu_sums is not None:
            sums += _to_device(torch.from_numpy(cpu_sums), self.device)
        self.step_launches.append(launches)
        return sums

    def _launch(self, s: StepRows, coef: np.ndarray, keys: np.ndarray, sums: torch.Tensor | None,
                copy: bool) -> None:
        from curvzo_ds.noise import gpu

        device = s.group.device
        rademacher = self.noise.rademacher
        if s.device_rows is None or s.rademacher != rademacher:
            per = gpu.programs_per_row(torch.from_numpy(s.rows[:, N]), torch.from_numpy(s.rows[:, START]), rademacher)
            s.rademacher = rademacher
            prefix = torch.cat([torch.zeros(1, dtype=torch.int64), per.cumsum(0)])
            s.programs = int(prefix[-1])
            s.device_rows = _to_device(torch.from_numpy(s.rows), device)
            s.prefix = _to_device(prefix, device)
        coef_dev = _to_device(torch.from_numpy(coef.astype(np.float32)), device)
        keys_dev = _to_device(torch.from_numpy(keys), device)
        src_base = None if s.group.kind in ("direct", "master_self") else s.group.src_base
        gpu.launch(s.group.dst_base, src_base, s.device_rows, s.prefix, s.programs, coef_dev, sums, copy=copy,
                   keys=keys_dev, rademacher=rademacher)

    def _reference(self, s: StepRows, coef: np.ndarray, keys: np.ndarray, copy: bool, stats: bool) -> torch.Tensor:
        """No compiled kernel for this device or dtype: the torch reference's runner, row by row."""
        total = torch.zeros(len(self.blocks), dtype=torch.int64)
        for row, c, row_keys, i in zip(s.rows, coef, keys, s.index):
            dst, d_off, src, s_off, n = s.group.views[i]
            target, source = dst.view(-1)[d_off: d_off + n], src.view(-1)[s_off: s_off + n]
            if copy:
                target.copy_(source)
                continue
            cast = (lambda x: float(x)) if target.dtype == torch.float64 else f32  # noqa: E731
            sq = reference.run([(int(k) & 0xFFFFFFFF, (int(k) & 0xFFFFFFFFFFFFFFFF) >> 32) for k in row_keys],
                               int(row[START]), target, source, cast(c[0]), [cast(a) for a in c[1:]],
                               want_sq=stats and row[STAT] >= 0, rademacher=self.noise.rademacher)
            if sq is not None:
                total[int(row[STAT])] += sq.cpu()
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


