#!/usr/bin/env bash
# accelerate launch with the ZeRO-3 config; several nodes: add --num_machines N --machine_rank R
# --main_process_ip HOST --main_process_port PORT (ACCELERATE_ARGS).
exec accelerate launch --config_file "${ACCELERATE_CONFIG:-ds_configs/accelerate_zero3.yaml}" \
    --num_processes "${NPROC:-2}" ${ACCELERATE_ARGS:-} -m curvzo_ds.cli train "$@"
