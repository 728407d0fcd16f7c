"""The GPU noise kernel (Triton): the same definition as reference.py and philox.c, one launch per tensor piece.

Each program handles BLOCK Philox groups (4 * BLOCK elements): it generates z in registers and either
stores it, or updates the target in place (out <- out * scale + alpha * z, in float32, stored in the
target's dtype with round-to-nearest-even), and writes its partial sum of round(z^2 2^24) to `partial`
(int64), which the caller sums on the device: exact, order-free, and no host synchronisation.

Bit-identity with the CPU depends on three launch details: `enable_fp_fusion=False` (otherwise a*b+c
becomes a fused multiply-add), `div_rn` and `sqrt_rn` (Triton's `/` and `sqrt` are approximate on
NVIDIA GPUs), and int -> float conversions of values below 2^24 only (exact). The element -> counter map
is the element's global index, never the launch grid, so values do not depend on the GPU model
(unlike CUDA's torch.randn). Checked here only under TRITON_INTERPRET=1 on CPU tensors
(tests/test_noise.py); the first GPU run checks it against the CPU kernel (benchmarks/gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as R

SIN1, SIN3, SIN5, SIN7 = (tl.constexpr(v) for v in (R.SIN1, R.SIN3, R.SIN5, R.SIN7))
COS2, COS4, COS6, COS8 = (tl.constexpr(v) for v in (R.COS2, R.COS4, R.COS6, R.COS8))
LOG3, LOG5, LOG7 = (tl.constexpr(v) for v in (R.LOG3, R.LOG5, R.LOG7))
LN2_HI, LN2_LO = tl.constexpr(R.LN2_HI), tl.constexpr(R.LN2_LO)
BLOCK = 1024  # Philox groups per program


@triton.jit
def _box_muller(a, b):
    """uint32 words (a, b) -> (R cos theta, R sin theta), float32: reference.box_muller, op for op."""
    y = a | 1
    sh = tl.where(y >= 0x1000000, 8, 0).to(tl.uint32)
    e = ((y >> sh).to(tl.int32).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127 + sh.to(tl.int32)
    sr = tl.maximum(e - 23, 0).to(tl.uint32)
    sl = tl.maximum(23 - e, 0).to(tl.uint32)
    mant = ((y >> sr) << sl) & 0x7FFFFF
    big = (mant > 0x3504F3).to(tl.int32)
    f = (mant.to(tl.int32) | ((127 - big) << 23)).to(tl.float32, bitcast=True)
    E = (e - 32 + big).to(tl.float32)
    s = tl.math.div_rn(f - 1.0, f + 1.0)
    w = s * s
    lnf = (s + s) + s * (w * (LOG3 + w * (LOG5 + w * LOG7)))
    L = E * LN2_HI + (E * LN2_LO + lnf)
    radius = tl.math.sqrt_rn(-2.0 * L)
    octant = (b >> 29).to(tl.int32)
    j = (((b >> 5) & 0xFFFFFE) | 1).to(tl.int32)
    j = tl.where((octant & 1) == 1, 0x1000000 - j, j)
    t = j.to(tl.float32) * 5.9604644775390625e-08  # 2^-24, exact
    t2 = t * t
    sn = t * (SIN1 + t2 * (SIN3 + t2 * (SIN5 + t2 * SIN7)))
    cs = 1.0 + t2 * (COS2 + t2 * (COS4 + t2 * (COS6 + t2 * COS8)))
    swap = (((octant + 1) >> 1) & 1) == 1
    c = tl.where(swap, sn, cs)
    sv = tl.where(swap, cs, sn)
    c = tl.where(((octant + 2) & 4) != 0, -c, c)
    sv = tl.where((octant & 4) != 0, -sv, sv)
    return radius * c, radius * sv


@triton.jit
def _apply(out_ptr, idx, n, z, scale, alpha, MODE: tl.constexpr):
    inside = (idx >= 0) & (idx < n)
    if MODE == 0:
        tl.store(out_ptr + idx, z, mask=inside)
    elif MODE == 2:
        # bfloat16, handled as its int16 bits: widen exactly, round to nearest even in integers (as philox.c
        # does; NaN -> 0x7fc0), so the result does not depend on how a backend converts fp32 -> bf16.
        bits = tl.load(out_ptr + idx, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        x = (bits << 16).to(tl.float32, bitcast=True)
        u = (x * scale + alpha * z).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(out_ptr + idx, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
    else:
        x = tl.load(out_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        y = x * scale + alpha * z
        tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=inside)
    zz = z.to(tl.float64)
    sq = (zz * zz * 16777216.0 + 6755399441055744.0) - 6755399441055744.0  # round half even: + 1.5 2^52
    return tl.sum(tl.where(inside, sq, 0.0).to(tl.int64), axis=0)


@triton.jit
def _noise_kernel(out_ptr, partial_ptr, k0, k1, g0, start, n, scale, alpha, MODE: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    c = g0 + pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # Philox group of each lane
    x0 = (c & 0xFFFFFFFF).to(tl.uint32)
    x1 = (c >> 32).to(tl.uint32)
    x2 = tl.zeros([BLOCK], dtype=tl.uint32)
    x3 = tl.zeros([BLOCK], dtype=tl.uint32)
    ka = tl.zeros([BLOCK], dtype=tl.uint32) + k0.to(tl.uint32)
    kb = tl.zeros([BLOCK], dtype=tl.uint32) + k1.to(tl.uint32)
    m0 = tl.full([BLOCK], 0xD2511F53, tl.uint32)
    m1 = tl.full([BLOCK], 0xCD9E8D57, tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(m0, x0)
        lo0 = m0 * x0
        hi1 = tl.umulhi(m1, x2)
        lo1 = m1 * x2
        x0, x1, x2, x3 = hi1 ^ x1 ^ ka, lo1, hi0 ^ x3 ^ kb, lo0
        ka = ka + 0x9E3779B9
        kb = kb + 0xBB67AE85
    za, zb = _box_muller(x0, x1)
    zc, zd = _box_muller(x2, x3)
    idx = c * 4 - start  # index in out of z[4c]
    total = _apply(out_ptr, idx, n, za, scale, alpha, MODE)
    total += _apply(out_ptr, idx + 1, n, zb, scale, alpha, MODE)
    total += _apply(out_ptr, idx + 2, n, zc, scale, alpha, MODE)
    total += _apply(out_ptr, idx + 3, n, zd, scale, alpha, MODE)
    tl.store(partial_ptr + pid, total)


def run(k0: int, k1: int, start: int, out: torch.Tensor, mode: int, scale: float, alpha: float) -> torch.Tensor:
    """out <- z[start: start + len(out)] (mode 0, float32) or out * scale + alpha * z; returns the int64
    fixed-point sum of z^2 over the range as a 0-d tensor on out's device (not synchronised)."""
    n = out.numel()
    g0, g1 = start // 4, (start + n + 3) // 4
    programs = max(1, triton.cdiv(g1 - g0, BLOCK))
    partial = torch.zeros(programs, dtype=torch.int64, device=out.device)
    target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out  # mode 2 works on the bits
    if n:
        _noise_kernel[(programs,)](target, partial, k0, k1, g0, start, n, scale, alpha, MODE=mode, BLOCK=BLOCK,
                                   enable_fp_fusion=False)
    return partial.sum()
