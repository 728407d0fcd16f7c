#!/usr/bin/env bash
# torchrun: NPROC ranks on this node; for several nodes set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT.
# Exit code 3: the ranks stopped on a signal after a checkpoint (launch/preempt.bash); torchrun itself exits 1 then.
source "$(dirname "${BASH_SOURCE[0]}")/preempt.bash"
preflight --world 'NPROC*NNODES' --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
run_job torchrun --nproc_per_node "${NPROC:-2}" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    -m curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
