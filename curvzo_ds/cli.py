"""`curvzo-ds`: train | eval | export | plot | bench | plan | diagnose (docs/contracts.md).

`train` and `eval` run inside the current process: alone it is a one-rank job, under
deepspeed / torchrun / accelerate launch / mpirun / srun it is one rank of the job.
A bad configuration prints one line naming the key or file and the fix, and exits with 2.

Each command is a module of curvzo_ds/commands/ whose `register(sub)` adds its parser and
`set_defaults(handler=...)` (accelerate's commands/ shape). This module builds the parser from them, maps the
errors a user can fix to one line and an exit code (`main`), and tears the process group down (`entry`).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import re
import sys

from curvzo_ds.commands import bench, diagnose, export, plan, plot, train
from curvzo_ds.commands import eval as evaluate
from curvzo_ds.environment import check_accelerator
from curvzo_ds.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, ConfigError, RunEnded
from curvzo_ds.startup import exit_now, extensions_dir

# In this order in `curvzo-ds --help`. A command module imports neither DeepSpeed nor transformers when it is
# imported (its handler does): --help stays quick, and DeepSpeed's first log line cannot reach eval's stdout.
COMMANDS = (train, evaluate, export, plot, bench, plan, diagnose)
# A directory or run that is not what the command needs is the user's to fix: one line (exit 2), not a traceback.
VALUE_ERRORS_ARE_THE_USERS = ("export", "plot")
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped at once (KeyboardInterrupt), as a shell reports a Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    """The `curvzo-ds` parser: one subcommand per front end, every option with its help text."""
    parser = argparse.ArgumentParser(prog="curvzo-ds", description="CurvZO zeroth-order fine-tuning on ZeRO-3.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    for command_parser in sub.choices.values():  # `--resum` is a typo, not --resume: no prefix of an option is taken
        command_parser.allow_abbrev = False
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # The deepspeed launcher inserts --local_rank=N (before the subcommand); LOCAL_RANK has it too.
    argv = [a for a in argv if not re.match(r"--local[-_]rank=\d+$", a)]
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line, naming the option it resembles (no prefix is taken for an option: allow_abbrev)
        hint = _did_you_mean(parser, args, unknown)
        _say(f"curvzo-ds {args.command}: error: unrecognized arguments: {' '.join(unknown)}{hint}")
        return EXIT_BAD_INPUT
    try:
        check_accelerator()  # DS_ACCELERATOR, before any command imports DeepSpeed (which refuses it in a traceback)
        extensions_dir()  # a JIT build cache per Python environment, unless TORCH_EXTENSIONS_DIR is set (startup.py)
        code = args.handler(args)  # a handler may return its exit code (plan: 1 when the plan does not fit)
    except (ConfigError, FileNotFoundError) as e:
        _say(f"curvzo-ds {args.command}: error: {e}")
        return EXIT_BAD_INPUT
    except RunEnded as e:  # the run stopped for a stated reason: one line (the log above has the context)
        _say(f"curvzo-ds {args.command}: {'' if e.exit_code == EXIT_PREEMPTED else 'error: '}{e}")
        return e.exit_code
    except ValueError as e:
        if args.command not in VALUE_ERRORS_ARE_THE_USERS:
            raise
        _say(f"curvzo-ds {args.command}: error: {e}")
        return EXIT_BAD_INPUT
    return code if isinstance(code, int) else EXIT_OK


def _did_you_mean(parser: argparse.ArgumentParser, args, unknown: list[str]) -> str:
    """` (did you mean --resume?)` for the first unknown option that is close to one of the command's."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    for given in unknown:
        near = difflib.get_close_matches(given.split("=", 1)[0], options, n=1, cutoff=0.6) if given.startswith("--") \
            else []
        if near:
            return f" (did you mean {near[0]}? options are never abbreviated)"
    return ""


def _say(line: str) -> None:
    """One write per line, so that the lines of ranks sharing a terminal or log file never run together (a message
    from a library that spans lines is joined into one)."""
    sys.stderr.write(" ".join(part.strip() for part in line.splitlines()) + "\n")
    sys.stderr.flush()


def mark_exit(kind: str) -> None:
    """For launch/preempt.bash: a file in CURVZO_DS_EXIT_DIR says how this rank ended, where the launchers
    themselves exit 1 for any failed rank: `preempted` (stopped on a signal after the checkpoint that every rank
    saved; the scripts in launch/ exit 3) or `bad-input` (a one-line refusal; the scripts exit 2)."""
    directory = os.environ.get("CURVZO_DS_EXIT_DIR")
    if directory and os.path.isdir(directory):
        with contextlib.suppress(OSError):
            open(os.path.join(directory, f"{kind}-{os.getpid()}"), "w").close()


def _initialised_dist():
    """torch.distributed when this process has a process group that a command made (shard.distributed's
    init_distributed), else None: a group that the caller of `main` made itself is the caller's to keep. Only a
    command that made a group has torch.distributed imported, so the others import nothing here."""
    dist = sys.modules.get("torch.distributed")
    ours = sys.modules.get("curvzo_ds.shard.distributed")
    made = ours is not None and ours.CREATED[0]
    return dist if made and dist is not None and dist.is_available() and dist.is_initialized() else None


def destroy_process_group() -> None:
    """Leave the job's process group when a command has returned, as torchtitan's trainer does: without it NCCL
    warns at each exit, and the interpreter's teardown can abort in gloo's threads ("terminate called without an
    active exception", pytorch/pytorch#190489). Collective: call it where every rank gets to."""
    dist = _initialised_dist()
    if dist is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        sys.modules["curvzo_ds.shard.distributed"].CREATED[0] = False


def abort_process_group() -> None:
    """Drop this rank's process groups without waiting for any other rank: NCCL's communicators are aborted (all of
    them in one ncclGroupStart/End, so that no abort waits on another), gloo's connections closed. What the ranks
    still blocked in a collective with this one see is an error (gloo at once, NCCL at its watchdog's timeout) or
    the launcher's kill once this rank has exited non-zero."""
    dist = _initialised_dist()
    if dist is None:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.3 (experimental there)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()


def entry() -> None:
    """The console script and `python -m curvzo_ds.cli`: a crash in native code (a segfault or an abort in a
    communication library) prints every thread's Python stack to stderr, so a cluster job's log shows where. The
    process group is torn down on every way out of the command (below)."""
    faulthandler.enable()
    # Teardown. A collective teardown (destroy_process_group) is safe only where every rank gets to it; a rank that
    # destroys while the others sit in a collective waiting for it can deadlock there (NCCL's communicator
    # destruction: torchtitan#1342, pytorch/pytorch#119215), its traceback unprinted and the launcher never told.
    # - main returned (done, a bad input, a RunEnded): every rank is at the same point. A RunEnded is raised on
    #   each rank after the collective that decides it (the loss check, the agreement check, the checkpoint
    #   write, the pre-emption barrier), and a bad input comes from the configuration and files that every rank
    #   reads alike. So: destroy.
    # - an unexpected exception: this rank may be alone, the others in a collective that waits for it. So: the
    #   traceback first (nothing after it can hide it), then abort, which is local (no rank waits for another),
    #   and exit 1 as an uncaught exception does. The others then fail their collective (gloo: the connection
    #   closed; NCCL: the watchdog's timeout) or the launcher ends them on this rank's exit (torchrun,
    #   srun --kill-on-bad-exit, deepspeed).
    # - KeyboardInterrupt (a Ctrl-C before training, or a second SIGINT or SIGTERM well after the first:
    #   train/signals.py): aborted likewise, one line, exit 130 as a shell reports a Ctrl-C.
    # - a SystemExit from a command: aborted likewise, and re-raised unchanged. argparse's --help and usage errors
    #   exit before any group exists: nothing to do.
    try:
        code = main()
    except Exception:
        sys.excepthook(*sys.exc_info())  # as the interpreter prints it
        abort_process_group()
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        abort_process_group()
        _say("curvzo-ds: interrupted: stopped at once, saving nothing (a run's checkpoints so far are intact; "
             "--resume continues from the newest)")
        exit_now(EXIT_INTERRUPTED)  # no interpreter teardown: it can wait in the aborted group's threads
    except BaseException:
        abort_process_group()
        raise
    destroy_process_group()
    if code == EXIT_PREEMPTED:  # every rank is here at once (run_train's barrier): leave without the interpreter's
        mark_exit("preempted")  # teardown, which can take seconds, so that srun --kill-on-bad-exit ends no rank
        exit_now(code)
    if code == EXIT_BAD_INPUT:
        mark_exit("bad-input")
    sys.exit(code)

if __name__ == "__main__":
    entry()
