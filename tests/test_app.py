"""`curvzo-ds train` end to end: every launcher, world-size invariance, resume at 1->1, 2->2, 2->3.

All runs use the same small configuration, so every launcher and world size must produce the
same params_digest (the trajectory is world-size independent), and a run split by a resume must
equal the straight run: same digest and the same metrics lines (wall-clock fields aside).
"""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from curvzo_ds.cli import main
from tests.helpers import CHECK, CLI, COMMON, ENV, ROOT, free_port, metrics_lines, run_cli, train


def test_straight_run_trains_and_writes_the_contract(straight):
    out, summary = straight
    assert summary["world_size"] == 1 and summary["steps"] == 12
    assert summary["best_dev"] is not None and "accuracy" in summary["test"]
    rows = metrics_lines(out)
    train_rows = [r for r in rows if "split" not in r]
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    assert any(r["projected_grad"] not in (0, None) for r in train_rows)
    # Rotation kept the last two checkpoints and the best-dev one.
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    trainer = json.loads((out / "checkpoint-12" / "manifest.json").read_text())["trainer"]
    best = pathlib.Path(trainer["checkpoints"]["best_dev"]["checkpoint"]).name
    assert {"checkpoint-9", "checkpoint-12", best} == set(kept)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["torchrun.sh", "deepspeed.sh", "accelerate.sh", "mpirun.sh"])
def test_every_launcher_gives_the_one_process_result(straight, tmp_path, kind):
    """Each launcher through its script in launch/, as the README tells users to start them."""
    if kind == "mpirun.sh" and shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed (apt-get install openmpi-bin; .ci/run does it)")
    port = free_port()
    summary = train(kind, 2, tmp_path / kind, port=port)
    assert summary["world_size"] == 2
    # DeepSpeed's CPU shared-memory all-reduce buffers (deepspeed and mpirun launches) are not left in /dev/shm.
    assert not list(pathlib.Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert summary["params_digest"] == straight[1]["params_digest"]
    assert len(summary["peak_rss_bytes"]) == 2


@pytest.mark.multirank
def test_the_accelerate_config_is_mapped_like_a_deepspeed_file(tmp_path):
    """`accelerate launch` without --deepspeed: the Accelerate config's DeepSpeed settings are honoured or refused."""
    import yaml

    base = yaml.safe_load((ROOT / "ds_configs" / "accelerate_zero3.yaml").read_text())

    port = free_port()

    def launch(name: str, processes: int, **settings) -> subprocess.CompletedProcess:
        conf = {**base, "num_processes": processes, **settings.pop("top", {})}
        conf["deepspeed_config"] = {**base["deepspeed_config"], **settings}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(conf))
        cmd = [shutil.which("accelerate"), "launch", "--config_file", str(tmp_path / f"{name}.yaml"),
               "--main_process_port", str(port), "-m", "curvzo_ds.cli", "train", "--set", "max_steps=2",
               "--set", "disable_tqdm=true", "--set", "report_to=none", "--set", f"output_dir={tmp_path / name}"]
        return subprocess.run(cmd, env={**ENV, "MASTER_PORT": str(port)}, capture_output=True, text=True, timeout=400,
                              cwd=str(ROOT))

    refused = launch("stage2", 2, zero_stage=2)
    assert refused.returncode != 0 and not (tmp_path / "stage2" / "summary.json").exists()
    errors = [line for line in refused.stderr.splitlines() if line.startswith("curvzo-ds train: error: ")]
    assert len(errors) == 2 and all("Use zero_optimization.stage 3" in line for line in errors), refused.stderr[-3000:]

    mapped = launch("offload_bf16", 1, offload_param_device="cpu", top={"mixed_precision": "bf16"})
    assert mapped.returncode == 0, mapped.stderr[-3000:]
    run_config = json.loads((tmp_path / "offload_bf16" / "checkpoint-2" / "run_config.json").read_text())
    assert (run_config["offload_param"], run_config["dtype"]) == ("cpu", "bfloat16")


@pytest.mark.multirank
@pytest.mark.parametrize("first,second", [(1, 1), (2, 2), (2, 3)])
def test_resume_equals_the_straight_run(straight, tmp_path, first, second):
    out = tmp_path / "resumed"
    kind = "python" if first == 1 else "torchrun"
    train(kind, first, out, "--set", "max_steps=6")
    kind = "python" if second == 1 else "torchrun"
    summary = train(kind, second, out, "--resume")
    assert summary["params_digest"] == straight[1]["params_digest"]
    assert metrics_lines(out) == metrics_lines(straight[0])
    same_place = {**straight[1]["best_dev"], "checkpoint": str(out / pathlib.Path(straight[1]["best_dev"]
                                                                                 ["checkpoint"]).name)}
    assert summary["best_dev"] == same_place and summary["test"] == straight[1]["test"]


def test_export_loads_and_matches_the_digest(straight, tmp_path):
    out, summary = straight
    export = tmp_path / "hf"
    assert main(["export", str(out / "checkpoint-12"), "--out", str(export)]) == 0
    check = subprocess.run([sys.executable, str(CHECK), str(out), "--export", str(export)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert sum(p.numel() for p in model.parameters()) == summary["num_params"]


@pytest.mark.parametrize("args,words", [
    (["--set", "learnin_rate=1e-3"], "did you mean 'learning_rate'"),
    (["--set", "max_steps=abc"], "max_steps"),
    (["--set", "zo_eps=-1"], "zo_eps"),
    (["--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    (["--deepspeed", "/nonexistent.json"], "/nonexistent.json"),
    (["--set", "zero_stage=2"], "use 3"),
    (["--set", "novalue"], "KEY=VALUE"),
])
def test_bad_config_is_one_line_and_exit_2(capsys, args, words):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.slow
@pytest.mark.parametrize("setting,words", [
    ("task=SST2", "names are lower case: 'sst2'"),
    ("global_batch_size=5000", "lower global_batch_size or raise num_train"),
    ("lora_target_modules=foo", "lora_target_modules=['foo']"),
])
def test_bad_task_data_or_model_setting_is_one_line_and_exit_2(tmp_path, setting, words):
    """Errors found while building the task, data and model (past the config check) are one line too."""
    cmd = CLI + ["--set", setting, "--set", "lora=true", "--set", f"output_dir={tmp_path}"]
    proc = run_cli(cmd, env=ENV, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("curvzo-ds train: error: ") and words in errors[0], errors


@pytest.mark.slow
def test_a_log_file_gets_progress_lines_not_a_bar(tmp_path):
    """stderr is a pipe here, as in a cluster job's log file: progress comes as log lines, as do evaluations and
    saves."""
    args = ["disable_tqdm=false" if a == "disable_tqdm=true" else a for a in COMMON]
    cmd = CLI + args + ["--set", "max_steps=6", "--set", "progress_interval=0", "--set", f"output_dir={tmp_path}"]
    env = {**ENV, "MASTER_PORT": str(free_port())}
    proc = run_cli(cmd, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "\r" not in proc.stderr
    steps = [line.split("step ")[1].split(" ")[0] for line in proc.stderr.splitlines() if "INFO step " in line
             and "/6" in line]
    assert steps == [f"{i}/6" for i in range(1, 7)], proc.stderr[-3000:]
    assert "INFO step 3: dev loss" in proc.stderr and "ETA" in proc.stderr
    assert f"INFO saved {tmp_path / 'checkpoint-3'}" in proc.stderr
