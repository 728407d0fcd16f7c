# Sourced by the launch/*.sh scripts (not a launcher itself). `run_job COMMAND...` runs a launcher (torchrun,
# deepspeed, accelerate, mpirun) and returns its exit code, except that it returns 3 when the ranks stopped cleanly
# on a signal after saving a checkpoint, as `curvzo-ds train` does (docs/reliability.md): the launchers themselves
# exit 1 then. Each rank that stops that way (after every rank has saved) leaves a file in CURVZO_DS_EXIT_DIR.
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
    if [ "$own" = 1 ]; then rm -rf "$CURVZO_DS_EXIT_DIR"; fi
    return "$code"
}
