"""Low-precision weights: what each forward sees, with and without the fp32 master copy.

The two forwards of a step must see w + eps z and w - eps z. With `fp32_master_weights` the
master holds w in fp32, and each forward sees exactly bf16(master + (+-eps) z): checked bit
for bit. Editing bf16 weights in place instead rounds after every add, so the second forward
sees bf16(bf16(w + eps z) - 2 eps z): within two bf16 roundings of w - eps z, i.e. at most
2^-8 (2 |w| + 4 eps |z|) per element (each rounding is at most half an ulp, at most 2^-8 of the
rounded value's magnitude, and both values rounded are at most |w| + 2 eps |z|).
"""

import logging

import pytest
import torch

from curvzo_ds.engine import ZOEngine
from curvzo_ds.noise.gaussian import NoiseSource
from tests.toys import TinyNet, ce_loss, toy_task

EPS, SEED = 1e-2, 5


def _seen(master: bool):
    torch.manual_seed(0)
    net = TinyNet().to(torch.bfloat16)
    x, y = toy_task(32)
    seen = []

    def loss(model, batch):
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return ce_loss(model, (batch[0].to(torch.bfloat16), batch[1]))

    engine = ZOEngine(net, loss, method="mezo", learning_rate=0.0, zo_eps=EPS, seed=SEED,
                      fp32_master_weights=master)
    w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    engine.step((x, y))
    noise = NoiseSource(SEED)
    z = {n: noise.slice(0, n, p.numel(), 0, p.numel()).view_as(p) for n, p in w0.items()}
    return w0, z, seen, net


def test_master_copy_forwards_see_exactly_w_plus_and_minus_eps_z():
    w0, z, (plus, minus), net = _seen(master=True)
    for n, w in w0.items():
        m = w.float()
        assert torch.equal(plus[n], (m + EPS * z[n]).to(torch.bfloat16)), n
        assert torch.equal(minus[n], (m + (-EPS) * z[n]).to(torch.bfloat16)), n
        assert torch.equal(dict(net.named_parameters())[n].detach(), w), n  # lr = 0: restored exactly


@pytest.mark.parametrize("master", [False, True])
def test_second_forward_is_within_bf16_rounding_of_w_minus_eps_z(master):
    w0, z, (plus, minus), _ = _seen(master)
    for n, w in w0.items():
        w, zz = w.double(), z[n].double()
        bound = 2.0**-8 * (2 * w.abs() + 4 * EPS * zz.abs())
        assert ((minus[n].double() - (w - EPS * zz)).abs() <= bound).all(), n
        assert ((plus[n].double() - (w + EPS * zz)).abs() <= bound).all(), n


def test_drift_benchmark_prints_its_table(capsys):
    from curvzo_ds.commands.bench import drift

    rows = drift(steps=3, dtype="bfloat16")
    assert [(r["lr"] > 0, r["fp32_master"]) for r in rows] == [(False, False), (False, True), (True, False),
                                                              (True, True)]
    assert rows[1]["changed_fraction"] == 0.0  # lr = 0 with the master copy: every weight restored exactly
    assert rows[0]["changed_fraction"] > 0.0  # without it, bf16 rounding moves weights
    assert "vs fp32" in capsys.readouterr().out


def test_visibility_names_the_block_that_bf16_cannot_perturb(caplog):
    """eps = 1e-5 is far below the bf16 spacing of weights near 0.1 (about 5e-4): few elements move, and the run
    is warned. eps = 1e-1 moves almost all. The 1-D tensors (norms, biases) have an fp32 copy under "auto"
    and are not watched."""
    x, y = toy_task(32)
    results = {}
    for eps in (1e-5, 1e-1):
        torch.manual_seed(0)
        net = TinyNet().to(torch.bfloat16)
        engine = ZOEngine(net, lambda m, b: ce_loss(m, (b[0].to(torch.bfloat16), b[1])), method="mezo",
                          learning_rate=0.0, zo_eps=eps, seed=SEED, visibility_steps=1)
        assert {e.name for e in engine.entries if e.master is not None} == {"l1.bias", "l2.bias", "norm.weight",
                                                                            "norm.bias"}
        with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
            results[eps] = engine.step((x, y))
    low, high = results[1e-5], results[1e-1]
    assert low.visibility < 0.2 and low.visibility_block in ("l1.weight", "l2.weight")
    assert high.visibility > 0.9
    assert f"block {low.visibility_block}: +eps z changed only" in caplog.text
