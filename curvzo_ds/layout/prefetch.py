"""What ZeRO-3 holds gathered on one rank during a forward: DeepSpeed's parameter coordinator replayed over the
modules' call order (`gather_peak`), for the memory plan (layout/memory.py, docs/plan.md)."""

from __future__ import annotations

import collections

# glibc's largest mmap threshold: freed blocks below it stay in the heap for reuse, so a process keeps its
# high-water mark of them (a CPU run; measured in docs/plan.md).
SMALL_BLOCK = 32 * 2**20


def shard_elements(numel: int, group: int) -> int:
    """Elements of one tensor's ZeRO-3 partition on each rank: ceil(numel / K) (`p.ds_tensor`; the last rank's
    is padded). Python integers: exact for tensors beyond 2^31 elements."""
    return -(-numel // group)


def gather_peak(calls: list[list[int]], numels: list[int], persistent: set[int], group: int, zero,
                width: int, gloo: bool = False) -> tuple[int, int]:
    """(peak bytes of gathered parameters, peak bytes of them in blocks under SMALL_BLOCK) during one forward.

    DeepSpeed's parameter coordinator (partitioned_param_coordinator.py) replayed over `calls`, the own parameters
    of each module in call order, with a complete trace: fetch the module's parameters; wait for them; prefetch
    from the trace while under the live limit, up to one bucket (stopping after the tensor that passes it);
    after the module, release its parameters unless they are used again within max_reuse_distance elements.
    What is held: each all-gather's flat output (K * ceil(numel / K) per tensor) until its last tensor is
    fetched; a gather of several tensors is copied out of its buffer at the first wait (one tensor is used in
    place, its buffer freed at release); with gloo (CPU) also the all-gather's own output-sized temporary
    until the wait. Python integers throughout: exact beyond 2^31 elements.
    """
    status = ["held" if i in persistent else "out" for i in range(len(numels))]
    queue = collections.deque((i, s) for s, own in enumerate(calls) for i in own)
    last_use = collections.defaultdict(lambda: -1)  # DeepSpeed's most recent step each parameter was fetched for
    flat, unwaited, copies, handle_of = {}, set(), {}, {}  # handle -> bytes; waited copies; param -> handle
    members: dict[int, set[int]] = {}
    live = [0]
    peak = small = 0

    def gather(params):
        params = [i for i in params if status[i] == "out"]
        if params:
            h = len(members) + 1
            members[h] = set(params)
            flat[h] = width * group * sum(shard_elements(numels[i], group) for i in params)
            unwaited.add(h)
            for i in params:
                status[i], handle_of[i] = "flight", h
                live[0] += numels[i]

    def note():
        nonlocal peak, small
        held = list(flat.values()) + list(copies.values())
        peak = max(peak, sum(held) + (sum(flat[h] for h in unwaited) if gloo else 0))
        small = max(small, sum(b for b in held if b < SMALL_BLOCK))

    for step, own in enumerate(calls):
        gather(own)
        note()
        for i in own:
            h = handle_of.pop(i, None)
            if h is None:
                continue
            if h in unwaited:
                unwaited.discard(h)
                for j in members[h]:
                    status[j] = "held"
                    if len(members[h]) > 1:
                        copies[j] = width * numels[j]
                note()
            if len(members[h]) > 1 and not any(handle_of.get(j) == h for j in members[h]):
                del flat[h]
        ahead = sum(1 for i in own if last_use[i] < step)
        for _ in range(min(ahead, len(queue))):
            i, at = queue.popleft()
            last_use[i] = at
        room, picked, count = min(zero.max_live_parameters - live[0], zero.prefetch_bucket_size), [], 0
        while queue and count < room:
            i, at = queue.popleft()
            last_use[i] = max(last_use[i], at)
            if status[i] == "out" and i not in picked:
                picked.append(i)
                count += numels[i]
        gather(picked)
        note()
        release = {i for i in own if i not in persistent and last_use[i] <= step + 1}
        seen = 0
        for later in calls[step + 1:]:
            if seen >= zero.max_reuse_distance:
                break
            release -= set(later)
            seen += sum(numels[i] for i in later)
        for i in release:
            if status[i] == "held":
                status[i] = "out"
                live[0] -= numels[i]
                if copies.pop(i, None) is None:  # used in place: its buffer goes
                    flat.pop(next(h for h, m in members.items() if m == {i} and h in flat), None)
    return peak, small
