"""Instructions per element of the GPU noise kernel, read from its compiled code: no GPU needed (triton compiles
for a CUDA target on any machine, and nvdisasm from triton's own tools prints the SASS).

    python tools/kernel_sass.py                      # this tree's kernel (curvzo_ds/noise/gpu.py), sm_90
    python tools/kernel_sass.py --old FILE.py        # a previous version's gpu.py (e.g. git show e2c42e6:...)

For each variant it prints the SASS instruction count of the kernel and, since the kernel has no loop over
elements, instructions per element = count / elements per thread (4 * BLOCK * SUB / threads per program). The
binary search's loop runs ~log2(rows) times per program, which adds a few instructions per 16,384 elements.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

WARPS = 4
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def sass_count(fn, signature: dict, constexprs: dict, capability: int) -> tuple[int, str]:
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"enable_fp_fusion": False, "num_warps": WARPS})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # nvdisasm ourselves: asm["sass"] stops at 4096 lines
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    # one instruction per line ending in ';' (nvdisasm's "control-code<TAB>OPCODE operands;" or "/*addr*/ OPCODE ...")
    instructions = [line for line in sass.splitlines() if line.rstrip().endswith(";")
                    and re.search(r"(^|\t|\*/\s+)@?!?[A-Z][A-Z0-9_.]*", line)]
    return len(instructions), sass


def new_kernel(capability: int) -> list[dict]:
    sys.path.insert(0, ".")
    from curvzo_ds.noise import gpu
    from curvzo_ds.noise.rows import ElementMode

    out = []
    per_thread = 4 * gpu.BLOCK * gpu.SUB / (32 * WARPS)
    bf16, fp32 = int(ElementMode.BFLOAT16), int(ElementMode.FLOAT32)
    for name, dst, src, ptr_d, ptr_s, stats in (("bf16 in place", bf16, bf16, "*i16", "*i16", False),
                                                ("bf16 in place + stats", bf16, bf16, "*i16", "*i16", True),
                                                ("fp32 master -> bf16", bf16, fp32, "*i16", "*fp32", False),
                                                ("fp32 in place", fp32, fp32, "*fp32", "*fp32", False)):
        sig = {"dst_base": ptr_d, "src_base": ptr_s, "rows": "*i64", "prefix": "*i64", "coef": "*fp32",
               "sums": "*i64", "n_rows": "i64", "DST": "constexpr", "SRC": "constexpr", "INPLACE": "constexpr",
               "COPY": "constexpr", "STATS": "constexpr", "RZ": "constexpr", "BLOCK": "constexpr", "SUB": "constexpr"}
        consts = {"DST": dst, "SRC": src, "INPLACE": ptr_d == ptr_s, "COPY": False, "STATS": stats, "RZ": True,
                  "BLOCK": gpu.BLOCK, "SUB": gpu.SUB}
        count, _ = sass_count(gpu._rows_kernel, sig, consts, capability)
        out.append({"kernel": f"new: {name}", "sass_instructions": count, "elements_per_thread": per_thread,
                    "instructions_per_element": count / per_thread})
    return out


def old_kernel(path: str, capability: int) -> list[dict]:
    source = open(path).read().replace("from . import reference as R", "from curvzo_ds.noise import reference as R")
    spec = importlib.util.spec_from_loader("old_gpu", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, ".")
    with open("/tmp/_old_gpu_kernel.py", "w") as f:  # triton reads the source of the function from its file
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_gpu", "/tmp/_old_gpu_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = []
    per_thread = 4 * module.BLOCK / (32 * WARPS)
    for name, mode, ptr in (("bf16 (sums always)", 2, "*i16"), ("fp32 (sums always)", 1, "*fp32")):
        sig = {"out_ptr": ptr, "partial_ptr": "*i64", "k0": "i32", "k1": "i32", "g0": "i64", "start": "i64",
               "n": "i32", "scale": "fp32", "alpha": "fp32", "MODE": "constexpr", "BLOCK": "constexpr"}
        count, _ = sass_count(module._noise_kernel, sig, {"MODE": mode, "BLOCK": module.BLOCK}, capability)
        out.append({"kernel": f"old: {name}", "sass_instructions": count, "elements_per_thread": per_thread,
                    "instructions_per_element": count / per_thread})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a previous gpu.py to compare (its _noise_kernel)")
    ap.add_argument("--capability", type=int, default=90)
    args = ap.parse_args()
    rows = old_kernel(args.old, args.capability) if args.old else []
    rows += new_kernel(args.capability)
    print(f"triton {triton.__version__}, sm_{args.capability}, {WARPS} warps per program")
    for r in rows:
        print(f"{r['kernel']:32s} {r['sass_instructions']:6d} SASS instructions, {r['elements_per_thread']:.0f} "
              f"elements per thread: {r['instructions_per_element']:.1f} per element")


if __name__ == "__main__":
    main()
