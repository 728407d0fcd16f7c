"""One perturb pass of the Perturber over bf16 tensors on a GPU: the noise kernel's time per element, for Nsight
Compute's instruction counts, and a sweep of its launch shape.

    python3 tools/kernel_profile.py                  # time per pass, without and with the block statistics
    python3 tools/kernel_profile.py --perturbation rademacher   # the +-1 path (issue 58), against the same floor
    python3 tools/kernel_profile.py --sweep          # the same for several (BLOCK, SUB, warps), bits checked
    ncu --kernel-name regex:_rows_kernel --metrics smsp__thread_inst_executed.sum,gpu__time_duration.sum \\
        python3 tools/kernel_profile.py              # tools/gpu_run.sh's `ncu` stage

Each shape's line ends with the floor arm: a plain `torch.add_` over the same tensors (each element read and written
once, the bytes of an in-place pass) and the pass's throughput as a fraction of it (issue 58's target for +-1: >= 70%).
It prints the elements each launch covers; Nsight Compute's thread instructions / elements is the dynamic count
benchmarks/RESULTS.md records next to the static one of tools/kernel_sass.py.
"""

import argparse
import sys

import torch

sys.path.insert(0, ".")
from curvzo_ds.noise import gpu  # noqa: E402
from curvzo_ds.noise.gaussian import NoiseSource  # noqa: E402
from curvzo_ds.shard.params import collect_entries, make_blocks  # noqa: E402
from curvzo_ds.shard.perturb import Perturber  # noqa: E402

NUMEL, TENSORS = 1 << 26, 16


def perturber(perturbation: str = "gaussian"):
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(NUMEL // TENSORS // 1024, 1024, device="cuda",
                                                                   generator=gen).to(torch.bfloat16))
                                    for _ in range(TENSORS)])
    entries = collect_entries(model, replicated_rank=0, fp32_master=False)
    p = Perturber(entries, make_blocks(entries, "tensor", 0), NoiseSource(0, perturbation), torch.device("cuda"))
    p.begin(0, torch.ones(TENSORS, dtype=torch.bool))
    return p, model


def time_passes(p, stats: bool, repeat: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        p.perturb(1e-3, -1e-3, stats=stats)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def time_floor(model, repeat: int = 10) -> float:
    """The floor arm: one torch.add_ of a scalar over every tensor, per pass (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        start.record()
        for r in range(repeat):
            for t in model:
                t.add_((-1.0) ** r * 1e-3)
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--perturbation", choices=["gaussian", "rademacher"], default="gaussian")
    args = ap.parse_args()
    shapes = [(gpu.BLOCK, gpu.SUB, gpu.WARPS)]
    if args.sweep:
        shapes += [(512, 8, 4), (1024, 4, 8), (512, 8, 8), (2048, 2, 8), (256, 16, 2), (256, 16, 4), (512, 4, 4),
                   (1024, 1, 4), (128, 32, 1)]
    print(f"elements per launch: {NUMEL} ({TENSORS} bf16 tensors); launch 1 without statistics, 2 with")
    reference = None
    for block, sub, warps in shapes:
        gpu.BLOCK, gpu.SUB, gpu.WARPS = block, sub, warps
        p, model = perturber(args.perturbation)
        sums = p.perturb(0.0, 1e-3, stats=True)  # compiles; the values are checked against the first shape's
        torch.cuda.synchronize()
        result = (torch.cat([t.detach().view(-1)[:4096].float() for t in model]).cpu(), sums.cpu())
        same = reference is None or (torch.equal(result[0], reference[0]) and torch.equal(result[1], reference[1]))
        reference = reference or result
        p.perturb(1e-3, -1e-3)
        ms = {stats: time_passes(p, stats) for stats in (False, True)}
        floor = time_floor(model)
        print(f"BLOCK {block:5d} SUB {sub:3d} warps {warps}: {ms[False]:.3f} ms per pass "
              f"({NUMEL / ms[False] / 1e6:.1f} G elements/s), with statistics {ms[True]:.3f} ms; "
              f"bits {'equal' if same else 'DIFFER'}; floor (torch.add_) {floor:.3f} ms, pass at "
              f"{floor / ms[False]:.0%} of the floor's throughput ({args.perturbation})", flush=True)
        del p, model


if __name__ == "__main__":
    main()
