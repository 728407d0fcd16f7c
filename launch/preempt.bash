# Sourced by the launch/*.sh scripts (not a launcher itself). `preflight ARGS...` checks the configuration of
# `curvzo-ds train ARGS...` once, before any rank starts (`train --check`): a bad input is one line and exit 2.
# `run_job COMMAND...` runs a launcher (torchrun, deepspeed, accelerate, mpirun) and returns its exit code, except
# that it returns 3 when the ranks stopped cleanly on a signal after saving a checkpoint, and 2 when they refused a
# bad input that only the ranks can see (the data, the model), as `curvzo-ds train` does (docs/reliability.md):
# the launchers themselves exit 1 then. Each rank that stops that way leaves a file in CURVZO_DS_EXIT_DIR.
# SIGTERM and SIGINT sent to the script are passed to the launcher, which passes them to the ranks.
run_job() {
    local own=0 code=0 pid
    if [ -z "${CURVZO_DS_EXIT_DIR:-}" ]; then
        CURVZO_DS_EXIT_DIR=$(mktemp -d) && own=1
        export CURVZO_DS_EXIT_DIR
    fi
    "$@" &
    pid=$!
    trap 'kill -TERM "$pid" 2>/dev/null || true' TERM
    trap 'kill -INT "$pid" 2>/dev/null || true' INT
    wait "$pid" || code=$?
    while kill -0 "$pid" 2>/dev/null; do  # wait was cut short by a trap: wait for the launcher's own exit
        code=0
        wait "$pid" || code=$?
    done
    if [ "$code" != 0 ] && compgen -G "$CURVZO_DS_EXIT_DIR/preempted-*" >/dev/null; then
        echo "curvzo-ds: the ranks stopped on a signal after saving a checkpoint (the launcher exited $code): exit 3;" \
             "resume with --resume" >&2
        code=3
    fi
    if [ "$code" != 0 ] && [ "$code" != 3 ] && compgen -G "$CURVZO_DS_EXIT_DIR/bad-input-*" >/dev/null; then
        echo "curvzo-ds: the ranks refused a bad input (the line above; the launcher exited $code): exit 2" >&2
        code=2
    fi
    if [ "$own" = 1 ]; then rm -rf "$CURVZO_DS_EXIT_DIR"; fi
    return "$code"
}

preflight() {
    DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" "${PYTHON:-python}" -m curvzo_ds.cli train --check "$@"
}
