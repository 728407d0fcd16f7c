"""The noise generator's definition in torch eager ops: the reference, and the fallback on any device.

Element j of the stream for a 64-bit key (key0, key1): group c = j // 4, Philox4x32-10 (Salmon et al.
2011, Random123's constants) of counter (c mod 2^32, c // 2^32, 0, 0) -> four uint32 words r0..r3;
Box-Muller on (r0, r1) gives z[4c], z[4c+1], on (r2, r3) gives z[4c+2], z[4c+3].

The transform uses only integer operations and IEEE float32 +, -, *, / and sqrt, each rounded
separately: no library log/sin/cos (their last bits differ between CPU and GPU libraries), no fused
multiply-add. ln(u1) comes from the exact exponent of u1 and a polynomial in s = (f-1)/(f+1) on the
mantissa f in [sqrt(1/2), sqrt(2)); cos and sin of 2 pi u2 from an exact integer octant reduction and
polynomials on [0, pi/4]. Measured against float64: ln within 1.7 ulp, sin/cos within 1.7 ulp, z within
1.8e-7 R. u1 = (r0 | 1) 2^-32 with 24 significant bits, so |z| <= 6.66.

perturbation=rademacher (`signs`): the same Philox calls, one per 128 elements: element j is bit j % 32 of word
(j // 32) % 4 of the call at counter j // 128, set -> -1, clear -> +1 (no float arithmetic at all).

An update of a range applies the stream(s) to a tensor: axpy_ (one stream: out * scale + alpha * z) and
axpy_keys_ (K streams, one pass: source * scale + acc, acc = alpha_0 z_0 + ... + alpha_{K-1} z_{K-1} summed left
to right), each operation rounded separately, as the kernels' row passes do.

philox.c (CPU) and gpu.py (Triton) compute the same operations in the same order: the three give the
same bits. uint32 arithmetic is emulated here in int64 tensors, with the 32x32 -> 64 multiply split into
16-bit halves so that no int64 product overflows.
"""

import torch

MASK = 0xFFFFFFFF
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85

# float32 coefficients (exact float32 values), fitted once offline (the fitting script is not in the repository;
# these values define the noise, and the C and Triton kernels are checked against them bit for bit)
SIN1, SIN3, SIN5, SIN7 = (float.fromhex(h) for h in
                          ("0x1.921fb6p-1", "-0x1.4abbbap-4", "0x1.465e92p-9", "-0x1.2d9302p-15"))
COS2, COS4, COS6, COS8 = (float.fromhex(h) for h in
                          ("-0x1.3bd3ccp-2", "0x1.03c1dep-6", "-0x1.55c5e0p-12", "0x1.d9d57ep-19"))
LOG3, LOG5, LOG7 = (float.fromhex(h) for h in ("0x1.55557ap-1", "0x1.995eccp-2", "0x1.31e138p-2"))
LN2_HI = float.fromhex("0x1.63p-1")          # 0.693359375, E * LN2_HI exact for |E| <= 32
LN2_LO = float.fromhex("-0x1.bd0106p-13")    # float32(ln 2 - LN2_HI)


def _mulhilo(m, x):
    """(hi, lo) 32-bit words of m * x, m a Python int < 2^32, x int64 tensor < 2^32."""
    p_l = x * (m & 0xFFFF)                   # < 2^48
    p_h = x * (m >> 16)                      # < 2^48
    mid = p_l + ((p_h & 0xFFFF) << 16)       # < 2^49
    return (p_h >> 16) + (mid >> 32), mid & MASK


def philox4x32_10(x0, x1, x2, x3, key0, key1):
    """Philox4x32-10 (Random123) on int64 tensors holding uint32 words."""
    k0, k1 = key0, key1
    for _ in range(10):
        hi0, lo0 = _mulhilo(M0, x0)
        hi1, lo1 = _mulhilo(M1, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return x0, x1, x2, x3


def _f32(bits):
    """Reinterpret int64 tensor holding uint32 bits < 2^31 as float32."""
    return bits.to(torch.int32).view(torch.float32)


def box_muller(a, b):
    """a, b: int64 tensors of uint32 words -> (R cos theta, R sin theta), float32."""
    # ---- u1 = (a | 1) * 2^-32, mantissa truncated to 24 significant bits
    y = a | 1
    # e = floor(log2 y): the float conversion gives e or e + 1 whatever its rounding;
    # the integer test makes it exact.
    e = (_to_bits(y.to(torch.float32)) >> 23) - 127
    e = e - ((y >> e) == 0).to(torch.int64)
    sr = (e - 23).clamp(min=0)
    sl = (23 - e).clamp(min=0)
    mant = ((y >> sr) << sl) & 0x7FFFFF
    big = (mant > 0x3504F3).to(torch.int64)  # 1.mant > sqrt(2): halve f
    f = _f32(mant | ((127 - big) << 23))     # f in [sqrt(.5), sqrt(2))
    E = (e - 32 + big).to(torch.float32)     # u1 = f * 2^E
    s = (f - 1.0) / (f + 1.0)
    w = s * s
    lnf = (s + s) + s * (w * (LOG3 + w * (LOG5 + w * LOG7)))
    L = E * LN2_HI + (E * LN2_LO + lnf)
    # torch.sqrt on CPU float32 is NOT correctly rounded (MKL VML: ~0.7% of inputs off
    # by 1 ulp).  sqrt in float64 then rounding to float32 is correctly rounded (double
    # rounding is innocuous for sqrt since 53 >= 2*24 + 2), on every device.
    R = torch.sqrt((-2.0 * L).double()).float()
    # ---- theta = 2 pi (oct + t) / 8, t = j * 2^-24, j odd
    oct_ = b >> 29
    j = ((b >> 5) & 0xFFFFFE) | 1
    j = torch.where((oct_ & 1) == 1, 0x1000000 - j, j)
    t = j.to(torch.float32) * float.fromhex("0x1p-24")   # exact: j < 2^24
    t2 = t * t
    sn = t * (SIN1 + t2 * (SIN3 + t2 * (SIN5 + t2 * SIN7)))
    cs = 1.0 + t2 * (COS2 + t2 * (COS4 + t2 * (COS6 + t2 * COS8)))
    swap = (((oct_ + 1) >> 1) & 1) == 1
    c = torch.where(swap, sn, cs)
    sv = torch.where(swap, cs, sn)
    c = torch.where(((oct_ + 2) & 4) != 0, -c, c)
    sv = torch.where((oct_ & 4) != 0, -sv, sv)
    return R * c, R * sv


def _to_bits(x):
    return x.view(torch.int32).to(torch.int64) & MASK


def normals(key0: int, key1: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """float32 tensor z[start:start+n] for key (key0, key1); start + n < 2^63."""
    g0, g1 = start // 4, (start + n + 3) // 4
    c = torch.arange(g0, g1, dtype=torch.int64, device=device)
    zero = torch.zeros_like(c)
    r0, r1, r2, r3 = philox4x32_10(c & MASK, c >> 32, zero, zero, key0, key1)
    zc, zs = box_muller(torch.stack([r0, r2], 1), torch.stack([r1, r3], 1))
    z = torch.stack([zc, zs], -1).reshape(-1)   # order 4c + 2h + {cos, sin}
    off = start - 4 * g0
    return z[off:off + n]


def signs(key0: int, key1: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """float32 tensor of +-1 (Rademacher) z[start:start+n] for key (key0, key1): element j is bit j % 32 of word
    (j // 32) % 4 of Philox4x32-10 at counter c = j // 128 (the counter split as for normals), 1 -> -1, 0 -> +1.
    One Philox call gives 128 signs where it gives 4 normals."""
    g0, g1 = start // 128, (start + n + 127) // 128
    c = torch.arange(g0, g1, dtype=torch.int64, device=device)
    zero = torch.zeros_like(c)
    words = torch.stack(philox4x32_10(c & MASK, c >> 32, zero, zero, key0, key1), 1)  # [C, 4]: r0 .. r3
    bits = (words[:, :, None] >> torch.arange(32, device=device)) & 1  # [C, 4, 32]
    z = (1 - 2 * bits).to(torch.float32).reshape(-1)  # order 128c + 32w + b
    off = start - 128 * g0
    return z[off:off + n]


def draw(key0: int, key1: int, start: int, n: int, device="cpu", rademacher: bool = False) -> torch.Tensor:
    """z[start:start+n] of the stream of key (key0, key1): normals, or +-1 signs with `rademacher`."""
    return (signs if rademacher else normals)(key0, key1, start, n, device)


def fixed_point_sum_of_squares(z: torch.Tensor) -> torch.Tensor:
    """sum round(z^2 2^24) as an int64 tensor (z^2 exact in float64, round half to even): exact, order-free."""
    zd = z.double()
    return torch.round(zd * zd * 16777216.0).long().sum()


def axpy_(out: torch.Tensor, z: torch.Tensor, scale: float, alpha: float) -> None:
    """out <- out * scale + alpha * z with three separately rounded float32 operations (float64 for float64
    tensors), stored back in out's dtype with round-to-nearest-even. scale and alpha must already be float32
    values. No `add_(..., alpha=)`: ATen may fuse that into a multiply-add, which changes the last bit."""
    if out.dtype == torch.float64:
        t = z.double() * alpha
        if scale != 1.0:
            out.mul_(scale)
        out.add_(t)
        return
    t = z * alpha
    if out.dtype == torch.float32:
        if scale != 1.0:
            out.mul_(scale)
        out.add_(t)
        return
    x = out.float()
    if scale != 1.0:
        x = x * scale
    out.copy_(x + t)


def axpy_keys_(out: torch.Tensor, source: torch.Tensor, zs: list[torch.Tensor], scale: float,
               alphas: list[float]) -> None:
    """out <- source * scale + acc with acc = alphas[0] * zs[0], then acc = acc + alphas[k] * zs[k] for k = 1 ..
    K-1 in that order: several noise streams (zs: float32 tensors of out's length, as normals() draws them) in one
    update, as the kernels' rows with K keys do. Each operation is rounded separately in float32 (float64 when out
    is float64: the z are widened exactly first), the result stored in out's dtype with round-to-nearest-even.
    source may be out itself (in place) or another tensor of out's length (a float32 master copy into a bfloat16
    target); scale and alphas must already be float32 values (for non-float64 out), as for axpy_. With one stream
    this is axpy_'s arithmetic, bit for bit. No fused ops (`add_(..., alpha=)`, addcmul): see axpy_."""
    if len(zs) != len(alphas) or not zs:
        raise ValueError(f"{len(zs)} noise streams for {len(alphas)} coefficients: need one each, at least one")
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    acc = zs[0].to(compute) * alphas[0]
    for z, alpha in zip(zs[1:], alphas[1:]):
        acc = acc + z.to(compute) * alpha
    x = source.to(compute)
    if scale != 1.0:  # x * 1 is exact: the same bits without the pass
        x = x * scale
    out.copy_(x + acc)


def run(keys: list[tuple[int, int]], start: int, target: torch.Tensor, source: torch.Tensor | None = None,
        scale: float = 1.0, alphas: list[float] | None = None, want_sq: bool = False, rademacher: bool = False):
    """The torch-eager fallback, the one runner of every caller without a compiled kernel (NoiseSource on a device
    or dtype the kernels lack, the Perturber's rows): target <- source * scale + sum_k alphas[k] z_k over the range
    [start, start + len(target)) of the streams of `keys` (axpy_keys_'s arithmetic; source None: target itself);
    alphas None: target <- z of the last key (float32); `rademacher`: z = +-1 (signs) instead of normals. Returns
    sum round(z^2 2^24) of the last key's z as a 0-d int64 tensor on the target's device when `want_sq`, else
    None."""
    n = target.numel()
    zs = [draw(k0, k1, start, n, target.device, rademacher)
          for k0, k1 in (keys if alphas is not None else keys[-1:])]
    if alphas is None:
        target.copy_(zs[-1])
    else:
        axpy_keys_(target, target if source is None else source, zs, scale, alphas)
    return fixed_point_sum_of_squares(zs[-1]) if want_sq else None
