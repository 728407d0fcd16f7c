"""World-size-independent Gaussian (or Rademacher) noise from a counter-based generator, drawn on the parameter's
device.

Element j of the noise of tensor `name` at step t (and direction d) is a pure function of
(seed, t, name, d, j): a 64-bit Philox key from a stable hash of (seed, t, name, d), the element's
global flat index as the counter, then a Box-Muller transform built from correctly rounded float32
operations only (noise/reference.py holds the definition). So:
- a rank generates exactly the range it owns, and the values do not depend on the world size;
- the values do not depend on the GPU model or the launch grid (unlike CUDA's torch.randn);
- the CPU kernel, the GPU kernel and the torch reference give the same bits (tests/test_noise.py checks
  CPU against the reference, and the Triton kernel's logic under Triton's interpreter).
With perturbation=rademacher, element j is +-1 from bit j % 128 of the same stream's Philox call j // 128 (keys,
counters and every property above unchanged; reference.signs holds the definition).

Backends: `backend()` chooses the kernel, for NoiseSource and the Perturber alike (shard/perturb.py); where no
compiled kernel serves a device or dtype, both go through the torch reference's one runner (`reference.run`). The
Perturber's passes update the weights in place without materialising z and return the exact fixed-point sums of z^2
(the score statistics) from the same pass; NoiseSource draws z itself (`slice`: the static mask, the start-up check).

Everything that draws noise goes through `NoiseSource`, whose `ident` goes into checkpoints: a resume with another
generator is refused (another perturbation is not: the resumed run keeps its checkpoint's), and ranks compare
`reference_digest` at start-up (ZOEngine), so a rank with another kernel build fails at once.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from curvzo_ds.algo.estimators import Perturbation
from curvzo_ds.environment import noise_kernel
from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise.rows import MODES, ElementMode

# z^2 is summed as round(z^2 * 2^24) in int64: exact and order-free. The one source of the scale: philox.c,
# noise/gpu.py and noise/reference.py state 2^24 as a literal, and tests/test_noise.py checks that they agree.
FIXED_POINT_BITS = 24
MAX_ABS_Z = 6.7  # |z| <= 6.66 by construction (u1 >= 2^-32)


def stable_seeds(head: tuple, tails: list[tuple]) -> list[int]:
    """The key hash, the one definition: stable_seed(*head, *tail) for each tail, with `head` hashed once. A 63-bit
    blake2b of each part's str as (uint32 little-endian length, utf-8 bytes), never Python's salted `hash`."""
    prefix = hashlib.blake2b(digest_size=8)
    prefix.update(_encode(head))
    out = []
    for tail in tails:
        h = prefix.copy()
        h.update(_encode(tail))
        out.append(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    return out


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of `parts` (stable_seeds)."""
    return stable_seeds(parts, [()])[0]


def _encode(parts: tuple) -> bytes:
    out = b""
    for part in parts:
        data = str(part).encode()
        out += struct.pack("<I", len(data)) + data
    return out


def f32(x: float) -> float:
    """x rounded to float32 (to nearest even), as the kernels take their scalars."""
    return struct.unpack("f", struct.pack("f", x))[0]


# The generator's identifier per perturbation (the `perturbation` key): it goes into checkpoints and the ranks' start-up
# comparison. The Gaussian one is the identifier every checkpoint before the key carries.
IDENTS = {Perturbation.GAUSSIAN: "philox4x32-10-boxmuller-f32-v1",
          Perturbation.RADEMACHER: "philox4x32-10-rademacher-v1"}


def perturbation_of(describe: dict) -> Perturbation:
    """The perturbation of a checkpoint's noise record (NoiseSource.describe()); ValueError for an unknown one."""
    for perturbation, ident in IDENTS.items():
        if describe.get("ident") == ident:
            return perturbation
    known = ", ".join(IDENTS.values())
    raise ValueError(f"noise {describe} is no generator of this curvzo_ds version (known: {known})")


class NoiseSource:
    """The noise of one run: keyed by (seed, step, canonical tensor name, direction); z ~ N(0, 1) per element, or
    +-1 with perturbation=rademacher (one bit of the same Philox stream per element)."""

    ident = IDENTS[Perturbation.GAUSSIAN]  # the default's; an instance has its perturbation's

    def __init__(self, seed: int, perturbation: str | Perturbation = Perturbation.GAUSSIAN):
        self.seed = seed
        self.perturbation = Perturbation(perturbation)
        self.rademacher = self.perturbation is Perturbation.RADEMACHER
        self.ident = IDENTS[self.perturbation]
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
        """The keys of tensors `names` at `step` as int64 (k0 | k1 << 32): `key()` for many names, through the same
        hash (stable_seeds) with (seed, step) hashed once."""
        seeds = stable_seeds((self.seed, step), [(name, direction) for name in names])
        return np.array(seeds, dtype=np.int64)

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
        self._run(self.key(step, name, direction), start, out)
        return out

    def _run(self, key, start: int, out: torch.Tensor) -> None:
        """z of one range into `out` (float32) through the kernel of out's device (`backend`), or the torch
        reference's one runner where there is none."""
        chosen = backend(out.device, out.dtype)
        if chosen == "c":
            cpu_kernel.run(*key, start, out, ElementMode.WRITE_Z, 0.0, 0.0, False, self.rademacher)
        elif chosen == "triton":
            from curvzo_ds.noise import gpu

            gpu.run(*key, start, out, ElementMode.WRITE_Z, 0.0, 0.0, False, self.rademacher)
        else:
            reference.run([key], start, out, rademacher=self.rademacher)

    def mask_uniforms(self, step: int, count: int) -> torch.Tensor:
        """Uniform [0, 1) float64 draws for the block mask of `step`, the same on every rank (CPU)."""
        self._gen.manual_seed(stable_seed(self.seed, step, "__block_mask__"))
        return torch.rand(count, generator=self._gen, dtype=torch.float64)

    def reference_digest(self, device="cpu") -> str:
        """A hash of a short noise vector drawn by this process's backend for `device`: ranks compare it at
        start-up (shard.distributed.check_ranks_agree), so a rank with a different build (another kernel, another
        definition) fails fast."""
        z = self.slice(0, "__reference__", 4099, 3, 4096, device=device).cpu()
        return hashlib.sha256(z.numpy().tobytes()).hexdigest()[:16]


TRITON_FOUND: bool | None = None
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def backend(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for a tensor of `dtype` on `device`, for NoiseSource and the Perturber alike: "c" (cpu.py),
    "triton" (gpu.py) or "torch" (reference.py).

    CURVZO_DS_NOISE_KERNEL=triton runs the Triton kernel on any device for the dtypes it has (tests run it on CPU
    tensors under TRITON_INTERPRET=1); =torch turns the C kernel off (cpu.available). Otherwise: the C kernel on
    CPU for the dtypes it has (float32, bfloat16, float16, float64), the Triton kernel on CUDA for float32,
    bfloat16 and float16 when Triton imports; the torch reference for the rest."""
    if noise_kernel() == "triton" and dtype in TRITON_DTYPES:
        return "triton"
    if device.type == "cpu" and dtype in MODES and cpu_kernel.available():
        return "c"
    if device.type == "cuda" and dtype in TRITON_DTYPES and triton_available():
        return "triton"
    return "torch"


def triton_available() -> bool:
    global TRITON_FOUND
    if TRITON_FOUND is None:
        try:
            import triton  # noqa: F401

            TRITON_FOUND = True
        except ImportError:
            TRITON_FOUND = False
    return TRITON_FOUND
