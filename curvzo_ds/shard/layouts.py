"""Where a job's weights live (docs/scaling.md): the layouts `zero_stage: auto` chooses between, each planned with
the memory model of `curvzo-ds plan` (shard/memory.py): stage 0 when the whole model fits one device, else ZeRO-3 in
the smallest shard group that fits."""

from __future__ import annotations

import dataclasses

from curvzo_ds.shard.memory import WIDTH, GiB, plan_memory

MARGIN = 0.10  # the share of a device's memory that `auto` leaves free (allocator fragmentation, CUDA context)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a job's weights live (docs/scaling.md): stage 0, every rank a whole copy with the micro-batches dealt
    over all ranks (`shard_group_size` 1, `replicas` W); or ZeRO-3 in shard groups of K ranks, each group a whole
    copy that evaluates its own directions (`replicas` W / K). `per_rank`: the planned bytes per rank (0: unknown);
    `gathered`: parameter bytes each rank all-gathers per step (two forwards per direction; 0 at stage 0)."""

    zero_stage: int
    shard_group_size: int
    replicas: int
    reason: str
    per_rank: int = 0
    gathered: int = 0

    def record(self) -> dict:
        """summary.json's `layout`."""
        return {"zero_stage": self.zero_stage, "shard_group_size": self.shard_group_size,
                "replicas": self.replicas, "reason": self.reason}

    def describe(self) -> str:
        if self.zero_stage == 0:
            return f"zero_stage=0 replicas={self.replicas} (each rank a whole copy, micro-batches split over ranks)"
        return (f"zero_stage=3 shard_group_size={self.shard_group_size} replicas={self.replicas}"
                + (f" (directions: num_directions a multiple of {self.replicas})" if self.replicas > 1 else ""))


def group_candidates(world_size: int, local_world_size: int | None = None) -> list[int]:
    """The shard group sizes `auto` tries, in order: divisors of the world size that divide the ranks of one node
    (the all-gathers stay inside a node), smallest first, then the other divisors, smallest first."""
    local = local_world_size or world_size
    divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
    return [k for k in divisors if local % k == 0] + [k for k in divisors if local % k]


def plan_layouts(world_size: int, memory: int, local_world_size: int | None = None, num_directions: int = 1,
                 **kwargs) -> tuple[Layout, list[Layout]]:
    """(the layout `zero_stage: auto` takes, every layout that fits, cheapest first), from `plan_memory` at
    `memory` bytes per rank less MARGIN. The rule: stage 0 when the whole model, its activations at the run's
    micro-batch, the ZO state and the piece table fit one device (`plan_memory` at shard group 1); else ZeRO-3 in
    the smallest shard group K (a divisor of the world size; inside a node first) whose plan fits and whose W / K
    replica groups divide num_directions (each group evaluates its own directions); else, when nothing fits,
    ZeRO-3 over the whole job (today's layout; `curvzo-ds plan` says by how much it does not fit)."""
    budget = int(memory * (1 - MARGIN))
    whole = plan_memory(world_size=world_size, shard_group_size=1, gpu_memory=memory, **kwargs)
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    fits = []
    if whole.total <= budget:
        fits.append(Layout(0, 1, world_size, f"the whole model fits one device: {gib(whole.total)} planned of "
                           f"{gib(memory)} less a {MARGIN:.0%} margin", whole.total, 0))
    for k in group_candidates(world_size, local_world_size):
        if k == 1:
            continue  # a shard group of one is stage 0's memory with ZeRO-3's hooks
        p = plan_memory(world_size=world_size, shard_group_size=k, gpu_memory=memory, **kwargs)
        if p.total <= budget:
            # every parameter gathered once per forward, two forwards per direction, (q / R) directions per group
            per_step = 2 * p.params * WIDTH[p.dtype] * max(num_directions // (world_size // k), 1)
            why = ("" if whole.total <= budget else f"the whole model ({gib(whole.total)} planned) does not fit one "
                   f"device of {gib(memory)} less a {MARGIN:.0%} margin; ")
            fits.append(Layout(3, k, world_size // k, f"{why}the smallest shard group that fits is {k} ranks, "
                               f"{gib(p.total)} per rank", p.total, per_step))
    usable = [lay for lay in fits if num_directions % lay.replicas == 0 or lay.zero_stage == 0]
    if usable:
        chosen = usable[0]
        if chosen is not fits[0]:  # a smaller group fits, but its replica groups would need more directions
            chosen = dataclasses.replace(chosen, reason=(
                f"{chosen.reason.split('the smallest shard group')[0]}shard groups of {fits[0].shard_group_size} "
                f"ranks fit, but their {fits[0].replicas} replica groups each need their own directions "
                f"(num_directions={num_directions}): a shard group of {chosen.shard_group_size} ranks, "
                f"{gib(chosen.per_rank)} per rank"))
        return chosen, fits
    full = plan_memory(world_size=world_size, shard_group_size=world_size, gpu_memory=memory, **kwargs)
    return Layout(3, world_size, 1, f"nothing fits {gib(memory)} per rank less a {MARGIN:.0%} margin (ZeRO-3 over "
                  f"all {world_size} ranks needs {gib(full.total)}): ZeRO-3 over the whole job", full.total,
                  2 * full.params * WIDTH[full.dtype] * num_directions), fits


__all__ = ["MARGIN", "Layout", "group_candidates", "plan_layouts"]
