"""What the tests share: paths, the CLI's common settings, launch commands, and free ports.

Every multi-rank test takes its ports from `free_port()` (no port is hard-coded), and every launch
goes through `launcher_cmd` / `train`, so the launchers are started the same way in every file.
"""

import json
import os
import pathlib
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from tests import launches

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "check_run.py"  # the output contract (docs/contracts.md), checked on every test run
# method=curvzo: the runs exercise the paper's method (pi, budgets, scores), not the default mezo.
COMMON = ["--set", "method=curvzo", "--set", "max_steps=12", "--set", "eval_steps=3", "--set", "save_steps=3",
          "--set", "num_train=200",
          "--set", "num_dev=16", "--set", "num_eval=16", "--set", "global_batch_size=8",
          "--set", "micro_batch_size=2", "--set", "disable_tqdm=true", "--set", "report_to=none",
          "--set", "save_total_limit=2", "--deepspeed", str(ROOT / "ds_configs" / "zero3.json")]
# PYTHONPATH: the repository, and tests/launch_log, whose sitecustomize counts the interpreters started (launches.py).
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{launches.HOOK_DIR}"}
CLI = [sys.executable, "-m", "curvzo_ds.cli", "train"]
# For the scripts in launch/: their `python` is this interpreter.
SCRIPT_PATH = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}"
# No launcher variables from the calling shell; this interpreter's bin directory first (`python` in launch/).
BASE_ENV = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
BASE_ENV["PATH"] = SCRIPT_PATH
LAUNCH_TIMEOUT = 400  # seconds for one launch (a warm 2-rank run takes 15-30 s here)

_given: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that is free now and not handed out before in this test session."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # DeepSpeed's and torchrun's stores also use port + 1 on some paths: keep both unused.
        if port not in _given and port + 1 not in _given and port < 65000:
            _given.update((port, port + 1))
            return port


class CliServer:
    """A tests/cli_server.py process: `run` forks a child of it per `curvzo-ds` command, so the command's imports
    are paid once per session instead of once per command (the child is still a process of its own)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_server.py")], env=ENV, cwd=str(ROOT),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        assert ready.startswith('{"ready"'), f"tests/cli_server.py did not start: {ready!r}"

    def run(self, argv: list[str], env: dict, cwd: str, timeout: float, nproc: int = 1,
            script: str | None = None) -> subprocess.CompletedProcess:
        request = {"argv": argv, "env": env, "cwd": cwd, "timeout": timeout, "nproc": nproc, "script": script}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(["curvzo-ds", *argv], timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(["curvzo-ds", *argv], reply["returncode"], reply["stdout"], reply["stderr"])


_idle: queue.Queue[CliServer] = queue.Queue()
_started = 0
_servers_lock = threading.Lock()
MAX_SERVERS = 2  # one per core: the bad-input table runs two commands at a time
# Variables that torch, transformers, huggingface_hub, DeepSpeed or Python read while importing (cli_server.py).
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "DS_", "OMP_", "MKL_", "PYTHON", "CUDA",
                        "TRITON", "LD_", "PATH")


def cli(*argv: str, env: dict | None = None, cwd: pathlib.Path | str = ROOT, timeout: float = 400, nproc: int = 1,
        script: pathlib.Path | str | None = None) -> subprocess.CompletedProcess:
    """`curvzo-ds ARGV...` in a process of its own, forked from a CliServer (tests/cli_server.py), as
    `subprocess.run(..., capture_output=True, text=True)` would return it. Two threads may call it at once.
    `nproc` > 1: the ranks of one job, started as `torchrun --nproc_per_node N` starts them (MASTER_PORT from
    `env`, else a free port); `script`: a test worker instead of the CLI.
    An environment that differs from the server's in a variable that libraries read while importing (HF_*,
    TORCH*, DS_*, ...) cannot be had by a fork: such a command is started for real (python, or torchrun)."""
    global _started
    env = dict(env or ENV)
    if nproc > 1 or script:
        env.setdefault("MASTER_PORT", str(free_port()))
    if any(env.get(k) != ENV.get(k) for k in {*env, *ENV} if k.startswith(IMPORT_TIME_PREFIXES)):
        target = [str(script)] if script else ["-m", "curvzo_ds.cli"]
        cmd = (torchrun(nproc, int(env["MASTER_PORT"]), *target) if nproc > 1 or script else [sys.executable, *target])
        return subprocess.run(cmd + [str(a) for a in argv], env=env, cwd=str(cwd), capture_output=True, text=True,
                              timeout=timeout)
    launches.count("forked", nproc)
    with _servers_lock:  # a server is started only when none is idle, up to MAX_SERVERS; else wait for one
        new = _idle.empty() and _started < MAX_SERVERS
        _started += new
    server = CliServer() if new else _idle.get()
    try:
        return server.run([str(a) for a in argv], env, str(cwd), timeout, nproc, str(script) if script else None)
    finally:
        _idle.put(server)


def launcher_cmd(kind: str, n: int, port: int) -> list[str]:
    """The command that starts `curvzo-ds train` (or, with a script path after it, any module) under `kind`."""
    if kind == "python":
        return CLI
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                str(port), "-m", "curvzo_ds.cli", "train"]
    if kind == "deepspeed":
        return [shutil.which("deepspeed"), "--num_gpus", str(n), "--master_port", str(port), "--module",
                "curvzo_ds.cli", "train"]
    if kind == "accelerate":
        cfg = str(ROOT / "ds_configs" / "accelerate_zero3.yaml")
        return [shutil.which("accelerate"), "launch", "--config_file", cfg,
                "--num_processes", str(n), "--main_process_port", str(port), "-m", "curvzo_ds.cli", "train"]
    if kind == "mpirun":
        return [shutil.which("mpirun"), "-np", str(n), "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH",
                "-x", "DS_ACCELERATOR", "-x", "MASTER_PORT", sys.executable, "-m", "curvzo_ds.cli", "train"]
    raise ValueError(kind)


def torchrun(n: int, port: int, script: str, *args: str) -> list[str]:
    """torchrun of a test worker script with `n` ranks on one machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(port),
            script, *args]


def run_cli(cmd: list[str], env: dict | None = None, cwd: pathlib.Path | str | None = None, timeout: float = 400,
            **_) -> subprocess.CompletedProcess:
    """`subprocess.run(CLI + args, ..., capture_output=True, text=True)`, the process forked from a CliServer."""
    assert cmd[:3] == CLI[:3], cmd
    return cli(*cmd[3:], env=env, cwd=cwd or ROOT, timeout=timeout)


def run_checked(cmd: list[str], env: dict | None = None, timeout: int = LAUNCH_TIMEOUT,
                log: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root; fail with the end of its output (and of `log`) unless it exits 0.
    `python -m curvzo_ds.cli ...` is forked from a CliServer (`cli`), any other command started."""
    if cmd[:3] == CLI[:3]:
        proc = run_cli(cmd, env, timeout=timeout)
    else:
        proc = subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    text = proc.stdout[-3000:] + proc.stderr[-6000:] + (log.read_text()[-5000:] if log and log.exists() else "")
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{text}"
    return proc


def run_worker(world: int, script: pathlib.Path, *args, timeout: int = LAUNCH_TIMEOUT) -> dict:
    """A test worker (tests/multirank/) with `world` ranks, started as torchrun starts them (forked from a
    CliServer: `cli`); returns the JSON it wrote to args[-1]."""
    proc = cli(*map(str, args), script=script, nproc=world, timeout=timeout)
    assert proc.returncode == 0, f"{script.name} x{world} exited {proc.returncode}:\n" + proc.stdout[-3000:] + \
        proc.stderr[-6000:]
    return json.loads(pathlib.Path(args[-1]).read_text())


def check_contract(out: pathlib.Path, *extra: str) -> None:
    check = subprocess.run([sys.executable, str(CHECK), str(out), *extra], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def train(kind: str, n: int, out: pathlib.Path, *extra: str, port: int | None = None) -> dict:
    """A run of COMMON's settings; `kind` is a launcher, or one of the scripts in launch/ ("torchrun.sh", ...).
    "python" and "torchrun" fork their ranks from a CliServer (`cli`): the test is then about the run, not the
    launcher (the launchers themselves are started for real by test_app, test_launchers and test_reliability)."""
    port = port or free_port()
    env = {**ENV, "MASTER_PORT": str(port)}
    args = [*COMMON, "--set", f"output_dir={out}", *extra]
    if kind in ("python", "torchrun"):
        proc = cli("train", *args, env=env, nproc=n, timeout=LAUNCH_TIMEOUT)
        assert proc.returncode == 0, f"{kind} x{n} train {' '.join(args)} exited {proc.returncode}:\n" + \
            proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        cmd = ["bash", str(ROOT / "launch" / kind)] if kind.endswith(".sh") else launcher_cmd(kind, n, port)
        if kind.endswith(".sh"):  # as a user runs it
            env.update(NPROC=str(n), ACCELERATE_ARGS=f"--main_process_port {port}", PATH=SCRIPT_PATH)
        run_checked(cmd + args, env)
    check_contract(out)
    return json.loads((out / "summary.json").read_text())


def eval_cli(checkpoint: pathlib.Path, cwd: pathlib.Path) -> dict:
    """`curvzo-ds eval --resume CHECKPOINT` with nothing else, as a user types it in `cwd`: stdout must be the JSON
    result alone (so `| jq` works), and the same result must be in eval.json next to the checkpoint."""
    proc = cli("eval", "--resume", str(checkpoint), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # raises if anything but the JSON reached stdout
    assert result == json.loads((checkpoint / "eval.json").read_text())
    assert not (cwd / "runs").exists()  # nothing written to the default output_dir
    return result


def logged_eval(out: pathlib.Path, step: int) -> dict:
    """{split: row} of the evaluations metrics.jsonl logged at `step` (the end-of-run ones included)."""
    return {r["split"]: r for r in metrics_rows(out) if r.get("split") and r["step"] == step}


def metrics_rows(out: pathlib.Path) -> list[dict]:
    """Every line of metrics.jsonl, parsed strictly (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def metrics_lines(out: pathlib.Path) -> list[dict]:
    """metrics.jsonl without wall-clock fields and end-of-run evaluations (for comparing runs)."""
    rows = metrics_rows(out)
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows if not r.get("final")]


# Interrupted runs (test_reliability, test_launchers): TOTAL steps of the demo model with the COMMON settings but a
# global batch of 4 (2 micro-batches of 2 on one rank, one a rank on two: 4 forwards a step, not 8; these tests
# are about signals, checkpoints and resumes: a 200-step run at one rank took 19 s of its 31 s), so that a signal
# sent at step 20 lands in the middle of training with seconds of margin. 200, not 400 as before issue 35: every resume
# after an interruption runs the rest.
TOTAL, SAVE, EVAL = 200, 50, 100
STEPS = ["--set", f"max_steps={TOTAL}", "--set", f"save_steps={SAVE}", "--set", f"eval_steps={EVAL}",
         "--set", "save_total_limit=3"]
RUN = ["global_batch_size=4" if a == "global_batch_size=8" else a for a in COMMON] + STEPS
assert RUN.count("global_batch_size=4") == 1


def start(cmd: list[str], out: pathlib.Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd + RUN + ["--set", f"output_dir={out}", *extra], env=env or ENV, cwd=str(ROOT),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_steps(out: pathlib.Path, proc: subprocess.Popen, at_least: int, timeout: float = 300) -> None:
    """Until metrics.jsonl has a train line with step >= at_least (the run is mid-training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early:\n{log_of(out)[-3000:]}"
        path = out / "metrics.jsonl"
        if path.exists():
            steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()[-5:] if line.strip()]
            if steps and max(steps) >= at_least:
                return
        time.sleep(0.2)
    raise AssertionError(f"no step {at_least} within {timeout} s:\n{log_of(out)[-3000:]}")


def log_of(out: pathlib.Path) -> str:
    path = out.parent / f"{out.name}.log"
    return path.read_text() if path.exists() else ""


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def checkpoints(out: pathlib.Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "manifest.json").exists())


def resume(out: pathlib.Path, *extra: str) -> dict:
    proc = cli("train", *RUN, "--set", f"output_dir={out}", "--resume", *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())
