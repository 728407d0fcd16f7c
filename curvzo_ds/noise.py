"""World-size-independent Gaussian noise, defined in fixed-size chunks (docs/deepspeed.md).

The noise z of a parameter with n elements at a step is the concatenation of chunks
c = 0, 1, ..., each of length min(chunk, n - c*chunk), chunk c drawn from its own generator
seeded by a stable hash of (seed, step, parameter name, c). Any slice [start, start + n) can
then be produced alone, bit-identical to the same slice of the whole, in O(n + chunk) memory:
a rank generates only the chunks that overlap the part of a parameter it owns.

Everything that draws noise goes through `NoiseSource`, whose `ident` is written into
checkpoints, so that a later generator (counter-based, the same on CPU and GPU) can replace
this one without silently mixing two definitions of z in one run.
"""

from __future__ import annotations

import hashlib
import struct

import torch


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of `parts` (never Python's salted `hash`)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = str(part).encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class NoiseSource:
    """Chunked Gaussian noise from CPU `torch.Generator`s (mt19937), float32."""

    ident = "chunked-mt19937-blake2b-v1"

    def __init__(self, seed: int, chunk_size: int = 1 << 16):
        if chunk_size < 1:
            raise ValueError(f"noise_chunk_size={chunk_size} is invalid: it must be >= 1")
        self.seed = seed
        self.chunk_size = chunk_size
        self._gen = torch.Generator(device="cpu")

    def describe(self) -> dict:
        return {"ident": self.ident, "chunk_size": self.chunk_size}

    def slice(self, step: int, name: str, numel: int, start: int, length: int) -> torch.Tensor:
        """z[start:start+length] of the parameter `name` (numel elements) at `step`, float32 CPU."""
        if start < 0 or length < 0 or start + length > numel:
            raise ValueError(f"noise slice [{start}, {start + length}) outside a tensor of {numel} elements")
        out = torch.empty(length, dtype=torch.float32)
        cs = self.chunk_size
        pos = start
        end = start + length
        while pos < end:
            c = pos // cs
            c_start = c * cs
            c_len = min(cs, numel - c_start)
            self._gen.manual_seed(stable_seed(self.seed, step, name, c))
            chunk = torch.randn(c_len, generator=self._gen, dtype=torch.float32)
            lo = pos - c_start
            hi = min(end, c_start + c_len) - c_start
            out[pos - start: pos - start + hi - lo] = chunk[lo:hi]
            pos = c_start + hi
        return out

    def mask_uniforms(self, step: int, count: int) -> torch.Tensor:
        """Uniform [0, 1) float64 draws for the block mask of `step`, the same on every rank."""
        self._gen.manual_seed(stable_seed(self.seed, step, "__block_mask__"))
        return torch.rand(count, generator=self._gen, dtype=torch.float64)
