"""`params_digest` (docs/contracts.md): a world-size-independent hash of the trainable parameters.

For each trainable tensor in sorted canonical-name order: the name in UTF-8 and a zero byte,
the shape as text, the dtype name and a zero byte, then the full tensor's bytes (contiguous,
row-major, little-endian, stored dtype). Under ZeRO-3 the tensors are gathered one at a time,
so this is a collective call; every rank returns the same string.
"""

from __future__ import annotations

import hashlib

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
