"""The counter-based noise generator: one definition on every backend, slices of the whole, and its statistics.

Statistical tolerances are derived from the sample size before running: for N standard normals the
standard error of the mean is 1/sqrt(N), of the mean of z^2 sqrt(2/N) (Var z^2 = 2), of the mean of z^4
sqrt(96/N) (Var z^4 = E z^8 - 9 = 105 - 9), and of a sample correlation 1/sqrt(N). Each check allows
5 standard errors: over the ~40 checks here a false failure has probability below 1e-4.
"""

import hashlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference, rows
from curvzo_ds.noise.gaussian import FIXED_POINT_BITS, NoiseSource, backend, f32, stable_seed
from tests.helpers import ENV, ROOT

K = 5.0  # standard errors allowed
KEYS = [(1, 2), (0xFFFFFFFF, 0xFFFFFFFF), (0x12345678, 0), (0, 0x9ABCDEF0)]
# Starts include every residue mod 4, block edges of the C kernel (1024 elements), the 2^32-group carry
# of the Philox counter, and an offset above 2^40 (a tensor over 2^31 elements).
STARTS = [0, 1, 2, 3, 5, 1023, 1024, 4097, 4 * (1 << 32) - 6, (1 << 40) + 3]
LENGTHS = [0, 1, 2, 3, 5, 17, 1024, 1031, 5000]


def test_the_c_kernel_builds_here():
    """The fast path must exist where the tests run: a silent fallback to the reference would hide it."""
    assert cpu_kernel.available(), "the CPU noise kernel did not build (is gcc installed?)"


@pytest.mark.parametrize("key", KEYS)
def test_c_kernel_equals_the_torch_reference_bit_for_bit(key):
    for start in STARTS:
        for n in LENGTHS:
            ref = reference.normals(*key, start, n)
            out = torch.empty(n, dtype=torch.float32)
            cpu_kernel.run(*key, start, out, 0, 0.0, 0.0, False)
            assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (key, start, n)


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, expected in cases:
        words = reference.philox4x32_10(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key)
        assert tuple(int(w) for w in words) == expected


def test_any_slice_is_the_slice_of_the_whole():
    src = NoiseSource(seed=7)
    numel = 100_003
    whole = src.slice(3, "layer.weight", numel, 0, numel)
    gen = torch.Generator().manual_seed(0)
    cases = [(0, 64), (63, 65), (1, 4), (99_999, 100_003), (5, 5)]
    cases += [tuple(sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())) for _ in range(100)]
    for lo, hi in cases:
        assert torch.equal(src.slice(3, "layer.weight", numel, lo, hi - lo), whole[lo:hi]), (lo, hi)
    buf = torch.full((1000,), float("nan"))  # into a given buffer: the same values, in place
    assert src.slice(3, "layer.weight", numel, 500, 1000, out=buf) is buf and torch.equal(buf, whole[500:1500])
    with pytest.raises(ValueError, match="float32 tensor of 10 elements"):
        src.slice(3, "layer.weight", numel, 0, 10, out=torch.empty(11))


def fused(out: torch.Tensor, key, start: int, scale: float, alpha: float, want_sq: bool = True):
    """out <- out * scale + alpha * z in place through the C kernel (the Perturber's in-place rows), or the torch
    reference's runner for a dtype the kernel lacks; the scalars rounded as the callers round them."""
    exact = out.dtype == torch.float64
    s, a = (scale, alpha) if exact else (f32(scale), f32(alpha))
    if backend(out.device, out.dtype) == "c":
        return cpu_kernel.run(*key, start, out, rows.MODES[out.dtype], s, a, want_sq)
    total = reference.run([key], start, out, None, s, [a], want_sq)
    return int(total) if total is not None else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fused_update_equals_separately_rounded_operations(dtype):
    """A fused in-place pass = out * scale + alpha * z with each operation rounded in float32 (float64 for
    float64), then stored in out's dtype; the sum of squares is the reference's."""
    src = NoiseSource(seed=3)
    gen = torch.Generator().manual_seed(1)
    for scale, alpha in ((1.0, 1e-3), (0.999, -2e-3), (1.0 - 1e-7, 0.37)):
        for start, n in ((0, 1000), (3, 4097), (1 << 33, 77)):
            base = torch.randn(n, generator=gen).to(dtype)
            out = base.clone()
            total = fused(out, src.key(9, "w"), start, scale, alpha)
            z = reference.normals(*src.key(9, "w"), start, n)
            expected = base.clone()
            exact = dtype == torch.float64  # float64 tensors take float64 scalars; the rest float32 ones
            reference.axpy_(expected, z, scale if exact else f32(scale), alpha if exact else f32(alpha))
            assert torch.equal(out, expected), (dtype, scale, alpha, start, n)
            assert total == int(reference.fixed_point_sum_of_squares(z))


def test_fixed_point_sums_add_up_over_any_split():
    key = NoiseSource(seed=11).key(0, "w")
    whole = fused(torch.zeros(10_000), key, 0, 1.0, 0.0)
    parts = sum(fused(torch.zeros(hi - lo), key, lo, 1.0, 0.0)
                for lo, hi in ((0, 1), (1, 4002), (4002, 9999), (9999, 10_000)))
    assert parts == whole


def test_the_fixed_point_scale_is_one_number_everywhere():
    """noise.FIXED_POINT_BITS is the scale's one source. The C kernel, the Triton kernel and the torch reference
    state 2^24 as a literal (their arithmetic is not edited to import it): each literal must be 2^FIXED_POINT_BITS,
    and the sums the C kernel and the reference return must be round(z^2 2^FIXED_POINT_BITS), computed here in
    Python (exact: z has 24 significant bits, so z^2 2^24 is exact in float64; round() ties to even)."""
    scale = 2**FIXED_POINT_BITS
    kernels = ROOT / "curvzo_ds" / "noise"
    literals = {
        "philox.c": re.findall(r"\(double\)zf \* \(double\)zf \* (\d+)\.0", (kernels / "philox.c").read_text()),
        "gpu.py": re.findall(r"FIXED_POINT_SCALE = tl\.constexpr\((\d+)\.0\)", (kernels / "gpu.py").read_text()),
        "reference.py": re.findall(r"zd \* zd \* (\d+)\.0", (kernels / "reference.py").read_text()),
    }
    assert literals == {name: [str(scale)] for name in literals}
    z = NoiseSource(seed=5).slice(0, "w", 5000, 0, 5000)
    expected = sum(round(float(v) ** 2 * scale) for v in z.tolist())
    total = fused(torch.zeros(5000), NoiseSource(seed=5).key(0, "w"), 0, 1.0, 0.0)
    assert total == expected == int(reference.fixed_point_sum_of_squares(z))


def test_the_key_hash_is_one_definition():
    """key() (one tensor), keys() (many, vectorised) and stable_seed give the same bits, and the values are those the
    hash gave before it was written once (pinned)."""
    src = NoiseSource(2**40 + 7)
    names = ["model.embed_tokens.weight", "x", "é.weight", ""]
    for step, direction in ((3, 1), (123, 0), (0, 5)):
        keys = [int(k) for k in src.keys(step, names, direction)]
        assert keys == [stable_seed(src.seed, step, n, direction) for n in names]
        assert keys == [k1 << 32 | k0 for k0, k1 in (src.key(step, n, direction) for n in names)]
    assert [int(k) for k in src.keys(3, ["a", "b"], 1)] == [6881979852762984575, 8293075928006372833]
    assert src.keys(3, []).shape == (0,)


def test_one_backend_chooser_for_the_noise_source_and_the_perturber(monkeypatch):
    """gaussian.backend is the only rule: the Perturber's groups ask it, and it answers as the Perturber's own rule
    did (C on CPU, Triton on CUDA for the dtypes it has, CURVZO_DS_NOISE_KERNEL=triton on any device, else torch)."""
    from curvzo_ds.noise import gaussian
    from curvzo_ds.shard.row_table import Group

    monkeypatch.setattr(gaussian, "TRITON_FOUND", True)
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    f32_, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    expected = {"auto": {(cpu, f32_): "c", (cpu, bf16): "c", (cpu, f64): "c", (cuda, f32_): "triton",
                         (cuda, bf16): "triton", (cuda, f64): "torch", (meta, f32_): "torch"},
                "triton": {(cpu, f32_): "triton", (cpu, bf16): "triton", (cpu, f64): "c", (cuda, f32_): "triton",
                           (cuda, bf16): "triton", (cuda, f64): "torch", (meta, f32_): "triton"}}
    for forced, table in expected.items():
        monkeypatch.setenv("CURVZO_DS_NOISE_KERNEL", forced)
        for (device, dtype), want in table.items():
            group = Group("direct", device, dtype, dtype, None, [], None, None)
            assert backend(device, dtype) == group.backend == want, (forced, device, dtype)


def test_philox_c_takes_the_row_layout_from_rows_py():
    """philox.c names the row columns, the KIND packing and the element modes only through the -D flags that
    cpu.build passes (rows.c_defines): every such name it uses is defined there, it indexes rows by no bare number,
    and it refuses to compile without them."""
    source = (ROOT / "curvzo_ds" / "noise" / "philox.c").read_text()
    defined = {flag[2:].split("=")[0] for flag in rows.c_defines()}
    used = set(re.findall(r"\b((?:ROW|KIND|MODE)_[A-Z0-9_]+)\b", source))
    assert used and used <= defined, used - defined
    assert not re.findall(r"row\[\d", source)
    assert {f"ROW_{c}" for c in rows.COLUMNS if c != "ENTRY"} | {"ROW_WIDTH"} <= used
    bare = subprocess.run(["gcc", "-fsyntax-only", "-x", "c", "-"], input=source, capture_output=True, text=True)
    assert bare.returncode != 0 and "build through curvzo_ds/noise/cpu.py" in bare.stderr


def test_values_depend_on_seed_step_name_and_direction():
    a = NoiseSource(1).slice(0, "w", 100, 0, 100)
    for other in (NoiseSource(1).slice(1, "w", 100, 0, 100), NoiseSource(1).slice(0, "v", 100, 0, 100),
                  NoiseSource(2).slice(0, "w", 100, 0, 100), NoiseSource(1).slice(0, "w", 100, 0, 100, direction=1)):
        assert not torch.equal(a, other)


N = 4_000_000


@pytest.fixture(scope="module")
def big():
    return NoiseSource(5).slice(0, "model.layers.0.mlp.up_proj.weight", N + 17, 17, N).double()


def test_moments_are_those_of_a_standard_normal(big):
    """E z = 0, E z^2 = 1, E z^3 = 0, E z^4 = 3 (the score identity, Eq. 6, relies on the 4th moment)."""
    n = big.numel()
    assert abs(big.mean().item()) <= K / math.sqrt(n)
    assert abs((big**2).mean().item() - 1) <= K * math.sqrt(2 / n)
    assert abs((big**3).mean().item()) <= K * math.sqrt(15 / n)
    assert abs((big**4).mean().item() - 3) <= K * math.sqrt(96 / n)
    # The tail: P(|z| > 3) = 0.0026998, binomial standard error.
    p = 0.0026997960632601866
    assert abs((big.abs() > 3).double().mean().item() - p) <= K * math.sqrt(p * (1 - p) / n)
    assert big.abs().max().item() < 6.7


def test_neighbours_are_uncorrelated(big):
    """Lags 1-5 and 8 (within a Box-Muller pair, within a Philox group, across groups), and z^2 at lag 1
    (the radius is shared by a pair: z_a^2 and z_b^2 must still be uncorrelated)."""
    for lag in (1, 2, 3, 4, 5, 8):
        a, b = big[:-lag], big[lag:]
        r = ((a * b).mean() / (a.std() * b.std())).item()
        assert abs(r) <= K / math.sqrt(a.numel()), (lag, r)
    sq = big**2 - 1
    r2 = ((sq[:-1] * sq[1:]).mean() / sq.var()).item()
    assert abs(r2) <= K / math.sqrt(sq.numel())


def test_streams_of_other_names_steps_and_chunks_are_uncorrelated():
    """Streams that share a prefix of their key inputs, and distant chunks of one stream, are independent."""
    src, n = NoiseSource(5), 500_000
    base = src.slice(0, "w", 1 << 40, 0, n).double()
    others = [src.slice(1, "w", 1 << 40, 0, n), src.slice(0, "w2", 1 << 40, 0, n),
              NoiseSource(6).slice(0, "w", 1 << 40, 0, n), src.slice(0, "w", 1 << 40, 1 << 32, n)]
    for other in others:
        r = (base * other.double()).mean().item()
        assert abs(r) <= K / math.sqrt(n)


def _digest() -> str:
    src = NoiseSource(seed=123)
    h = hashlib.sha256()
    h.update(src.slice(9, "model.layers.0.mlp.up_proj.weight", 777, 33, 500).numpy().tobytes())
    h.update(src.mask_uniforms(9, 17).numpy().tobytes())
    h.update(str(stable_seed(1, "a", 2)).encode())
    h.update(src.reference_digest().encode())
    return h.hexdigest()


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_same_values_in_a_fresh_process_with_either_backend(kernel):
    """Another process, another hash seed, and the compiled kernel or the torch reference: the same bits."""
    code = "from tests.test_noise import _digest; print(_digest())"
    env = {**ENV, "PYTHONHASHSEED": "99", "CURVZO_DS_NOISE_KERNEL": kernel}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=str(ROOT))
    assert out.stdout.strip().splitlines()[-1] == _digest()


def test_builds_for_other_instruction_sets_give_the_same_bits():
    """-march=x86-64-v2 (SSE only) and haswell (AVX2) against this machine's native build."""
    if os.uname().machine != "x86_64":
        pytest.fail("this check is written for x86_64")
    for march in ("x86-64-v2", "haswell"):
        flags = [f if not f.startswith("-march") else f"-march={march}" for f in cpu_kernel.FLAGS]
        lib = cpu_kernel.load(flags)
        out = torch.empty(5000, dtype=torch.float32)
        lib.noise_run(1, 2, 3, 5000, out.data_ptr(), 0, 0.0, 0.0, 0)
        assert torch.equal(out, reference.normals(1, 2, 3, 5000)), march


TRITON_CHECK = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from curvzo_ds.noise import gpu, reference
bad = []
# key words 0, 1 and 2^32 - 1 (a compiled kernel specialises an int argument equal to 1), starts at 2^31, 2^32 and
# 2^33 + a tail (index arithmetic past int32), the 2^32-group counter carry, 2^40, every mode
CASES = [((1, 2), 0, 1000, torch.float32, 0), ((0xFFFFFFFF, 0xFFFFFFFF), 4 * (1 << 32) - 6, 5003, torch.float32, 0),
         ((5, 6), 3, 1, torch.float32, 0), ((5, 6), (1 << 40) + 1, 9001, torch.float32, 1),
         ((7, 8), 2, 4099, torch.bfloat16, 2), ((7, 8), 2, 4099, torch.float16, 3),
         ((0, 0), 1 << 31, 5003, torch.float32, 1), ((1, 1), 1 << 32, 20001, torch.float32, 0),
         ((0, 1), (1 << 33) + 5, 70001, torch.bfloat16, 2), ((1, 0xFFFFFFFF), (1 << 33) - 8, 5003, torch.float16, 3)]
for key, start, n, dtype, mode in CASES:
    base = torch.linspace(-1, 1, n).to(dtype)
    out = base.clone()
    total = gpu.run(*key, start, out, mode, 0.999, -0.5)
    z = reference.normals(*key, start, n)
    expected = z.clone() if mode == 0 else base.clone()
    if mode:
        reference.axpy_(expected, z, float(torch.tensor(0.999, dtype=torch.float32)), -0.5)
    if not torch.equal(out, expected) or int(total) != int(reference.fixed_point_sum_of_squares(z)):
        bad.append((key, start, n, str(dtype)))
print("bad", bad)
"""

# Rows with K keys (gpu.launch's `keys`) against the C kernel (cpu.run_rows's `keys`), in the same subprocess: K = 1,
# 2, 4; float32 and bfloat16 in place and bfloat16 from a float32 master copy; three rows per launch (starts of
# several residues mod 4, the 2^32-group carry, past 2^33) with stat blocks 0, -1, 1; K = 1 also against the one-key
# launch (keys None), and a WRITE_Z target with 2 keys (the last key's z).
TRITON_KEYS_CHECK = r"""
import numpy as np
from curvzo_ds.noise import cpu, rows as L
assert cpu.available()
SPANS, STATS = [(3, 1000), (4 * (1 << 32) - 6, 2100), ((1 << 33) + 5, 2051)], [0, -1, 1]
offsets = [0, 1000, 3100, 5151]  # each row's elements in one base tensor
bad_keys = []
def word(k0, k1):
    v = k0 | k1 << 32
    return v - (1 << 64) if v >= 1 << 63 else v
def table(nk, gen):
    t = torch.zeros(len(SPANS), L.WIDTH, dtype=torch.int64)
    for r, (start, n) in enumerate(SPANS):
        t[r, L.DST], t[r, L.SRC], t[r, L.N], t[r, L.START] = offsets[r], offsets[r], n, start
        t[r, L.STAT], t[r, L.ENTRY] = STATS[r], r
    keys = torch.tensor([[word(*(int(v) for v in torch.randint(0, 1 << 32, (2,), generator=gen)))
                          for _ in range(nk)] for _ in SPANS], dtype=torch.int64)
    keys[0, 0] = word(0xFFFFFFFF, 0xFFFFFFFF)
    t[:, L.KEY] = keys[:, 0]
    coef = torch.cat([torch.tensor([[1.0], [0.999], [0.5]]), torch.randn(len(SPANS), nk, generator=gen) * 1e-2], 1)
    return t, keys, coef.float()
def gpu_pass(t, keys, coef, dst, src, write_z=False):
    per = gpu.programs_per_row(t[:, L.N], t[:, L.START])
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), per.cumsum(0)])
    sums = torch.zeros(2, dtype=torch.int64)
    gpu.launch(dst, src, t, prefix, int(prefix[-1]), coef, sums, write_z=write_z, keys=keys)
    return sums.tolist()
def c_pass(t, keys, coef, dst, src):
    c = t.numpy().copy()
    src_ = dst if src is None else src
    c[:, L.DST] = dst.data_ptr() + c[:, L.DST] * dst.element_size()
    c[:, L.SRC] = src_.data_ptr() + c[:, L.SRC] * src_.element_size()
    c[:, L.KIND] = L.kind(L.MODES[dst.dtype], L.MODES[src_.dtype])
    return cpu.run_rows(c, coef.double().numpy(), 2, True, keys=keys.numpy()).tolist()
gen = torch.Generator().manual_seed(0)
for nk in (1, 2, 4):
    for dtype, master in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        t, keys, coef = table(nk, gen)
        base = torch.randn(offsets[-1], generator=gen).to(dtype)
        src = torch.randn(offsets[-1], generator=gen) if master else None
        a, b = base.clone(), base.clone()
        sa, sb = gpu_pass(t, keys, coef, a, src), c_pass(t, keys, coef, b, src)
        if not torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)) or sa != sb:
            bad_keys.append(("c", nk, str(dtype), master))
        if nk == 1:
            legacy = base.clone()
            if gpu_pass(t, None, coef, legacy, src) != sa or not torch.equal(legacy, a):
                bad_keys.append(("legacy", str(dtype), master))
t, keys, coef = table(2, gen)
out = torch.full((offsets[-1],), float("nan"))
sums = gpu_pass(t, keys, coef, out, None, write_z=True)
z = [reference.normals(keys[r, 1].item() & 0xFFFFFFFF, (keys[r, 1].item() >> 32) & 0xFFFFFFFF, *SPANS[r])
     for r in range(len(SPANS))]
if not torch.equal(out, torch.cat(z)) or sums != [int(reference.fixed_point_sum_of_squares(z[0])),
                                                  int(reference.fixed_point_sum_of_squares(z[2]))]:
    bad_keys.append(("write_z",))
print("bad keys", bad_keys)
"""


def test_triton_kernel_logic_matches_the_reference_under_the_interpreter():
    """The GPU kernel's integer and float logic, run by Triton's interpreter on CPU tensors (numpy, IEEE
    float32): the same bits as the reference, in every mode, at the edge keys and starts; and rows with K = 1, 2, 4
    noise keys the same bits and sums as the C kernel's (TRITON_KEYS_CHECK, in the same process); and the +-1 path
    (perturbation=rademacher: test_rademacher.py's TRITON_CHECK, in the same process). On a GPU the
    one-key check is `pytest -m gpu` (tests/test_gpu.py), with the compiled kernel's exponent path (the interpreter
    has no libdevice)."""
    from tests.test_rademacher import TRITON_CHECK as TRITON_RADEMACHER_CHECK  # +-1 z: in the same process

    env = {**ENV, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK + TRITON_KEYS_CHECK + TRITON_RADEMACHER_CHECK],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-3:] == ["bad []", "bad keys []", "bad rademacher []"], proc.stdout[-3000:]
