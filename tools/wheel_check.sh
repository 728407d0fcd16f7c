#!/usr/bin/env bash
# The package as a new user gets it (.ci/run calls this before the tests): build the wheel from the repository's
# files, install it non-editable in a fresh venv, and from a directory outside the repository run `curvzo-ds --help`
# and the default job (the built-in demo, 2 CPU ranks under ZeRO-3, shortened), then check its summary.json.
# An editable install reads the source tree and hides package data missing from the wheel; this does not.
# Last, README.md's CPU install line, as written, in a venv of its own (it downloads the dependencies): it must
# install torch's CPU wheel and no CUDA package, and give a working `curvzo-ds`.
#   bash tools/wheel_check.sh            # MAX_STEPS=4 by default
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The dependencies, as tools/test.sh installs them (torch first: the CPU wheel; PyPI's Linux wheel pulls CUDA).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
python -c "import deepspeed, transformers, accelerate, peft" 2>/dev/null || python -m pip install -q -e ".[test]"

# Build from a copy of what a clone holds (tracked and new files): no stale build/ in the tree goes into the wheel,
# and the tree is left as it was.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null \
    | tar -C "$work/src" -xf -
python -m pip wheel -q --no-deps "$work/src" -w "$work/dist"
wheel=$(ls "$work"/dist/curvzo_ds-*.whl)

# --system-site-packages: torch, deepspeed and the rest come from this Python, nothing is downloaded (the check below
# compares them with the wheel's requirements). curvzo_ds is installed editable there too, so the check also makes
# sure the venv's copy is the one imported. --without-pip: no older pip or setuptools of the venv's own shadows
# this Python's (DeepSpeed builds its CPU ops with setuptools); this Python's pip installs into the venv.
python -m venv --system-site-packages --without-pip "$work/venv"
py="$work/venv/bin/python"
python -m pip --python "$py" install -q --no-deps --force-reinstall "$wheel"

# DeepSpeed's CPU op as this Python built it (the venv runs the same torch and DeepSpeed): building it again for the
# venv took 60-75 s of CI and checks DeepSpeed's JIT build, not the wheel.
ops=$(python -c "from curvzo_ds.startup import extensions_dir; print(extensions_dir())")
cd "$work"  # outside the repository; nothing points back into it
unset PYTHONPATH
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 CURVZO_DS_CACHE="$work/cache" TORCH_EXTENSIONS_DIR="$ops"
"$py" - "$repo" "$wheel" <<'EOF'
import subprocess, sys, sysconfig, zipfile
from importlib import metadata

from packaging.requirements import Requirement

import curvzo_ds
from curvzo_ds.noise import cpu

repo, wheel = sys.argv[1], sys.argv[2]
site = sysconfig.get_paths()["purelib"]
assert curvzo_ds.__file__.startswith(site + "/"), f"curvzo_ds imported from {curvzo_ds.__file__}, not from {site}"
tracked = subprocess.run(["git", "-C", repo, "ls-files", "curvzo_ds"], capture_output=True, text=True, check=True)
shipped = set(zipfile.ZipFile(wheel).namelist())
missing = [name for name in tracked.stdout.split() if name not in shipped]
assert not missing, f"the wheel leaves out {missing}: add them to setup.cfg's package_data"
assert cpu.available(), "the CPU noise kernel does not build from the installed philox.c"
for line in metadata.requires("curvzo_ds"):
    req = Requirement(line)
    if req.marker is None:  # the extras' requirements carry a marker
        have = metadata.version(req.name)
        assert req.specifier.contains(have, prereleases=True), f"the wheel requires {req}; installed: {have}"
print(f"wheel_check: curvzo_ds {curvzo_ds.__version__} from {site}, {len(shipped)} files in the wheel")
EOF
"$work/venv/bin/curvzo-ds" --help >/dev/null
"$work/venv/bin/curvzo-ds" train --help | grep -q "max_steps"

port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$py" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" -m curvzo_ds.cli train \
    --set max_steps="${MAX_STEPS:-4}" --set output_dir="$work/run" > "$work/job.log" 2>&1 \
    || { tail -n 40 "$work/job.log"; echo "wheel_check: the default job failed" >&2; exit 1; }
"$py" "$repo/tests/check_run.py" "$work/run"
"$py" - "$work/run" "${MAX_STEPS:-4}" <<'EOF'
import json, os, sys

run, steps = sys.argv[1], int(sys.argv[2])
summary = json.load(open(os.path.join(run, "summary.json")))
assert (summary["world_size"], summary["steps"]) == (2, steps), summary
assert summary["device_names"] == ["cpu", "cpu"] and summary["versions"]["curvzo_ds"], summary
assert sorted(os.listdir(os.path.join(run, "logs"))) == ["rank-00000.log", "rank-00001.log"]
assert "[rank 1] INFO" in open(os.path.join(run, "logs", "rank-00001.log")).read()  # left out of the console
print(f"wheel_check: the default job ran {steps} steps on 2 ranks; digest {summary['params_digest']}")
EOF

# README.md's CPU line, exactly as written (the line that names PyTorch's CPU index), run in a copy of the clone with
# a fresh venv's pip first on PATH. Only pip's patience is set here: an index that cannot be reached fails over in
# seconds to the machine's other sources (a pip.conf find-links or mirror), as it would for a user.
line=$(grep -m1 'download.pytorch.org/whl/cpu' "$repo/README.md" | sed 's/ *#.*$//')
[ -n "$line" ] || { echo "wheel_check: README.md has no CPU install line" >&2; exit 1; }
python -m venv "$work/readme-venv"
(cd "$work/src" && PATH="$work/readme-venv/bin:$PATH" PIP_RETRIES=1 PIP_TIMEOUT=20 bash -c "$line" \
    > "$work/readme-install.log" 2>&1) \
    || { tail -n 30 "$work/readme-install.log"; echo "wheel_check: the README's CPU line failed: $line" >&2; exit 1; }
"$work/readme-venv/bin/python" - <<'EOF'
from importlib import metadata

import torch

cuda = sorted(d.metadata["Name"] for d in metadata.distributions()
              if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-", "triton")))
assert torch.__version__.endswith("+cpu") and torch.version.cuda is None, torch.__version__
assert not cuda, f"the README's CPU line installed CUDA packages: {cuda}"
print(f"wheel_check: the README's CPU line installs torch {torch.__version__}, no CUDA package")
EOF
"$work/readme-venv/bin/curvzo-ds" plan --world-size 2 | tail -n 1 | grep -q "fits"
