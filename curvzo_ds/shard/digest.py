"""`params_digest` (docs/contracts.md): a world-size-independent hash of the trainable parameters.

For each trainable tensor in sorted canonical-name order: the name in UTF-8 and a zero byte,
the shape as text, the dtype name and a zero byte, then the full tensor's bytes (contiguous,
row-major, little-endian, stored dtype). Under ZeRO-3 the tensors are gathered one at a time,
so this is a collective call; every rank returns the same string.
"""

from __future__ import annotations

import hashlib
import math

import torch

from curvzo_ds.shard import ds_compat


def hash_tensor(h, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().contiguous().cpu()
    h.update(name.encode() + b"\0")
    h.update(str(list(t.shape)).encode())
    h.update(str(t.dtype).encode() + b"\0")
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())


def params_digest(entries, comm) -> str:
    """Digest of the trainable parameters described by `entries` (engine.entries)."""
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.name):
        with ds_compat.gathered([e.param]):
            if comm.rank == 0:
                hash_tensor(h, e.name, e.param.data.view(e.shape))
    return comm.broadcast_object("sha256:" + h.hexdigest() if comm.rank == 0 else None)


ROW = 4096  # sum_of_squares: elements summed in one row (one thread each, whatever the thread count)
PART = 1 << 22  # ... and per float64 copy (32 MiB)


def sum_of_squares(t: torch.Tensor) -> list[float]:
    """The sums of squares of `t`'s rows of ROW elements, in float64: a reduction along a row is one thread's, in a
    fixed order, so the values do not depend on torch's thread count (which the launchers set per world size)."""
    flat, out = t.detach().reshape(-1), []
    for part in flat.split(PART):
        rows = torch.nn.functional.pad(part.to(torch.float64), (0, (-part.numel()) % ROW)).view(-1, ROW)
        out += rows.square().sum(dim=1).tolist()
    return out


def weights_rms(entries, comm) -> float:
    """The root mean square of the trainable parameters described by `entries`: each full tensor (gathered one at a
    time under ZeRO-3, as `params_digest`) in rows of squares (`sum_of_squares`) on rank 0, all added by math.fsum
    (correctly rounded, so in no order), so the value is the same at any world size and thread count. Collective;
    every rank returns the same float (`learning_rate: auto`, algo/rate.py)."""
    sums, count = [], 0
    for e in sorted(entries, key=lambda e: e.name):
        with ds_compat.gathered([e.param]):
            if comm.rank == 0:
                sums += sum_of_squares(e.param.data.view(e.shape))
                count += e.param.data.view(e.shape).numel()
    return comm.broadcast_object(math.sqrt(math.fsum(sums) / max(count, 1)) if comm.rank == 0 else None)
