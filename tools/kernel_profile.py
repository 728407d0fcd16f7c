"""One perturb pass of the Perturber over bf16 tensors on a GPU, for Nsight Compute: dynamic instructions per element
of the noise kernel, and its time per element.

    ncu --kernel-name regex:_rows_kernel --metrics smsp__thread_inst_executed.sum,gpu__time_duration.sum \\
        python3 tools/kernel_profile.py                 # tools/gpu_run.sh's `ncu` stage

It prints the elements each launch covers; thread instructions / elements is the figure benchmarks/RESULTS.md
records next to the static count of tools/kernel_sass.py. Without ncu it prints the passes' times (CUDA events).
"""

import sys

import torch

sys.path.insert(0, ".")
from curvzo_ds.noise import NoiseSource  # noqa: E402
from curvzo_ds.params import collect_entries, make_blocks  # noqa: E402
from curvzo_ds.perturb import Perturber  # noqa: E402


def main() -> None:
    numel, tensors = 1 << 26, 16
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel // tensors // 1024, 1024, device="cuda")
                                                       .to(torch.bfloat16)) for _ in range(tensors)])
    entries = collect_entries(model, replicated_rank=0, fp32_master=False)
    perturber = Perturber(entries, make_blocks(entries, "tensor", 0), NoiseSource(0), torch.device("cuda"))
    perturber.begin(0, torch.ones(tensors, dtype=torch.bool))
    perturber.perturb(0.0, 1e-3)  # compiles
    perturber.perturb(0.0, 1e-3, stats=True)
    torch.cuda.synchronize()
    print(f"elements per launch: {numel} ({tensors} bf16 tensors); launch 1 without statistics, 2 with")
    for stats in (False, True):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            perturber.perturb(1e-3, -1e-3, stats=stats)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"statistics {stats}: {ms:.3f} ms per pass, {numel / ms / 1e6:.1f} G elements/s")


if __name__ == "__main__":
    main()
