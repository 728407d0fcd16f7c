#!/usr/bin/env bash
# The first-GPU-run command (benchmarks/RESULTS.md gives the exact call): on a lent GPU machine, in the repository
# root, with the wheels of tools/gpu_wheels.sh in .whl/. Under 8 minutes on an H100. Each result is written to $OUT
# as soon as it exists, so a command killed at its limit keeps what it measured:
#   env.txt          the machine, the driver and the library versions
#   pytest-gpu.txt   the tests marked `gpu` (CUDA: launch counts, no host sync, Triton against the CPU kernel)
#   demo-*.json*     the demo through `python -m curvzo_ds.cli train` on cuda:0 under ZeRO-3, 20 steps
#   layouts.jsonl    benchmarks/gpu.py --layouts-only, one process per model (issue 39): two plain forwards, MeZO's
#                    algorithm (mezo_reference) and our step under stage 0 (the default) and ZeRO-3, interleaved
#                    rounds; a line per round as it ends, then `step_over_mezo_reference` per layout
#   demo-auto-*.json the same demo with the default layout (zero_stage: auto: stage 0 here), and
#   accelerate-*.json through `accelerate launch` with ds_configs/accelerate_gpu.yaml: all three digests printed
#   results.jsonl    benchmarks/gpu.py: noise parity (edge keys and starts), offloaded noise at 1-16 threads, then
#                    Llama-2-7B and 13B in bf16, each in its own process
#   kernel.txt       with STAGES containing ncu: the kernel's time per pass and Nsight Compute's instruction counts
#   log.txt          everything printed
# STAGES (default "env layouts demo bench tests"; add ncu for Nsight Compute) picks stages; MODELS (default "llama2-7b llama2-13b") the models; BENCH_ARGS
# go to benchmarks/gpu.py (e.g. --offload: also offload_param cpu, slower).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-env layouts demo bench tests}
unset DS_ACCELERATOR  # a CPU-only setting must never reach the GPU run
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_run: installing the carried wheels failed"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
stage() { echo "=== $(date -u +%H:%M:%S) $*"; }

if [[ " $STAGES " == *" env "* ]]; then
    stage env
    { nvidia-smi; uname -a; python3 --version; grep -m1 "model name" /proc/cpuinfo; grep -o -m1 'avx512f' /proc/cpuinfo;
      python3 -m pip list 2>/dev/null | grep -iE '^(torch|triton|deepspeed|transformers|accelerate|peft|pydantic|safetensors|tokenizers) ';
      gcc --version | head -1; } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
fi
if [[ " $STAGES " == *" demo "* ]]; then
    stage "demo: curvzo-ds train on cuda:0 under ZeRO-3, 20 steps"
    rm -rf /tmp/demo-gpu
    start=$(date +%s)
    timeout 180 python3 -m curvzo_ds.cli train --deepspeed ds_configs/zero3.json --set max_steps=20 \
        --set output_dir=/tmp/demo-gpu --set eval_steps=10 --set save_steps=20
    echo "demo exit: $? after $(( $(date +%s) - start )) s"
    cp /tmp/demo-gpu/summary.json "$OUT/demo-summary.json" 2>/dev/null
    cp /tmp/demo-gpu/metrics.jsonl "$OUT/demo-metrics.jsonl" 2>/dev/null
fi
if [[ " $STAGES " == *" layouts "* ]]; then
    for model in ${MODELS:-llama2-7b llama2-13b}; do
        stage "layouts: $model (plain forward, mezo_reference, our step at stage 0 and ZeRO-3)"
        timeout 200 python3 benchmarks/gpu.py --models "$model" --skip-parity --layouts-only --rounds 5 \
            --out "$OUT/layouts.jsonl"
        echo "layouts $model exit: $?"
    done
fi
if [[ " $STAGES " == *" demo "* ]]; then
    stage "demo: the default layout (auto), and accelerate launch with ds_configs/accelerate_gpu.yaml"
    rm -rf /tmp/demo-auto /tmp/demo-acc
    timeout 150 python3 -m curvzo_ds.cli train --set max_steps=20 --set output_dir=/tmp/demo-auto --set eval_steps=10 \
        --set save_steps=20
    echo "demo auto exit: $?"
    cp /tmp/demo-auto/summary.json "$OUT/demo-auto-summary.json" 2>/dev/null
    timeout 150 accelerate launch --config_file ds_configs/accelerate_gpu.yaml --num_processes 1 -m curvzo_ds.cli \
        train --set max_steps=20 --set output_dir=/tmp/demo-acc --set eval_steps=10 --set save_steps=20
    echo "demo accelerate exit: $?"
    cp /tmp/demo-acc/summary.json "$OUT/accelerate-summary.json" 2>/dev/null
    for f in demo-summary demo-auto-summary accelerate-summary; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['params_digest'], \
d.get('layout'))" "$OUT/$f.json" 2>/dev/null || echo "$f: no summary"
    done | tee "$OUT/digests.txt"
fi
if [[ " $STAGES " == *" bench "* ]]; then
    # each model in its own process, so that one model's memory never inflates the next one's peak
    stage "bench: noise parity, offloaded noise threads"
    timeout 120 python3 benchmarks/gpu.py --models "" --noise-threads --out "$OUT/results.jsonl"
    echo "parity exit: $?"
    for model in ${MODELS:-llama2-7b llama2-13b}; do
        stage "bench: $model"
        # shellcheck disable=SC2086
        timeout 240 python3 benchmarks/gpu.py --models "$model" --skip-parity --out "$OUT/results.jsonl" ${BENCH_ARGS:-}
        echo "$model exit: $?"
    done
fi
if [[ " $STAGES " == *" tests "* ]]; then
    stage "tests (pytest -m gpu)"
    timeout 140 python3 -m pytest -m gpu -p no:cacheprovider -q tests 2>&1 | tee "$OUT/pytest-gpu.txt"
    echo "pytest -m gpu exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest-gpu.txt"
fi
if [[ " $STAGES " == *" ncu "* ]]; then
    stage "ncu: dynamic instructions per element of the noise kernel"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 150 python3 tools/kernel_profile.py 2>&1 | tee "$OUT/kernel.txt"
    [ -n "$NCU" ] && timeout 200 "$NCU" --kernel-name regex:_rows_kernel --launch-skip 0 --launch-count 2 \
        --metrics smsp__thread_inst_executed.sum,smsp__inst_executed.sum,gpu__time_duration.sum \
        python3 tools/kernel_profile.py 2>&1 | tee -a "$OUT/kernel.txt"
fi
stage done
