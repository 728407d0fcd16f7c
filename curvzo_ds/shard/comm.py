"""The engine's few collectives, on an explicit process group (no-ops in one process), and the wire format of
the step's one all-reduce (`StepPacket`).

Per step the engine sends one all-reduce of int64 values: the fixed-point block statistics
(G values) and, as bit patterns, the float64 loss sums of each micro-batch slot (each slot is
written by exactly one rank and is zero elsewhere, so the integer sum returns it exactly).
`stats` counts calls and elements so tests can check the traffic.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, group=None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.stats: Counter = Counter()

    @property
    def device(self) -> torch.device:
        """Where collectives run: the current GPU under NCCL, else the CPU."""
        if self.active and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_sum_int64(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over the group, read back to the host: a step's one host synchronisation (`stats["host_reads"]`
        counts them; under torch.cuda.set_sync_debug_mode("error") this read is the one allowed)."""
        assert values.dtype == torch.int64
        self.stats["all_reduce"] += 1
        self.stats["all_reduce_elements"] += values.numel()
        if self.active and self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return read_back(values, self.stats)

    def all_gather_object(self, obj) -> list:
        self.stats["all_gather_object"] += 1
        if not self.active or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if not self.active or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src) if self.group else src,
                                   group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.active and self.world_size > 1:
            dist.barrier(group=self.group)


@contextlib.contextmanager
def main_process_first(comm: Comm):
    """Rank 0 of `comm`'s group runs the body first (it fills the download and tokenizer caches); the
    other ranks wait at a barrier of that group until it is done, then run theirs."""
    if comm.rank != 0:
        comm.barrier()
    try:
        yield
    finally:
        if comm.rank == 0:
            comm.barrier()  # also on an error, so that the others fail on their own instead of hanging


def read_back(values: torch.Tensor, stats: Counter | None = None) -> torch.Tensor:
    """values on the host. From a GPU this waits for the device: the step's one synchronisation point, allowed
    here even under torch.cuda.set_sync_debug_mode("error") (tests wrap a whole step in it)."""
    if values.device.type != "cuda":
        return values
    if stats is not None:
        stats["host_reads"] += 1
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return values.cpu()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def float64_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float64).contiguous().view(torch.int64)


def bits_float64(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.float64)


class StepPacket:
    """The one all-reduce of a step, int64, packed and unpacked here (docs/deepspeed.md):

        [q x `sums` block sums | `moved` counts | q x slots x (`points` loss sums, count) | stop flag]

    The block sums (fixed-point sums of z^2 over each rank's owned elements, 0 for MeZO, which reads no scores)
    and the counts of bf16/fp16 elements that +eps z moved (visibility steps only) add up over the ranks. The loss
    sums of a direction and micro-batch slot (one per evaluation point of the direction: `points`, the estimator's
    DifferenceSpec.points) and the slot's count are written, as float64 bit patterns, by the one rank that
    evaluated them and are 0 elsewhere, so the integer sum returns them exactly. The stop flag (pre-emption) counts
    the ranks that asked to stop.
    """

    def __init__(self, directions: int, sums: int, slots: int, moved: int = 0, stop: bool = False, device=None,
                 points: int = 2):
        if points < 1:
            raise ValueError(f"a step's packet needs at least one evaluation point per direction, not {points}")
        self.directions, self.sums, self.slots, self.points = directions, sums, slots, points
        self.width = points + 1  # per slot: the loss sum at each point, then the count
        self.moved_at = directions * sums
        self.losses_at = self.moved_at + moved
        self.flag_at = self.losses_at + self.width * directions * slots
        self.has_stop = stop
        self.values = torch.zeros(self.flag_at + stop, dtype=torch.int64, device=device)

    def put_sums(self, direction: int, sums: torch.Tensor) -> None:
        self.values[direction * self.sums: (direction + 1) * self.sums] = sums

    def put_moved(self, counts: torch.Tensor) -> None:
        self.values[self.moved_at: self.losses_at] = counts

    def put_losses(self, direction: int, slot: int, rows: list[torch.Tensor]) -> None:
        """A slot's [loss_sum, count] float64 pairs, one per evaluation point in the estimator's order (device
        tensors: no host read here). The count is the slot's micro-batch's, the same at every point."""
        if len(rows) != self.points:
            raise ValueError(f"direction {direction}, slot {slot}: {len(rows)} evaluations for a packet of "
                             f"{self.points} points per direction")
        at = self.losses_at + self.width * (direction * self.slots + slot)
        self.values[at: at + self.width] = float64_bits(torch.stack([*(row[0] for row in rows), rows[0][1]]))

    def put_stop(self, flag: bool) -> None:
        self.values[self.flag_at] = int(flag)

    def all_reduce(self, comm: Comm) -> None:
        """The sum over `comm`'s group, read back to the host (the step's one synchronisation)."""
        self.values = comm.all_reduce_sum_int64(self.values)

    def block_sums(self) -> torch.Tensor:
        """[q * sums] int64."""
        return self.values[:self.moved_at]

    def moved(self) -> torch.Tensor | None:
        return self.values[self.moved_at: self.losses_at].to(torch.float64) if self.losses_at > self.moved_at else None

    def losses(self) -> list[list[list[float]]]:
        """Per direction, per slot: [the loss sum at each point..., count]."""
        return bits_float64(self.values[self.losses_at: self.flag_at]).view(
            self.directions, self.slots, self.width).tolist()

    def stop(self) -> bool:
        return bool(self.values[self.flag_at]) if self.has_stop else False
