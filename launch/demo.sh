#!/usr/bin/env bash
# Set up (if needed) and run the built-in demo: a tiny Llama on the bundled demo task,
# 2 CPU ranks under ZeRO-3, a few hundred steps of the paper's CurvZO. Extra arguments go to `curvzo-ds train`
# (a later --set wins: `bash launch/demo.sh --set method=mezo` runs the library's default method instead).
# The demo runs method=curvzo on purpose, though the library's default is mezo (README, "Which method"): on this
# tiny model the paper's method beats MeZO, and the demo shows its mechanism (pi, the budget, the scores) at work.
set -euo pipefail
cd "$(dirname "$0")/.."
# Installed means: the project's distribution is there (the source tree alone also imports) with its test extras.
if ! python -c "import importlib.metadata as m; m.version('curvzo_ds'); import deepspeed, peft, pytest" 2>/dev/null; then
    python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu  # PyPI's pulls CUDA
    python -m pip install -q -e ".[test]"
fi
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS=1
source launch/preempt.bash  # exit code 3: stopped on a signal after a checkpoint
preflight --world NPROC --deepspeed ds_configs/zero3.json --set method=curvzo --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
run_job torchrun --nproc_per_node "${NPROC:-2}" --master_port "${MASTER_PORT:-29500}" -m curvzo_ds.cli train --deepspeed ds_configs/zero3.json --set method=curvzo --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
