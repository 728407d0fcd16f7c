#!/usr/bin/env bash
# The DeepSpeed launcher. Several nodes: pass a hostfile (`worker-1 slots=8` per line), e.g.
#   HOSTFILE=hosts launch/deepspeed.sh --deepspeed ds_configs/zero3.json
# (it reaches the nodes with pdsh by default; DS_ARGS="--launcher openmpi" for Open MPI). DeepSpeed 0.19.8's
# --launcher slurm drops --module: there use launch/slurm.sbatch, or see docs/multinode.md.
# Exit code 3: the ranks (on this node) stopped on a signal after a checkpoint (launch/preempt.bash).
source "$(dirname "${BASH_SOURCE[0]}")/preempt.bash"
if [ -n "${HOSTFILE:-}" ]; then
    preflight --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
    run_job deepspeed --hostfile "$HOSTFILE" ${DS_ARGS:-} --module curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
    exit
fi
preflight --world NPROC --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
run_job deepspeed --num_gpus "${NPROC:-2}" --master_port "${MASTER_PORT:-29500}" --module curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
