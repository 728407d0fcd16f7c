"""The Perturber (perturb.py): a pass is a constant number of launches whatever the number of tensors, every
backend gives the same bits, threads do not change them, and offsets past 2^31 are handled in Python integers."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.noise import cpu as cpu_kernel
from curvzo_ds.noise import reference
from curvzo_ds.noise import rows as layout
from curvzo_ds.shard import perturb, row_table
from tests.helpers import ENV, ROOT


def tiny_params(count: int, dtypes=(torch.float32,), alternate_1d: bool = False) -> torch.nn.ParameterList:
    """`count` tensors of 8 elements, the dtypes in turn; with `alternate_1d` every other one is 1-D (a norm weight:
    an fp32 master copy under fp32_master_weights=auto), the others 2-D."""
    gen = torch.Generator().manual_seed(count)
    shape = lambda i: (8,) if alternate_1d and i % 2 else (2, 4)  # noqa: E731
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*shape(i), generator=gen).to(dtypes[i % len(dtypes)]))
                                   for i in range(count)])


def sum_loss(model, batch):
    """A loss that reads every parameter: Delta != 0, so updates are not only the decay."""
    return (sum((p.float() * (i % 3 - 1)).sum() for i, p in enumerate(model)) ** 2, 1)


def step_launches(count: int, dtypes, alternate_1d: bool = False, **cfg) -> list[int]:
    engine = ZOEngine(tiny_params(count, dtypes, alternate_1d), sum_loss,
                      ZOConfig(learning_rate=1e-3, zo_eps=1e-3, **cfg))
    engine.perturber.threads = 1
    engine.step(None)
    assert engine.last_mask.any()
    return engine.perturber.step_launches


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16, torch.float16)])
def test_a_pass_is_one_c_call_for_10_and_1000_tensors(dtypes):
    """On the CPU every row of a pass goes to one C call (one per thread): +eps (with the statistics), -2 eps,
    update; the same for 10 and 1,000 tensors, and for one dtype or three."""
    for cfg in (dict(method="mezo"), dict(method="fixed", budget=0.5)):
        few = step_launches(10, dtypes, fp32_master_weights=False, **cfg)
        many = step_launches(1000, dtypes, fp32_master_weights=False, **cfg)
        assert few == many == [1, 1, 1], (cfg, few, many)


TRITON_LAUNCHES = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CURVZO_DS_NOISE_KERNEL"] = "triton"
sys.path.insert(0, "tests")
from test_perturb import step_launches
for dtypes, master in (((torch.float32,), False), ((torch.float32, torch.bfloat16, torch.float16), False),
                       ((torch.bfloat16,), "auto")):
    few = step_launches(10, dtypes, alternate_1d=True, method="mezo", fp32_master_weights=master)
    many = step_launches(30, dtypes, alternate_1d=True, method="mezo", fp32_master_weights=master)
    print(len(dtypes), master, few, many)
few = step_launches(10, (torch.bfloat16,), alternate_1d=True, method="mezo", fp32_master_weights="auto",
                    perturbation="rademacher")
many = step_launches(30, (torch.bfloat16,), alternate_1d=True, method="mezo", fp32_master_weights="auto",
                     perturbation="rademacher")
print("rademacher", few, many)
"""


def test_a_pass_is_one_triton_launch_per_dtype_for_10_and_30_tensors():
    """The Triton kernel (run by Triton's interpreter on CPU tensors): one launch per target dtype and pass. With
    fp32 master copies (bf16 weights, the 1-D half kept in fp32 too) one more per pass for the master rows, and the
    update a third (the master copies in place, then written to the stored copies). Independent of the count (30,
    not 100 as before issue 35: the interpreter's time grows with the tensors, the property does not); the same with
    +-1 directions (perturbation=rademacher, issue 58)."""
    proc = subprocess.run([sys.executable, "-c", TRITON_LAUNCHES], capture_output=True, text=True, cwd=str(ROOT),
                          env={**ENV, "TRITON_INTERPRET": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-4:]
    assert lines == ["1 False [1, 1, 1] [1, 1, 1]", "3 False [3, 3, 3] [3, 3, 3]",
                     "1 auto [2, 2, 3] [2, 2, 3]", "rademacher [2, 2, 3] [2, 2, 3]"], proc.stdout


BACKEND_RUN = r"""
import hashlib, os, sys, torch
sys.path.insert(0, "tests")
from curvzo_ds import ZOConfig, ZOEngine
from test_perturb import mixed_model, mixed_sum_loss
for perturbation in ("gaussian", "rademacher"):  # one digest line each
    h = hashlib.sha256()
    for cfg in (dict(method="curvzo", score_warmup_steps=1, weight_decay=0.1),
                dict(method="mezo", num_directions=2, weight_decay=0.1)):
        model = mixed_model()
        engine = ZOEngine(model, mixed_sum_loss, ZOConfig(learning_rate=1e-3, zo_eps=1e-2, max_steps=4,
                                                          perturbation=perturbation, **cfg))
        for _ in range(4):
            engine.step(None)
        for name, p in sorted(model.named_parameters()):
            h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        h.update(engine.sampler.scores.numpy().tobytes())
    print(h.hexdigest())
"""


def mixed_model() -> torch.nn.Module:
    """Matrices in fp32, bf16 and fp16, 1-D bf16 tensors (an fp32 master copy under fp32_master_weights=auto), and
    tensors of odd lengths, so that rows start at every offset modulo 4."""
    gen = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    for name, shape, dtype in (("a", (7, 9), torch.float32), ("b", (5, 11), torch.bfloat16),
                               ("c", (3, 13), torch.float16), ("norm", (17,), torch.bfloat16),
                               ("bias", (6,), torch.float32), ("d", (4099,), torch.bfloat16)):
        setattr(m, name, torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype)))
    return m


def mixed_sum_loss(model, batch):
    return sum_loss(list(model.parameters()), batch)


def backend_digest(**extra: str) -> str:
    proc = subprocess.run([sys.executable, "-c", BACKEND_RUN], capture_output=True, text=True, cwd=str(ROOT),
                          env={**ENV, "CURVZO_DS_NOISE_KERNEL": "auto", **extra}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gaussian, rademacher = proc.stdout.strip().splitlines()[-2:]
    assert gaussian != rademacher
    return f"{gaussian} {rademacher}"


@pytest.fixture(scope="module")
def c_kernel_digest() -> str:
    """The C kernel's run, once for both backends compared with it."""
    return backend_digest()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_backend_gives_the_c_kernels_bits(c_kernel_digest, backend):
    """Four steps of CurvZO (statistics, weight decay) and of MeZO with q = 2 directions (snapshot, restore, the
    per-direction update) on mixed dtypes with fp32 master copies: the torch reference and the Triton kernel (under
    the interpreter) leave every weight and score exactly as the C kernel does, with Gaussian z and with +-1 z
    (perturbation=rademacher, every pass kind: the chain's moves, the keyed update, master and copy rows)."""
    extra = {"CURVZO_DS_NOISE_KERNEL": "torch"} if backend == "torch" else {"CURVZO_DS_NOISE_KERNEL": "triton",
                                                                            "TRITON_INTERPRET": "1"}
    assert backend_digest(**extra) == c_kernel_digest


def test_threads_give_the_same_bits_and_cover_every_element_once():
    """cpu_kernel.run_rows cut into 1, 2, 3 or 7 parts (threads): the same values and sums, each element once."""
    assert cpu_kernel.available()
    sizes = [1, 5, 4099, 3, 70_001, 12]
    targets = [torch.zeros(n) for n in sizes] + [torch.zeros(64, dtype=torch.bfloat16)]
    results = []
    for threads in (1, 2, 3, 7):
        outs = [t.clone() for t in targets]
        rows = np.zeros((len(outs), layout.WIDTH), dtype=np.int64)
        for i, o in enumerate(outs):  # in place: source = target
            rows[i, [layout.DST, layout.SRC, layout.N]] = o.data_ptr(), o.data_ptr(), o.numel()
            rows[i, [layout.START, layout.KEY, layout.STAT, layout.ENTRY]] = 3 + 1000 * i, 12345 + (i << 32), i, i
            rows[i, layout.KIND] = layout.kind(layout.MODES[o.dtype], layout.MODES[o.dtype])
        coef = np.tile([[1.0, 0.5]], (len(outs), 1))
        sums = cpu_kernel.run_rows(rows, coef, len(outs), True, threads)
        results.append(([o.clone() for o in outs], sums.tolist()))
        parts = cpu_kernel.split_rows(rows, coef, threads)
        assert sum(int(r[:, layout.N].sum()) for r, _ in parts) == sum(o.numel() for o in outs)
    for outs, sums in results[1:]:
        assert sums == results[0][1] and all(torch.equal(a, b) for a, b in zip(outs, results[0][0]))
    assert torch.equal(results[0][0][1], 0.5 * reference.normals(12345, 1, 1003, 5))  # row 1: key (12345, 1)


def test_offsets_beyond_2_to_the_31_on_the_meta_device(monkeypatch):
    """A 4.3e9-element tensor partitioned over K = 3 ranks, on the meta device (nothing allocated): each rank's
    owned range (ds_compat.owned_range) and the Perturber's rows of it (whole tensor and 2^31-element chunks): they
    cover the owned range contiguously, no row is longer than 2^30 elements (the GPU kernel's int32 row index) or
    crosses a chunk, and the noise at the last row's end is the definition's at that global offset."""
    import torch.distributed as dist

    from curvzo_ds.noise.gaussian import NoiseSource
    from curvzo_ds.shard.params import collect_entries, make_blocks

    rows, K = 2**20 + 3, 3
    numel = rows * 4096
    part = -(-numel // K)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.empty(0, device="meta"))
    p = module.weight
    p.ds_numel, p.ds_shape, p.ds_process_group = numel, (rows, 4096), None
    p.ds_tensor = torch.empty(part, device="meta")  # ZeRO-3's shard: ceil(numel / K) elements, last one padded
    owned = []
    for rank in range(K):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        [e] = collect_entries(module, replicated_rank=rank, fp32_master=False)
        assert e.numel == numel and e.region == e.owned
        owned.append(e.owned)
        for granularity in ("tensor", "chunk"):
            blocks = make_blocks([e], granularity, 2**31)
            perturber = perturb.Perturber([e], blocks, NoiseSource(3), torch.device("cpu"))
            perturber.begin(0, torch.ones(len(blocks), dtype=torch.bool))
            [selected] = perturber._selected
            starts = selected.rows[:, perturb.START]
            ends = starts + selected.rows[:, perturb.N]
            assert starts[0] == e.owned[0] and ends[-1] == e.owned[1]
            assert (starts[1:] == ends[:-1]).all() and (selected.rows[:, perturb.N] <= row_table.ROW_LIMIT).all()
            assert (selected.rows[:, perturb.STAT] >= 0).all()  # the shard is the owned copy
            if granularity == "chunk":  # no row crosses a chunk edge; blocks are numbered from the tensor's start
                assert ((starts // 2**31) == ((ends - 1) // 2**31)).all()
                assert ((starts // 2**31) == selected.group.block[selected.index]).all()
    assert owned == [(r * part, min((r + 1) * part, numel)) for r in range(K)] and owned[-1][1] == numel
    assert owned[-1][0] > 2**31 and numel > 2**32
    src, start = NoiseSource(3), int(ends[-1]) - 1000
    z = src.slice(0, "weight", numel, start, 1000)
    assert torch.equal(z, reference.normals(*src.key(0, "weight"), start, 1000))


NO_SUMS = r"""
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from curvzo_ds.noise import gpu
seen = []
real = gpu.launch
gpu.launch = lambda *args, **kwargs: seen.append(args[6]) or real(*args, **kwargs)  # args[6]: the sums tensor
out = torch.zeros(100)
print(gpu.run(1, 1, 0, out, 1, 1.0, 0.5, want_sq=False), seen[-1])
total = gpu.run(1, 1, 0, out, 1, 1.0, 0.5, want_sq=True)
print(seen[-1].dtype, seen[-1].shape, int(total) > 0)
"""


def test_no_statistics_work_or_allocation_when_none_are_wanted():
    """The Triton path allocates the int64 sums and compiles the statistics in only when they are asked for (the
    old kernel allocated and summed a partials tensor on every call)."""
    proc = subprocess.run([sys.executable, "-c", NO_SUMS], capture_output=True, text=True, cwd=str(ROOT),
                          env={**ENV, "TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2:] == ["None None", "torch.int64 torch.Size([1]) True"]


def test_keys_equal_the_one_at_a_time_definition():
    from curvzo_ds.noise.gaussian import NoiseSource

    src = NoiseSource(2**40 + 7)
    names = ["model.embed_tokens.weight", "x", "é.weight"]
    for direction in (0, 5):
        keys = src.keys(123, names, direction)
        assert [int(k) for k in keys] == [k1 << 32 | k0 for k0, k1 in (src.key(123, n, direction) for n in names)]


@pytest.mark.parametrize("difference,q,expected", [("central", 1, 3), ("rloo", 4, 5), ("rloo", 8, 9),
                                                   ("central", 3, 7)])
def test_a_step_reads_its_weights_q_plus_one_times(difference, q, expected):
    """The passes over the weights of one step, counted by the Perturber: MeZO 3 (+eps, -2 eps, update); RLOO with q
    directions q + 1 (the first point, q - 1 moves, the update); central with q, 2q + 1. fp32 weights: no copy."""
    engine = ZOEngine(tiny_params(6), sum_loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-3,
                                                         num_directions=q, difference=difference))
    engine.step(None)
    assert engine.perturber.step_passes == expected
    assert len(engine.perturber.step_launches) == expected
    assert engine.perturber._copies == {}


def test_bf16_rows_of_a_several_direction_step_are_written_from_one_copy():
    """bf16 weights edited in place (no fp32 master): with q > 1 the step copies them once (one more pass), writes
    every point from the copy, and drops the copy with the update; with an fp32 master copy, nothing is copied."""
    for master, copies, passes in ((False, 1, 6), (True, 0, 6)):
        engine = ZOEngine(tiny_params(6, (torch.bfloat16,)), sum_loss,
                          ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-2, num_directions=4,
                                   difference="rloo", fp32_master_weights=master))
        held = []
        p, real = engine.perturber, engine.perturber.update
        p.update = lambda *a, p=p, real=real, held=held, **k: held.append(dict(p._copies)) or real(*a, **k)
        engine.step(None)
        assert len(held[0]) == copies and engine.perturber._copies == {}
        if copies:
            (copy,) = held[0].values()
            assert copy.group.src_base.dtype == torch.bfloat16 and copy.group.src_base.numel() == 6 * 8
        assert engine.perturber.step_passes == passes  # copy + 4 points + update; master: 4 points, update, copies


def test_a_move_is_one_pass_of_two_keys_and_bf16_points_are_exact():
    """A move from w + a z_0 to w + b z_1 leaves fp32 weights at w + (-a z_0 + b z_1), each product and the sum
    rounded once in float32 (the kernels' keyed rows); bf16 weights of a several-direction step are at
    bf16(w + b z_1) exactly, as from w (their copy). Checked against the torch reference's draws."""
    from curvzo_ds.noise.gaussian import NoiseSource, f32

    for dtype in (torch.float32, torch.bfloat16):
        params = tiny_params(3, (dtype,))
        w = [p.detach().clone() for p in params]
        engine = ZOEngine(params, sum_loss, ZOConfig(method="mezo", learning_rate=1e-3, zo_eps=1e-2,
                                                     num_directions=2, difference="rloo",
                                                     fp32_master_weights=False))
        p = engine.perturber
        p.begin(0, torch.ones(3, dtype=torch.bool), 2)
        a, b = 1e-2, -1e-2
        p.move(None, (0, a))
        p.move((0, a), (1, b))
        src = NoiseSource(engine.cfg.seed)
        for e, start in zip(engine.entries, w):
            z0, z1 = (reference.normals(*src.key(0, e.name, d), 0, e.numel) for d in (0, 1))
            if dtype == torch.float32:
                once = start.view(-1) + f32(a) * z0
                expected = once + (f32(-a) * z0 + f32(b) * z1)
            else:
                expected = (start.view(-1).float() + f32(b) * z1).to(torch.bfloat16)
            assert torch.equal(e.param.detach().view(-1), expected), (dtype, e.name)
