#!/usr/bin/env bash
# mpirun (Open MPI or MPICH); needs mpi4py (pip install -e '.[mpi]'). Several nodes: MPI_ARGS="--hostfile hosts".
extra=()
if [ "$(id -u)" = 0 ]; then extra+=(--allow-run-as-root); fi
if [ "${NPROC:-2}" -gt "$(nproc)" ]; then extra+=(--oversubscribe); fi
# Exit code 3: the ranks stopped on a signal after a checkpoint (launch/preempt.bash).
source "$(dirname "${BASH_SOURCE[0]}")/preempt.bash"
preflight --world NPROC --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
run_job mpirun -np "${NPROC:-2}" "${extra[@]}" ${MPI_ARGS:-} python -m curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
