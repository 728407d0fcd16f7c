"""A static element mask (`static_mask`, issue 31): SPSA on a fixed set of the most sensitive elements.

The mechanism of SensZOQ (Guo et al.). On SmolLM2-135M (experiments/RESULTS.md, "A real pretrained model") it
beat MeZO by far more than 1.5x in steps; docs/algorithm.md ("A static mask") gives its rules and costs.

`fit`: one backprop of the step's mean loss per probe batch (every rank runs every micro-batch of the global
batch, so the gradient, and with it the mask, is the same at any world size; under ZeRO-3 the forward and
backward gather one layer at a time as usual). A post-accumulate hook per parameter moves the gradient of the
elements this rank edits into an fp32 accumulator and frees it, so no rank holds more than one layer's full
gradient. The squared batch gradients are summed over the probe batches, and the k = fraction x (trainable
elements) largest sums are kept: the k-th largest is found by bisection over float32 bit patterns, with one
all-reduce of a count per round over the shard group (31 rounds), so no rank sees more than its own slice.

`MaskedPerturber` stands in for the engine's `Perturber` (both are perturb.StepPasses; method mezo: every block is
drawn, pi = 1, no 1/pi weights): z is drawn only for the selected elements, from the same counter-based noise (one
stream per tensor, keyed by its canonical name, counter = the element's rank among the tensor's selected elements,
so that the values do not depend on the world size), and the selected elements are written from an fp32 copy of
their values.
Memory per rank: 8 bytes (index) + 4 (fp32 value) + 4 per direction (z, kept for the step) per selected element
of its region; the probe adds 8 bytes per element of its region (two fp32 accumulators), once, before training.
On a GPU each pass is a few launches per tensor (index_copy), not one per dtype as for the dense passes.
"""

from __future__ import annotations

import torch

from curvzo_ds.data.losses import loss_parts
from curvzo_ds.data.stream import MicroBatches
from curvzo_ds.noise.gaussian import NoiseSource
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.forwards import eval_mode
from curvzo_ds.shard.params import ParamEntry
from curvzo_ds.shard.perturb import StepPasses


class StaticMask:
    """The selected elements of each entry: sorted global flat indices within the entry's region, the tensor's
    number of selected elements, and how many of them come before the region (the noise counter's offset)."""

    def __init__(self, entries: list[ParamEntry], index: list[torch.Tensor], total: list[int], before: list[int],
                 fraction: float):
        self.entries, self.index, self.total, self.before, self.fraction = entries, index, total, before, fraction

    @classmethod
    def from_full(cls, entries: list[ParamEntry], full: dict[str, torch.Tensor], fraction: float) -> StaticMask:
        """From every tensor's whole sorted index list (a checkpoint's), keeping this rank's region."""
        index, total, before = [], [], []
        for e in entries:
            idx = full.get(e.name, torch.zeros(0, dtype=torch.int64))
            lo, hi = e.region
            first, last = (int(torch.searchsorted(idx, v)) for v in (lo, hi))
            index.append(idx[first:last].clone())
            total.append(len(idx))
            before.append(first)
        return cls(entries, index, total, before, fraction)

    def owned(self, i: int) -> torch.Tensor:
        """Entry i's selected elements that this rank owns (what its checkpoint file holds)."""
        lo, hi = self.entries[i].owned
        idx = self.index[i]
        return idx[(idx >= lo) & (idx < hi)]

    @property
    def selected(self) -> int:
        return sum(self.total)


def fit(engine, batches, fraction: float) -> StaticMask:
    """The mask of the top `fraction` of trainable elements by squared batch gradient over `batches` (a list of
    MicroBatches or of micro-batches: each item is one step's global batch). Collective over the engine's ranks."""

    entries, module = engine.entries, engine.module  # `fraction`: the static_mask key, validated with the config
    grad = [torch.zeros(e.region[1] - e.region[0], dtype=torch.float32, device=ds_compat.storage_device(e.param))
            for e in entries]
    squared = [torch.zeros_like(g) for g in grad]

    def hook_for(i: int):
        e = entries[i]

        def hook(p):
            g = p.grad.detach().reshape(-1)
            grad[i] += g[e.region[0]: e.region[1]].to(grad[i].device, torch.float32)
            p.grad = None
        return hook

    handles = [e.param.register_post_accumulate_grad_hook(hook_for(i)) for i, e in enumerate(entries)]
    try:
        with eval_mode(module):  # as the step's forwards run (no dropout)
            for batch in batches:
                items = batch.items if isinstance(batch, MicroBatches) else [batch]
                count = 0.0
                for item in items:
                    with torch.enable_grad():
                        # the module itself: a DeepSpeed engine's forward refuses a backward without an optimizer
                        loss_sum, n = loss_parts(engine.loss_fn(module, item))
                        torch.autograd.backward(loss_sum)
                    count += float(n)
                for g, s in zip(grad, squared):
                    s.add_((g / count).square())
                    g.zero_()
    finally:
        for h in handles:
            h.remove()
    ds_compat.forget_backward(engine.model, [e.param for e in entries])
    grad.clear()
    # An element whose gradient was 0 on every probe batch is never chosen (the mask can then hold fewer than k).
    threshold = max(1, _kth_largest(engine, entries, squared, max(1, round(fraction * engine.num_params))))
    index = [torch.nonzero(s.view(torch.int32) >= threshold).flatten().cpu() + e.region[0]
             for e, s in zip(entries, squared)]
    mask = StaticMask(entries, index, [0] * len(entries), [0] * len(entries), fraction)
    # Each tensor's count, and how many of its selected elements come before this rank's region.
    mine = [(e.owned[0], e.owned[1], len(mask.owned(i))) for i, e in enumerate(entries)]
    everyone = engine.comm.all_gather_object(mine)
    for i, e in enumerate(entries):
        mask.total[i] = sum(r[i][2] for r in everyone)
        mask.before[i] = sum(r[i][2] for r in everyone if r[i][1] <= e.region[0] and r[i][1] > r[i][0])
    return mask


def _kth_largest(engine, entries: list[ParamEntry], squared: list[torch.Tensor], k: int) -> int:
    """The float32 bit pattern of the k-th largest value over every rank's owned elements: the largest t with
    count(x >= t) >= k (non-negative floats order as their bit patterns)."""
    owned = []
    for e, s in zip(entries, squared):
        lo, hi = e.owned
        owned.append(s[lo - e.region[0]: hi - e.region[0]].view(torch.int32) if hi > lo else s[:0].view(torch.int32))

    def count(t: int) -> int:
        local = sum(int((o >= t).sum()) for o in owned)
        return int(engine.comm.all_reduce_sum_int64(torch.tensor([local], dtype=torch.int64))[0])

    lo, hi = 0, 0x7F800000  # 0.0 .. +inf
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


class MaskedPerturber(StepPasses):
    """The passes of a step over the selected elements only."""

    def __init__(self, mask: StaticMask, noise: NoiseSource):
        self.mask, self.noise = mask, noise
        self.entries = mask.entries
        self.used = [i for i, idx in enumerate(mask.index) if len(idx)]
        self.values = [self._read(i) for i in self.used]  # fp32 w at the selected elements
        self._kept: list[torch.Tensor] | None = None  # w during learning_rate auto's probe (`line`)
        self._step = -1
        self._z: dict[int, list[torch.Tensor]] = {}

    def _targets(self, i: int):
        """(view, local indices into it, positions in the entry's selection or None for all) of every stored copy
        to write, the indices on the view's device."""
        e, idx = self.entries[i], self.mask.index[i]
        if e.master is not None:
            yield e.master, (idx - e.region[0]).to(e.master.device), None
        for view, off in e.targets():
            local = idx - e.region[0] - off
            keep = (local >= 0) & (local < view.numel())
            if keep.all():
                yield view, local.to(view.device), None
            else:
                yield view, local[keep].to(view.device), torch.nonzero(keep).flatten()

    def _read(self, i: int) -> torch.Tensor:
        e = self.entries[i]
        if e.master is not None:
            return e.master[(self.mask.index[i] - e.region[0]).to(e.master.device)].clone()
        out = covered = None
        for view, local, at in self._targets(i):
            if out is None:
                out = torch.empty(len(self.mask.index[i]), dtype=torch.float32, device=view.device)
                covered = torch.zeros(len(out), dtype=torch.bool)
            values = view.index_select(0, local).float()
            if at is None:
                out.copy_(values)
                covered[:] = True
            else:
                out[at.to(out.device)] = values.to(out.device)
                covered[at] = True
        if not covered.all():
            raise RuntimeError(f"{e.name}: only part of its region is here; gather the parameter first")
        return out

    def _write(self, j: int, values: torch.Tensor) -> None:
        for view, local, at in self._targets(self.used[j]):
            part = values if at is None else values.index_select(0, at.to(values.device))
            view.index_copy_(0, local, part.to(view.device, view.dtype))

    def _noise(self, direction: int) -> list[torch.Tensor]:
        if direction not in self._z:
            m = self.mask
            self._z[direction] = [
                self.noise.slice(self._step, self.entries[i].name, m.total[i], m.before[i], len(m.index[i]),
                                 device=self.values[j].device, direction=direction)
                for j, i in enumerate(self.used)]
        return self._z[direction]

    def begin(self, step: int, mask: torch.Tensor, directions: int = 1) -> None:
        if step != self._step:
            self._step, self._z = step, {}

    def move(self, frm, to, stats: bool = False) -> None:
        """Write w + b z_e (`to` = (e, b); None: w) at the selected elements: w itself is kept in fp32, so `frm` needs
        no undoing and a move is exact."""
        if stats:
            raise ValueError("static_mask draws no blocks and computes no score statistics: use method=mezo")
        for j in range(len(self.used)):
            self._write(j, self.values[j] if to is None else self.values[j] + to[1] * self._noise(to[0])[j])

    def update(self, coefs: list[torch.Tensor], keep: torch.Tensor, at, weight_decay: float,
               keep_copies: bool = False) -> None:
        """w <- keep w - sum_d coef_d z_d at the selected elements (decay on matrices only), then write w (`at` needs
        no undoing: see move). With method mezo every block has the same coefficients (pi = 1), so block 0's serve
        every tensor."""
        if keep_copies:  # learning_rate auto's probe: w is kept for `line`
            self._kept = [v.clone() for v in self.values]
        for j, i in enumerate(self.used):
            if weight_decay and self.entries[i].decay:
                self.values[j].mul_(float(keep[0]))
            for d, coef_d in enumerate(coefs):
                self.values[j].sub_(float(coef_d[0]) * self._noise(d)[j])
            self._write(j, self.values[j])

    def line(self, coefs: list[torch.Tensor], at: float, to: float) -> None:
        """Write w - to u from the fp32 w that `update(..., keep_copies=True)` kept (exact at every point, as
        `move`); at to = 0, w itself again."""
        for j in range(len(self.used)):
            u = sum(float(c[0]) * self._noise(d)[j] for d, c in enumerate(coefs))
            self.values[j] = self._kept[j] - to * u if to else self._kept[j]
            self._write(j, self.values[j])
        if to == 0:
            self._kept = None

    def owned_low_precision(self) -> list:
        return []
