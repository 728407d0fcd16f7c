#!/usr/bin/env bash
# Set up (if needed) and run the built-in demo: a tiny Llama on the bundled demo task,
# 2 CPU ranks under ZeRO-3, a few hundred CurvZO steps. Extra arguments go to `curvzo-ds train`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import curvzo_ds, deepspeed" 2>/dev/null; then
    python -m pip install -q torch==2.13.0          # the CPU wheel; an unpinned torch pulls CUDA
    python -m pip install -q -e ".[test]"
fi
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS=1
exec torchrun --nproc_per_node "${NPROC:-2}" -m curvzo_ds.cli train --deepspeed ds_configs/zero3.json "$@"
