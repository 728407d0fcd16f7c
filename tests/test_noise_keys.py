"""Passes with several noise keys per row (K keys): the C kernel (cpu.run_rows with `keys`) against the torch
reference (reference.axpy_keys_), bit for bit, and K = 1 against the one-key API. The Triton kernel's K-key
logic is checked under the interpreter in tests/test_noise.py (test_triton_kernel_logic_matches_the_reference_
under_the_interpreter), in the subprocess that test already starts.

A row with keys (k_0 .. k_{K-1}) and coef (scale, alpha_0 .. alpha_{K-1}) does, each op rounded separately:
    acc = alpha_0 z_0[i];  acc = acc + alpha_k z_k[i] (k = 1 .. K-1);  dst[i] = src[i] * scale + acc
in float32 (float64 targets: float64), every z_k drawn at the row's START; the statistics are z_{K-1}'s."""

import numpy as np
import pytest
import torch

from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise import rows as layout
from curvzo_ds.noise.gaussian import f32

# (start, n): starts of every residue mod 4, lengths across the C kernel's 1024-element blocks (a row that starts
# inside a block and ends inside a later one), the 2^32-group counter carry, and a short row.
SPANS = [(0, 1024), (1, 1023), (2, 1025), (3, 3000), (1021, 2053), (4097, 17), (4 * (1 << 32) - 6, 1031), (5, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _keys(r: int, k: int, salt: int) -> list[tuple[int, int]]:
    """K distinct key pairs for row r, including words 0, 1 and 2^32 - 1."""
    edge = [(0xFFFFFFFF, 0xFFFFFFFF), (0, 1), (1, 0)]
    return [edge[(r + j) % 3] if (r + j + salt) % 5 == 0 else
            ((0x9E3779B9 * (r + 1) + 7919 * j + salt) & 0xFFFFFFFF, (0x85EBCA6B * (j + 3) + r) & 0xFFFFFFFF)
            for j in range(k)]


def _word(k0: int, k1: int) -> int:
    """k0 | k1 << 32 as a signed int64 (the KEY column's and `keys`' encoding)."""
    v = k0 | k1 << 32
    return v - (1 << 64) if v >= 1 << 63 else v


class Case:
    """A table of rows, one per span, over separate tensors of `dtype`: in place, or from a float32 master copy
    (`master`); K keys and K + 1 coefficients per row; stat blocks 0, 1 and -1 in turn."""

    def __init__(self, dtype: torch.dtype, k: int, master: bool, seed: int = 0, spans=SPANS):
        gen = torch.Generator().manual_seed(seed + 17 * k)
        self.dtype, self.k, self.master = dtype, k, master
        self.spans = spans
        self.base = [torch.randn(n, generator=gen).to(dtype) for _, n in spans]
        self.sources = [torch.randn(n, generator=gen) for _, n in spans] if master else None
        self.pairs = [_keys(r, k, seed) for r in range(len(spans))]
        self.keys = np.array([[_word(*p) for p in row] for row in self.pairs], dtype=np.int64)
        scales = [1.0, 0.999, 1.0 - 1e-7, 0.5 + 1e-3]
        self.coef = np.array([[scales[r % 4]] + (torch.randn(k, generator=gen) * 10.0 ** -(r % 3)).tolist()
                              for r in range(len(spans))], dtype=np.float64)
        self.stat = [[0, 1, -1][r % 3] for r in range(len(spans))]

    def table(self, outs: list[torch.Tensor]) -> np.ndarray:
        rows = np.zeros((len(self.spans), layout.WIDTH), dtype=np.int64)
        smode = layout.MODES[torch.float32 if self.master else self.dtype]
        for r, ((start, n), out) in enumerate(zip(self.spans, outs)):
            src = self.sources[r] if self.master else out
            rows[r, [layout.DST, layout.SRC, layout.N, layout.START]] = out.data_ptr(), src.data_ptr(), n, start
            rows[r, [layout.KEY, layout.STAT, layout.ENTRY]] = self.keys[r, 0], self.stat[r], r
            rows[r, layout.KIND] = layout.kind(layout.MODES[self.dtype], smode)
        return rows

    def run(self, threads: int = 1, keys: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        outs = [b.clone() for b in self.base]
        sums = cpu_kernel.run_rows(self.table(outs), self.coef, 2, True, threads, self.keys if keys else None)
        return outs, sums.tolist()

    def expected(self) -> tuple[list[torch.Tensor], list[int]]:
        outs, sums = [], [0, 0]
        exact = self.dtype == torch.float64
        for r, (start, n) in enumerate(self.spans):
            zs = [reference.normals(k0, k1, start, n) for k0, k1 in self.pairs[r]]
            out = self.base[r].clone()
            scale, *alphas = self.coef[r].tolist()
            rnd = (lambda v: v) if exact else f32
            reference.axpy_keys_(out, self.sources[r] if self.master else out, zs, rnd(scale), [rnd(a) for a in alphas])
            outs.append(out)
            if self.stat[r] >= 0:
                sums[self.stat[r]] += int(reference.fixed_point_sum_of_squares(zs[-1]))
        return outs, sums


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.fixture(autouse=True, scope="module")
def c_kernel():
    """Every test here needs the compiled kernel (loaded once per process by available())."""
    assert cpu_kernel.available(), "the CPU noise kernel did not build (is gcc installed?)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_c_kernel_with_k_keys_equals_the_reference_bit_for_bit(dtype, k):
    """In place and (float32/bf16/fp16 targets) from a float32 master copy; every span; the sums of z_{K-1}."""
    for master in (False, True) if dtype != torch.float64 else (False,):
        case = Case(dtype, k, master)
        outs, sums = case.run()
        want, want_sums = case.expected()
        for r, (o, w) in enumerate(zip(outs, want)):
            assert _same(o, w), (dtype, k, master, case.spans[r])
        assert sums == want_sums, (dtype, k, master)


@pytest.mark.parametrize("k", [2, 8])
def test_split_rows_carry_the_keys_and_threads_give_the_same_bits(k):
    """threads = 2 (each row table cut in two, a row cut across the threads) equals threads = 1; split_rows keeps
    each piece's keys and wide coef with it and covers each element once."""
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True), (torch.float64, False)):
        case = Case(dtype, k, master, seed=3)
        one, two = case.run(threads=1), case.run(threads=2)
        assert one[1] == two[1] and all(_same(a, b) for a, b in zip(one[0], two[0])), (dtype, k)
        outs = [b.clone() for b in case.base]
        rows = case.table(outs)
        for parts in (2, 3, 7):
            pieces = cpu_kernel.split_rows(rows, case.coef, parts, case.keys)
            assert all(len(p) == 3 and p[2].shape == (len(p[0]), k) and p[1].shape == (len(p[0]), k + 1)
                       for p in pieces)
            assert sum(int(p[0][:, layout.N].sum()) for p in pieces) == sum(n for _, n in case.spans)
            for r, c, kk in pieces:  # each piece keeps its row's keys and coef
                src_row = r[:, layout.ENTRY]
                assert np.array_equal(kk, case.keys[src_row]) and np.array_equal(c, case.coef[src_row])
        assert all(len(p) == 2 for p in cpu_kernel.split_rows(rows, case.coef[:, :2], 2))  # no keys: as before


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_key_through_the_keys_api_equals_the_one_key_api(dtype):
    """keys = the KEY column as [R, 1] and the same coef [R, 2]: the legacy noise_rows bits and sums, with copy rows
    (which ignore the keys) in the table."""
    for master in (False, True) if dtype != torch.float64 else (False,):
        case = Case(dtype, 1, master, seed=5)
        legacy, keyed = case.run(keys=False), case.run(keys=True)
        assert legacy[1] == keyed[1]
        assert all(_same(a, b) for a, b in zip(legacy[0], keyed[0])), (dtype, master)
    # a copy row among noise rows: unchanged by the keys (keys K = 3 for the whole table)
    src = torch.randn(100)
    for key_count in (1, 3):
        dst = torch.zeros(100, dtype=torch.bfloat16)
        rows = np.zeros((1, layout.WIDTH), dtype=np.int64)
        rows[0, [layout.DST, layout.SRC, layout.N, layout.STAT]] = dst.data_ptr(), src.data_ptr(), 100, 0
        rows[0, layout.KIND] = layout.kind(layout.ElementMode.BFLOAT16, layout.ElementMode.FLOAT32, copy=True)
        sums = cpu_kernel.run_rows(rows, np.ones((1, 1 + key_count)), 1, True,
                                   keys=np.arange(key_count, dtype=np.int64)[None])
        assert torch.equal(dst, src.to(torch.bfloat16)) and sums.tolist() == [0]


def test_the_one_key_reference_is_axpy():
    """reference.axpy_keys_ with one stream is axpy_ bit for bit (in place), for every dtype and scale 1 or not."""
    z = reference.normals(3, 4, 5, 3001)
    gen = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        for scale, alpha in ((1.0, 1e-3), (0.999, -0.37)):
            if dtype != torch.float64:
                scale, alpha = f32(scale), f32(alpha)
            base = torch.randn(3001, generator=gen).to(dtype)
            a, b = base.clone(), base.clone()
            reference.axpy_(a, z, scale, alpha)
            reference.axpy_keys_(b, b, [z], scale, [alpha])
            assert _same(a, b), (dtype, scale)
    with pytest.raises(ValueError, match="one each"):
        reference.axpy_keys_(a, a, [z, z], 1.0, [1.0])


def test_write_z_targets_get_the_last_keys_z():
    """A WRITE_Z target (float32) with K keys: z of the last key (the statistics' stream), its fixed-point sum."""
    out = torch.full((2000,), float("nan"))
    rows = np.zeros((1, layout.WIDTH), dtype=np.int64)
    rows[0, [layout.DST, layout.SRC, layout.N, layout.START, layout.STAT]] = out.data_ptr(), 0, 2000, 1022, 0
    rows[0, layout.KIND] = layout.kind(layout.ElementMode.WRITE_Z, layout.ElementMode.WRITE_Z)
    keys = np.array([[_word(1, 2), _word(3, 4), _word(5, 6)]], dtype=np.int64)
    sums = cpu_kernel.run_rows(rows, np.array([[0.0, 1.0, 2.0, 3.0]]), 1, True, keys=keys)
    z = reference.normals(5, 6, 1022, 2000)
    assert torch.equal(out, z) and sums.tolist() == [int(reference.fixed_point_sum_of_squares(z))]


def test_bad_keys_or_coef_shapes_are_refused():
    out = torch.zeros(10)
    rows = np.zeros((1, layout.WIDTH), dtype=np.int64)
    rows[0, [layout.DST, layout.SRC, layout.N]] = out.data_ptr(), out.data_ptr(), 10
    rows[0, layout.KIND] = layout.kind(layout.ElementMode.FLOAT32, layout.ElementMode.FLOAT32)
    with pytest.raises(ValueError, match="coef must be"):
        cpu_kernel.run_rows(rows, np.ones((1, 2)), 1, False, keys=np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="keys must be"):
        cpu_kernel.run_rows(rows, np.ones((1, 1)), 1, False, keys=np.zeros((1, 0), dtype=np.int64))
    assert torch.equal(out, torch.zeros(10))
