#!/usr/bin/env bash
# The DeepSpeed launcher. Several nodes: pass a hostfile (`worker-1 slots=8` per line), e.g.
#   HOSTFILE=hosts launch/deepspeed.sh --deepspeed ds_configs/zero3.json
# (it reaches the nodes with pdsh by default; --launcher openmpi or slurm also work).
if [ -n "${HOSTFILE:-}" ]; then
    exec deepspeed --hostfile "$HOSTFILE" --module curvzo_ds.cli train "$@"
fi
exec deepspeed --num_gpus "${NPROC:-2}" --master_port "${MASTER_PORT:-29500}" --module curvzo_ds.cli train "$@"
