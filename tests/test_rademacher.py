"""perturbation=rademacher (issue 58): z = +-1 from one bit of the counter-based Philox stream, 128 signs per call.

The definition is reference.signs; the C kernel, the Triton kernel (under Triton's interpreter) and the Perturber on
every backend give its bits, for every element mode, several keys per row, and the statistics (z^2 = 1: the sum of a
range is its length x 2^24). The Triton check and the engine on every backend run inside existing launches
(TRITON_CHECK below; test_perturb.py). Statistical tolerances are set from the variance before running: a sign has
mean 0 and variance 1, so the mean of N signs, and a sample correlation of N pairs, has standard error 1/sqrt(N);
each check allows K = 5 standard errors (over the ~140 checks here a false failure has probability below 1e-4).
"""

import math

import numpy as np
import pytest
import torch

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.algo import estimators
from curvzo_ds.algo.estimators import Perturbation
from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference, rows
from curvzo_ds.noise.gaussian import IDENTS, NoiseSource, f32, perturbation_of

K = 5.0
KEYS = [(1, 2), (0xFFFFFFFF, 0xFFFFFFFF), (0x12345678, 0)]
# Every residue class that matters for 128-element groups, the C kernel's 1024-element blocks, the 2^32-group carry of
# the counter (128 * 2^32), and an offset above 2^40.
STARTS = [0, 1, 3, 31, 32, 127, 128, 129, 1023, 1024, 4095, 4097, 128 * (1 << 32) - 6, (1 << 40) + 3]
LENGTHS = [0, 1, 5, 31, 33, 127, 128, 129, 1024, 1031, 5000]


@pytest.fixture(autouse=True)
def c_kernel():
    assert cpu_kernel.available(), "the CPU noise kernel did not build (is gcc installed?)"


def test_signs_are_bits_of_the_philox_words():
    """The definition, from Philox's known answer (Random123: counter 0, key 0 -> 0x6627E8D5, 0xE169C58D,
    0xBC57AC4C, 0x9B00DBD8): element 32 w + b of group 0 is -1 exactly where bit b of word w is set."""
    words = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    expected = torch.tensor([-1.0 if w >> b & 1 else 1.0 for w in words for b in range(32)])
    assert torch.equal(reference.signs(0, 0, 0, 128), expected)
    assert torch.equal(reference.signs(0, 0, 37, 50), expected[37:87])


@pytest.mark.parametrize("key", KEYS)
def test_c_kernel_equals_the_reference_bit_for_bit(key):
    """z itself (WRITE_Z) and in-place updates in every element mode, at every start and length: the reference's
    bits, and the statistics sum n x 2^24."""
    for start in STARTS:
        for n in LENGTHS:
            z = reference.signs(*key, start, n)
            out = torch.empty(n)
            assert cpu_kernel.run(*key, start, out, rows.ElementMode.WRITE_Z, 0.0, 0.0, True, True) == n << 24
            assert torch.equal(out, z), (key, start, n)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for start, n in ((3, 5000), (128 * (1 << 32) - 6, 300), (129, 1031)):
            base = torch.linspace(-1, 1, n, dtype=torch.float64).to(dtype)
            scale, alpha = (0.999, -1e-3) if dtype == torch.float64 else (f32(0.999), f32(-1e-3))
            out, expected = base.clone(), base.clone()
            total = cpu_kernel.run(*key, start, out, rows.MODES[dtype], scale, alpha, True, True)
            reference.axpy_(expected, reference.signs(*key, start, n), scale, alpha)
            assert total == n << 24 and torch.equal(out, expected), (key, dtype, start)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rows_with_k_keys_equal_the_reference_and_threads_do_not_change_them(k):
    """run_rows with K keys per row (the chain's moves, the keyed update): each row the reference's
    source * scale + sum_k alpha_k z_k in float32, float32 and bfloat16 in place and bfloat16 from an fp32 source;
    cut over 1 or 3 threads, the same bits and sums."""
    gen = torch.Generator().manual_seed(k)
    spans = [(3, 1000), (128 * (1 << 32) - 6, 2100), ((1 << 33) + 5, 2051), (0, 1)]
    for dtype, master in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        outs = []
        keys = torch.randint(-(1 << 62), 1 << 62, (len(spans), k), generator=gen).numpy()
        coef = np.concatenate([[[1.0], [0.5], [1.0], [0.999]], torch.randn(len(spans), k, generator=gen).numpy()
                               * 1e-2], axis=1)
        for threads in (1, 3):
            targets = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) for _, n in spans]
            sources = [torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) for _, n in spans]
            table = np.zeros((len(spans), rows.WIDTH), dtype=np.int64)
            for r, ((start, n), t, s) in enumerate(zip(spans, targets, sources)):
                src = s if master else t
                table[r, [rows.DST, rows.SRC]] = t.data_ptr(), src.data_ptr()
                table[r, [rows.N, rows.START, rows.STAT]] = n, start, r % 2
                table[r, rows.KIND] = rows.kind(rows.MODES[dtype], rows.MODES[src.dtype])
            expected = [t.clone() for t in targets]
            sums = cpu_kernel.run_rows(table, coef, 2, True, threads, keys=keys, rademacher=True)
            for r, (start, n) in enumerate(spans):
                zs = [reference.signs(int(w) & 0xFFFFFFFF, (int(w) >> 32) & 0xFFFFFFFF, start, n) for w in keys[r]]
                reference.axpy_keys_(expected[r], sources[r] if master else expected[r].clone(), zs, f32(coef[r, 0]),
                                     [f32(a) for a in coef[r, 1:]])
                assert torch.equal(targets[r], expected[r]), (dtype, master, r, threads)
            assert sums.tolist() == [(1000 + 2051) << 24, (2100 + 1) << 24]
            outs.append(torch.cat([t.float() for t in targets]))
        assert torch.equal(outs[0], outs[1])


def test_noise_source_draws_signs_and_names_its_generator():
    """NoiseSource(perturbation=rademacher): +-1 slices of one world-size-independent whole, its own identifier
    (the Gaussian one is unchanged: old checkpoints carry it), and the identifiers map back (perturbation_of)."""
    src = NoiseSource(7, "rademacher")
    numel = 10_007
    whole = src.slice(3, "layer.weight", numel, 0, numel)
    assert set(whole.unique().tolist()) == {-1.0, 1.0}
    for lo, hi in ((0, 128), (127, 300), (5, 5), (9000, 10_007)):
        assert torch.equal(src.slice(3, "layer.weight", numel, lo, hi - lo), whole[lo:hi])
    k0, k1 = src.key(3, "layer.weight")
    assert torch.equal(whole, reference.signs(k0, k1, 0, numel))
    gaussian = NoiseSource(7)
    assert gaussian.ident == NoiseSource.ident == "philox4x32-10-boxmuller-f32-v1" != src.ident
    assert gaussian.key(3, "layer.weight") == (k0, k1)  # keyed as before: only the transform differs
    for p in Perturbation:
        assert perturbation_of(NoiseSource(1, p).describe()) is p and IDENTS[p] == NoiseSource(1, p).ident
    with pytest.raises(ValueError, match="no generator"):
        perturbation_of({"ident": "mt19937"})
    assert src.reference_digest() != gaussian.reference_digest()


N = 1 << 22


def test_sign_statistics():
    """Mean 0; no correlation between neighbours at lags 1, 31, 32, 127, 128 (within and across Philox words and
    calls); each of the 128 bit positions of a call balanced (N/128 signs each); two streams (another name, another
    direction) uncorrelated."""
    src = NoiseSource(5, "rademacher")
    z = src.slice(0, "model.layers.0.mlp.up_proj.weight", N + 17, 17, N).double()
    assert abs(z.mean().item()) <= K / math.sqrt(N)
    for lag in (1, 31, 32, 127, 128):
        assert abs((z[lag:] * z[:-lag]).mean().item()) <= K / math.sqrt(N - lag), lag
    positions = src.slice(0, "w", N, 0, N).double().reshape(-1, 128).mean(0)
    assert (positions.abs() <= K / math.sqrt(N / 128)).all(), positions.abs().max()
    for other in (src.slice(0, "model.layers.0.mlp.down_proj.weight", N + 17, 17, N),
                  src.slice(0, "model.layers.0.mlp.up_proj.weight", N + 17, 17, N, direction=1)):
        assert abs((z * other.double()).mean().item()) <= K / math.sqrt(N)


def test_a_pass_counts_each_drawn_block_at_its_size():
    """The Perturber's statistics under +-1: a drawn block's fixed-point sum is exactly n_B x 2^24 (its ||z_B||^2 =
    |B|), 0 for a block not drawn; and ZOEngine's step skips that work (it knows the sums) with the same scores."""
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 5, 129)])
    engine = ZOEngine(params, lambda m, b: (sum((p * p).sum() for p in m), 1),
                      ZOConfig(learning_rate=1e-3, zo_eps=1e-3, perturbation="rademacher", method="curvzo"))
    mask = torch.tensor([True, True, False, True])
    engine.perturber.begin(0, mask)
    sums = engine.perturber.move(None, (0, 1e-3), stats=True)
    assert sums.tolist() == [7 << 24, 300 << 24, 0, 129 << 24]
    engine.perturber.move((0, 1e-3), None)
    assert not engine._drawn_stats and ZOEngine(params, engine.loss_fn, ZOConfig(method="curvzo"))._drawn_stats


# The Triton kernel's +-1 path, run by Triton's interpreter on CPU tensors: one range in every mode at the edge keys and
# starts against the reference (and n x 2^24), rows with 1 and 3 keys against the C kernel's bits and sums, and a copy
# launch with the +-1 program map. It runs inside test_noise.py's Triton subprocess (no launch of its own: CI's budget,
# tests/launches.py), which checks its last line. The engine on every backend under +-1: test_perturb.py's
# test_every_backend_gives_the_c_kernels_bits (its second digest).
TRITON_CHECK = r"""
import numpy as np, torch
from curvzo_ds.noise import cpu, gpu, reference, rows as L
assert cpu.available()
bad = []
# one range: key words 0, 1 and 2^32 - 1, starts of every residue mod 128 that matters, the 2^32-group carry, 2^40
CASES = [((1, 2), 0, 1000, torch.float32, 0), ((0xFFFFFFFF, 0xFFFFFFFF), 128 * (1 << 32) - 6, 5003, torch.float32, 0),
         ((5, 6), 3, 1, torch.float32, 0), ((5, 6), (1 << 40) + 1, 9001, torch.float32, 1),
         ((7, 8), 130, 4099, torch.bfloat16, 2), ((7, 8), 2, 4099, torch.float16, 3),
         ((0, 1), (1 << 33) + 5, 20001, torch.bfloat16, 2)]
for key, start, n, dtype, mode in CASES:
    base = torch.linspace(-1, 1, n).to(dtype)
    out = base.clone()
    total = gpu.run(*key, start, out, mode, 0.999, -0.5, rademacher=True)
    z = reference.signs(*key, start, n)
    expected = z.clone() if mode == 0 else base.clone()
    if mode:
        reference.axpy_(expected, z, float(torch.tensor(0.999, dtype=torch.float32)), -0.5)
    if not torch.equal(out, expected) or int(total) != n << 24:
        bad.append((key, start, n, str(dtype)))
# rows with K keys against the C kernel: float32 in place, bfloat16 from an fp32 master copy, and a copy launch
SPANS, STATS = [(3, 1000), (128 * (1 << 32) - 6, 2100), ((1 << 33) + 5, 2051)], [0, -1, 1]
offsets = [0, 1000, 3100, 5151]
gen = torch.Generator().manual_seed(0)
for nk in (1, 3):
    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        t = torch.zeros(len(SPANS), L.WIDTH, dtype=torch.int64)
        for r, (start, n) in enumerate(SPANS):
            t[r, L.DST], t[r, L.SRC], t[r, L.N], t[r, L.START] = offsets[r], offsets[r], n, start
            t[r, L.STAT] = STATS[r]
        keys = torch.randint(-(1 << 62), 1 << 62, (len(SPANS), nk), generator=gen)
        coef = torch.cat([torch.tensor([[1.0], [0.999], [0.5]]), torch.randn(len(SPANS), nk, generator=gen) * 1e-2], 1)
        base = torch.randn(offsets[-1], generator=gen).to(dtype)
        src = torch.randn(offsets[-1], generator=gen) if master else None
        a, b = base.clone(), base.clone()
        per = gpu.programs_per_row(t[:, L.N], t[:, L.START], True)
        prefix = torch.cat([torch.zeros(1, dtype=torch.int64), per.cumsum(0)])
        sa = torch.zeros(2, dtype=torch.int64)
        gpu.launch(a, src, t, prefix, int(prefix[-1]), coef.float(), sa, keys=keys, rademacher=True)
        c = t.numpy().copy()
        src_ = b if src is None else src
        c[:, L.DST] = b.data_ptr() + c[:, L.DST] * b.element_size()
        c[:, L.SRC] = src_.data_ptr() + c[:, L.SRC] * src_.element_size()
        c[:, L.KIND] = L.kind(L.MODES[dtype], L.MODES[src_.dtype])
        sb = cpu.run_rows(c, coef.double().numpy(), 2, True, keys=keys.numpy(), rademacher=True)
        same = torch.equal(a.float(), b.float()) and sa.tolist() == sb.tolist()
        if not same or sb.tolist() != [1000 << 24, 2051 << 24]:
            bad.append(("keys", nk, str(dtype)))
        if master:  # a copy launch walks the rows with the +-1 program map: target = source, every element once
            gpu.launch(a, src, t, prefix, int(prefix[-1]), coef.float(), None, copy=True, keys=keys, rademacher=True)
            if not torch.equal(a[:offsets[-1]], src.to(dtype)):
                bad.append(("copy", nk))
print("bad rademacher", bad)
"""



# ---------------------------------------------------------------------------------------------------------------------
# The algorithm under +-1 z (docs/algorithm.md, "Rademacher directions"): the score estimators' means with c = E z^4 - 1
# = 0, against Monte Carlo on test_sampler.py's vectorised draws (Delta = g . v exactly, v = m ⊙ z) with z = +-1 from
# a fixed seed. Tolerance: 4.5 standard errors of each Monte-Carlo mean (test_sampler.assert_mean), the standard error
# from the same draws; over the ~40 coordinates checked a false failure has probability below 1e-3.


def draw_signs(pi: torch.Tensor, g: torch.Tensor, owner: torch.Tensor, n: int, seed: int = 1):
    """test_sampler.draw_at with z = +-1: (plan with an [n, G] mask, z [n, d], Delta [n, 1], ||v_i||^2 [n, G])."""
    from curvzo_ds.algo.sampling import StepPlan

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, len(pi), generator=gen, dtype=torch.float64) < pi
    z = torch.randint(0, 2, (n, g.numel()), generator=gen).to(torch.float64) * 2 - 1
    v = z * mask[:, owner]
    delta = (v @ g)[:, None]
    block_sq = torch.zeros(n, len(pi), dtype=torch.float64).index_add_(1, owner, v * v)
    return StepPlan(0, pi, float(pi.sum()), None, None, mask, False), z, delta, block_sq


def test_block_sums_of_signs_are_the_block_sizes():
    from tests.test_sampler import HAND_G, HAND_SIZES, hand_layout

    pi, sizes, g, owner = hand_layout(HAND_SIZES, HAND_G)
    plan, _, _, block_sq = draw_signs(pi, g, owner, 1000)
    assert torch.equal(block_sq, plan.mask * sizes)


@pytest.mark.parametrize("one_element_blocks", [True, False])
def test_raw_score_mixed_moment_under_signs(one_element_blocks):
    """E[Delta^2 ||v_Gi||^2] = pi_i n_i sum_{k != i} pi_k a_k + pi_i (n_i + c) a_i with c = E z^4 - 1 = 0 for +-1 z
    (2 for Gaussian z: test_sampler.py), worked by hand at pi = (1/2, 1/4, 1, 3/4): the raw score's Monte-Carlo mean and
    expected_scores's exact mean against the literal numbers."""
    from tests.test_sampler import HAND_G, HAND_SIZES, N, assert_mean, hand_layout

    if one_element_blocks:
        # Eq. 6 with E z^4 = 1: pi_i sum_j pi_j g_j^2 + pi_i (1 - pi_i) g_i^2, g^2 = (1, 4, 1, 1/4), sum_j pi_j g_j^2
        # = 2.6875; block 0: 1.34375 + (1/2)(1/2)(1) = 1.59375; block 1: 0.671875 + (1/4)(3/4)(4) = 1.421875;
        # block 2: 2.6875 + 0 = 2.6875; block 3: 2.015625 + (3/4)(1/4)(1/4) = 2.0625
        sizes_t, g_t, energy = (1, 1, 1, 1), (1.0, 2.0, -1.0, 0.5), (1.0, 4.0, 1.0, 0.25)
        expected = torch.tensor([1.59375, 1.421875, 2.6875, 2.0625], dtype=torch.float64)
    else:
        # pi_k a_k = (1/2, 1/2, 4, 3/8), sum 5.375; block 0: (1/2)(1)(4.875) + (1/2)(1)(1) = 2.9375;
        # block 1: (1/4)(2)(4.875) + (1/4)(2)(2) = 3.4375; block 2: (1)(1)(1.375) + (1)(1)(4) = 5.375;
        # block 3: (3/4)(2)(5) + (3/4)(2)(1/2) = 8.25
        sizes_t, g_t, energy = HAND_SIZES, HAND_G, (1.0, 2.0, 4.0, 0.5)
        expected = torch.tensor([2.9375, 3.4375, 5.375, 8.25], dtype=torch.float64)
    pi, sizes, g, owner = hand_layout(sizes_t, g_t)
    plan, _, delta, block_sq = draw_signs(pi, g, owner, N)
    scores = estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "raw", "rademacher")
    assert_mean(scores, expected)
    energy = torch.tensor(energy, dtype=torch.float64)
    exact = estimators.expected_scores(pi, sizes, energy, "raw", None, "rademacher")
    torch.testing.assert_close(exact, expected, rtol=1e-15, atol=0)


def test_unbiased_score_under_signs_and_the_block_it_cannot_see():
    """Appendix B's estimator with c = 0, (Delta^2 ||v_Gi||^2 - pi_i n_i Delta^2) / (pi_i n_i (1 - pi_i)) = Delta^2 (m_i
    / pi_i - (1 - m_i) / (1 - pi_i)): mean ||g_i||^2 = (1, 2, -, 1/2) where pi_i < 1; the block at pi_i = 1 (every
    step: ||v_Gi||^2 = n_i carries nothing about it) gets 0 and is marked not informative. With the Gaussian
    constant (c = 2) the same +-1 draws are biased, measurably."""
    from tests.test_sampler import HAND_ENERGY, HAND_G, HAND_SIZES, N, assert_mean, hand_layout

    pi, sizes, g, owner = hand_layout(HAND_SIZES, HAND_G)
    plan, _, delta, block_sq = draw_signs(pi, g, owner, N)
    seen = torch.tensor([True, True, False, True])
    assert torch.equal(estimators.informative_blocks(pi, sizes, "unbiased", "rademacher"), seen)
    assert estimators.informative_blocks(pi, sizes, "unbiased", "gaussian").all()
    energy = torch.tensor(HAND_ENERGY, dtype=torch.float64)
    for name, target in (("unbiased", energy), ("unbiased_element", energy / sizes)):
        scores = estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, name, "rademacher")
        assert_mean(scores[:, seen], target[seen])
        assert (scores[:, ~seen] == 0).all()
    wrong = estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "unbiased", "gaussian")[:, seen]
    se = wrong.std(0) / math.sqrt(N)
    assert ((wrong.mean(0) - energy[seen]).abs() > 4.5 * se).all()


def normalized_mean_signs(pi, sizes, g_sq):
    """The exact mean of Eq. 27's score under +-1 z, by enumerating the 2^G masks: given M, ||v_Gi||^2 / ||v||^2 =
    n_i / N_M exactly and E[Delta^2 | M] = ||g_M||^2, so E[s_i | M] = m_i n_i ||g_M||^2 / N_M (the Gaussian formula
    (n_i ||g_M||^2 + 2 a_i) / (N_M + 2) with 2 -> c = 0)."""
    import itertools

    out = torch.zeros(len(pi), dtype=torch.float64)
    for bits in itertools.product((0, 1), repeat=len(pi)):
        m = torch.tensor(bits, dtype=torch.bool)
        if m.any():
            prob = torch.where(m, pi, 1 - pi).prod()
            out += prob * torch.where(m, sizes * g_sq[m].sum() / sizes[m].sum(), torch.zeros_like(pi))
    return out


def test_normalized_score_mean_under_signs():
    """Eq. 27 under +-1 z: the enumeration's mean, from the scores and from expected_scores over the drawn masks."""
    from tests.test_sampler import N, assert_mean, layout, sampler_with

    sizes, g, owner = layout(seed=5)
    pi = sampler_with([1.0, 0.2, 4.0, 0.5], sizes).probabilities(0).pi
    plan, _, delta, block_sq = draw_signs(pi, g, owner, N)
    g_sq = torch.zeros(4, dtype=torch.float64).index_add_(0, owner, g * g)
    exact = normalized_mean_signs(pi, sizes, g_sq)
    assert_mean(estimators.block_scores(delta, block_sq, plan.mask, plan.pi, sizes, "normalized", "rademacher"), exact)
    per_mask = torch.stack([estimators.expected_scores(pi, sizes, g_sq, "normalized", m[None], "rademacher")
                            for m in plan.mask[:20_000]])
    assert_mean(per_mask, exact)


def test_horvitz_thompson_step_under_signs_is_unbiased_with_variance_d_not_d_plus_2():
    """Prop. 3.2 holds for any z with E z z^T = I: E[g~] = g at non-uniform pi. With every block drawn (MeZO) the
    estimate Delta z has E||Delta z||^2 = d ||g||^2 for +-1 z (||z||^2 = d exactly) and (d + 2) ||g||^2 for Gaussian
    z."""
    from tests.test_sampler import N, assert_mean, draw_at, layout, sampler_with

    sizes, g, owner = layout()
    sampler = sampler_with([1.0, 0.05, 9.0, 0.3], sizes, perturbation="rademacher")
    assert sampler.perturbation is Perturbation.RADEMACHER
    pi = sampler.probabilities(0).pi
    plan, z, delta, _ = draw_signs(pi, g, owner, N)
    step, _ = sampler.update_coefficients(plan, delta, lr=1.0)
    assert_mean(step[:, owner] * z, g)
    d, g2 = g.numel(), float(g @ g)
    ones = torch.ones(len(sizes), dtype=torch.float64)
    for draw, factor in ((draw_signs, d), (draw_at, d + 2)):
        _, z, delta, _ = draw(ones, g, owner, N, 3)
        assert_mean(((delta * z) ** 2).sum(1, keepdim=True), torch.tensor([factor * g2], dtype=torch.float64))


def test_sampler_keeps_the_score_of_a_block_it_cannot_see():
    """CurvZOSampler.observe under +-1 z with Appendix B's estimator: the EMA moves the informative blocks and leaves
    a block at pi = 1 with its score, bit for bit; with Gaussian z every block moves."""
    from tests.test_sampler import HAND_G, HAND_SIZES, hand_layout, sampler_with

    pi, sizes, g, owner = hand_layout(HAND_SIZES, HAND_G)
    for perturbation, frozen in (("rademacher", [False, False, True, False]), ("gaussian", [False] * 4)):
        sampler = sampler_with([0.3, 0.7, 1.1, 0.2], sizes, score_estimator="unbiased", perturbation=perturbation)
        plan, _, delta, block_sq = draw_signs(pi, g, owner, 1, seed=4)
        plan.mask = plan.mask[0]
        before = sampler.scores.clone()
        sampler.observe(plan, float(delta[0, 0]), block_sq[0])
        assert (sampler.scores == before).tolist() == frozen, perturbation


def test_the_key_is_validated_and_a_resume_keeps_the_checkpoints_perturbation(caplog):
    """`perturbation` takes gaussian or rademacher (a bad value is one ConfigError naming the key); an engine asked
    for +-1 that loads a Gaussian engine's state keeps Gaussian z (config, generator, sampler), with a log line, and
    then steps as the Gaussian engine does; a state of an unknown generator is refused."""
    import logging

    from curvzo_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="perturbation='uniform' is invalid: it must be gaussian or rademacher"):
        ZOConfig(perturbation="uniform").validate()

    def engine(perturbation):
        torch.manual_seed(0)
        params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 5)])
        return params, ZOEngine(params, lambda m, b: (sum((p * p).sum() for p in m), 1),
                                ZOConfig(learning_rate=1e-3, zo_eps=1e-3, method="curvzo", score_warmup_steps=1,
                                         perturbation=perturbation))

    params_a, a = engine("gaussian")
    for _ in range(2):
        a.step(None)
    params_b, b = engine("rademacher")
    with torch.no_grad():
        for x, y in zip(params_b, params_a):
            x.copy_(y)
    with caplog.at_level(logging.INFO, logger="curvzo_ds"):
        b.load_state_dict(a.state_dict())
    assert "draws perturbation=gaussian; it keeps it (perturbation=rademacher is not taken" in caplog.text
    assert b.cfg.perturbation == "gaussian" and b.noise.ident == a.noise.ident
    assert b.sampler.perturbation is Perturbation.GAUSSIAN and b.perturber.noise is b.noise
    for _ in range(2):
        a.step(None)
        b.step(None)
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b)) and torch.equal(a.sampler.scores,
                                                                                      b.sampler.scores)
    with pytest.raises(ValueError, match="another noise generator"):
        b.check_state({**a.state_dict(), "noise": {"ident": "mt19937"}})
