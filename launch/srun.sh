#!/usr/bin/env bash
# Inside a SLURM allocation: one task per rank; curvzo-ds reads SLURM_PROCID/SLURM_NTASKS and takes
# MASTER_ADDR from the job's first host.
exec srun --ntasks "${NPROC:-2}" --kill-on-bad-exit=1 ${SRUN_ARGS:-} python -m curvzo_ds.cli train --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@"
