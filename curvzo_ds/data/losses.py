"""The training losses, `loss_fn(model, micro_batch) -> (loss_sum, count)` (docs/contracts.md), and the
classification scores that evaluation shares with them (MeZO's candidate log-likelihood). Which loss a run takes:
data/objectives.py (`loss_fn_for`)."""

import inspect
import math
from collections.abc import Iterable

import torch


def mean_loss(parts: Iterable[tuple[float, float]]) -> float:
    """The loss of a batch or split from its parts' (loss_sum, count): sum of loss sums / sum of counts, added in
    float64 in micro-batch order (docs/contracts.md); nan when the counts sum to 0. The step's L+ and L- and an
    evaluation's loss are this one sum."""
    num = den = 0.0
    for loss_sum, count in parts:
        num += loss_sum
        den += count
    return num / den if den else math.nan


def inner_module(model) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (or any wrapper that keeps it in `.module`), else `model` itself: where
    `forward`'s signature and `generate` are read. shard.ds_compat.module_of, which recognises only a DeepSpeed
    engine, is a layer above data."""
    return getattr(model, "module", model)


def _token_logprobs(model, batch: dict) -> torch.Tensor:
    """[rows, T-1] float32: log p(token t+1 | tokens <= t) at label tokens, 0 elsewhere.

    Logits are computed only at the positions that predict a label token of some row (`logits_to_keep`,
    transformers' slicing before the head): a handful of positions instead of T, which saves the largest
    activation of a forward ([rows, T, vocab]). No key/value cache is built (`use_cache=False`).
    """
    mask = batch["label_mask"][:, 1:] > 0
    cols = mask.any(0).nonzero().flatten()
    logits = _forward(model, batch, cols)  # [rows, len(cols), vocab]
    sub = mask[:, cols]
    targets = batch["input_ids"][:, 1:][:, cols][sub]
    picked = torch.log_softmax(logits[sub].float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    kept = torch.zeros(sub.shape, dtype=torch.float32, device=logits.device)
    kept[sub] = picked  # unique positions: deterministic, unlike index_add on a GPU
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    out[:, cols] = kept
    return out


_EXTRAS: dict[type, set[str]] = {}  # per model class: which of use_cache and logits_to_keep its forward takes


def _forward(model, batch: dict, cols: torch.Tensor) -> torch.Tensor:
    """Logits at positions `cols` (the next-token predictions of those positions)."""
    module = inner_module(model)  # a DeepSpeed engine passes keywords on to its module
    kind = type(module)
    if kind not in _EXTRAS:
        params = inspect.signature(module.forward).parameters
        any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        _EXTRAS[kind] = {k for k in ("use_cache", "logits_to_keep") if any_keyword or k in params}
    extras = _EXTRAS[kind]
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    if "use_cache" in extras:
        kwargs["use_cache"] = False
    if "logits_to_keep" in extras:
        return model(**kwargs, logits_to_keep=cols.to(batch["input_ids"].device)).logits
    return model(**kwargs).logits[:, cols]


def _scores(token_logprobs: torch.Tensor, batch: dict) -> torch.Tensor:
    return token_logprobs.sum(1) / batch["label_mask"][:, 1:].sum(1)


def candidate_scores(model, batch: dict) -> torch.Tensor:
    """[rows]: the average log-likelihood of each candidate's label tokens (MeZO's score)."""
    return _scores(_token_logprobs(model, batch), batch)


def _cross_entropy(scores: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    losses, scores = [], scores.double()
    for e in range(batch["num_examples"]):
        rows = batch["row_example"] == e
        example_scores = scores[rows]
        gold = (batch["row_candidate"][rows] == batch["labels"][e]).nonzero()[0, 0]
        losses.append(torch.logsumexp(example_scores, 0) - example_scores[gold])
    loss_sum = torch.stack(losses).sum()
    return loss_sum, torch.tensor(float(batch["num_examples"]), dtype=torch.float64, device=scores.device)


def classification_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """MeZO's train_as_classification: cross-entropy over the candidates of each example, the
    logit of a candidate being the mean log-likelihood of its label tokens. Summed over
    examples; count = number of examples."""
    return _cross_entropy(candidate_scores(model, batch), batch)


def lm_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative log-likelihood of the gold row's label tokens, summed; count = number of those tokens."""
    gold_rows = batch["row_candidate"] == batch["labels"][batch["row_example"]]
    mask = batch["label_mask"][:, 1:] * gold_rows[:, None]
    token_logprobs = _token_logprobs(model, batch)
    return -(token_logprobs.double() * mask).sum(), mask.double().sum()


def _argmax_per_example(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    chosen = []
    for e in range(batch["num_examples"]):
        rows = batch["row_example"] == e
        chosen.append(batch["row_candidate"][rows][torch.argmax(scores[rows])])
    return torch.stack(chosen)


@torch.no_grad()
def predict_classification(model, batch: dict) -> torch.Tensor:
    """[examples] long: the candidate with the highest average log-likelihood (first on ties)."""
    return _argmax_per_example(candidate_scores(model, batch), batch)


@torch.no_grad()
def classification_eval(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward for evaluation: (loss_sum, count) of classification_loss, and the predictions."""
    scores = candidate_scores(model, batch)
    return *_cross_entropy(scores, batch), _argmax_per_example(scores, batch)


def loss_parts(out) -> tuple:
    """(loss_sum, count) of a loss function's result (docs/contracts.md); anything else is refused in one line."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        shown = f"a {type(out).__name__}" if not torch.is_tensor(out) else f"a tensor of shape {list(out.shape)}"
        raise ValueError(f"loss_fn returned {shown}: it must return (loss_sum, count), and the step's loss is "
                         "the sum of loss_sum over the sum of count (docs/contracts.md); for a mean loss return "
                         "(mean, 1)")
    return tuple(out)
