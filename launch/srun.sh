#!/usr/bin/env bash
# Inside a SLURM allocation: one task per rank; curvzo-ds reads SLURM_PROCID/SLURM_NTASKS and takes
# MASTER_ADDR from the job's first host.
# srun ends a step at once on SIGTERM, so a SIGTERM (or SIGINT) to this script is passed to the ranks as SIGUSR1,
# which srun forwards: they stop at the next step boundary after a checkpoint and exit with 3 (docs/reliability.md).
set -uo pipefail
srun --ntasks "${NPROC:-2}" --kill-on-bad-exit=1 ${SRUN_ARGS:-} python -m curvzo_ds.cli train \
    --set "ddp_timeout=${DDP_TIMEOUT:-1800}" "$@" &
step=$!
trap 'kill -USR1 "$step" 2>/dev/null || true' TERM INT USR1
code=0
wait "$step" || code=$?
while kill -0 "$step" 2>/dev/null; do  # wait was cut short by the trap: wait for the ranks' own exit
    code=0
    wait "$step" || code=$?
done
exit "$code"
