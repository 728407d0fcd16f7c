"""`objective=accuracy | f1` (issue 48 §3): a task metric, negated, as the step's loss, through the loss contract; and
a user's own non-differentiable reward through the Python API (docs/integrations.md's block, run as written).

In one process on the demo model (`build_plain`: the splits, micro-batches and loss of a one-rank `curvzo-ds train`);
the multi-rank runs of objective=f1 are in tests/test_eval.py.
"""

import re

import pytest
import torch

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.data import F1Loss, accuracy_loss
from tests.helpers import ROOT


def steps(job, n: int) -> list:
    return [job.engine.step(job.batch(t)) for t in range(n)]


def test_f1_objective_moves_and_trains(tmp_path):
    """objective=f1 on a task where F1 moves (tests/f1_task.py: the gold answers are the first word of the demo
    model's own greedy answers): at the initial weights the dev F1 is between 0 and 1; each step's L+ and L- are
    minus the mean F1 of the batch's greedy answers (in [-1, 0]), a step whose two sides differ gives a non-zero
    projected gradient and moves the dev F1, and an evaluation's loss is minus its f1."""
    from curvzo_ds.train.build import build_plain
    from tests.f1_task import own_answers_task

    cfg = TrainConfig(task=str(own_answers_task(tmp_path / "own-answers")), objective="f1", global_batch_size=6,
                      micro_batch_size=2, max_new_tokens=8, max_steps=3, method="mezo", learning_rate=1e-5,
                      zo_eps=3e-4, report_to="none", disable_tqdm=True)
    job = build_plain(cfg)
    assert isinstance(job.loss, F1Loss) and job.loss.micro_batch_size == 2
    before = job.evaluate("dev")
    assert set(before) == {"loss", "f1", "exact_match"} and before["loss"] == pytest.approx(-before["f1"])
    assert 0 < before["f1"] < 1
    results = steps(job, 3)
    assert all(-1 <= r.loss_plus <= 0 and -1 <= r.loss_minus <= 0 for r in results)
    moved = [r for r in results if r.loss_plus != r.loss_minus]
    assert moved and all(r.projected_grad != 0 for r in moved), [(r.loss_plus, r.loss_minus) for r in results]
    assert job.evaluate("dev")["f1"] != before["f1"]


def test_accuracy_objective_trains_on_the_demo():
    """objective=accuracy: L+ and L- are minus the fraction of the 16 examples whose best candidate is right (a
    multiple of 1/16), and the dev loss is minus the dev accuracy."""
    from curvzo_ds.train.build import build_plain

    job = build_plain(TrainConfig(objective="accuracy", method="mezo", learning_rate=1e-3, zo_eps=1e-2, max_steps=2,
                                  report_to="none", disable_tqdm=True, num_dev=32, train_as_classification=False))
    assert job.loss is accuracy_loss
    assert all(len(ex["input_ids"]) == 2 for ex in job.train_data)  # every candidate scored, whatever the flag says
    for r in steps(job, 2):
        for loss in (r.loss_plus, r.loss_minus):
            assert -1 <= loss <= 0 and (loss * 16) == pytest.approx(round(loss * 16))
    dev = job.evaluate("dev")
    assert dev["loss"] == -dev["accuracy"]


def test_the_integrations_reward_block_runs_as_written():
    """docs/integrations.md, "A reward that is not differentiable": its Python block, on the demo model and tokenizer,
    with the names it leaves to the user defined first."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    block = re.search(r"## A reward that is not differentiable\n.*?```python\n(.*?)```", text, re.S).group(1)
    from transformers import AutoModelForCausalLM

    from curvzo_ds.tasks import demo_model_config, load_tokenizer

    torch.manual_seed(0)
    names = {"model": AutoModelForCausalLM.from_config(demo_model_config("llama")),
             "tokenizer": load_tokenizer("llama"),
             "prompts": ["The film was", "Q: the colour of the sky?\nA:", "It was", "Two and two make"],
             "wanted": ["great", "blue", "good", "four"]}
    exec(compile(block, "docs/integrations.md", "exec"), names)
    engine, result = names["engine"], names["result"]
    assert engine.step_count == 2 and all(-1 <= loss <= 0 for loss in (result.loss_plus, result.loss_minus))
