"""Tests that need CUDA (`python -m pytest -m gpu`; deselected, never skipped, where there is none: conftest.py).
tools/gpu_run.sh runs them on a lent GPU machine.

- the compiled Triton kernel gives the C kernel's and the reference's bits at the edge keys and starts, for normals
  and for +-1 signs (perturbation=rademacher);
- the Perturber's passes on CUDA leave weights, scores and losses bit-identical to the same passes on the CPU;
- a pass is one launch per dtype, for 10 and 1,000 tensors;
- a step does not synchronise with the host except for the one all-reduce's read-back.
"""

import pytest
import torch

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import gpu, reference

pytestmark = pytest.mark.gpu

EDGE_CASES = [  # (k0, k1, start, n): key words 0, 1, 2^32 - 1; starts 2^31, 2^32, 2^33 + tail, the counter carry
    (0, 0, 0, 1 << 20), (1, 2, 3, 100_001), (2, 1, 5, 4099), (0xFFFFFFFF, 0xFFFFFFFF, 7, 65_537),
    (1, 1, 1 << 31, 5003), (12345, 1, 1 << 32, 5003), (0, 0xFFFFFFFF, (1 << 33) - 8, 5003),
    (3, 4, (1 << 33) + 5, 70_001), (77, 88, 4 * (1 << 32) - 6, 5003), (99, 100, (1 << 40) + 1, 70_001)]


@pytest.mark.parametrize("k0,k1,start,n", EDGE_CASES)
def test_triton_kernel_equals_the_c_kernel_and_the_reference(k0, k1, start, n):
    assert cpu_kernel.available(), "the C kernel did not build here (gcc?)"
    ref = reference.normals(k0, k1, start, n)
    z = torch.empty(n, device="cuda")
    gpu.run(k0, k1, start, z, 0, 0.0, 0.0, want_sq=False)
    assert torch.equal(z.cpu().view(torch.int32), ref.view(torch.int32))
    for dtype, mode in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 3)):
        base = torch.linspace(-2, 2, n).to(dtype)
        on_gpu, on_cpu = base.cuda(), base.clone()
        total = gpu.run(k0, k1, start, on_gpu, mode, 0.999, 1e-3, want_sq=True)
        expected_total = cpu_kernel.run(k0, k1, start, on_cpu, mode, 0.999, 1e-3, True)
        assert torch.equal(on_gpu.cpu(), on_cpu), dtype
        assert int(total) == expected_total == int(reference.fixed_point_sum_of_squares(ref))


@pytest.mark.parametrize("k0,k1,start,n", EDGE_CASES)
def test_triton_rademacher_equals_the_c_kernel_and_the_reference(k0, k1, start, n):
    """perturbation=rademacher (issue 58): the compiled +-1 path gives reference.signs' bits and the C kernel's, in
    every mode; the statistics are n x 2^24."""
    assert cpu_kernel.available(), "the C kernel did not build here (gcc?)"
    z = torch.empty(n, device="cuda")
    gpu.run(k0, k1, start, z, 0, 0.0, 0.0, want_sq=False, rademacher=True)
    assert torch.equal(z.cpu(), reference.signs(k0, k1, start, n))
    for dtype, mode in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 3)):
        base = torch.linspace(-2, 2, n).to(dtype)
        on_gpu, on_cpu = base.cuda(), base.clone()
        total = gpu.run(k0, k1, start, on_gpu, mode, 0.999, 1e-3, want_sq=True, rademacher=True)
        assert cpu_kernel.run(k0, k1, start, on_cpu, mode, 0.999, 1e-3, True, True) == int(total) == n << 24
        assert torch.equal(on_gpu.cpu(), on_cpu), dtype


def mixed(device) -> torch.nn.Module:
    """fp32, bf16 and fp16 matrices, bf16 1-D tensors (fp32 master copies under `auto`), odd lengths."""
    gen = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    for name, shape, dtype in (("a", (70, 90), torch.float32), ("b", (50, 110), torch.bfloat16),
                               ("c", (30, 130), torch.float16), ("norm", (1700,), torch.bfloat16),
                               ("bias", (6,), torch.float32), ("d", (40_999,), torch.bfloat16)):
        setattr(m, name, torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype).to(device)))
    return m


def first_elements_loss(model, batch):
    """Exact on any device: first elements added one after the other in float64 (no reduction order to differ)."""
    loss = None
    for i, p in enumerate(model.parameters()):
        term = p.view(-1)[i % p.numel()].double() * (i % 3 - 1)
        loss = term if loss is None else loss + term
    return loss * loss, 1


@pytest.mark.parametrize("cfg", [dict(method="curvzo", score_warmup_steps=1, weight_decay=0.1),
                                 dict(method="mezo", num_directions=2, weight_decay=0.1),
                                 dict(method="fixed", budget=0.5, fp32_master_weights=False),
                                 dict(method="curvzo", score_warmup_steps=1, perturbation="rademacher"),
                                 dict(method="mezo", num_directions=3, difference="rloo", perturbation="rademacher")])
def test_steps_on_cuda_equal_steps_on_the_cpu_bit_for_bit(cfg):
    results = []
    for device in ("cpu", "cuda"):
        model = mixed(device)
        engine = ZOEngine(model, first_elements_loss, ZOConfig(learning_rate=1e-3, zo_eps=1e-2, max_steps=5, **cfg))
        losses = [engine.step(None).loss for _ in range(5)]
        results.append(({n: p.detach().cpu() for n, p in model.named_parameters()}, engine.sampler.scores.clone(),
                        losses))
    (w_cpu, s_cpu, l_cpu), (w_gpu, s_gpu, l_gpu) = results
    assert l_cpu == l_gpu
    assert torch.equal(s_cpu, s_gpu)
    for name in w_cpu:
        assert torch.equal(w_cpu[name].view(torch.uint8), w_gpu[name].view(torch.uint8)), name


def many(count: int, dtypes) -> torch.nn.ParameterList:
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2, 4, device="cuda").to(dtypes[i % len(dtypes)]))
                                   for i in range(count)])


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float32, torch.bfloat16, torch.float16)])
def test_a_pass_is_one_launch_per_dtype_for_10_and_1000_tensors(dtypes):
    counts = []
    for count in (10, 1000):
        engine = ZOEngine(many(count, dtypes), first_elements_loss,
                          ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3, fp32_master_weights=False))
        engine.step(None)
        counts.append(engine.perturber.step_launches)
    assert counts[0] == counts[1] == [len(dtypes)] * 3


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256).to(torch.bfloat16)
        self.norm = torch.nn.LayerNorm(256).to(torch.bfloat16)
        self.down = torch.nn.Linear(256, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def tiny_loss(model, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x).float(), y, reduction="sum")
    return loss, y.numel()


@pytest.mark.parametrize("cfg", [dict(method="mezo"), dict(method="curvzo", visibility_steps=1),
                                 dict(method="mezo", num_directions=2), dict(method="fixed", budget=0.5,
                                                                              fp32_master_weights=True)])
def test_a_step_synchronises_only_for_the_all_reduce(cfg):
    """torch.cuda.set_sync_debug_mode("error") around whole steps: any host synchronisation but the all-reduce's
    read-back (comm.read_back, the one allowed) raises. The read-back happens once per step."""
    torch.manual_seed(0)
    model = Tiny().cuda()
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, 8, (32,), device="cuda")
    engine = ZOEngine(model, tiny_loss, ZOConfig(learning_rate=1e-3, zo_eps=1e-2, **cfg))
    engine.step((x, y))  # warm-up: Triton compiles, the table is built
    reads = engine.comm.stats["host_reads"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            engine.step((x, y))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.comm.stats["host_reads"] - reads == 3


def test_static_mask_steps_on_cuda_equal_steps_on_the_cpu_bit_for_bit():
    """static_mask: the probe's backprop, the threshold, and the masked passes (index writes, noise from the Triton
    kernel on CUDA) give the CPU's mask and weights."""
    results = []
    for device in ("cpu", "cuda"):
        model = mixed(device)
        n = sum(p.numel() for p in model.parameters())
        engine = ZOEngine(model, first_elements_loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-2,
                                                               max_steps=5, static_mask=6 / n))
        mask = engine.fit_static_mask([None])
        losses = [engine.step(None).loss for _ in range(5)]
        results.append(([i.clone() for i in mask.index], {k: p.detach().cpu() for k, p in model.named_parameters()},
                        losses))
    (m_cpu, w_cpu, l_cpu), (m_gpu, w_gpu, l_gpu) = results
    # 6 asked for, 4 chosen: the loss reads 6 elements, 2 with a coefficient 0 (a zero gradient is never chosen)
    assert sum(len(i) for i in m_cpu) == 4 and all(torch.equal(a, b) for a, b in zip(m_cpu, m_gpu))
    assert l_cpu == l_gpu
    for name in w_cpu:
        assert torch.equal(w_cpu[name].view(torch.uint8), w_gpu[name].view(torch.uint8)), name
