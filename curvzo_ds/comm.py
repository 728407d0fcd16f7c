"""The engine's few collectives, on an explicit process group (no-ops in one process).

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
