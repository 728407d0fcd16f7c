"""The one-process engine: the paper's statistical properties, training, faults, bad input."""

import logging
import math
import re

import pytest
import torch

from curvzo_ds.algo.sampling import CurvZOSampler
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import NonFiniteLossError
from curvzo_ds.noise.gaussian import NoiseSource
from tests.toys import Quadratic, TinyNet, ce_loss, quad_loss, toy_task


def _frozen_pi_engine(model, pi_scores, **cfg):
    base = dict(method="fixed", budget=0.5, score_init=1.0, score_warmup_steps=0, budget_floor=0.1,
                learning_rate=1.0, zo_eps=1e-3, rate_correction="none")  # the paper's step
    base.update(cfg)
    engine = ZOEngine(model, quad_loss, ZOConfig(**base))
    engine.sampler.scores = torch.tensor(pi_scores, dtype=torch.float64)
    return engine


def _run_frozen(engine, model, n):
    """n steps from the same weights and scores: returns the estimates -delta_w and the raw scores."""
    w0 = [w.detach().clone() for w in model.ws]
    s0 = engine.sampler.scores.clone()
    estimates, scores = [], []
    for _ in range(n):
        engine.step(None)
        estimates.append(torch.cat([(a - w.detach()) for a, w in zip(w0, model.ws)]))
        scores.append(engine.sampler.scores.clone())
        with torch.no_grad():
            for w, a in zip(model.ws, w0):
                w.copy_(a)
        engine.sampler.scores = s0.clone()
    return torch.stack(estimates), torch.stack(scores)


@pytest.mark.slow  # end to end through the engine; the vectorised version is in test_sampler.py
def test_horvitz_thompson_estimate_is_unbiased():
    """Prop. 3.2 (the issue's 'Prop. 3.1'): E[g~] = g for non-uniform pi, with and without the floor."""
    for floor in (0.0, 0.2):
        model = Quadratic()
        engine = _frozen_pi_engine(model, [1.0, 0.05, 9.0, 0.3], budget_floor=floor)
        pi, _, _, _ = engine.sampler.probabilities(engine.step_count)
        assert pi.max() - pi.min() > 0.3  # really non-uniform
        g = torch.cat(model.grad())
        n = 6000
        est, _ = _run_frozen(engine, model, n)
        mean = est.mean(0)
        se = est.std(0) / math.sqrt(n)
        # 16 coordinates at 4.5 standard errors: a false failure has probability < 1e-4.
        assert ((mean - g).abs() <= 4.5 * se + 1e-9).all(), (mean, g, se)


@pytest.mark.slow  # end to end through the engine; the vectorised version is in test_sampler.py
@pytest.mark.parametrize("chunk", [1, None])
def test_block_score_mixed_moment(chunk):
    """E[Delta^2 ||v_Gi||^2] = pi_i n_i sum_{k!=i} pi_k ||g_k||^2 + pi_i (n_i + 2) ||g_i||^2.

    With one-element blocks (chunk=1) this is Eq. 6 (the issue's 'Eq. 7'):
    E[s_i] = pi_i sum_j pi_j g_j^2 + pi_i (3 - pi_i) g_i^2.
    """
    sizes = (2, 3, 1, 2)
    model = Quadratic(sizes, seed=3)
    extra = dict(score_estimator="raw", score_beta=1.0)
    if chunk:
        extra.update(block_granularity="chunk", block_chunk_size=1)
        start = [1.0, 0.2, 4.0, 0.5, 0.1, 2.0, 0.7, 0.05]
    else:
        start = [1.0, 0.2, 4.0, 0.5]
    engine = _frozen_pi_engine(model, start, **extra)
    pi, _, _, _ = engine.sampler.probabilities(engine.step_count)
    g = model.grad()
    if chunk:
        g_sq = torch.cat(g) ** 2
        n_i = torch.ones_like(g_sq)
    else:
        g_sq = torch.stack([x.square().sum() for x in g])
        n_i = torch.tensor(sizes, dtype=torch.float64)
    total = (pi * g_sq).sum()
    expected = pi * n_i * (total - pi * g_sq) + pi * (n_i + 2) * g_sq
    n = 6000  # at 4.5 standard errors either way; the vectorised test_sampler.py checks it with more draws
    _, scores = _run_frozen(engine, model, n)
    mean = scores.mean(0)
    se = scores.std(0) / math.sqrt(n)
    assert ((mean - expected).abs() <= 4.5 * se).all(), (mean, expected, se)


@pytest.mark.slow  # end to end through the engine; the vectorised version is in test_sampler.py
def test_unbiased_block_score_has_mean_the_squared_block_gradient():
    """Appendix B's s'_i in block form: E[(Delta^2 ||v_Gi||^2 - pi_i n_i Delta^2) / (pi_i (n_i + 2 - pi_i n_i))]
    = ||g_i||^2, for non-uniform pi (the raw score's mean, by contrast, mixes in the other blocks)."""
    sizes = (2, 3, 1, 2)
    model = Quadratic(sizes, seed=3)
    engine = _frozen_pi_engine(model, [1.0, 0.2, 4.0, 0.5], score_estimator="unbiased", score_beta=1.0)
    pi, _, _, _ = engine.sampler.probabilities(engine.step_count)
    g_sq = torch.stack([x.square().sum() for x in model.grad()])
    n_i = torch.tensor(sizes, dtype=torch.float64)
    raw_mean = pi * n_i * ((pi * g_sq).sum() - pi * g_sq) + pi * (n_i + 2) * g_sq
    n = 12000
    _, scores = _run_frozen(engine, model, n)
    mean, se = scores.mean(0), scores.std(0) / math.sqrt(n)
    assert ((mean - g_sq).abs() <= 4.5 * se).all(), (mean, g_sq, se)
    assert ((mean - raw_mean).abs() > 4.5 * se).all()  # precise enough to tell the two apart


def test_every_block_is_drawn_and_inverse_pi_is_bounded():
    """The floor keeps every block reachable. No warm-up and S = 0 at the start, so blocks unscored by the
    first draws get pi = 0 without the floor (gamma = 0 draws 5 of the 16 blocks here, gamma = 0.1 all)."""
    g, floor = 16, 0.1
    model = Quadratic((4,) * g, seed=1)
    engine = ZOEngine(model, quad_loss, ZOConfig(method="curvzo", learning_rate=1e-5, zo_eps=1e-3,
                                                 budget_min=0.125, budget_max=0.25, budget_floor=floor,
                                                 score_init=0.0, score_warmup_steps=0))
    drawn = torch.zeros(g, dtype=torch.bool)
    for _ in range(300):
        r = engine.step(None)
        drawn |= engine.last_mask  # the blocks this step perturbed
        assert all(math.isfinite(x) for x in engine.sampler.scores.tolist())
        bound = g / (floor * r.budget) * (1 + 1e-9)  # pi_i >= gamma B / G
        assert (1 / r.pi).max().item() <= bound and r.max_inv_pi <= bound
    assert drawn.all(), f"{int(drawn.sum())} of {g} blocks drawn"


@pytest.mark.parametrize("skip", ["empty_mask", "non_finite_loss"])
def test_warmup_mean_is_applied_when_the_last_warmup_step_is_skipped(skip):
    """S := mean observed score after the warm-up, even if its last step is skipped. Seed 0, B = G/8:
    warm-up step 5 draws no block; with B = G every block is drawn and step 5 gets a NaN loss instead."""
    warm, budget = 5, (0.125 if skip == "empty_mask" else 1.0)
    cfg = ZOConfig(method="curvzo", seed=0, learning_rate=1e-5, zo_eps=1e-3, budget_min=budget,
                   budget_max=budget, score_warmup_steps=warm)

    def loss(model, batch):
        return model() * (math.nan if batch == "nan" else 1.0), 1

    engine = ZOEngine(Quadratic((4,) * 8, seed=1), loss, cfg)
    for _ in range(warm - 1):
        assert engine.step(None).skipped is None
    state = engine.state_dict()
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    assert engine.step("nan").skipped == skip
    assert (engine.sampler.warmup_sum > 0).sum() >= 2
    assert torch.equal(engine.sampler.scores, engine.sampler.warmup_sum / warm)
    # Resumed just before that step, it ends the same way.
    model = Quadratic((4,) * 8, seed=1)
    model.load_state_dict(weights)
    resumed = ZOEngine(model, loss, cfg)
    resumed.load_state_dict(state)
    assert resumed.step("nan").skipped == skip
    assert torch.equal(resumed.sampler.scores, engine.sampler.scores)


def test_us_ab_samples_uniformly_with_the_adaptive_budget():
    """Eq. 20 by hand: S = (9, 1, 0, 0, 4, 0, 0, 0), G = 8, B_min = 0.125 G = 1, B_max = 0.75 G = 6, alpha = 0.5.
    sqrt S = (3, 1, 0, 0, 2, 0, 0, 0): d_eff = (3 + 1 + 2)^2 / (9 + 1 + 4) = 36/14 = 2.5714285714285716, and
    p = (1/2, 1/6, 1/3) on the scored blocks gives H = -(1/2 ln 1/2 + 1/6 ln 1/6 + 1/3 ln 1/3) / ln 8
    = 1.01140426 / 2.07944154 = 0.4863826390090817; B = 1 + (6 - 1)(0.5 * 2.5714285714285716 / 8 + 0.5 * 0.48638264)
    = 1 + 5 * 0.40390561 = 3.019528026094133 blocks, well off both ends. us_ab draws every block at
    pi = B/8 = 0.3774410032617666, so the largest 1/pi is 8/B = 2.6494206812672925."""
    g = 8
    engine = ZOEngine(Quadratic((4,) * g, seed=1), quad_loss,
                      ZOConfig(method="us_ab", learning_rate=1e-5, zo_eps=1e-3, budget_min=0.125, budget_max=0.75))
    engine.sampler.scores = torch.tensor([9.0, 1.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    r = engine.step(None)
    assert r.budget == pytest.approx(3.019528026094133, rel=1e-12)
    assert r.d_eff == pytest.approx(2.5714285714285716, rel=1e-12)
    assert r.score_entropy == pytest.approx(0.4863826390090817, rel=1e-12)
    torch.testing.assert_close(r.pi, torch.full((g,), 0.3774410032617666, dtype=torch.float64), rtol=1e-12, atol=0)
    assert r.max_inv_pi == pytest.approx(2.6494206812672925, rel=1e-12)
    assert r.n_selected == int(engine.last_mask.sum())


def test_budget_of_one_block_never_gives_nan():
    model = Quadratic((3, 3, 3, 3), seed=2)
    engine = ZOEngine(model, quad_loss, ZOConfig(method="curvzo", learning_rate=1e-3, zo_eps=1e-3,
                                                 budget_min=0.25, budget_max=0.25))
    empty = 0
    for _ in range(200):
        r = engine.step(None)
        empty += r.skipped == "empty_mask"
        assert torch.isfinite(engine.sampler.scores).all()
        assert r.skipped in (None, "empty_mask")
    assert empty > 0  # B = 1 block leaves some masks empty; they must be harmless
    assert engine.step_count == 200


@pytest.mark.parametrize("method", ["mezo", "curvzo"])
def test_engine_lowers_the_loss(method):
    torch.manual_seed(0)
    net = TinyNet()
    x, y = toy_task()
    engine = ZOEngine(net, ce_loss, ZOConfig(method=method, learning_rate=2e-2, zo_eps=1e-3, seed=3))
    with torch.no_grad():
        before = ce_loss(net, (x, y))[0].item() / len(y)
    for i in range(300):
        idx = torch.arange(i * 16, i * 16 + 16) % len(y)
        engine.step((x[idx], y[idx]))
    with torch.no_grad():
        after = ce_loss(net, (x, y))[0].item() / len(y)
    assert after < before - 0.1, (before, after)


def _drift_bound(w, z, eps):
    # +eps z, -2 eps z, +eps z in fp32: each of the three adds (and each product eps*z) rounds by at
    # most half an ulp, below 2^-24 of its magnitude; the intermediate magnitudes are <= |w| + 2 eps |z|.
    return 2.0**-24 * (3 * (w.abs() + 2 * eps * z.abs()) + 4 * eps * z.abs())


def test_lr_zero_step_restores_fp32_weights_within_drift():
    torch.manual_seed(0)
    net = TinyNet()
    x, y = toy_task(32)
    eps = 1e-2
    engine = ZOEngine(net, ce_loss, ZOConfig(method="mezo", learning_rate=0.0, zo_eps=eps, seed=11))
    before = {e.name: e.param.detach().clone() for e in engine.entries}
    engine.step((x, y))
    noise = NoiseSource(11)
    moved = 0
    for e in engine.entries:
        w0 = before[e.name].view(-1)
        z = noise.slice(0, e.name, e.numel, 0, e.numel)
        diff = (e.param.detach().view(-1) - w0).abs()
        assert (diff <= _drift_bound(w0, z, eps)).all(), e.name
        moved += int((diff > 0).sum())
    assert moved < sum(e.numel for e in engine.entries)  # most elements return exactly


def test_fp32_master_copy_makes_bf16_restore_exact():
    torch.manual_seed(0)
    x, y = toy_task(32)
    for master, exact in ((False, False), (True, True)):
        net = TinyNet().to(torch.bfloat16)
        batch = (x.to(torch.bfloat16), y)
        engine = ZOEngine(net, ce_loss, ZOConfig(method="mezo", learning_rate=0.0, zo_eps=1e-3,
                                                 fp32_master_weights=master))
        before = [p.detach().clone() for p in net.parameters()]
        for _ in range(3):
            engine.step(batch)
        same = all(torch.equal(a, p.detach()) for a, p in zip(before, net.parameters()))
        assert same == exact


def test_non_finite_loss_restores_weights_and_stops_after_a_streak(caplog):
    torch.manual_seed(0)
    net = TinyNet()
    x, y = toy_task(32)
    calls = {"n": 0}

    def flaky(model, batch):
        calls["n"] += 1
        loss, count = ce_loss(model, batch)
        return (loss * math.nan if calls["n"] > 2 else loss), count

    engine = ZOEngine(net, flaky, ZOConfig(method="mezo", learning_rate=1e-2, zo_eps=1e-3,
                                           max_consecutive_skips=3))
    engine.step((x, y))  # forwards 1 and 2 are finite
    before = [p.detach().clone() for p in net.parameters()]
    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        r = engine.step((x, y))
    assert r.skipped == "non_finite_loss" and engine.skipped_total == 1
    assert "step 2: non-finite loss (L(+1)=nan, L(-1)=nan); weights restored, step skipped (1 in a row)" in caplog.text
    for a, p in zip(before, net.parameters()):
        assert torch.allclose(a, p.detach(), atol=1e-6, rtol=0)
    engine.step((x, y))
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        engine.step((x, y))


def test_the_non_finite_loss_warning_names_each_rloo_direction_loss(caplog):
    """Under rloo a direction has one loss and there is no L+ or L-: the warning prints the q losses."""
    torch.manual_seed(0)
    net = TinyNet()
    x, y = toy_task(32)
    calls = {"n": 0}

    def second_direction_nan(model, batch):
        calls["n"] += 1
        loss, count = ce_loss(model, batch)
        return (loss * math.nan if calls["n"] == 2 else loss), count

    engine = ZOEngine(net, second_direction_nan, ZOConfig(method="mezo", learning_rate=1e-2, zo_eps=1e-3,
                                                          difference="rloo", num_directions=2))
    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        assert engine.step((x, y)).skipped == "non_finite_loss"
    assert re.search(r"step 1: non-finite loss \(L_0\(\+1\)=[0-9.]+, L_1\(\+1\)=nan\)", caplog.text), caplog.text


FRACTION = "a fraction of the number of blocks G in (0, 1]"


@pytest.mark.parametrize("key,value,valid", [
    ("zo_eps", 0.0, "a number > 0"), ("zo_eps", -1e-3, "a number > 0"), ("learning_rate", -1.0, "a number >= 0"),
    ("weight_decay", -0.1, "a number >= 0"), ("score_beta", 0.0, "in (0, 1]"), ("score_beta", 1.5, "in (0, 1]"),
    ("budget_alpha", -0.1, "in [0, 1]"), ("budget_alpha", 2.0, "in [0, 1]"), ("budget_min", 0.0, FRACTION),
    ("budget_max", 1.5, FRACTION), ("budget", 0.0, FRACTION), ("method", "adam", "one of curvzo, mezo, us_ab, fixed"),
    ("budget_floor", -0.1, "in [0, 1]"), ("score_warmup_steps", -1, "an integer >= 0"),
])
def test_bad_hyper_parameters_are_refused_with_value_and_range(key, value, valid):
    with pytest.raises(ValueError) as err:
        ZOEngine(TinyNet(), ce_loss, ZOConfig(**{key: value}))
    assert f"{key}={value!r}" in str(err.value) and valid in str(err.value), str(err.value)


def test_budget_min_above_max_and_no_trainable_parameters():
    with pytest.raises(ValueError, match="budget_min=0.8 is larger than budget_max=0.5"):
        ZOEngine(TinyNet(), ce_loss, ZOConfig(budget_min=0.8, budget_max=0.5))
    frozen = TinyNet().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ZOEngine(frozen, ce_loss, ZOConfig())


@pytest.mark.parametrize("q", [1, 4])
def test_noise_generated_three_times_per_selected_tensor_and_direction(monkeypatch, q):
    """MeZO: +eps z, -2 eps z, then the update (which undoes -eps z in the same pass): 3 generations of each
    element, fused into the edit. RLOO with q directions: the first point (1), q - 1 moves (2 each: out of z_k,
    into z_k+1) and the update (q keys): 3q - 1."""
    from curvzo_ds.shard import perturb

    net = TinyNet()
    x, y = toy_task(16)
    cfg = dict(num_directions=q, difference="rloo") if q > 1 else {}
    engine = ZOEngine(net, ce_loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3, **cfg))
    generated: dict[str, int] = {}
    real = perturb.cpu_kernel.run_rows

    def counting(rows, coef, num_blocks, want_sq, threads=1, keys=None):
        for row, row_keys in zip(rows, keys if keys is not None else [[0]] * len(rows)):
            if not row[perturb.KIND] & perturb.COPY:
                name = engine.entries[row[perturb.ENTRY]].name
                generated[name] = generated.get(name, 0) + int(row[perturb.N]) * len(row_keys)
        return real(rows, coef, num_blocks, want_sq, threads, keys=keys)

    monkeypatch.setattr(perturb.cpu_kernel, "run_rows", counting)
    engine.step((x, y))
    assert generated == {e.name: (3 * q - (q > 1)) * e.numel for e in engine.entries}


def test_weight_decay_scales_selected_tensors_by_one_minus_lr_wd_over_pi():
    """A constant loss gives Delta = 0, so a step is only the decay: w <- (1 - lr wd / pi_i) w for selected
    matrices, nothing for unselected blocks, and never anything for biases and norm weights (MeZO)."""
    torch.manual_seed(0)
    net = TinyNet().double()
    lr, wd = 0.1, 0.5
    engine = ZOEngine(net, lambda m, b: (torch.tensor(1.0), 1), ZOConfig(
        method="fixed", budget=0.5, budget_floor=0.2, score_init=1.0, score_warmup_steps=0, learning_rate=lr,
        zo_eps=1e-2, weight_decay=wd, rate_correction="none"))  # the paper's step
    engine.sampler.scores = torch.tensor([4.0, 1.0, 0.25, 0.5, 2.0, 0.1], dtype=torch.float64)
    seen = set()
    for _ in range(10):
        before = [e.param.detach().clone() for e in engine.entries]
        r = engine.step(None)
        assert r.projected_grad == 0.0
        pi, mask = r.pi, engine.last_mask  # what this step drew from, and what it drew
        for b, (e, w0) in enumerate(zip(engine.entries, before)):
            w1 = e.param.detach()
            if mask[b] and e.decay:
                assert pi[b] < 0.9  # so that 1/pi matters
                w1 = w1 / (1 - lr * wd / pi[b].item())
            # float64, weights below 2 and eps |z| below 0.1: the +eps, -2 eps, +eps round-trip rounds by < 1e-14.
            assert (w1 - w0).abs().max() <= (1e-14 if mask[b] else 0.0), (e.name, bool(mask[b]))
            seen.add((bool(mask[b]), e.decay))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


def test_loss_runs_without_autograd():
    modes = []

    def loss(model, batch):
        modes.append(torch.is_grad_enabled())
        return model(), 1

    engine = ZOEngine(Quadratic(), loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3))
    assert torch.is_grad_enabled()
    engine.step(None)
    engine.loss(None)
    assert modes == [False, False, False]


def test_state_dict_round_trip_continues_the_same_trajectory():
    x, y = toy_task(64)

    def run(split):
        torch.manual_seed(0)
        net = TinyNet()
        cfg = ZOConfig(method="curvzo", learning_rate=1e-2, zo_eps=1e-3, score_warmup_steps=3)
        engine = ZOEngine(net, ce_loss, cfg)
        for i in range(12):
            if i == split:
                state = engine.state_dict()
                weights = {k: v.clone() for k, v in net.state_dict().items()}
                net = TinyNet()
                net.load_state_dict(weights)
                engine = ZOEngine(net, ce_loss, cfg)
                engine.load_state_dict(state)
            engine.step((x[i * 4: i * 4 + 16], y[i * 4: i * 4 + 16]))
        return net.state_dict(), engine.sampler.scores

    a, sa = run(-1)
    b, sb = run(6)
    assert torch.equal(sa, sb)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_step_forwards_run_in_eval_mode_so_dropout_cannot_split_l_plus_and_l_minus():
    """The issue's "with eps = 0, L+ = L- on OPT with dropout". ZOConfig refuses eps = 0, so the only
    trainable tensor is one the model never reads: the perturbation has no effect, and L+ = L- exactly
    if and only if both forwards see the same network (no dropout masks)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                     dropout=0.1, attention_dropout=0.1))
    model.requires_grad_(False)
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(4)))
    ids = torch.randint(2, 64, (4, 12), generator=torch.Generator().manual_seed(1))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss, 1

    model.train()
    with torch.no_grad():
        assert loss_fn(model, ids)[0].item() != loss_fn(model, ids)[0].item()  # dropout is live in train mode
    engine = ZOEngine(model, loss_fn, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3))
    r = engine.step(ids)
    assert r.loss_plus == r.loss_minus and r.projected_grad == 0.0
    assert model.training  # the engine restores the mode it found
    assert engine.loss(ids) == engine.loss(ids) == r.loss_plus
    model.eval = lambda: model  # without the engine's eval(), the two forwards differ
    r = engine.step(ids)
    assert r.loss_plus != r.loss_minus


@pytest.mark.parametrize("method", ["fixed", "mezo"])
def test_max_weight_rate_correction_is_the_step_at_lr_times_min_pi(method):
    """rate_correction=max_weight: every step is the paper's step at the rate lr * min_i pi_i (MeZO: pi = 1, no
    change), with the same draws; the recorded learning rate is that rate."""
    scores = [4.0, 1.0, 0.25, 0.01]
    a, b = Quadratic(), Quadratic()
    corrected = _frozen_pi_engine(a, scores, method=method, rate_correction="max_weight")
    pi_min = float(corrected.sampler.plan(0).pi.min())
    assert pi_min < 0.2 if method == "fixed" else pi_min == 1.0
    plain = _frozen_pi_engine(b, scores, method=method, learning_rate=pi_min)
    for _ in range(3):
        r, s = corrected.step(None), plain.step(None)
        assert r.learning_rate == s.learning_rate == pytest.approx(pi_min * 1.0)
        for x, y in zip(a.ws, b.ws):
            assert torch.equal(x, y)
        assert not torch.equal(a.ws[0], Quadratic().ws[0])  # the steps moved the weights


# ------------------------------------------------------------------ pinned against a hand computation


def _hand_axpy(w: torch.Tensor, zs: list[torch.Tensor], alphas: list[float], scale: float = 1.0) -> torch.Tensor:
    """The kernels' arithmetic, written out (noise/reference.py's definition): acc = a_0 z_0 + a_1 z_1 + ..., each
    product and sum rounded in float32, then w * scale + acc."""
    from curvzo_ds.noise.gaussian import f32

    acc = zs[0] * f32(alphas[0])
    for z, a in zip(zs[1:], alphas[1:]):
        acc = acc + z * f32(a)
    return (w * f32(scale) if scale != 1.0 else w) + acc


def _hand_loss(net: TinyNet, weights: dict, batch) -> float:
    """The step's loss of `net` at `weights`: loss_sum / count in float64, as the engine reduces it."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(weights[name].view_as(p))
        loss_sum, count = ce_loss(net, batch)
    return float(loss_sum.double()) / count


@pytest.mark.parametrize("difference,q,steps", [("central", 1, 3), ("rloo", 3, 2)])
def test_a_short_trajectory_equals_the_hand_computation_bit_for_bit(difference, q, steps):
    """tests/test_zero3.py checks that every world size gives the same bits, which a formula wrong the same way
    everywhere would pass. Here the trajectory of one rank is computed by hand from the noise's definition (the
    keys of NoiseSource, the torch reference's normals): MeZO's +eps, -2 eps, update, and RLOO's chain of points
    w + eps z_k with its moves and its one update pass, each pass in the kernels' float32 arithmetic. The engine's
    losses and weights after every step equal it bit for bit."""
    from curvzo_ds.noise import reference

    torch.manual_seed(3)
    net, hand_net = TinyNet(), TinyNet()
    x, y = toy_task(32)
    batch = (x[:16], y[:16])
    lr, eps = 0.05, 1e-2
    cfg = ZOConfig(method="mezo", learning_rate=lr, zo_eps=eps, num_directions=q, difference=difference, seed=5)
    engine = ZOEngine(net, ce_loss, cfg)
    names = [e.name for e in engine.entries]
    w = {name: p.detach().clone().view(-1) for name, p in net.named_parameters()}
    src = NoiseSource(cfg.seed)
    for t in range(steps):
        z = [{n: reference.normals(*src.key(t, n, d), 0, w[n].numel()) for n in names} for d in range(q)]
        if difference == "central":
            plus = {n: _hand_axpy(w[n], [z[0][n]], [eps]) for n in names}
            minus = {n: _hand_axpy(plus[n], [z[0][n]], [-2 * eps]) for n in names}
            losses = [_hand_loss(hand_net, plus, batch), _hand_loss(hand_net, minus, batch)]
            coef = [lr * (losses[0] - losses[1]) / (2 * eps)]  # Eq. 28 with pi = 1
            w = {n: _hand_axpy(minus[n], [z[0][n]], [eps - coef[0]]) for n in names}  # -(-eps z) - c z
        else:
            point, losses = w, []
            for k in range(q):
                point = {n: _hand_axpy(point[n], [z[k - 1][n], z[k][n]] if k else [z[0][n]],
                                       [-eps, eps] if k else [eps]) for n in names}
                losses.append(_hand_loss(hand_net, point, batch))
            total = sum(losses)
            coef = [lr / q * (lk - (total - lk) / (q - 1)) / eps for lk in losses]
            alphas = [-c for c in coef]
            alphas[-1] -= eps  # the last point's +eps z removed in the same pass
            w = {n: _hand_axpy(point[n], [z[k][n] for k in range(q)], alphas) for n in names}
        r = engine.step(batch)
        if difference == "central":
            assert (r.loss_plus, r.loss_minus) == tuple(losses)
        else:
            assert r.loss == total / q
        for name, p in net.named_parameters():
            assert torch.equal(p.detach().view(-1), w[name]), (t, name)


def test_a_steps_block_statistics_are_the_sums_of_z_squared_of_its_noise():
    """The block sums of z^2 that the step's all-reduce carries (the scores' ||v_Gi||^2) equal the fixed-point sums
    of z^2 computed directly from the noise's definition over each drawn block, and 0 for the blocks not drawn."""
    from curvzo_ds.noise import reference
    from curvzo_ds.noise.gaussian import FIXED_POINT_BITS

    seen = []

    class Watching(CurvZOSampler):  # the engine's seam for a sampler: it sees what each step observes
        def observe(self, plan, delta, block_sq) -> None:
            seen.append(block_sq.clone())
            super().observe(plan, delta, block_sq)

    net = TinyNet()
    x, y = toy_task(16)
    engine = ZOEngine(net, ce_loss, ZOConfig(method="fixed", budget=0.5, score_init=1.0, score_warmup_steps=0,
                                             learning_rate=1e-3, zo_eps=1e-3, seed=9), sampler=Watching)
    src = NoiseSource(9)
    for t in range(3):
        engine.step((x, y))
        assert len(seen) == t + 1
        block_sq, mask = seen[-1], engine.last_mask
        assert mask.any() and not mask.all()
        for i, e in enumerate(engine.entries):  # block_granularity=tensor: block i is entry i
            z = reference.normals(*src.key(t, e.name), 0, e.numel)
            expected = float(reference.fixed_point_sum_of_squares(z)) / 2.0**FIXED_POINT_BITS if mask[i] else 0.0
            assert float(block_sq[i]) == expected, (t, e.name)


def test_check_state_refuses_another_noise_another_model_and_another_seed():
    """ZOEngine.check_state, before a checkpoint's state is loaded: each of its three refusals, in one line that
    names what differs."""
    engine = ZOEngine(TinyNet(), ce_loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3, seed=4))
    good = engine.state_dict()
    engine.check_state(good)
    cases = [({"noise": {"ident": "philox-v0"}}, "written by another noise generator"),
             ({"blocks": good["blocks"][:-1]}, "checkpoint blocks differ from this model's trainable parameters"),
             ({"seed": 5}, "checkpoint seed 5 differs from seed=4")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            engine.check_state({**good, **change})
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match=message):
            engine.load_state_dict({**good, **change})
    assert engine.step_count == 0
