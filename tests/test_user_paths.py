"""A user's second hour (issue 28), through the real CLI in subprocesses: what eval does without a checkpoint, what
summary.json and the done line pair, a resume that takes no step, an unreachable hub, DeepSpeed's start-up prints,
a terminal that reports 0 columns, and ranks left without examples.

(The refusals, one line and exit 2, are in the bad-input table, tests/test_bad_inputs.py.)
"""

import fcntl
import hashlib
import json
import os
import pathlib
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from tests.helpers import CLI, COMMON, ENV, ROOT, free_port, launcher_cmd, run_checked, run_cli

pytestmark = pytest.mark.slow  # CLI runs in real processes
SHORT = [*COMMON, "--set", "max_steps=3", "--set", "save_steps=3", "--set", "eval_steps=3"]


def snapshot(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def cli(*args: str, env: dict | None = None, cwd=ROOT, timeout: int = 400) -> subprocess.CompletedProcess:
    return run_cli([sys.executable, "-m", "curvzo_ds.cli", *args], env=env or ENV, cwd=str(cwd),
                          capture_output=True, text=True, timeout=timeout)


def test_eval_without_resume_evaluates_the_untrained_model_and_writes_nothing(tmp_path):
    """§2: with no --resume and an output_dir that holds no run, eval prints the untrained model's result (step 0)
    on stdout and writes no file anywhere (next to a run it is refused: the bad-input table)."""
    out = tmp_path / "empty"
    out.mkdir()
    proc = cli("eval", *COMMON, "--set", f"output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["step"] == 0 and set(result) == {"dev", "test", "step", "params_digest"}
    assert "evaluated the untrained model (no --resume); nothing written" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any(out.iterdir())


def test_summary_and_done_line_pair_each_test_score_with_its_own_checkpoint_and_digest(straight, tmp_path):
    """§3: best_dev names its checkpoint and its parameters' digest, which a run stopped at the best step
    reproduces; summary.test is that checkpoint's test score and final.test the final weights' (params_digest,
    summary.checkpoint); the done line names both pairs."""
    out, summary = straight
    best, final = summary["best_dev"], summary["final"]
    step = best["step"]
    assert step != summary["steps"]  # the straight run's best dev is an earlier step: the pairs can be told apart
    assert best["checkpoint"] == str(out / f"checkpoint-{step}") and (out / f"checkpoint-{step}").is_dir()
    assert summary["checkpoint"] == str(out / f"checkpoint-{summary['steps']}")
    stopped = tmp_path / "stopped-at-best"
    run_checked(CLI + COMMON + ["--set", f"max_steps={step}", "--set", f"output_dir={stopped}"])
    at_best = json.loads((stopped / "summary.json").read_text())
    assert best["digest"] == at_best["params_digest"] != summary["params_digest"]
    assert summary["test"] == at_best["final"]["test"] and final["test"] != summary["test"]
    log = (out / "logs" / "rank-00000.log").read_text()
    done = [line for line in log.splitlines() if " INFO done: " in line][-1]
    metric = "accuracy"
    assert done.endswith(
        f"done: {summary['steps']} steps; best dev at step {step} ({best['checkpoint']}): test {metric} "
        f"{summary['test'][metric]:.4g}, digest {best['digest']}; final step {summary['steps']} "
        f"({summary['checkpoint']}): test {metric} {final['test'][metric]:.4g}, digest {summary['params_digest']}"
    ), done


def test_a_resume_that_takes_no_step_leaves_its_checkpoint_as_it_was(tmp_path):
    """§6: max_steps equal to the checkpoint's step: nothing is trained, and the checkpoint, with the eval.json that
    `eval --resume` wrote into it, is not written again. The run is started from the clone with a relative
    --deepspeed path and evaluated from another directory (issue 38 §4: the path is recorded absolute)."""
    out = tmp_path / "run"
    run_checked(CLI + SHORT + ["--deepspeed", "ds_configs/zero3.json", "--set", f"output_dir={out}"])
    recorded = json.loads((out / "checkpoint-3" / "run_config.json").read_text())["deepspeed"]
    assert recorded == str(ROOT / "ds_configs" / "zero3.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli("eval", "--resume", str(out / "checkpoint-3"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = snapshot(out / "checkpoint-3")
    assert "eval.json" in before
    summary = json.loads((out / "summary.json").read_text())
    run_checked(CLI + SHORT + ["--set", f"output_dir={out}", "--resume"])
    assert snapshot(out / "checkpoint-3") == before
    again = json.loads((out / "summary.json").read_text())
    assert again["params_digest"] == summary["params_digest"] and again["best_dev"] == summary["best_dev"]


@pytest.mark.parametrize("what", [["--set", "task=sst2"], ["--set", "model=facebook/opt-125m"]],
                         ids=["hub-dataset", "hub-model"])
def test_an_unreachable_hub_fails_at_once_without_retries(tmp_path, what):
    """§8: no network and no HF_HUB_OFFLINE (HF_ENDPOINT at a closed local port, an empty cache): one probe, one
    warning that the run works offline, then the usual one-line error; none of the libraries' retry warnings."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf-home"))
    start = time.monotonic()
    proc = cli("train", *SHORT, *what, "--set", f"output_dir={tmp_path / 'run'}", env=env)
    seconds = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("curvzo-ds train: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert proc.stderr.count("did not answer within") == 1, proc.stderr[-3000:]
    assert "retry" not in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    print(f"{what[-1]}: failed after {seconds:.1f} s")


def test_deepspeeds_start_up_line_goes_to_the_log_and_its_op_to_this_environments_cache(tmp_path):
    """§11: `... built successfully` is in the rank's log, not on stdout; the op lives in TORCH_EXTENSIONS_DIR as
    curvzo_ds sets it for this Python environment (the default cache here, where the op is built once)."""
    from curvzo_ds import startup

    env = {k: v for k, v in ENV.items() if k != "TORCH_EXTENSIONS_DIR"}
    proc = cli("train", *SHORT, "--set", f"output_dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built successfully" not in proc.stdout and proc.stdout == ""
    log = (tmp_path / "run" / "logs" / "rank-00000.log").read_text()
    assert "INFO deepspeed: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" in log
    saved = os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    try:
        directory = pathlib.Path(startup.extensions_dir())
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        if saved is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    assert list(directory.glob("deepspeed_shm_comm/*.so")), directory


def test_a_terminal_of_0_columns_gets_the_progress_lines(tmp_path):
    """§14: stderr a terminal that reports 0 columns (some container consoles): tqdm would draw nothing, so the run
    writes its progress as log lines, as it does into a file."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 0, 0, 0))
    cmd = CLI + SHORT + ["--set", "disable_tqdm=false", "--set", "progress_interval=0",
                         "--set", f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, env=ENV, cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the terminal closed: the process has exited
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert proc.wait(timeout=400) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    reader.join(10)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert "INFO step 3/3 (100%)" in text, text[-3000:]


@pytest.mark.multirank
def test_ranks_left_without_a_micro_batch_are_named_in_a_warning(tmp_path):
    """§10: global_batch_size=1 on 2 ranks: one rank gets no examples; the run says so once."""
    cmd = launcher_cmd("torchrun", 2, free_port())
    proc = run_checked(cmd + [*SHORT, "--set", "global_batch_size=1", "--set", "micro_batch_size=1",
                              "--set", "max_steps=1", "--set", f"output_dir={tmp_path / 'run'}"])
    warned = [line for line in proc.stderr.splitlines() if "micro-batch per step for 2 ranks" in line]
    assert len(warned) == 1 and "1 of them get no examples" in warned[0], proc.stderr[-3000:]
