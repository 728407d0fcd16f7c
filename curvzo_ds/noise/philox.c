/* curvzo_ds noise kernel (CPU): Philox4x32-10 + integer-reduced Box-Muller, or Rademacher signs.
 * The definition is shared with noise/reference.py (torch eager) and noise/gpu.py (Triton):
 * change all three together, and the generator's ident in noise/gaussian.py.
 *
 *
 * Element j of the stream for key (k0, k1) is a pure function of (key, j):
 *   group c = j / 4, Philox counter (c & 0xffffffff, c >> 32, 0, 0), key (k0, k1)
 *   -> r0..r3;  pair (r0, r1) -> z[4c], z[4c+1];  pair (r2, r3) -> z[4c+2], z[4c+3].
 * Rademacher (perturbation=rademacher, `rad`): group c = j / 128, the same counter and key -> r0..r3;
 *   z[128c + 32w + b] = bit b of r_w ? -1 : +1 (signs() below: a sign bit, no branch, no float arithmetic).
 *   alpha * z is then exact (+-alpha), so a pass is the same separately rounded ops as with normals.
 * The transform uses only integer ops and IEEE float32 + - * / sqrt, each rounded
 * separately (build with -ffp-contract=off, no fast-math), so that torch eager ops
 * (noise/reference.py) on any IEEE device give the same bits.  See box_muller() below.
 *
 * Work is done per block of BLK groups in three passes over L1-resident buffers:
 * Philox (hand-vectorised, below) -> Box-Muller (branch-free, auto-vectorised by gcc)
 * -> store / axpy / sum of squares (auto-vectorised).  A row with several noise keys (noise_rows_keys)
 * draws each key's block of z in turn into the same buffer, adds alpha_k z_k to an accumulator block
 * (acc = alpha_0 z_0, then acc = acc + alpha_k z_k, in key order), then stores src * scale + acc once.
 * Build: gcc -O3 -march=native -ffp-contract=off -fno-fast-math -fno-math-errno
 *   -shared -fPIC, and the row format and element modes as -D flags (noise/rows.py's c_defines(), which
 *   noise/cpu.py's build() passes).  -fno-math-errno is needed for gcc to vectorise sqrtf (else a
 *   scalar errno check, ~8x slower transform); it does not change any result.
 */
#include <stdint.h>
#include <string.h>

#ifndef ROW_WIDTH
#error "build through curvzo_ds/noise/cpu.py: it passes the row format and the element modes (noise/rows.py)"
#endif

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

/* groups per block: 4*BLK floats of z + 4*BLK uint32 of Philox output stay in L1 */
#define BLK 256
/* elements per block of +-1 signs (RAD_BLK / 128 Philox groups; a and b hold up to 2 BLK): 16 KiB of float32 terms,
 * in L1; 4x the normals' block, as a block of signs costs a quarter of the Philox calls (measured: 1024 -> 4096
 * took a one-key pass from 1.38x to 1.17x the floor arm on this CPU) */
#define RAD_BLK 4096

/* float32 coefficients, fitted by fit_coeffs.py (minimax, relative error) */
#define SIN1 0x1.921fb6p-1f   /* sin(pi/4 t) = t (S1 + S3 t^2 + S5 t^4 + S7 t^6) */
#define SIN3 -0x1.4abbbap-4f
#define SIN5 0x1.465e92p-9f
#define SIN7 -0x1.2d9302p-15f
#define COS2 -0x1.3bd3ccp-2f  /* cos(pi/4 t) = 1 + t^2 (C2 + C4 t^2 + C6 t^4 + C8 t^6) */
#define COS4 0x1.03c1dep-6f
#define COS6 -0x1.55c5e0p-12f
#define COS8 0x1.d9d57ep-19f
#define LOG3 0x1.55557ap-1f   /* ln f = 2 s + s w (L3 + L5 w + L7 w^2), s=(f-1)/(f+1), w=s^2 */
#define LOG5 0x1.995eccp-2f
#define LOG7 0x1.31e138p-2f
#define LN2_HI 0x1.630000p-1f /* 0.693359375: 9 significant bits, so E*LN2_HI is exact */
#define LN2_LO -0x1.bd0106p-13f /* ln2 - LN2_HI, rounded to float32 */

static inline float as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t as_u32(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Philox4x32-10 on counters (lo + i, hi (+carry), 0, 0), i in [0, n), n a multiple of VW.
 * Output stored pair-major: a[2i] = r0, a[2i+1] = r2 (the u1 words), b[2i] = r1,
 * b[2i+1] = r3 (the angle words), so the transform reads both contiguously.
 *
 * Vectorised by hand with GNU vector extensions: one group per 64-bit lane.  gcc does
 * not turn (x & 0xffffffff) * M into pmuludq (with AVX-512 it emits the slow 64x64
 * vpmullq plus zero-extend/permute shuffles), so the 32x32->64 multiply is an intrinsic.
 * pmuludq reads only the low 32 bits of each lane, so the upper halves of the state
 * words may hold garbage and are never masked inside the rounds ("lazy" 32-bit words). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define VW 8
typedef uint64_t u64v __attribute__((vector_size(64)));
#define MUL32(x, m) ((u64v)_mm512_mul_epu32((__m512i)(x), (__m512i)(m)))
#elif defined(__AVX2__)
#define VW 4
typedef uint64_t u64v __attribute__((vector_size(32)));
#define MUL32(x, m) ((u64v)_mm256_mul_epu32((__m256i)(x), (__m256i)(m)))
#elif defined(__SSE2__)
#define VW 2
typedef uint64_t u64v __attribute__((vector_size(16)));
#define MUL32(x, m) ((u64v)_mm_mul_epu32((__m128i)(x), (__m128i)(m)))
#else
#define VW 2
typedef uint64_t u64v __attribute__((vector_size(16)));
#define MUL32(x, m) (((x) & 0xffffffffu) * ((m) & 0xffffffffu))
#endif

static void philox_block(uint32_t lo, uint32_t hi, uint32_t k0, uint32_t k1, int n,
                         uint32_t *restrict a, uint32_t *restrict b) {
    u64v lane, m0 = {0}, m1 = {0};
    for (int k = 0; k < VW; k++) lane[k] = (uint64_t)k;
    m0 += PHILOX_M0;
    m1 += PHILOX_M1;
    for (int i = 0; i < n; i += VW) {
        u64v c = lane + ((uint64_t)lo + (uint64_t)i);   /* < 2^33: carry in bit 32 */
        u64v x0 = c, x1 = (c >> 32) + hi, x2 = {0}, x3 = {0};
        uint32_t ka = k0, kb = k1;
#pragma GCC unroll 10
        for (int r = 0; r < 10; r++) {
            u64v p0 = MUL32(x0, m0);
            u64v p1 = MUL32(x2, m1);
            x0 = (p1 >> 32) ^ x1 ^ (uint64_t)ka;
            x2 = (p0 >> 32) ^ x3 ^ (uint64_t)kb;
            x1 = p1;                               /* low 32 bits = lo word */
            x3 = p0;
            ka += PHILOX_W0;
            kb += PHILOX_W1;
        }
        /* lane g -> a[2g] = r0, a[2g+1] = r2 (little endian); b likewise with r1, r3 */
        u64v A = (x0 & 0xffffffffu) | (x2 << 32);
        u64v B = (x1 & 0xffffffffu) | (x3 << 32);
        memcpy(a + 2 * i, &A, sizeof A);
        memcpy(b + 2 * i, &B, sizeof B);
    }
}

/* Box-Muller on m pairs: (a[p], b[p]) -> z[2p] = R cos(theta), z[2p+1] = R sin(theta).
 *
 * u1 = y * 2^-32 with y = a | 1 (odd, so u1 in (0,1), the midpoint of one of 2^31
 * cells), y truncated to its 24 leading significant bits; ln(u1) is computed from the
 * exact exponent (count leading zeros) and the mantissa f, reduced to [sqrt(.5), sqrt(2)).
 * theta = 2 pi (oct + t) / 8: octant oct = top 3 bits of b, t = j * 2^-24 with
 * j = 2 * (next 23 bits) + 1 odd, so t in (0,1) and the reflection 1 - t (odd octants)
 * is exact in integers and lands on the same grid. */
static void box_muller(int m, const uint32_t *restrict a, const uint32_t *restrict b,
                       float *restrict z) {
    for (int p = 0; p < m; p++) {
        /* ---- R = sqrt(-2 ln u1) */
        uint32_t y = a[p] | 1u;
#ifdef __AVX512CD__
        int e = 31 - __builtin_clz(y);            /* y in [2^e, 2^(e+1)); vplzcntd */
#else   /* same value, vectorisable without lzcnt: int -> float is exact below 2^24 */
        int sh = y >= 0x1000000u ? 8 : 0;
        int e = (int)(as_u32((float)(int32_t)(y >> sh)) >> 23) - 127 + sh;
#endif
        int sr = e > 23 ? e - 23 : 0, sl = e < 23 ? 23 - e : 0;
        uint32_t mant = ((y >> sr) << sl) & 0x7fffffu; /* 23 bits below the leading 1 */
        int big = mant > 0x3504f3u;               /* 1.mant > sqrt(2): use f = 1.mant / 2 */
        float f = as_float(mant | ((uint32_t)(127 - big) << 23));
        float E = (float)(e - 32 + big);          /* u1 = f * 2^E, exact small integer */
        float s = (f - 1.0f) / (f + 1.0f);        /* f - 1 is exact (Sterbenz) */
        float w = s * s;
        float lnf = (s + s) + s * (w * (LOG3 + w * (LOG5 + w * LOG7)));
        float L = E * LN2_HI + (E * LN2_LO + lnf);  /* ln u1 < 0 */
        float R = __builtin_sqrtf(-2.0f * L);

        /* ---- (cos, sin) of theta */
        uint32_t v = b[p];
        uint32_t oct = v >> 29;
        int32_t j = (int32_t)(((v >> 5) & 0xfffffeu) | 1u);
        if (oct & 1) j = 0x1000000 - j;           /* odd octant: angle to the next axis */
        float t = (float)j * 0x1p-24f;            /* exact */
        float t2 = t * t;
        float sn = t * (SIN1 + t2 * (SIN3 + t2 * (SIN5 + t2 * SIN7)));
        float cs = 1.0f + t2 * (COS2 + t2 * (COS4 + t2 * (COS6 + t2 * COS8)));
        int swap = ((oct + 1) >> 1) & 1;          /* octants 1, 2, 5, 6 */
        float c = swap ? sn : cs, sv = swap ? cs : sn;
        if ((oct + 2) & 4) c = -c;                /* octants 2..5: cos < 0 */
        if (oct & 4) sv = -sv;                    /* octants 4..7: sin < 0 */
        z[2 * p] = R * c;
        z[2 * p + 1] = R * sv;
    }
}

/* Rademacher signs of ng groups of 128 elements: z[128c + 32w + b] = bit b of r_w of group c, set -> -1.0f, clear
 * -> +1.0f, written as the float's bits (sign bit | 1.0f), vectorised by gcc (variable shifts).  a, b as
 * philox_block stores them: r0 = a[2c], r1 = b[2c], r2 = a[2c+1], r3 = b[2c+1]. */
static void signs(int ng, const uint32_t *restrict a, const uint32_t *restrict b, float *restrict z) {
    for (int c = 0; c < ng; c++) {
        const uint32_t words[4] = {a[2 * c], b[2 * c], a[2 * c + 1], b[2 * c + 1]};
        for (int w = 0; w < 4; w++) {
            float *o = z + 128 * c + 32 * w;
            uint32_t word = words[w];
            for (int bit = 0; bit < 32; bit++) o[bit] = as_float(0x3f800000u | ((word >> bit) & 1u) << 31);
        }
    }
}

/* The same signs times alpha, straight into the accumulator of a pass (no z written): acc = +-alpha (first key) or
 * acc = acc + (+-alpha), element order as in signs().  +-alpha is alpha * z exactly (the sign bit flipped), so the
 * bits are those of acc_block's alpha * z and acc + alpha * z. */
static void signed_alphas(int first, int ng, const uint32_t *restrict a, const uint32_t *restrict b, float alpha,
                          float *restrict acc) {
    uint32_t bits = as_u32(alpha);
    for (int c = 0; c < ng; c++) {
        const uint32_t words[4] = {a[2 * c], b[2 * c], a[2 * c + 1], b[2 * c + 1]};
        for (int w = 0; w < 4; w++) {
            float *o = acc + 128 * c + 32 * w;
            uint32_t word = words[w];
            if (first)
                for (int bit = 0; bit < 32; bit++) o[bit] = as_float(bits ^ ((word >> bit) & 1u) << 31);
            else
                for (int bit = 0; bit < 32; bit++) o[bit] = o[bit] + as_float(bits ^ ((word >> bit) & 1u) << 31);
        }
    }
}

/* round(z^2 * 2^24) as an integer: z^2 is exact in double; adding 1.5 * 2^52 rounds
 * to the nearest integer (ties to even) and leaves it in the low mantissa bits. */
static inline int64_t fixsq(float zf) {
    double d = (double)zf * (double)zf * 16777216.0 + 0x1.8p52;
    int64_t i; memcpy(&i, &d, 8);
    return i - 0x4338000000000000LL;
}

/* Element modes (noise/rows.py ElementMode): MODE_FLOAT32, MODE_BFLOAT16, MODE_FLOAT16, MODE_FLOAT64; MODE_WRITE_Z
 * as a target mode: write z itself (float32). Loads widen exactly to float (double for MODE_FLOAT64); stores round
 * to nearest even. */
static inline float ld(int mode, const void *p, int64_t i) {
    if (mode == MODE_FLOAT32) return ((const float *)p)[i];
    if (mode == MODE_BFLOAT16) return as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return (float)((const _Float16 *)p)[i];
}

static inline uint16_t bf16_bits(float x) {
    uint32_t u = as_u32(x);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(x != x ? 0x7fc0u : r);
}

/* dst[i] = src[i] * scale + alpha * zs[i] (acc NULL: one key, three separately rounded float ops), or
 * dst[i] = src[i] * scale + acc[i] (several keys: acc = sum_k alpha_k z_k, accumulated by acc_block), for i < cnt;
 * one loop per (target, source) pair so that gcc vectorises each. src == dst for an in-place update.  With one key
 * both give the same bits (alpha * z is rounded before the add either way); the first loop saves a pass. */
#define AXPY(DT, ST, LOAD, STORE)                                                      \
    do {                                                                               \
        DT *o = (DT *)dst + done;                                                      \
        const ST *x = (const ST *)src + done;                                          \
        if (acc)                                                                       \
            for (int64_t i = 0; i < cnt; i++) { float v = (LOAD) * scale + acc[i]; o[i] = STORE; } \
        else                                                                           \
            for (int64_t i = 0; i < cnt; i++) { float v = (LOAD) * scale + alpha * zs[i]; o[i] = STORE; } \
    } while (0)

static void axpy_block(int dmode, void *dst, int smode, const void *src, int64_t done, int64_t cnt,
                       const float *zs, float scale, float alpha, double scale64, double alpha64,
                       const float *acc, const double *acc64) {
    if (dmode == MODE_WRITE_Z) {
        float *o = (float *)dst + done;
        for (int64_t i = 0; i < cnt; i++) o[i] = zs[i];
    } else if (dmode == MODE_FLOAT64) {
        double *o = (double *)dst + done;
        const double *x = (const double *)src + done;
        if (acc64)
            for (int64_t i = 0; i < cnt; i++) o[i] = x[i] * scale64 + acc64[i];
        else
            for (int64_t i = 0; i < cnt; i++) o[i] = x[i] * scale64 + alpha64 * (double)zs[i];
    } else if (dmode == MODE_FLOAT32) {
        AXPY(float, float, x[i], v);
    } else if (dmode == MODE_BFLOAT16 && smode == MODE_BFLOAT16) {
        AXPY(uint16_t, uint16_t, as_float((uint32_t)x[i] << 16), bf16_bits(v));
    } else if (dmode == MODE_BFLOAT16) {
        AXPY(uint16_t, float, x[i], bf16_bits(v));
    } else if (smode == MODE_FLOAT16) {
        AXPY(_Float16, _Float16, (float)x[i], (_Float16)v);
    } else {
        AXPY(_Float16, float, x[i], (_Float16)v);
    }
}

/* Key k's term of the sum, for i < cnt: acc = alpha_0 * z_0 (first), then acc = acc + alpha_k * z_k, each op
 * rounded separately (float64 targets: in double, from (double)z). */
static void acc_block(int dmode, int first, int64_t cnt, const float *zs, float alpha, double alpha64,
                      float *acc, double *acc64) {
    if (dmode == MODE_FLOAT64) {
        if (first)
            for (int64_t i = 0; i < cnt; i++) acc64[i] = alpha64 * (double)zs[i];
        else
            for (int64_t i = 0; i < cnt; i++) acc64[i] = acc64[i] + alpha64 * (double)zs[i];
    } else if (first) {
        for (int64_t i = 0; i < cnt; i++) acc[i] = alpha * zs[i];
    } else {
        for (int64_t i = 0; i < cnt; i++) acc[i] = acc[i] + alpha * zs[i];
    }
}

/* Elements [start, start + n) of nkeys streams (keys[k] = k0 | k1 << 32, all with the counter origin start):
 * dst = src * scale + acc, acc = alpha_0 z_0 + alpha_1 z_1 + ... summed left to right (coef = scale, alpha_0 ..
 * alpha_{nkeys-1}: rounded to float32 here, except for float64 targets).  A WRITE_Z target (dst mode 0) gets the
 * last key's z, and only that key is drawn.  Returns sum round(z^2 * 2^24) of the last key's z over the range if
 * want_sq, else 0.  Per block of 4 BLK elements: each key's Philox -> Box-Muller (rad: -> signs) in turn into z, its
 * term added to acc (L1-resident, the size of z), then one store; with one key the store reads z directly.  With
 * rad the sum is exact without drawing: z^2 = 1, round(1 * 2^24) per element. */
static int64_t run(int nkeys, const uint64_t *keys, const double *coef, uint64_t start, int64_t n, void *dst,
                   int dmode, const void *src, int smode, int want_sq, int rad) {
    uint32_t a[2 * BLK], b[2 * BLK];
    float z[RAD_BLK > 4 * BLK ? RAD_BLK : 4 * BLK];
    float acc[RAD_BLK > 4 * BLK ? RAD_BLK : 4 * BLK];
    double acc64[RAD_BLK > 4 * BLK ? RAD_BLK : 4 * BLK];
    int64_t total = 0;
    int k_first = dmode == MODE_WRITE_Z ? nkeys - 1 : 0;   /* the first key drawn */
    int multi = nkeys - k_first > 1;
    /* +-1 into a float32-computed target: every key's +-alpha goes straight into acc (signed_alphas), no z */
    int fused = rad && dmode != MODE_WRITE_Z && dmode != MODE_FLOAT64;
    float scale = (float)coef[0];
    double scale64 = coef[0];
    int shift = rad ? 7 : 2;          /* elements per group (Philox call): 128 signs or 4 normals */
    int block = rad ? RAD_BLK : 4 * BLK;  /* elements per block */
    int per_block = block >> shift;   /* groups per block */
    uint64_t g = start >> shift;      /* first group */
    int64_t skip = (int64_t)(start & ((1u << shift) - 1));   /* elements of the first group before start */
    int64_t done = 0;
    while (done < n) {
        int64_t want = n - done + skip;   /* elements still needed from group g on */
        int ng = want >= block ? per_block : (int)((want + (1 << shift) - 1) >> shift);
        int ng8 = (ng + 7) & ~7;  /* whole vectors (VW <= 8); extra groups are unused */
        int64_t cnt = ((int64_t)ng << shift) - skip;
        if (cnt > n - done) cnt = n - done;
        const float *zs = z + skip;
        for (int k = k_first; k < nkeys; k++) {
            philox_block((uint32_t)g, (uint32_t)(g >> 32), (uint32_t)keys[k], (uint32_t)(keys[k] >> 32), ng8, a, b);
            if (fused)
                signed_alphas(k == k_first, ng, a, b, (float)coef[1 + k], acc);
            else if (rad)
                signs(ng, a, b, z);
            else
                box_muller(2 * ng8, a, b, z);
            if (multi && !fused)
                acc_block(dmode, k == k_first, cnt, zs, (float)coef[1 + k], coef[1 + k], acc, acc64);
        }
        /* zs now holds the last key's z (not with `fused`: acc + skip holds the sum of the +-alpha terms) */
        if (fused)
            axpy_block(dmode, dst, smode, src, done, cnt, NULL, scale, 0.0f, scale64, 0.0, acc + skip, NULL);
        else
            axpy_block(dmode, dst, smode, src, done, cnt, zs, scale, (float)coef[nkeys], scale64, coef[nkeys],
                       multi && dmode != MODE_FLOAT64 ? acc : NULL, multi && dmode == MODE_FLOAT64 ? acc64 : NULL);
        if (want_sq && rad)
            total += cnt * fixsq(1.0f);   /* z^2 = 1 */
        else if (want_sq)
            for (int64_t i = 0; i < cnt; i++) total += fixsq(zs[i]);
        done += cnt;
        g += (uint64_t)ng;
        skip = 0;
    }
    return total;
}

/* dst[i] = src[i] rounded to dst's mode: the master copy written back to a stored copy, no noise drawn. */
static void copy_cast(int dmode, void *dst, int smode, const void *src, int64_t n) {
    if (dmode == smode) {
        memcpy(dst, src, (size_t)n * (dmode == MODE_FLOAT64 ? 8 : dmode == MODE_FLOAT32 ? 4 : 2));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float v = ld(smode, src, i);
        if (dmode == MODE_FLOAT32) ((float *)dst)[i] = v;
        else if (dmode == MODE_BFLOAT16) ((uint16_t *)dst)[i] = bf16_bits(v);
        else ((_Float16 *)dst)[i] = (_Float16)v;
    }
}

/* One range of one key in place: `mode` an element mode, with KIND_RADEMACHER set for +-1 signs (as in a row's KIND
 * column). */
int64_t noise_run(uint32_t k0, uint32_t k1, uint64_t start, int64_t n, void *out,
                  int mode, float scale, float alpha, int want_sq) {
    uint64_t key = (uint64_t)k0 | (uint64_t)k1 << 32;
    double coef[2] = {scale, alpha};   /* exact: (float) gives scale and alpha back */
    int emode = mode & KIND_MODE_MASK;
    return run(1, &key, coef, start, n, out, emode, out, emode, want_sq, (mode & KIND_RADEMACHER) != 0);
}

/* float64 targets (MODE_FLOAT64): the scalars stay double (normals; +-1 signs go through noise_rows). */
int64_t noise_run64(uint32_t k0, uint32_t k1, uint64_t start, int64_t n, double *out,
                    double scale, double alpha, int want_sq) {
    uint64_t key = (uint64_t)k0 | (uint64_t)k1 << 32;
    double coef[2] = {scale, alpha};
    return run(1, &key, coef, start, n, out, MODE_FLOAT64, out, MODE_FLOAT64, want_sq, 0);
}

/* The row loop of noise_rows and noise_rows_keys: keys NULL takes each row's ROW_KEY column (nkeys 1). */
static void rows_pass(int64_t nrows, const int64_t *rows, const double *coef, int nkeys, const int64_t *keys,
                      int64_t *sums, int want_sq) {
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t *row = rows + ROW_WIDTH * r;
        void *dst = (void *)(intptr_t)row[ROW_DST];
        const void *src = (const void *)(intptr_t)row[ROW_SRC];
        int64_t n = row[ROW_N];
        int dmode = (int)(row[ROW_KIND] & KIND_MODE_MASK);
        int smode = (int)((row[ROW_KIND] >> KIND_SRC_SHIFT) & KIND_MODE_MASK);
        if (row[ROW_KIND] & KIND_COPY) {
            copy_cast(dmode, dst, smode, src, n);
            continue;
        }
        const uint64_t *row_keys = (const uint64_t *)(keys ? keys + (int64_t)nkeys * r : row + ROW_KEY);
        int stat = want_sq && row[ROW_STAT] >= 0;
        int64_t total = run(nkeys, row_keys, coef + (int64_t)(1 + nkeys) * r, (uint64_t)row[ROW_START], n, dst,
                            dmode, src, smode, stat, (row[ROW_KIND] & KIND_RADEMACHER) != 0);
        if (stat) sums[row[ROW_STAT]] += total;
    }
}

/* One pass of the Perturber over a table of rows (shard/perturb.py builds it, noise/cpu.py calls it; several
 * threads may each take a part of the table, with their own `sums`):
 *   rows: int64 [nrows][ROW_WIDTH], noise/rows.py's format: ROW_DST and ROW_SRC addresses, ROW_N, ROW_START,
 *         ROW_KEY (k0 | k1 << 32), ROW_STAT block (-1: none), ROW_KIND (dst mode | src mode << KIND_SRC_SHIFT |
 *         KIND_COPY | KIND_RADEMACHER: the row's z are +-1 signs);
 *   coef: double [nrows][2] = scale, alpha (rounded to float32 here, except for float64 rows).
 * A row does dst[i] = src[i] * scale + alpha * z[start + i] (a copy row: dst[i] = src[i]); with want_sq, a
 * row with a stat block adds its sum round(z^2 2^24) to sums[block]. */
void noise_rows(int64_t nrows, const int64_t *rows, const double *coef, int64_t *sums, int want_sq) {
    rows_pass(nrows, rows, coef, 1, NULL, sums, want_sq);
}

/* The same pass with nkeys >= 1 noise keys per row, from `keys` (the rows' ROW_KEY column is not read):
 *   keys: int64 [nrows][nkeys], each k0 | k1 << 32;  coef: double [nrows][1 + nkeys] = scale, alpha_0 ..
 *   alpha_{nkeys-1}.
 * A row does, for i < n, with z_k the stream of keys[r][k] at the row's start (every key the same counters):
 *   acc = alpha_0 * z_0[i];  acc = acc + alpha_k * z_k[i] for k = 1 .. nkeys-1;  dst[i] = src[i] * scale + acc
 * each op rounded separately in float32 (float64 rows: in double), stored in dst's mode.  With want_sq, a row with
 * a stat block adds the sum round(z^2 2^24) of its LAST key's z.  nkeys = 1 gives noise_rows's bits; a copy row
 * ignores the keys; a WRITE_Z target gets the last key's z. */
void noise_rows_keys(int64_t nrows, const int64_t *rows, const double *coef, int64_t nkeys, const int64_t *keys,
                     int64_t *sums, int want_sq) {
    if (nkeys < 1) return;   /* noise/cpu.py refuses it first */
    rows_pass(nrows, rows, coef, (int)nkeys, keys, sums, want_sq);
}
