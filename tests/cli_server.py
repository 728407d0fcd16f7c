"""Runs `curvzo-ds` commands for the tests in forked processes: the imports are paid once per test session.

A run of `python -m curvzo_ds.cli` spends most of its time importing torch, transformers, DeepSpeed and peft
(6-8 s on the 2-core CI machine) before it looks at its arguments. This server imports them once, then forks one
child per command. The child is a real process with its own pid, file descriptors, environment and working
directory: it runs `curvzo_ds.cli.entry()` exactly as the console script does, and its exit code, stdout and stderr
are what the test reads. A crash that the CLI does not catch prints its traceback and exits 1, as Python would.

What a forked child does not repeat is the import itself, so behaviour at import time (the version check of
`import curvzo_ds`, environment variables read while importing) is covered by the tests that start real
interpreters: the launcher, reliability and wheel tests.

With `nproc` > 1 it starts the ranks of one job on this machine as `torchrun --nproc_per_node N` would: N
children at once, each with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joined by a real gloo process group. When one rank fails, the others
are stopped, as torchrun does. `script` runs a test worker (tests/multirank/) instead of the CLI, as
`torchrun ... script.py ARGS` would. The launchers themselves are tested by starting them (test_launchers.py,
test_app.py, test_reliability.py).

Protocol (one JSON object per line on stdin, one per line on stdout):
    {"argv": [...], "env": {...}, "cwd": "...", "timeout": 300, "nproc": 1, "script": null}
    -> {"returncode": 0, "stdout": "...", "stderr": "...", "timed_out": false}
The stdout and stderr of several ranks are joined in rank order.
"""

import atexit
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback


def _child(request: dict, rank_env: dict, out_path: str, err_path: str, reply_fd: int) -> None:
    """In the forked child: become the command, then leave with its exit code (never return to the server loop)."""
    code = 1
    try:
        os.close(reply_fd)
        out = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
        err = os.open(err_path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        os.setpgid(0, 0)  # its own process group: a timeout kills whatever it started
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(rank_env)
        try:
            if request.get("script"):
                sys.argv = [request["script"], *request["argv"]]
                sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
                runpy.run_path(request["script"], run_name="__main__")
            else:
                sys.argv = ["curvzo-ds", *request["argv"]]
                from curvzo_ds import cli

                cli.entry()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run (log handlers, trackers)
        except BaseException:
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _rank_envs(request: dict) -> list[dict]:
    n = int(request.get("nproc", 1))
    if n == 1 and not request.get("script"):
        return [{}]
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": request["env"].get("MASTER_PORT", "29500")}
    return [{**master, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
             "GROUP_RANK": "0", "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": str(n)} for r in range(n)]


def _stop(pids: dict[int, int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(request: dict, reply_fd: int) -> dict:
    # mkdtemp, not TemporaryDirectory: that one registers an exit handler, which each child would run
    tmp = tempfile.mkdtemp(prefix="cli-server-")
    try:
        envs = _rank_envs(request)
        paths = [(os.path.join(tmp, f"stdout-{r}"), os.path.join(tmp, f"stderr-{r}")) for r in range(len(envs))]
        running: dict[int, int] = {}  # pid -> rank
        for rank, (env, (out_path, err_path)) in enumerate(zip(envs, paths)):
            for path in (out_path, err_path):
                open(path, "w").close()
            pid = os.fork()
            if pid == 0:
                _child(request, env, out_path, err_path, reply_fd)
            running[pid] = rank
        codes: dict[int, int] = {}
        deadline = time.monotonic() + request.get("timeout", 300)
        timed_out, failed_at = False, None
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in running:
                rank = running.pop(pid)
                codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank] != 0 and failed_at is None:
                    failed_at = time.monotonic()  # like torchrun: the other ranks get a moment, then are stopped
                continue
            if time.monotonic() > deadline or (failed_at and time.monotonic() - failed_at > 10):
                timed_out = time.monotonic() > deadline
                _stop(running)
                for pid, rank in list(running.items()):
                    os.waitpid(pid, 0)
                    codes[rank] = -9
                running.clear()
                break
            time.sleep(0.02)
        failures = [codes[r] for r in sorted(codes) if codes[r] != 0]
        stdout, stderr = "", ""
        for out_path, err_path in paths:
            with open(out_path, errors="replace") as f:
                stdout += f.read()
            with open(err_path, errors="replace") as f:
                stderr += f.read()
        return {"returncode": failures[0] if failures else 0, "stdout": stdout, "stderr": stderr,
                "timed_out": timed_out}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    # What every command imports before it looks at its arguments or builds a model: paid here once.
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM, OPTForCausalLM  # noqa: F401

    import curvzo_ds.cli  # noqa: F401

    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing but replies on the protocol's stream
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(_run(json.loads(line), reply.fileno())), file=reply, flush=True)


if __name__ == "__main__":
    main()
