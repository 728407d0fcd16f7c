#!/usr/bin/env bash
# Issue 57's SmolLM2 cells (python -m experiments.horizon --config smollm) on a lent GPU, in two calls of the device
# tool, because the model (the GGUF of experiments/smollm.py, 98 MB, 90 MB as xz) is larger than one call may carry.
# Here, first (once): `bash tools/gpu_wheels.sh; bash tools/gpu_horizon.sh pack` writes .gpu/ (ignored by git): the
# xz'd GGUF in two parts, the gguf and transformers wheels (the version CI tests), the converted weights' digest.
# Then, on the device machine, back to back (it stays warm 30 s between calls; /tmp survives while it does):
#   1. carry [".whl", ".gpu/part1", ".gpu/wheels"]: `bash tools/gpu_horizon.sh stash`  keeps part 1, installs the
#      wheels, and runs the `ci` config on cuda (a smoke test that also fills Triton's cache)
#   2. carry [".gpu/part2", ".gpu/digest"]: `SECONDS_LEFT=560 bash tools/gpu_horizon.sh run`  rebuilds the GGUF,
#      checks its sha256 and the converted weights' digest, then runs WORKERS workers (default 10) on the one GPU
#      until the plan is done or the time is up: the decision arms first (mezo, std-auto-plateau,
#      rms-auto-plateau), then the rest (preset-fixed, the LoRA cell), skipping the runs committed in
#      experiments/results/horizon-smollm/runs/ (they travel with the tree). Every run is cached as on the CPU
#      (experiments/horizon.py); $OUT/runs.tar holds the finished runs and progress.log, refreshed every 15 s, so a
#      call stopped at its limit keeps them. Here: `tar -xf runs.tar -C /tmp/g`, copy /tmp/g/runs/*.json to
#      experiments/results/horizon-smollm/runs/ and append /tmp/g/progress.log (marked as the GPU's) to its log.
# Sizes: call 1 carries 64.2 MB with the tree (the limit is 64 MiB = 67.1 MB), call 2 60.1 MB. On 2026-11-30 the
# start and call 1 took 101 s of device time, call 2 576 s (10 runs; benchmarks/RESULTS.md has the throughput).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
CACHE=/tmp/gpu-cache
RUNS=/tmp/gpu-horizon
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
unset DS_ACCELERATOR
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "${1:-}" in
pack)
    rm -rf .gpu/part1 .gpu/part2 && mkdir -p .gpu/wheels .gpu/part1 .gpu/part2
    src=${SRC:-$HOME/.cache/curvzo_ds/real_model}
    [ -s .gpu/gguf.xz ] || xz -9e -T2 -c "$src/$GGUF" > .gpu/gguf.xz
    head -c 38000000 .gpu/gguf.xz > .gpu/part1/part0 && tail -c +38000001 .gpu/gguf.xz > .gpu/part2/part1
    python -m pip download -q --no-deps gguf==0.19.0 transformers==5.24.0 -d .gpu/wheels
    python - "$src" > .gpu/digest <<'EOF'
import hashlib, os, sys
from safetensors.torch import load_file
folder = [os.path.join(sys.argv[1], d) for d in os.listdir(sys.argv[1]) if d.startswith("smollm2-135m-")][0]
sd = load_file(os.path.join(folder, "model.safetensors"))
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].contiguous().numpy().tobytes())
print(h.hexdigest())
EOF
    du -ab .gpu
    ;;
stash)
    mkdir -p /tmp/gpu && cp .gpu/part1/* /tmp/gpu/ && ls -l /tmp/gpu | tee "$OUT/stash.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .gpu/wheels/*.whl || { echo "installing the carried wheels failed"; exit 1; }
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 --version;
      python3 -c "import torch, transformers, deepspeed, peft, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__, 'triton', triton.__version__)"
    } 2>&1 | grep -v Warning | tee -a "$OUT/stash.txt"
    start=$(date +%s)
    timeout 200 python3 -m experiments.horizon --config ci --work --device "${DEVICE:-cuda}" \
        --arms mezo std-auto-plateau --out /tmp/ci-out \
        --cache /tmp/ci-cache > "$OUT/smoke.txt" 2>&1
    echo "smoke (ci config on cuda): exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/stash.txt"
    tail -25 "$OUT/smoke.txt"
    python3 -c "import json,glob; [print(json.load(open(f)).get('device'), json.load(open(f))['settings']['arm'],
(json.load(open(f))['curve'] or [{'loss': 'refused'}])[-1].get('loss')) for f in glob.glob('/tmp/ci-out/runs/*.json')]" | tee -a "$OUT/stash.txt"
    ;;
run)
    t0=$(date +%s)
    left=${SECONDS_LEFT:-560}
    mkdir -p "$CACHE" "$RUNS"
    cat /tmp/gpu/part0 .gpu/part2/part1 | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(
sys.stdin.buffer.read()))" > "$CACHE/$GGUF" || { echo "the GGUF could not be rebuilt (part 1 lost?)"; exit 3; }
    python3 - "$CACHE" "$(cat .gpu/digest)" <<'EOF' 2>&1 | grep -v -i warn | tee "$OUT/convert.txt"
import hashlib, os, sys, time
from safetensors.torch import load_file
from experiments import smollm
from experiments.core import Log
start = time.time()
path = smollm.convert(smollm.fetch_gguf(sys.argv[1], print), sys.argv[1], print)
sd = load_file(os.path.join(path, "model.safetensors"))
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].contiguous().numpy().tobytes())
same = h.hexdigest() == sys.argv[2]
print(f"converted in {time.time() - start:.0f} s; weights digest {h.hexdigest()[:16]}: "
      f"{'the same as on the CPU' if same else 'DIFFERS from the CPU conversion ' + sys.argv[2][:16]}")
sys.exit(0 if same else 4)
EOF
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "no runs: the model is not the CPU's (see above)"; exit 4; }
    snapshot() { tar -cf "$OUT/runs.tmp" -C "$RUNS" runs progress.log gpu.log workers 2>/dev/null
                 mv "$OUT/runs.tmp" "$OUT/runs.tar"; }
    mkdir -p "$RUNS/workers" "$RUNS/runs"
    cp experiments/results/horizon-smollm/runs/*.json "$RUNS/runs/" 2>/dev/null  # the committed runs: not rerun
    before=$(ls "$RUNS/runs" | wc -l)
    echo "runs already cached: $before" | tee -a "$OUT/convert.txt"
    (trap 'exit 0' TERM; while sleep 15; do nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader \
        >> "$RUNS/gpu.log" 2>&1; snapshot; done) &
    loop=$!
    deadline=$(( t0 + left ))
    worker() {  # the decision arms first, then whatever the plan still lists
        local budget=$(( deadline - $(date +%s) ))
        [ $budget -gt 30 ] && timeout -k 10 $budget python3 -m experiments.horizon --config smollm --work --device "${DEVICE:-cuda}" \
            --out "$RUNS" --cache "$CACHE" --arms mezo std-auto-plateau rms-auto-plateau >> "$RUNS/workers/$1" 2>&1
        budget=$(( deadline - $(date +%s) ))
        [ $budget -gt 30 ] && timeout -k 10 $budget python3 -m experiments.horizon --config smollm --work --device "${DEVICE:-cuda}" \
            --out "$RUNS" --cache "$CACHE" >> "$RUNS/workers/$1" 2>&1
    }
    for i in $(seq "${WORKERS:-10}"); do worker "$i" & sleep 2; done
    while [ "$(jobs -rp | wc -l)" -gt 1 ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    sleep 3
    kill $loop 2>/dev/null; wait $loop 2>/dev/null  # its tar done before the last one starts
    snapshot
    echo "runs finished here: $(( $(ls "$RUNS/runs" | wc -l) - before )) after $(( $(date +%s) - t0 )) s" \
        | tee -a "$OUT/convert.txt"
    grep -h -i -m3 "error\|traceback" "$RUNS"/workers/* | head -20
    tail -60 "$RUNS/progress.log" 2>/dev/null
    ;;
*)
    echo "usage: tools/gpu_horizon.sh pack|stash|run" >&2; exit 2 ;;
esac
