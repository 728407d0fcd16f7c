"""experiments/core.py and experiments/stats.py: the run core runs the product's steps, an arm is a row of config keys,
a task variant is a parameter; the shared figures (mean_sd, c_q, the RLOO rate ratio) once, with known values."""

import dataclasses
import json
import math

import pytest

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.train.plain import PlainRun
from experiments import core
from experiments.smollm import write_task
from experiments.stats import c_q, mean_sd, rloo_moment, rloo_per_forward, rloo_rate_ratio


def test_mean_sd_has_no_sd_for_one_seed():
    assert mean_sd([1.0, 2.0, 3.0]) == "2.0000 ± 1.0000"  # ddof 1
    assert mean_sd([0.5]) == "0.5000 (1 seed)"  # not "± 0.0000", and not silently the bare value


def test_c_q_and_the_rate_ratio_are_the_second_moments_ratio():
    assert c_q(2) == pytest.approx(2.0) and c_q(4) == pytest.approx(4 / 3)
    # q = 4, ‖g‖² = 1, tr H = 3: gᵀHg = 0 leaves tr H / 3; gᵀHg = 1 adds c_4 = 2/4 + (3/4)(1 + 1/9) = 4/3
    assert rloo_moment(4, 3.0, 0.0, 1.0) == pytest.approx(1.0)
    assert rloo_moment(4, 3.0, 1.0, 1.0) == pytest.approx(1.0 + 4 / 3)
    # the rate ratio is MeZO's E ĝᵀHĝ = ‖g‖² tr H (1 + 2x) over RLOO's, at any ‖g‖², tr H and x
    for q, g2, trace, x in ((8, 1.0, 1.0, 0.0), (8, 2.5, 0.3, 0.142), (4, 0.7, 5.0, 0.036), (16, 1.0, 2.0, 0.5)):
        mezo = g2 * trace * (1 + 2 * x)
        assert rloo_rate_ratio(q, x) == pytest.approx(mezo / rloo_moment(q, trace, x * g2 * trace, g2))
        assert rloo_per_forward(q, x) == pytest.approx(2 / q * rloo_rate_ratio(q, x))
    assert rloo_rate_ratio(8, 0.0) == pytest.approx(7)


def test_forwards_per_step_and_arm_rows():
    assert core.forwards_per_step({"method": "mezo"}) == 2
    assert core.forwards_per_step({"difference": "rloo", "num_directions": 8}) == 8
    assert core.forwards_per_step({"num_directions": 3}) == 6
    with pytest.raises(SystemExit, match="arm x: this checkout's TrainConfig has no no_such_key"):
        core.arm_config(TrainConfig(), {"no_such_key": 1}, "x")
    assert core.every(40, 100) == {0: ["dev"], 40: ["dev"], 80: ["dev"], 100: ["dev"]}


def test_run_curve_runs_the_products_steps():
    """run_curve of an arm (a row of config keys) gives the dev loss a hand loop of PlainRun gives, at the points asked
    for in forwards (rloo with q = 4: 4 forwards a step), and sets max_steps to the horizon."""
    base = TrainConfig(model="demo", task="demo", learning_rate=1e-2, zo_eps=1e-3, global_batch_size=8,
                       micro_batch_size=8, seed=3)
    arm = dict(method="mezo", difference="rloo", num_directions=4)
    got = core.run_curve(base, arm, {0: ["dev"], 8: ["dev"], 16: ["dev"]}, test=False)
    assert [(c["step"], c["forwards"]) for c in got["curve"]] == [(0, 0), (2, 8), (4, 16)] and "test" not in got
    run = PlainRun(dataclasses.replace(core.arm_config(base, arm), max_steps=4))
    losses = [run.evaluate("dev")["loss"]]
    for t in range(4):
        run.engine.step(run.batch(t))
        if t % 2 == 1:
            losses.append(run.evaluate("dev")["loss"])
    assert [c["loss"] for c in got["curve"]] == losses and losses[0] != losses[-1]
    with pytest.raises(ValueError, match="multiples of 4"):
        core.run_curve(base, arm, {0: ["dev"], 6: ["dev"]})


def test_run_curve_rolls_back_a_diverging_run_as_the_cli_does():
    """rollback=True: a dev loss above 2x the best goes back to the best evaluation's state at half the rate, the
    forwards counting on (the abandoned ones spent), until max_rollbacks (3) are spent and the run stops. The state
    comes back whole: the step after a rollback to step 0 is a fresh run's at half the rate, bit for bit. A run that
    never meets the rule is the run without rollback, bit for bit (so a run cached without it stands for both)."""
    base = TrainConfig(model="demo", task="demo", learning_rate=0.1, zo_eps=1e-3, global_batch_size=8,
                       micro_batch_size=8, seed=3)
    got = core.run_curve(base, dict(method="mezo"), core.every(4, 40), test=False, rollback=True)
    rolls = got["rollbacks"]
    assert [r["learning_rate"] for r in rolls] == [0.05, 0.025, 0.0125] and all(r["to_step"] == 0 for r in rolls)
    assert "above 2x the best so far" in rolls[0]["reason"] and "zero-shot" in rolls[0]["reason"]
    forwards = [c["forwards"] for c in got["curve"]]
    assert forwards == list(range(0, forwards[-1] + 1, 4)) and forwards[-1] < 40  # stopped: its rollbacks spent
    assert "above 2x" in got["curve"][-1]["diverged"]
    after = next(c for c in got["curve"] if c["forwards"] == rolls[0]["forwards"] + 4)
    fresh = core.run_curve(dataclasses.replace(base, learning_rate=0.05), dict(method="mezo"), {0: ["dev"], 4: ["dev"]},
                           test=False)
    assert after["step"] == 2 and after["loss"] == fresh["curve"][-1]["loss"]
    stable = dataclasses.replace(base, learning_rate=1e-3)
    kept = core.run_curve(stable, dict(method="mezo"), core.every(4, 16), test=False, rollback=True)
    plain = core.run_curve(stable, dict(method="mezo"), core.every(4, 16), test=False)
    assert kept["rollbacks"] == [] and kept["curve"] == plain["curve"] and "rollbacks" not in plain


def test_label_noise_flips_a_fixed_share_of_train_labels(tmp_path):
    task = write_task(str(tmp_path / "tasks"), "sentiment")
    noisy = core.label_noise(task, 0.2, str(tmp_path / "noisy"))
    read = lambda d, split: [json.loads(x) for x in open(f"{d}/{split}.jsonl")]  # noqa: E731
    before, after = read(task, "train"), read(noisy, "train")
    flipped = [a["label"] != b["label"] for a, b in zip(before, after)]
    assert sum(flipped) == round(0.2 * len(before)) and [a["text"] for a in after] == [b["text"] for b in before]
    assert read(noisy, "dev") == read(task, "dev") and read(noisy, "test") == read(task, "test")
    assert core.label_noise(task, 0.2, str(tmp_path / "again")) != noisy  # another folder,
    assert read(str(tmp_path / "again" / "sentiment-label-noise-0.2-0"), "train") == after  # the same labels
    assert math.isclose(sum(flipped) / len(flipped), 0.2, abs_tol=1 / len(flipped))
