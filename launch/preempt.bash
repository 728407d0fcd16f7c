# Sourced by the launch/*.sh scripts (not a launcher itself). `preflight ARGS...` checks the configuration of
# `curvzo-ds train ARGS...` once, before any rank starts (`train --check`): a bad input is one line and exit 2.
# `run_job COMMAND...` runs a launcher (torchrun, deepspeed, accelerate, mpirun) and returns its exit code, except
# that it returns 3 when the ranks stopped cleanly on a signal after saving a checkpoint, and 2 when they refused a
# bad input that only the ranks can see (the data, the model), as `curvzo-ds train` does (docs/reliability.md):
# the launchers themselves exit 1 then. Each rank that stops that way leaves a file in CURVZO_DS_EXIT_DIR.
# SIGTERM and SIGINT sent to the script are passed to the launcher, which passes them to the ranks; SIGHUP (the
# terminal closed) is passed on as SIGTERM. The launcher runs in a session of its own (setsid), so that a
# terminal's Ctrl-C, which goes to the whole foreground process group, reaches this script alone: the launcher
# then gets one signal, from here, not two at once (torchrun, given a second while it stops its workers, leaves
# them running). Signals that come together are passed on once; one that comes STOP_AGAIN seconds or more later
# is passed on too: the ranks take it as "stop now" (curvzo_ds/train/signals.py, STOP_NOW_AFTER = 5 s).
# A script started with `&` by a non-interactive shell (a batch script's background job) starts with SIGINT ignored,
# and bash can then neither trap nor relay it: there the launcher stays in the script's process group (no setsid),
# so that a SIGINT sent to the job's process group reaches the launcher itself, which passes it on (no terminal
# sends a Ctrl-C to such a job, so the launcher still gets one signal). SIGTERM and SIGHUP reach a job started
# with `&` as any other (docs/reliability.md).
STOP_AGAIN=6  # whole seconds ($SECONDS): more than the ranks' 5
run_job() {
    local own=0 code=0 pid last_forward=-100
    if [ -z "${CURVZO_DS_EXIT_DIR:-}" ]; then
        CURVZO_DS_EXIT_DIR=$(mktemp -d) && own=1
        export CURVZO_DS_EXIT_DIR
    fi
    if [ "$(trap -p INT)" != "trap -- '' SIGINT" ] && command -v setsid >/dev/null 2>&1; then
        setsid -w "$@" &  # a child of a script is no group leader: setsid execs the launcher, $! is its pid
    else
        "$@" &
    fi
    pid=$!
    trap 'forward TERM' TERM HUP
    trap 'forward INT' INT
    wait "$pid" || code=$?
    while kill -0 "$pid" 2>/dev/null; do  # wait was cut short by a trap: wait for the launcher's own exit
        code=0
        wait "$pid" || code=$?
    done
    if [ "$code" != 0 ] && compgen -G "$CURVZO_DS_EXIT_DIR/preempted-*" >/dev/null; then
        echo "curvzo-ds: the ranks stopped on a signal after saving a checkpoint (the launcher exited $code$(
             [ "$1" = torchrun ] && echo "; torchrun's traceback above (SignalException, ChildFailedError) is its" \
                                        "own report of that stop, not an error")): exit 3; resume with --resume" >&2
        code=3
    fi
    if [ "$code" != 0 ] && [ "$code" != 3 ] && compgen -G "$CURVZO_DS_EXIT_DIR/bad-input-*" >/dev/null; then
        echo "curvzo-ds: the ranks refused a bad input (the line above; the launcher exited $code): exit 2" >&2
        code=2
    fi
    if [ "$own" = 1 ]; then rm -rf "$CURVZO_DS_EXIT_DIR"; fi
    return "$code"
}

# Pass signal $1 to run_job's launcher, unless one went less than STOP_AGAIN seconds ago.
forward() {
    if (( SECONDS - last_forward >= STOP_AGAIN )); then
        last_forward=$SECONDS
        kill -"$1" "$pid" 2>/dev/null || true
    fi
}

# The scripts' own settings, then `curvzo-ds train --check` (which checks MASTER_PORT with the configuration).
# `preflight --world RULE ARGS...`: RULE says how many ranks the launcher starts, NPROC or NPROC*NNODES (checked
# against shard_group_size and num_directions, as the ranks would); without it the world size is not checked.
preflight() {
    local name value world=()
    if [ "${1:-}" = --world ]; then
        world=("$2")
        shift 2
    fi
    for name in NPROC NNODES NODE_RANK; do
        value="${!name:-}"
        if [ -n "$value" ] && ! [[ "$value" =~ ^[0-9]+$ && ( "$name" = NODE_RANK || "$value" -ge 1 ) ]]; then
            echo "curvzo-ds train: error: $name=$value is not a whole number$([ "$name" = NODE_RANK ] || echo ' >= 1')"\
                 "(NPROC: ranks on this node, NNODES: nodes, NODE_RANK: this node's index from 0)" >&2
            return 2
        fi
    done
    if [ -n "${NODE_RANK:-}" ] && [ "$NODE_RANK" -ge "${NNODES:-1}" ]; then
        echo "curvzo-ds train: error: NODE_RANK=$NODE_RANK is not below NNODES=${NNODES:-1}: the nodes are" \
             "0..$(( ${NNODES:-1} - 1 ))" >&2
        return 2
    fi
    case "${world[0]:-}" in
        NPROC) world=(--world-size "${NPROC:-2}") ;;
        'NPROC*NNODES') world=(--world-size "$(( ${NPROC:-2} * ${NNODES:-1} ))") ;;
        *) world=() ;;
    esac
    DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" "${PYTHON:-python}" -m curvzo_ds.cli train --check "${world[@]}" "$@"
}
