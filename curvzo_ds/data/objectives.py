"""Which loss a run's steps take, `loss_fn_for(task, data_section, tokenizer)`: the task's training loss
(data/losses.py), or with `objective` (docs/config.md) a task metric itself, negated, through the same contract
(docs/contracts.md):
- `accuracy` (classification): loss_sum = -(examples whose best-scored candidate is correct), count = examples;
- `f1` (generation): loss_sum = -(sum of the token F1 of each example's greedy answer), count = examples.
The step's loss is then minus the metric on the step's batch. Neither is differentiable: the ZO step needs none.
"""

import enum

import torch

from curvzo_ds.data.generation import generate_answers, stops_at_newline
from curvzo_ds.data.losses import classification_loss, lm_loss, predict_classification
from curvzo_ds.data.metrics import f1
from curvzo_ds.tasks import Task


class Objective(str, enum.Enum):
    """The `objective` key: what a step minimizes."""

    LOSS = "loss"  # the task's training loss (cross-entropy)
    ACCURACY = "accuracy"  # classification: minus the batch's accuracy
    F1 = "f1"  # generation: minus the batch's mean token F1


OBJECTIVES = tuple(o.value for o in Objective)


def check_objective(task: Task, objective: str) -> None:
    """A ValueError in one line where `objective` does not fit the task (the CLI's build turns it into exit 2)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is invalid: it must be one of {', '.join(OBJECTIVES)}")
    if objective == Objective.ACCURACY and not task.is_classification:
        raise ValueError(f"objective=accuracy needs a classification task (one whose candidates the model chooses "
                         f"from); task {task.name} is a {task.kind} task, scored by f1 and exact_match: use "
                         "objective=f1 or objective=loss")
    if objective == Objective.F1 and task.is_classification:
        raise ValueError(f"objective=f1 needs a generation task (squad, drop, or a completion or chat task "
                         f"directory); task {task.name} is a classification task: use objective=accuracy or "
                         "objective=loss")


def loss_fn_for(task: Task, data=None, tokenizer=None, synced_generation: bool = False):
    """The training loss of a task, from the config's data section `data` (config.sections; None: its defaults):
    classification_loss, or lm_loss (generation, or train_as_classification=false); with objective=accuracy
    `accuracy_loss`, with objective=f1 an `F1Loss`, which generates: it needs the tokenizer, and reads
    max_new_tokens and micro_batch_size (the number of generate() calls each of its calls makes).
    `synced_generation`: the weights are ZeRO-3 partitions over several ranks, so every generate() is collective."""
    train_as_classification = getattr(data, "train_as_classification", True)
    objective = getattr(data, "objective", Objective.LOSS.value)
    check_objective(task, objective)
    if objective == Objective.ACCURACY:
        return accuracy_loss
    if objective == Objective.F1:
        if tokenizer is None:
            raise ValueError("objective=f1 generates answers in every forward: loss_fn_for needs the tokenizer")
        return F1Loss(tokenizer, getattr(data, "max_new_tokens", 50), getattr(data, "micro_batch_size", 1),
                      stop_at_newline=stops_at_newline(task), synced=synced_generation)
    return classification_loss if task.is_classification and train_as_classification else lm_loss


def _right(predictions: torch.Tensor, batch: dict) -> torch.Tensor:
    """[examples] bool: each prediction is the gold candidate (or, with "accepted", any candidate counted correct)."""
    if "accepted" in batch:
        return torch.tensor([int(p) in ok for p, ok in zip(predictions.tolist(), batch["accepted"])],
                            device=predictions.device)
    return predictions == batch["labels"].to(predictions.device)


@torch.no_grad()
def accuracy_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """objective=accuracy: minus the examples whose best-scored candidate is correct (MeZO's prediction), and the
    number of examples: the step's loss is minus the batch's accuracy. One forward, as classification_loss's."""
    right = _right(predict_classification(model, batch), batch)
    return (-right.sum().to(torch.float64),
            torch.tensor(float(batch["num_examples"]), dtype=torch.float64, device=right.device))


class F1Loss:
    """objective=f1: minus the sum over examples of the token F1 of the greedy answer (generated from each example's
    prompt, as evaluation generates it) against its gold answers, and the number of examples.

    With `synced` (the weights are ZeRO-3 partitions over several ranks) each generate() is collective (synced_gpus:
    every rank runs the token steps of the longest answer): every call of this loss makes `micro_batch_size` of
    them, a shorter micro-batch (or a rank's zero-weight forward, shard/forwards.py) padded with its first prompt, so
    that ranks make as many."""

    objective = Objective.F1.value

    def __init__(self, tokenizer, max_new_tokens: int, micro_batch_size: int, stop_at_newline: bool = True,
                 synced: bool = False):
        self.tokenizer, self.max_new_tokens, self.micro_batch_size = tokenizer, max_new_tokens, micro_batch_size
        self.stop_at_newline, self.synced = stop_at_newline, synced

    def __call__(self, model, batch: dict) -> tuple[float, float]:
        prompts = batch["prompt_ids"]
        padded = prompts + prompts[:1] * (self.micro_batch_size - len(prompts))
        answers = generate_answers(model, self.tokenizer, padded, self.max_new_tokens, synced_gpus=self.synced,
                                   stop_at_newline=self.stop_at_newline)[:len(prompts)]
        return -sum(f1(a, gold) for a, gold in zip(answers, batch["answers"])), float(len(prompts))
