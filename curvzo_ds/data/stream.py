"""The world-size-independent data stream: which examples a step uses, how they are cut, who runs what.

This is the project's core promise in data form: the step's global batch, its micro-batches and their
padding are the same at any number of ranks, and only the assignment of micro-batches to ranks changes.
- `step_indices`: the examples of update t, whole global batches from a per-epoch permutation;
- `chunks` / `micro_batch_indices`: a global batch cut into fixed micro-batches;
- `MicroBatches` / `split_batch`: a step's micro-batches, handed to `ZOEngine.step`;
- `round_robin_slots`: micro-batch j runs on rank j mod W, with zero-weight rounds so every rank runs
  the same number of forwards (ZeRO-3's gathers are collective). Training and evaluation share it.
"""

from __future__ import annotations

import torch


def step_indices(step: int, num_examples: int, global_batch_size: int, seed: int) -> list[int]:
    """The examples of update `step` (0-based): a world-size-independent stream.

    Each epoch is a permutation seeded by (seed, epoch), cut into whole global batches (the
    remainder of an epoch is dropped: no padding samples, no partial batches).
    """
    per_epoch = num_examples // global_batch_size
    if per_epoch == 0:
        raise ValueError(f"global_batch_size={global_batch_size} is larger than the {num_examples} training "
                         "examples: lower global_batch_size or raise num_train")
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_examples, generator=gen)
    return perm[k * global_batch_size:(k + 1) * global_batch_size].tolist()


def chunks(n: int, size: int) -> list[range]:
    """[0, n) cut into consecutive ranges of `size` (the last one shorter)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batch_indices(step: int, num_examples: int, global_batch_size: int, micro_batch_size: int,
                        seed: int) -> list[list[int]]:
    """The example indices of each micro-batch of update `step`."""
    idx = step_indices(step, num_examples, global_batch_size, seed)
    return [idx[part.start:part.stop] for part in chunks(len(idx), micro_batch_size)]


def round_robin_slots(n: int, rank: int, world: int) -> list[int | None]:
    """The part this rank runs in each of ceil(n / W) rounds: part j on rank j mod W, None where the
    rank has none (it then runs a zero-weight forward: ZeRO-3's gathers are collective)."""
    return [j if j < n else None for j in range(rank, -(-n // world) * world, world)]


class MicroBatches:
    """The global batch of one step cut into micro-batches; micro-batch j runs on rank j mod W.

    Every rank gets the same list (the data stream is world-size independent) and runs its own
    share, plus zero-weight forwards so that all ranks run the same number (ZeRO-3 gathers are
    collective). Pass a plain batch to `ZOEngine.step` instead when each rank has its own.
    """

    def __init__(self, items: list):
        if not items:
            raise ValueError("a step needs at least one micro-batch")
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)


def split_batch(batch, micro_batch_size: int) -> MicroBatches:
    """One global batch (a dict of tensors or lists, first dimension = examples) as MicroBatches."""
    if not isinstance(batch, dict) or not batch:
        raise TypeError("split_batch needs a non-empty dict of tensors or lists (a collated batch)")
    sizes = {len(v) for v in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"the batch's fields have different lengths {sorted(sizes)}: cannot cut it into examples")
    n = sizes.pop()
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    parts = chunks(n, micro_batch_size)
    return MicroBatches([{k: v[part.start:part.stop] for k, v in batch.items()} for part in parts])
