"""Users' own code: an Accelerate loop (`curvzo_ds.from_accelerator`) and `ZOTrainer`, at 1 and 2 ranks.

Each test launches tests/multirank/integ_worker.py in real processes and reads what rank 0 wrote.
Thresholds were fixed before these runs, from one-process runs of the same data (the worker's
`examples` docstring): the loss must fall by at least 0.1 nats in the 40-step loop and 0.05 nats of
eval loss in the 30-step Trainer run (the one-process runs fell by 0.15-0.24 and 0.18).
"""

import json
import pathlib
import shutil
import sys

import pytest

from tests.helpers import ENV, ROOT, free_port, run_checked

WORKER = str(ROOT / "tests" / "multirank" / "integ_worker.py")
ACCELERATE_CFG = str(ROOT / "ds_configs" / "accelerate_zero3.yaml")


def launch(cmd: list[str], out: pathlib.Path, port: int, **env_extra: str) -> dict:
    run_checked(cmd, {**ENV, "MASTER_PORT": str(port), **env_extra})
    return json.loads(out.read_text())


def accelerate_loop(n: int, out: pathlib.Path, port: int) -> dict:
    cmd = [shutil.which("accelerate"), "launch", "--config_file", ACCELERATE_CFG, "--num_processes", str(n),
           "--main_process_port", str(port), WORKER, "loop", str(out)]
    return launch(cmd, out, port)


def eval_losses(history: list[dict]) -> dict[int, float]:
    return {row["step"]: row["eval_loss"] for row in history if "eval_loss" in row}


def train_rows(history: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in history if "loss" in row}


@pytest.mark.multirank
def test_accelerate_loop_two_ranks_saves_loads_and_matches_one_rank(tmp_path):
    two = accelerate_loop(2, tmp_path / "two.json", free_port())
    assert two["world_size"] == 2 and two["ds_engine"] == "DeepSpeedEngine"
    assert two["optimizer"] == "NoneType" and two["no_grads"]
    assert two["accelerator_optimizers"] in ([], ["DeepSpeedZeRoOffload"])
    assert two["loss_after"] < two["loss_before"] - 0.1, (two["loss_before"], two["loss_after"])
    # accelerator.save_state() went through the hooked engine.save_checkpoint (no hang) ...
    assert "pytorch_model" in two["saved_files"]
    manifest = json.loads((tmp_path / "two.json.d" / "state-20" / "pytorch_model" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 20
    # ... and load_state() restored the weights and the ZO state: the replayed steps give the same weights.
    assert two["step_after_load"] == 20
    assert two["digest_after_load"] == two["digests"]["20"]
    assert two["digest_replayed"] == two["digests"]["40"]
    # split_batch deals the global batch out by micro-batch: one rank gives the same trajectory.
    one = accelerate_loop(1, tmp_path / "one.json", free_port())
    assert one["world_size"] == 1
    assert one["digests"] == two["digests"] and one["losses"] == two["losses"]


def check_trainer_run(r: dict, out_dir: pathlib.Path, world: int) -> None:
    assert r["world_size"] == world and r["global_step"] == 30
    assert r["optimizer"] == "NoneType" and r["ds_optimizer"] == "NoneType" and r["no_grads"]
    evals = eval_losses(r["log_history"])
    assert sorted(evals) == [0, 10, 20, 30]  # eval_on_start, eval_steps=10
    assert evals[30] < evals[0] - 0.05, evals
    assert sorted(train_rows(r["log_history"])) == [5, 10, 15, 20, 25, 30]  # logging_steps=5
    assert r["checkpoints"] == ["checkpoint-20", "checkpoint-30"]  # save_steps=10, save_total_limit=2
    assert r["tensorboard"]  # report_to=tensorboard reached the Trainer's callback
    manifest = json.loads((out_dir / "checkpoint-30" / "manifest.json").read_text())
    assert manifest["world_size"] == world and manifest["step"] == 30
    state = json.loads((out_dir / "checkpoint-30" / "trainer_state.json").read_text())
    assert state["global_step"] == 30


@pytest.mark.slow
def test_zotrainer_one_process_trains_logs_saves_and_resumes(tmp_path):
    out = tmp_path / "t.json"
    r = launch([sys.executable, WORKER, "trainer", str(out)], out, free_port())
    check_trainer_run(r, tmp_path / "t.json.d", 1)
    assert r["ds_engine"] == "LlamaForCausalLM"  # no DeepSpeed in this run
    # Resumed from checkpoint-20: the same weights and the same training log (rows up to step 20 come from the
    # checkpoint's trainer_state.json, rows 25 and 30 are computed again).
    assert r["digest_resumed"] == r["digest"]
    drop = ("train_runtime",)
    straight = {s: {k: v for k, v in row.items() if k not in drop} for s, row in train_rows(r["log_history"]).items()}
    resumed = {s: {k: v for k, v in row.items() if k not in drop}
               for s, row in train_rows(r["log_history_resumed"]).items()}
    assert resumed == straight
    # The seed comes from TrainingArguments and decides the trajectory.
    assert (r["zo_seed_seed11"], r["zo_seed_seed12"]) == (11, 12)
    assert r["digest_seed11"] == r["digest_seed11_again"] != r["digest_seed12"]


@pytest.mark.multirank
def test_zotrainer_under_deepspeed_two_ranks_with_the_hf_auto_config_and_resume(tmp_path):
    def run(name: str, port: int, **env: str) -> dict:
        out = tmp_path / name
        cmd = [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(port), WORKER, "trainer", str(out)]
        return launch(cmd, out, port, **env)

    r = run("t.json", free_port())
    check_trainer_run(r, tmp_path / "t.json.d", 2)
    assert r["ds_engine"] == "DeepSpeedEngine"
    assert r["world_process_zero"] == [True, False]
    # A second launch resumed from checkpoint-20: the same weights and training log rows; rank 1 stays
    # non-zero although trainer_state.json was written by rank 0.
    resumed = run("r.json", free_port(), ZO_RESUME=str(tmp_path / "t.json.d" / "checkpoint-20"))
    assert resumed["world_process_zero"] == [True, False]
    assert resumed["digest"] == r["digest"]
    assert train_rows(resumed["log_history"]) == train_rows(r["log_history"])
