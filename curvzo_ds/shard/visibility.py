"""Whether +eps z reaches bf16/fp16 weights stored without an fp32 copy (docs/algorithm.md, "bf16 / fp16").

A small perturbation can round back to the stored value: about half of the bf16 elements of a block with large
weights do not move at zo_eps = 1e-3. Every `visibility_steps` steps the engine counts, per drawn block, the owned
low-precision elements that +eps z changed; the counts travel in the step's one all-reduce, and the block that
moved least is reported (`StepResult.visibility`, `visibility_block`), with one warning per block that falls below
`visibility_warn`.
"""

from __future__ import annotations

import logging

import torch

from curvzo_ds.shard.params import Block, ParamEntry

log = logging.getLogger("curvzo_ds")


def rounds_away(e: ParamEntry) -> bool:
    """Stored in bf16/fp16 and edited without an fp32 copy: a small +eps z can round back to the same value."""
    return e.master is None and e.param.dtype in (torch.bfloat16, torch.float16)


class VisibilityMonitor:
    def __init__(self, entries: list[ParamEntry], blocks: list[Block], device, every: int, warn_below: float,
                 eps: float):
        # Elements of each block stored in bf16/fp16 and edited without an fp32 copy: where +eps z can vanish.
        self.low_precision = torch.tensor([sum(hi - lo for ei, lo, hi in b.segments if rounds_away(entries[ei]))
                                           for b in blocks], dtype=torch.float64)
        self.names = [b.name for b in blocks]
        self.device, self.every, self.warn_below, self.eps = device, every, warn_below, eps
        self.warned: set[str] = set()

    def watch(self, step: int, perturber=None) -> list | None:
        """On a visibility step, (block, owned view, its values before +eps z) of the drawn low-precision copies (the
        step's selection in `perturber`); with no perturber, nothing watched, so that this rank sends zeros. None on
        other steps."""
        if not self.every or step % self.every or not self.low_precision.any():
            return None
        return [] if perturber is None else [(b, view, view.clone()) for b, view in perturber.owned_low_precision()]

    def moved(self, watch: list | None) -> torch.Tensor | None:
        """[G] int64 on the reduction device: the watched elements that changed since `watch`."""
        if watch is None:
            return None
        moved = torch.zeros(len(self.names), dtype=torch.int64, device=self.device)
        for b, view, before in watch:
            moved[b] += (view != before).sum().to(self.device)
        return moved

    def report(self, moved: torch.Tensor, mask: torch.Tensor) -> dict:
        """From the job's summed counts: the drawn low-precision block whose elements moved least under +eps z, and
        that fraction; a warning the first time a block falls below `warn_below`."""
        watched = mask & (self.low_precision > 0)
        if not watched.any():
            return {}
        fraction = torch.where(watched, moved / self.low_precision.clamp(min=1), torch.full_like(moved, 2.0))
        b = int(fraction.argmin())
        value, name = float(fraction[b]), self.names[b]
        if value < self.warn_below and name not in self.warned:
            self.warned.add(name)
            log.warning("block %s: +eps z changed only %.0f%% of its bf16/fp16 elements (zo_eps=%g is below the "
                        "storage spacing of many weights): raise zo_eps or set fp32_master_weights=true", name,
                        100 * value, self.eps)
        return {"visibility": value, "visibility_block": name}
