"""What the tests share: paths, the CLI's common settings, launch commands, and free ports.

Every multi-rank test takes its ports from `free_port()` (no port is hard-coded), and every launch
goes through `launcher_cmd` / `train`, so the launchers are started the same way in every file.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "check_run.py"  # the output contract (docs/contracts.md), checked on every test run
COMMON = ["--set", "max_steps=12", "--set", "eval_steps=3", "--set", "save_steps=3", "--set", "num_train=200",
          "--set", "num_dev=16", "--set", "num_eval=16", "--set", "global_batch_size=8",
          "--set", "micro_batch_size=2", "--set", "disable_tqdm=true", "--set", "report_to=none",
          "--set", "save_total_limit=2", "--deepspeed", str(ROOT / "ds_configs" / "zero3.json")]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
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


def run_checked(cmd: list[str], env: dict | None = None, timeout: int = LAUNCH_TIMEOUT,
                log: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root; fail with the end of its output (and of `log`) unless it exits 0."""
    proc = subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    text = proc.stdout[-3000:] + proc.stderr[-6000:] + (log.read_text()[-5000:] if log and log.exists() else "")
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{text}"
    return proc


def run_worker(world: int, script: pathlib.Path, *args, timeout: int = LAUNCH_TIMEOUT) -> dict:
    """A test worker (tests/multirank/) under torchrun with `world` ranks; returns the JSON it wrote to args[-1]."""
    run_checked(torchrun(world, free_port(), str(script), *map(str, args)), timeout=timeout)
    return json.loads(pathlib.Path(args[-1]).read_text())


def check_contract(out: pathlib.Path, *extra: str) -> None:
    check = subprocess.run([sys.executable, str(CHECK), str(out), *extra], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def train(kind: str, n: int, out: pathlib.Path, *extra: str, port: int | None = None) -> dict:
    """A run of COMMON's settings; `kind` is a launcher, or one of the scripts in launch/ ("torchrun.sh", ...)."""
    port = port or free_port()
    env = {**ENV, "MASTER_PORT": str(port)}
    if kind.endswith(".sh"):  # as a user runs it
        cmd = ["bash", str(ROOT / "launch" / kind)]
        env.update(NPROC=str(n), ACCELERATE_ARGS=f"--main_process_port {port}", PATH=SCRIPT_PATH)
    else:
        cmd = launcher_cmd(kind, n, port)
    run_checked(cmd + COMMON + ["--set", f"output_dir={out}", *extra], env)
    check_contract(out)
    return json.loads((out / "summary.json").read_text())


def eval_cli(checkpoint: pathlib.Path, cwd: pathlib.Path) -> dict:
    """`curvzo-ds eval --resume CHECKPOINT` with nothing else, as a user types it in `cwd`: stdout must be the JSON
    result alone (so `| jq` works), and the same result must be in eval.json next to the checkpoint."""
    proc = subprocess.run([sys.executable, "-m", "curvzo_ds.cli", "eval", "--resume", str(checkpoint)], env=ENV,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=str(cwd))
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


# Interrupted runs (test_reliability, test_launchers): 400 steps of the demo model with the COMMON settings, so
# that a signal sent once metrics.jsonl has lines lands in the middle of training.
STEPS = ["--set", "max_steps=400", "--set", "save_steps=100", "--set", "eval_steps=200", "--set", "save_total_limit=3"]
RUN = COMMON + STEPS


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
    proc = subprocess.run(CLI + RUN + ["--set", f"output_dir={out}", "--resume", *extra], env=ENV, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())
