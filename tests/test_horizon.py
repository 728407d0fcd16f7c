"""Issue 57's rate and issue 59's divergence, through the CLI with real processes: `learning_rate: auto`,
`lr_scheduler_type: plateau` and `step_normalization: running_rms` give bit-identical runs at 1 and 2 ranks and
resume exactly; a run forced to diverge (a rate 100x the demo's) rolls back the same way at 1 and 2 ranks and ends
finite, or stops with exit code 4 in one line (docs/reliability.md, "A run that diverges")."""

import json
import math
import shutil

import pytest

from tests.helpers import COMMON, ENV, checkpoints, cli, free_port, metrics_rows, train

pytestmark = pytest.mark.slow

HORIZON = ["--set", "method=mezo", "--set", "step_normalization=running_rms", "--set", "learning_rate=auto",
           "--set", "lr_scheduler_type=plateau", "--set", "plateau_patience=1"]
# The demo's preset rate is 3e-4: 100x that diverges within 10 steps (the train loss's running mean doubles).
DIVERGE = ["--set", "max_steps=30", "--set", "eval_steps=10", "--set", "save_steps=10", "--set", "learning_rate=3e-2"]


@pytest.mark.multirank
def test_auto_rate_plateau_and_running_rms_are_the_same_at_1_and_2_ranks_and_resume_exactly(tmp_path):
    one = train("python", 1, tmp_path / "one", *HORIZON)
    two = train("torchrun", 2, tmp_path / "two", *HORIZON)
    assert one["params_digest"] == two["params_digest"]
    assert one["learning_rate_chosen"] == two["learning_rate_chosen"] > 0
    rates = [r["learning_rate"] for r in metrics_rows(tmp_path / "one") if "split" not in r]
    assert rates == [r["learning_rate"] for r in metrics_rows(tmp_path / "two") if "split" not in r]
    assert rates[0] == one["learning_rate_chosen"] and min(rates) < rates[0]  # patience 1: at least one cut
    # summary.json's zero_shot_dev: the step-0 eval line's metrics (kept across the resume below: the watch's state)
    zero = next(r for r in metrics_rows(tmp_path / "one") if r.get("split") == "dev" and r["step"] == 0)
    assert one["zero_shot_dev"]["loss"] == zero["loss"] and two["zero_shot_dev"] == one["zero_shot_dev"]
    # resume from the middle: the rate's state (the chosen rate, the plateau's best and cuts) comes back with it
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "one", again)
    mid = max(step for step in checkpoints(again) if 0 < step < 12)
    shutil.rmtree(again / "checkpoint-12")
    proc = cli("train", *COMMON, *HORIZON, "--set", f"output_dir={again}", "--resume", str(again / f"checkpoint-{mid}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((again / "summary.json").read_text())
    assert resumed["params_digest"] == one["params_digest"] and resumed["zero_shot_dev"] == one["zero_shot_dev"]
    # under the plateau schedule the evaluations are part of the trajectory: eval_steps may not change on resume
    proc = cli("train", *COMMON, *HORIZON, "--set", f"output_dir={again}", "--set", "max_steps=14", "--set",
               "eval_steps=4", "--resume")
    assert proc.returncode == 2 and "eval_steps" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.multirank
def test_a_run_forced_to_diverge_rolls_back_the_same_at_1_and_2_ranks_and_ends_finite(tmp_path):
    # 100x needs more halvings than the default max_rollbacks (3) to train: 0.5^6 leaves 1.6x the demo's rate
    one = train("python", 1, tmp_path / "one", *DIVERGE, "--set", "max_rollbacks=6")
    two = train("torchrun", 2, tmp_path / "two", *DIVERGE, "--set", "max_rollbacks=6")
    assert one["params_digest"] == two["params_digest"] and one["rollbacks"] == two["rollbacks"] >= 1
    events = [r for r in metrics_rows(tmp_path / "one") if r.get("event") == "rollback"]
    assert len(events) == one["rollbacks"] and events[0]["learning_rate"] == pytest.approx(1.5e-2)
    assert events == [r for r in metrics_rows(tmp_path / "two") if r.get("event") == "rollback"]
    assert (tmp_path / "one" / "metrics-diverged-1.jsonl").stat().st_size > 0  # the diverged stretch is kept
    assert all(math.isfinite(v["loss"]) for v in one["final"].values())


def test_on_divergence_stop_exits_4_in_one_line_with_its_checkpoints_intact(tmp_path):
    out = tmp_path / "stop"
    proc = cli("train", *COMMON, *DIVERGE, "--set", "on_divergence=stop", "--set", "eval_steps=3", "--set",
               "save_steps=3", "--set", f"output_dir={out}", env={**ENV, "MASTER_PORT": str(free_port())})
    assert proc.returncode == 4, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "diverged at step" in line]
    assert len(lines) == 1 and "learning rate 0.03" in lines[0] and "on_divergence=stop" in lines[0], proc.stderr
    best = lines[0].split("best-dev checkpoint ")[1].split(" is intact")[0]
    assert (out / best.split("/")[-1] / "manifest.json").exists() and not (out / "summary.json").exists()


def test_a_run_no_better_than_its_zero_shot_evaluation_says_so_in_one_warning(tmp_path):
    """A finite run whose best dev evaluation does not beat the step-0 one (docs/reliability.md, "A run that only
    made the model worse"): one warning naming both, before the done line; summary.json's zero_shot_dev is the step-0
    eval line. A run that improved has no warning."""
    short = ["--set", "method=mezo", "--set", "max_steps=3", "--set", "eval_steps=3", "--set", "learning_rate=3e-3"]
    for seed, worse in ((7, True), (1, False)):  # at 10x the demo's rate, 3 steps: seed 7's dev loss rose, 1's fell
        out = tmp_path / str(seed)
        proc = cli("train", *COMMON, *short, "--set", f"seed={seed}", "--set", f"output_dir={out}",
                   env={**ENV, "MASTER_PORT": str(free_port())})
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        zero = next(r for r in metrics_rows(out) if r.get("split") == "dev" and r["step"] == 0)
        assert summary["zero_shot_dev"] == {k: zero[k] for k in ("loss", "accuracy")}
        lines = [line for line in proc.stderr.splitlines() if "no better by" in line]
        assert len(lines) == int(worse), proc.stderr[-3000:]
        if worse:
            assert f"the best dev evaluation (step 3: loss {summary['best_dev']['loss']:.4g}" in lines[0]
            assert f"(before the first step: loss {zero['loss']:.4g}, accuracy {zero['accuracy']:.4g})" in lines[0]
            assert proc.stderr.index(lines[0]) < proc.stderr.index("done: 3 steps")
