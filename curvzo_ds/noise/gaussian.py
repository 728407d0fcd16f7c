"""World-size-independent Gaussian noise from a counter-based generator, drawn on the parameter's device.

Element j of the noise of tensor `name` at step t (and direction d) is a pure function of
(seed, t, name, d, j): a 64-bit Philox key from a stable hash of (seed, t, name, d), the element's
global flat index as the counter, then a Box-Muller transform built from correctly rounded float32
operations only (kernels/reference.py holds the definition). So:
- a rank generates exactly the range it owns, and the values do not depend on the world size;
- the values do not depend on the GPU model or the launch grid (unlike CUDA's torch.randn);
- the CPU kernel, the GPU kernel and the torch reference give the same bits (tests/test_noise.py checks
  CPU against the reference, and the Triton kernel's logic under Triton's interpreter).

Backends, by the device of the tensor: on CPU the compiled kernel (kernels/cpu.py; the torch reference
when no C compiler is found), on CUDA the Triton kernel (the torch reference on the device without
Triton). `axpy_` updates a tensor in place without materialising z and can return the exact fixed-point
sum of z^2 over the range (the score statistics) from the same pass.

Everything that draws noise goes through `NoiseSource`, whose `ident` goes into checkpoints: a resume
with another generator is refused, and ranks compare `reference_digest` at start-up (ZOEngine), so a rank
with another kernel build fails at once.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise.cpu import ElementMode

# z^2 is summed as round(z^2 * 2^24) in int64: exact and order-free. The one source of the scale: philox.c,
# kernels/gpu.py and kernels/reference.py state 2^24 as a literal, and tests/test_noise.py checks that they agree.
FIXED_POINT_BITS = 24
MAX_ABS_Z = 6.7  # |z| <= 6.66 by construction (u1 >= 2^-32)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of `parts` (never Python's salted `hash`)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = str(part).encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def f32(x: float) -> float:
    """x rounded to float32 (to nearest even), as the kernels take their scalars."""
    return struct.unpack("f", struct.pack("f", x))[0]


class NoiseSource:
    """The noise of one run: keyed by (seed, step, canonical tensor name, direction)."""

    ident = "philox4x32-10-boxmuller-f32-v1"

    def __init__(self, seed: int):
        self.seed = seed
        self._gen = torch.Generator(device="cpu")
        self._cache_step: int | None = None
        self._cache: dict[tuple[str, int], tuple[int, int]] = {}

    def describe(self) -> dict:
        return {"ident": self.ident}

    def key(self, step: int, name: str, direction: int = 0) -> tuple[int, int]:
        """The Philox key of tensor `name` at `step` (two uint32 words); a step's keys are cached (three passes
        use each of them)."""
        if self._cache_step != step:
            self._cache_step, self._cache = step, {}
        key = self._cache.get((name, direction))
        if key is None:
            k = stable_seed(self.seed, step, name, direction)
            key = self._cache[(name, direction)] = (k & 0xFFFFFFFF, (k >> 32) & 0xFFFFFFFF)
        return key

    def keys(self, step: int, names: list[str], direction: int = 0) -> np.ndarray:
        """The keys of tensors `names` at `step` as int64 (k0 | k1 << 32): `key()` for many names, with the hash of
        (seed, step) computed once (the same bytes as stable_seed)."""
        prefix = hashlib.blake2b(digest_size=8)
        for part in (self.seed, step):
            data = str(part).encode()
            prefix.update(struct.pack("<I", len(data)) + data)
        d = str(direction).encode()
        tail = struct.pack("<I", len(d)) + d
        out = np.empty(len(names), dtype=np.uint64)
        for i, name in enumerate(names):
            data = name.encode()
            h = prefix.copy()
            h.update(struct.pack("<I", len(data)) + data + tail)
            out[i] = int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
        return out.view(np.int64)

    def slice(self, step: int, name: str, numel: int, start: int, length: int, device="cpu",
              direction: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """z[start: start + length] of tensor `name` (numel elements) at `step`, float32 on `device` (into `out`,
        a float32 tensor of `length` elements, when given)."""
        if start < 0 or length < 0 or start + length > numel:
            raise ValueError(f"noise slice [{start}, {start + length}) outside a tensor of {numel} elements")
        if out is None:
            out = torch.empty(length, dtype=torch.float32, device=device)
        elif out.dtype != torch.float32 or out.numel() != length:
            raise ValueError(f"out must be a float32 tensor of {length} elements")
        self._run(self.key(step, name, direction), start, out, ElementMode.WRITE_Z, 0.0, 0.0, False)
        return out

    def axpy_(self, out: torch.Tensor, step: int, name: str, start: int, scale: float, alpha: float,
              want_sq: bool = False, direction: int = 0):
        """out <- out * scale + alpha * z[start: start + len(out)], in place (out contiguous and 1-D).

        Each operation is rounded separately in float32 (float64 tensors in float64) and stored in
        out's dtype with round-to-nearest-even. With `want_sq`, returns sum round(z^2 2^24) over the
        range: an int on CPU, a 0-d int64 tensor on a GPU (no host synchronisation); else None.
        """
        if out.dtype != torch.float64:  # the kernels compute in float32: round the scalars once, here
            scale, alpha = f32(scale), f32(alpha)
        return self._run(self.key(step, name, direction), start, out, None, scale, alpha, want_sq)

    def _run(self, key, start: int, out: torch.Tensor, mode: ElementMode | None, scale: float, alpha: float,
             want_sq: bool):
        """One range through the kernel of out's device; `mode` None: out's dtype (no kernel has some dtypes: the
        torch reference then)."""
        k0, k1 = key
        kind = out.device.type
        if mode is None:
            mode = cpu_kernel.MODES.get(out.dtype)
        if kind == "cpu" and mode is not None and cpu_kernel.available():
            total = cpu_kernel.run(k0, k1, start, out, mode, scale, alpha, want_sq)
            return total if want_sq else None
        if kind == "cuda" and mode is not None and mode != ElementMode.FLOAT64 and triton_available():
            from curvzo_ds.noise import gpu

            return gpu.run(k0, k1, start, out, mode, scale, alpha, want_sq)
        z = reference.normals(k0, k1, start, out.numel(), out.device)
        if mode == ElementMode.WRITE_Z:
            out.copy_(z)
        else:
            reference.axpy_(out, z, scale, alpha)
        if not want_sq:
            return None
        total = reference.fixed_point_sum_of_squares(z)
        return int(total) if kind == "cpu" else total

    def mask_uniforms(self, step: int, count: int) -> torch.Tensor:
        """Uniform [0, 1) float64 draws for the block mask of `step`, the same on every rank (CPU)."""
        self._gen.manual_seed(stable_seed(self.seed, step, "__block_mask__"))
        return torch.rand(count, generator=self._gen, dtype=torch.float64)

    def reference_digest(self, device="cpu") -> str:
        """A hash of a short noise vector drawn by this process's backend for `device`: ranks compare it at
        start-up (ZOEngine._check_ranks_agree), so a rank with a different build (another kernel, another
        definition) fails fast."""
        z = self.slice(0, "__reference__", 4099, 3, 4096, device=device).cpu()
        return hashlib.sha256(z.numpy().tobytes()).hexdigest()[:16]


TRITON_FOUND: bool | None = None


def triton_available() -> bool:
    global TRITON_FOUND
    if TRITON_FOUND is None:
        try:
            import triton  # noqa: F401

            TRITON_FOUND = True
        except ImportError:
            TRITON_FOUND = False
    return TRITON_FOUND
