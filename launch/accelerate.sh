#!/usr/bin/env bash
# accelerate launch with the ZeRO-3 config; several nodes, run on each: NPROC=<ranks in all> ACCELERATE_ARGS=
# "--num_machines N --machine_rank R --main_process_ip HOST --main_process_port PORT
# --deepspeed_multinode_launcher standard" (without `standard`, DeepSpeed's pdsh runs from machine 0 only).
# Exit code 3: the ranks (on this machine) stopped on a signal after a checkpoint (launch/preempt.bash).
source "$(dirname "${BASH_SOURCE[0]}")/preempt.bash"
preflight --world NPROC --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" || exit $?  # a bad input: one line, exit 2, no rank started
run_job accelerate launch --config_file "${ACCELERATE_CONFIG:-ds_configs/accelerate_zero3.yaml}" \
    --num_processes "${NPROC:-2}" ${ACCELERATE_ARGS:-} -m curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
