"""The GPU noise kernel (Triton): the same definition as reference.py and philox.c, one launch per pass, for normals
or (`rademacher`) +-1 signs.

A pass is a table of rows (rows.py's format; perturb.py builds it once per step): row r reads n elements from a
source, writes them to a target, both given as element offsets from one base pointer per dtype (any tensor of that
dtype: the addresses of every row are then plain offsets from it), with
    target[i] = source[i] * scale_r + alpha_r * z[start_r + i]     (a copy row: target[i] = source[i])
where z is the stream of key_r; or, with K keys per row (launch's `keys`),
    target[i] = source[i] * scale_r + acc,   acc = alpha_r0 z_0[start_r + i], then acc = acc + alpha_rk z_k[...]
for k = 1 .. K-1 in that order (each op rounded separately, K a compile-time constant, the statistics of z_{K-1};
K = 1 is the line above, bit for bit). One launch covers every row of one (target dtype, source dtype) pair: program p
finds its row by a binary search in the prefix sum of programs per row, then handles SUB x BLOCK Philox groups
(4 elements each) of it. The fixed-point sums of z^2 (round(z^2 2^24), int64) of the rows that count statistics
are added per block with integer atomics: exact, order-free, on the device, no host synchronisation.

Bit-identity with the CPU depends on these launch details: `enable_fp_fusion=False` (otherwise a*b+c becomes a
fused multiply-add), `div_rn` and `sqrt_rn` (Triton's `/` and `sqrt` are approximate on NVIDIA GPUs), int ->
float conversions of values below 2^24 only (exact), and integer arithmetic for the counter: the element ->
counter map is the element's global index (int64), never the launch grid, so values do not depend on the GPU
model (unlike CUDA's torch.randn). Scalar arguments that can equal 1 are never specialised (`do_not_specialize`):
Triton would turn them into constants. Checked under TRITON_INTERPRET=1 on CPU tensors (tests/test_noise.py) and
against the CPU kernel on a GPU (`pytest -m gpu`, benchmarks/gpu.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from curvzo_ds.noise import reference, rows

SIN1, SIN3, SIN5, SIN7 = (tl.constexpr(v) for v in (reference.SIN1, reference.SIN3, reference.SIN5, reference.SIN7))
COS2, COS4, COS6, COS8 = (tl.constexpr(v) for v in (reference.COS2, reference.COS4, reference.COS6, reference.COS8))
LOG3, LOG5, LOG7 = (tl.constexpr(v) for v in (reference.LOG3, reference.LOG5, reference.LOG7))
LN2_HI, LN2_LO = tl.constexpr(reference.LN2_HI), tl.constexpr(reference.LN2_LO)
FIXED_POINT_SCALE = tl.constexpr(16777216.0)  # 2^24: gaussian.FIXED_POINT_BITS (tests/test_noise.py checks they agree)
# The launch shape, from a sweep on an H100 (tools/kernel_profile.py --sweep; benchmarks/RESULTS.md): 512 groups x 4
# sub-blocks x 4 warps needs 46 registers a thread and ran a pass 1.49x faster than 1024 x 4 x 4 (80 registers).
BLOCK = 512  # Philox groups per sub-block: 2048 elements
SUB = 4  # sub-blocks per program: 8192 elements
WARPS = 4  # warps per program
# rows.py's format, as constants the kernel can read
ROW_WIDTH, ROW_DST, ROW_SRC, ROW_N, ROW_START, ROW_KEY, ROW_STAT = (
    tl.constexpr(v) for v in (rows.WIDTH, rows.DST, rows.SRC, rows.N, rows.START, rows.KEY, rows.STAT))
# Element codes (rows.ElementMode): WRITE_Z (as a target), FLOAT32, BFLOAT16, FLOAT16; no FLOAT64 here.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODES = {dtype: int(rows.MODES[dtype]) for dtype in DTYPES}
WRITE_Z, BFLOAT16 = tl.constexpr(int(rows.ElementMode.WRITE_Z)), tl.constexpr(int(rows.ElementMode.BFLOAT16))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter has no libdevice: the portable exponent


@triton.jit
def _box_muller(a, b, RZ: tl.constexpr):
    """uint32 words (a, b) -> (R cos theta, R sin theta), float32: reference.box_muller, op for op.

    e = floor(log2 y) and the 23 bits below y's leading one (truncated): with RZ, both read off y converted to
    float rounded toward zero (one instruction on a GPU; truncation never reaches the next power of two); without
    (Triton's interpreter has no libdevice), from an exact int -> float conversion of y below 2^24 and shifts."""
    y = a | 1
    if RZ:
        bits = libdevice.uint2float_rz(y).to(tl.uint32, bitcast=True)
        e = (bits >> 23).to(tl.int32) - 127
        mant = bits & 0x7FFFFF
    else:
        sh = tl.where(y >= 0x1000000, 8, 0).to(tl.uint32)
        e = ((y >> sh).to(tl.int32).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127 + sh.to(tl.int32)
        mant = ((y << (31 - e).to(tl.uint32)) >> 8) & 0x7FFFFF  # the leading one to bit 31, then down to bit 23
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
def _apply(dst, src, e, n, z, acc, scale, DST: tl.constexpr, SRC: tl.constexpr, INPLACE: tl.constexpr,
           COPY: tl.constexpr, STATS: tl.constexpr):
    """Element e (local to the row) of one row: load, target = source * scale + acc (acc = the sum of alpha_k z_k,
    or alpha * z), store; returns the fixed-point sum of z^2 (z: the last key's) or 0."""
    inside = e.to(tl.uint32) < n.to(tl.uint32)  # 0 <= e < n in one unsigned compare
    if DST == WRITE_Z:
        y = z
    else:
        where = dst + e if INPLACE else src + e
        if SRC == BFLOAT16:  # bfloat16 as its int16 bits: widen exactly
            bits = tl.load(where, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
            x = (bits << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(where, mask=inside, other=0.0).to(tl.float32)
        if COPY:
            y = x
        else:
            y = x * scale + acc
    if DST == BFLOAT16:
        # bfloat16 rounded to nearest even in integers (as philox.c does; NaN -> 0x7fc0), so the result does not
        # depend on how a backend converts fp32 -> bf16
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(dst + e, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
    else:
        tl.store(dst + e, y.to(dst.dtype.element_ty), mask=inside)
    if STATS:
        zz = z.to(tl.float64)
        sq = (zz * zz * FIXED_POINT_SCALE + 6755399441055744.0) - 6755399441055744.0  # round half even: + 1.5 2^52
        total = tl.sum(tl.ravel(tl.where(inside, sq, 0.0).to(tl.int64)), axis=0)  # a 1-D lane block or a 2-D tile
    else:
        total = tl.zeros([], dtype=tl.int64)
    return total


@triton.jit
def _sign(word, bit):
    """+-1.0 (float32) of bit `bit` ([1, 32]) of each uint32 word ([LANES]): a [LANES, 32] tile, set -> -1, clear ->
    +1, built as the float's bits (reference.signs, philox.c's signs())."""
    flip = (word[:, None] >> bit) & 1
    return (flip << 31 | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _normals(g0_lo, g0_hi, gl, k0, k1, RZ: tl.constexpr, RAD: tl.constexpr = False):
    """z of the 4 elements of each group g0 + gl (g0 = (g0_hi, g0_lo), gl int32 [BLOCK]) for the key words (k0, k1),
    uint32: Philox4x32-10 of counter (g0 + gl), the carry into the high word by hand, then Box-Muller. RAD: the
    128 signs of each group instead, as four [LANES, 32] tiles (word w's tile holds elements 128 g + 32 w + b)."""
    x0 = g0_lo + gl.to(tl.uint32)
    x1 = g0_hi + (x0 < g0_lo).to(tl.uint32)
    x2 = tl.zeros_like(x0)
    x3 = tl.zeros_like(x0)
    ka = k0
    kb = k1
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(x0, 0xD2511F53)
        lo0 = x0 * 0xD2511F53
        hi1 = tl.umulhi(x2, 0xCD9E8D57)
        lo1 = x2 * 0xCD9E8D57
        x0, x1, x2, x3 = hi1 ^ x1 ^ ka, lo1, hi0 ^ x3 ^ kb, lo0
        ka = ka + 0x9E3779B9
        kb = kb + 0xBB67AE85
    if RAD:
        bit = tl.arange(0, 32).to(tl.uint32)[None, :]
        za, zb, zc, zd = _sign(x0, bit), _sign(x1, bit), _sign(x2, bit), _sign(x3, bit)
    else:
        za, zb = _box_muller(x0, x1, RZ)
        zc, zd = _box_muller(x2, x3, RZ)
    return za, zb, zc, zd


@triton.jit(do_not_specialize=["n_rows"])
def _rows_kernel(dst_base, src_base, rows, prefix, coef, keys, sums, n_rows, DST: tl.constexpr, SRC: tl.constexpr,
                 INPLACE: tl.constexpr, COPY: tl.constexpr, STATS: tl.constexpr, RZ: tl.constexpr,
                 KEYED: tl.constexpr, NKEYS: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr,
                 SUB: tl.constexpr, RAD: tl.constexpr = False):
    """KEYED: the row's NKEYS keys from keys[row] and coef[row] = (scale, alpha_0 .. alpha_{NKEYS-1}); else the
    row's KEY column and coef[row] = (scale, alpha), NKEYS 1. Keys FIRST .. NKEYS-1 are drawn (FIRST = NKEYS - 1 for
    a WRITE_Z target, which gets the last key's z; else 0). RAD: z = +-1 signs, 128 per Philox group: a sub-block
    is BLOCK // 32 groups, each lane's four words four [BLOCK // 32, 32] tiles of elements (the same 4 BLOCK
    elements per sub-block as with normals)."""
    pid = tl.program_id(0).to(tl.int64)
    # the row of this program: the last r with prefix[r] <= pid (prefix[0] = 0, prefix[n_rows] = all programs)
    lo = tl.zeros([], dtype=tl.int64)
    hi = n_rows.to(tl.int64)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(prefix + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    row = rows + lo * ROW_WIDTH
    dst = dst_base + tl.load(row + ROW_DST)
    src = src_base + tl.load(row + ROW_SRC)
    n = tl.load(row + ROW_N).to(tl.int32)  # rows are cut at 2^30 elements (shard/row_table.py)
    start = tl.load(row + ROW_START)
    stat = tl.load(row + ROW_STAT)
    row_coef = coef + lo * (1 + NKEYS)
    scale = tl.load(row_coef)
    first = pid - tl.load(prefix + lo)  # this program's index within the row
    GROUP: tl.constexpr = 128 if RAD else 4  # elements per Philox group
    LANES: tl.constexpr = BLOCK // 32 if RAD else BLOCK  # groups per sub-block
    STRIDE: tl.constexpr = 32 if RAD else 1  # from one word's (or normal's) elements to the next
    g0 = start // GROUP  # the row's first Philox group
    s0 = (start % GROUP).to(tl.int32)  # elements of that group before the row's start
    g0_lo = (g0 & 0xFFFFFFFF).to(tl.uint32)
    g0_hi = (g0 >> 32).to(tl.uint32)
    if KEYED:  # the first key drawn and its coefficient, loaded once per program
        key_first = tl.load(keys + lo * NKEYS + FIRST)
    else:
        key_first = tl.load(row + ROW_KEY)
    k0 = (key_first & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key_first >> 32) & 0xFFFFFFFF).to(tl.uint32)
    alpha_first = tl.load(row_coef + 1 + FIRST)
    total = tl.zeros([], dtype=tl.int64)
    for sub in tl.static_range(SUB):
        base = ((first * SUB + sub) * LANES).to(tl.int32)  # the sub-block's first group, local to the row
        if base * GROUP - s0 < n:
            gl = base + tl.arange(0, LANES)  # local group of each lane
            if RAD:  # local index of each word's first element (a [LANES, 32] tile of elements)
                e = gl[:, None] * GROUP + tl.arange(0, 32)[None, :] - s0
            else:  # local index of the group's first element
                e = gl * GROUP - s0
            if COPY:
                total += _apply(dst, src, e, n, 0.0, 0.0, scale, DST, SRC, INPLACE, True, False)
                total += _apply(dst, src, e + STRIDE, n, 0.0, 0.0, scale, DST, SRC, INPLACE, True, False)
                total += _apply(dst, src, e + 2 * STRIDE, n, 0.0, 0.0, scale, DST, SRC, INPLACE, True, False)
                total += _apply(dst, src, e + 3 * STRIDE, n, 0.0, 0.0, scale, DST, SRC, INPLACE, True, False)
            else:
                # acc = alpha_0 z_0 (with one key: alpha * z) ...
                za, zb, zc, zd = _normals(g0_lo, g0_hi, gl, k0, k1, RZ, RAD)
                aa, ab, ac, ad = alpha_first * za, alpha_first * zb, alpha_first * zc, alpha_first * zd
                # ... then acc = acc + alpha_k z_k in key order: a loop, not unrolled (the kernel's size and its
                # compile time do not grow with K)
                for k in range(FIRST + 1, NKEYS):
                    key = tl.load(keys + lo * NKEYS + k)
                    alpha = tl.load(row_coef + 1 + k)
                    za, zb, zc, zd = _normals(g0_lo, g0_hi, gl, (key & 0xFFFFFFFF).to(tl.uint32),
                                              ((key >> 32) & 0xFFFFFFFF).to(tl.uint32), RZ, RAD)
                    aa, ab, ac, ad = aa + alpha * za, ab + alpha * zb, ac + alpha * zc, ad + alpha * zd
                # za .. zd: the last key's z, for WRITE_Z and the statistics
                total += _apply(dst, src, e, n, za, aa, scale, DST, SRC, INPLACE, False, STATS)
                total += _apply(dst, src, e + STRIDE, n, zb, ab, scale, DST, SRC, INPLACE, False, STATS)
                total += _apply(dst, src, e + 2 * STRIDE, n, zc, ac, scale, DST, SRC, INPLACE, False, STATS)
                total += _apply(dst, src, e + 3 * STRIDE, n, zd, ad, scale, DST, SRC, INPLACE, False, STATS)
    if STATS:
        tl.atomic_add(sums + tl.maximum(stat, 0), total, mask=stat >= 0)


def programs_per_row(n: torch.Tensor, start: torch.Tensor, rademacher: bool = False) -> torch.Tensor:
    """Programs each row needs (int64 CPU tensors of the rows' lengths and starts): SUB sub-blocks of BLOCK Philox
    groups of 4 normals, or (rademacher) of BLOCK // 32 groups of 128 signs."""
    group, lanes = (128, BLOCK // 32) if rademacher else (4, BLOCK)
    groups = (start + n + group - 1) // group - start // group
    return (groups + SUB * lanes - 1) // (SUB * lanes)


def launch(dst_base: torch.Tensor, src_base: torch.Tensor | None, table: torch.Tensor, prefix: torch.Tensor,
           programs: int, coef: torch.Tensor, sums: torch.Tensor | None, copy: bool = False,
           write_z: bool = False, keys: torch.Tensor | None = None, rademacher: bool = False) -> None:
    """One launch over every row of a (target dtype, source dtype) pair; all tensors on the same CUDA device.

    table: int64 [R, rows.WIDTH] (rows.py's format) with element offsets from dst_base (DST) and src_base (SRC;
    src_base None: each row updates its target in place); prefix: int64 [R + 1], the running total of
    programs_per_row; coef: float32 [R, 2] (scale, alpha); sums: int64 [G] to add the rows' statistics to (None:
    no statistics work at all); copy: target = source, no noise; write_z: target (float32) = z.
    keys: int64 [R, K] (each k0 | k1 << 32; the table's KEY column is then not read), with coef float32 [R, 1 + K]
    (scale, alpha_0 .. alpha_{K-1}): target = source * scale + acc, acc = alpha_0 z_0 then acc + alpha_k z_k in key
    order, the statistics (and write_z's z) the last key's; K is a compile-time constant (one compiled kernel per
    K). K = 1 gives the bits of keys None. rademacher: z = +-1 signs; `prefix` then counts programs_per_row(...,
    rademacher=True) (a copy launch draws nothing, but walks the rows as its pass does)."""
    src = dst_base if src_base is None else src_base
    as_bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
    nkeys = 1 if keys is None else keys.shape[1]
    keys = keys if keys is None else keys.contiguous()
    if keys is not None and (keys.dim() != 2 or keys.shape[0] != table.shape[0] or nkeys < 1
                             or tuple(coef.shape) != (table.shape[0], 1 + nkeys)):
        raise ValueError(f"keys [{table.shape[0]}, K >= 1] and coef [{table.shape[0]}, 1 + K] for "
                         f"{table.shape[0]} rows, not {list(keys.shape)} and {list(coef.shape)}")
    _rows_kernel[(programs,)](as_bits(dst_base), as_bits(src), table, prefix, coef,
                              keys if keys is not None else table, sums if sums is not None else table,
                              table.shape[0],
                              DST=int(rows.ElementMode.WRITE_Z) if write_z else CODES[dst_base.dtype],
                              SRC=CODES[src.dtype],
                              INPLACE=src_base is None, COPY=copy, STATS=sums is not None, RZ=not INTERPRETED,
                              KEYED=keys is not None, NKEYS=nkeys, FIRST=nkeys - 1 if write_z else 0,
                              BLOCK=BLOCK, SUB=SUB, RAD=rademacher, num_warps=WARPS,
                              enable_fp_fusion=False)


def run(k0: int, k1: int, start: int, out: torch.Tensor, mode: int, scale: float, alpha: float,
        want_sq: bool = True, rademacher: bool = False) -> torch.Tensor | None:
    """One range: out <- z[start: start + len(out)] (mode 0, float32) or out * scale + alpha * z, in place; returns
    the int64 fixed-point sum of z^2 as a 0-d tensor on out's device (not synchronised), or None without want_sq.
    z: normals, or +-1 signs with `rademacher`."""
    n = out.numel()
    device = out.device
    sums = torch.zeros(1, dtype=torch.int64, device=device) if want_sq else None
    if n == 0:
        return sums[0] if want_sq else None
    key = (k1 << 32 | k0) - (1 << 64 if k1 >= 1 << 31 else 0)  # the two words as one int64
    table = torch.zeros(1, rows.WIDTH, dtype=torch.int64)
    table[0, rows.N], table[0, rows.START], table[0, rows.KEY] = n, start, key
    per = programs_per_row(table[:, rows.N], table[:, rows.START], rademacher)
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), per.cumsum(0)])
    coef = torch.tensor([[scale, alpha]], dtype=torch.float32)
    launch(out, None, table.to(device), prefix.to(device), int(prefix[-1]), coef.to(device), sums,
           write_z=mode == rows.ElementMode.WRITE_Z, rademacher=rademacher)
    return sums[0] if want_sq else None
