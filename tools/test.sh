#!/usr/bin/env bash
# The test command (README.md): install what the tests need, then run them. Arguments go to pytest:
#   bash tools/test.sh                  # the full suite (what CI runs)
#   bash tools/test.sh -m "not slow"    # the unit tier (README.md and docs/testing.md have the measurements)
#   bash tools/test.sh --install-only   # the installs alone
# The last line gives the suite's wall time. CURVZO_RECORD_LAUNCHES=1 records each test's launches in
# tests/launches.json instead of checking them against it (tests/launches.py).
# The suite starts real mpirun and SLURM jobs: Open MPI, SLURM and munge come from apt (as root), and runs the
# README's `curvzo-ds eval ... | jq` (tests/test_docs_blocks.py): jq too. The tests that need them fail, never skip,
# when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore DEBIAN_FRONTEND=noninteractive

if ! command -v mpirun >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v jq >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge jq >/dev/null
    else
        echo "tools/test.sh: Open MPI and SLURM are missing and cannot be installed here (needs root and apt);" \
             "the mpirun, SLURM and README-pipe tests will fail. Install openmpi-bin slurmctld slurmd slurm-client munge jq." >&2
    fi
fi

# torch first: the CPU wheel from PyTorch's index (PyPI's Linux wheel pulls several GB of CUDA packages).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
python -c "from importlib.metadata import version; version('curvzo_ds'); import pytest_timeout, xdist, mpi4py, ruff, triton, wandb, mlflow, bitsandbytes" \
    2>/dev/null || python -m pip install -q -e ".[test]"
[ "${1:-}" = "--install-only" ] && exit 0  # .ci/run: the installs first, then the tests beside the wheel job

start=$(date +%s)
status=0
# Two processes, a test file each at a time, the slowest files first (conftest.py's SLOWEST_FIRST): a launch waits
# on its ranks' start-up more than it computes, so two files at once fill the 2 cores (docs/testing.md). `-n 0`
# after the arguments runs it in one process, as recording the launches does.
workers=(-n 2 --dist loadfile --no-loadscope-reorder)
[ -n "${CURVZO_RECORD_LAUNCHES:-}" ] && workers=()
python -m pytest "${workers[@]}" --durations=25 "$@" || status=$?
echo "tools/test.sh: pytest $* took $(( $(date +%s) - start )) s of wall time (exit $status)"
exit $status
