#!/usr/bin/env bash
# Prepare, on a machine with pip and a network, the wheels that the lent GPU machine lacks (it has no network):
# DeepSpeed (pure Python, built here with `pip wheel --no-deps`: the registry has no 0.19.8 wheel), pydantic and
# its needs for CPython 3.12, and hjson. They go to .whl/ (ignored by git, about 5 MB); tools/gpu_run.sh installs
# them there into /tmp/site. The GPU image already has torch, triton, transformers, accelerate, peft, numpy,
# msgpack, ninja, psutil and py-cpuinfo (the device tool's KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    typing-extensions==4.15.0 hjson==3.1.0
ls -l .whl
