"""Examples to token ids, micro-batches, the two losses, and evaluation (MeZO's choices).

encode:  one example -> {"input_ids": one row per candidate, "option_len", "label", ...}
collate: encoded examples -> a micro-batch of tensors, right-padded to its own longest row
losses:  loss_fn(model, micro_batch) -> (loss_sum, count), the contract of CONTRACTS.md

Label tokens are the last `option_len` tokens of a row: the tokens of prompt+candidate
after their common prefix with the tokens of the prompt alone. That is MeZO's
len(prompt+candidate) - len(prompt) when the tokenizer does not merge across the
boundary, and still covers the answer when it does. Leading special tokens (Llama's <s>,
OPT's </s>) are kept when a row is cut from the left.
"""

import functools
import re
import string
from collections import Counter

import torch

from curvzo_ds.tasks import Task, load_splits

__all__ = [
    "encode", "collate", "to_device", "loss_fn_for", "classification_loss", "lm_loss", "candidate_scores",
    "predict_classification", "classification_eval", "generate_answers", "accuracy", "f1", "exact_match",
    "normalize_answer", "load_splits",
]


# ---- encoding ----

def encode(task: Task, tokenizer, example: dict, max_length: int, train_as_classification: bool = True,
           max_new_tokens: int = 50) -> dict:
    """Token ids of one example, as plain Python lists.

    Classification: one row per candidate (only the gold one when train_as_classification
    is False, for lm_loss), "label" = the gold row. Generation: one row, prompt + " answer\\n",
    plus "prompt_ids" (cut to max_length - max_new_tokens) and the gold "answers".
    """
    prompt = task.prompt(example)
    candidates = task.candidates(example)
    label = task.gold(example)
    if task.is_classification and not train_as_classification:
        candidates, label = [candidates[label]], 0
    n_special = _num_leading_special(tokenizer)
    prompt_ids = tokenizer.encode(prompt.strip(" "))
    rows, option_lens = [], []
    for candidate in candidates:
        ids = tokenizer.encode((prompt + candidate).strip(" "))
        option_len = len(ids) - _common_prefix(prompt_ids, ids)
        if option_len == 0:
            raise ValueError(f"task {task.name}: candidate {candidate!r} adds no token to the prompt")
        ids = _cut_left(ids, max_length, n_special)
        rows.append(ids)
        option_lens.append(min(option_len, len(ids) - 1))
    out = {"input_ids": rows, "option_len": option_lens, "label": label}
    if not task.is_classification:
        out["prompt_ids"] = _cut_left(prompt_ids, max_length - max_new_tokens, n_special)
        out["answers"] = task.answers(example)
    return out


def _num_leading_special(tokenizer) -> int:
    """How many special tokens the tokenizer puts before the text (1 for Llama's <s> and OPT's </s>)."""
    ids, special = tokenizer.encode("x"), set(tokenizer.all_special_ids)
    n = 0
    while n < len(ids) and ids[n] in special:
        n += 1
    return n


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _cut_left(ids: list[int], max_length: int, n_keep: int) -> list[int]:
    """At most max_length ids: the first n_keep (BOS) and the end of the rest (MeZO's truncation)."""
    if len(ids) <= max_length:
        return ids
    return ids[:n_keep] + ids[len(ids) - (max_length - n_keep):]


# ---- batching ----

def collate(encoded: list[dict], pad_id: int) -> dict:
    """A micro-batch: every candidate row of every example, right-padded to the longest row here.

    Keys: input_ids, attention_mask (long, [rows, T]); label_mask (float, 1 at label tokens);
    row_example, row_candidate (long, [rows]); labels (long, gold candidate per example);
    num_examples (int); for generation also prompt_ids and answers (Python lists).
    """
    rows = [(e, c, ids, n) for e, ex in enumerate(encoded)
            for c, (ids, n) in enumerate(zip(ex["input_ids"], ex["option_len"]))]
    width = max(len(ids) for _, _, ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    label_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, (_, _, ids, option_len) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, :len(ids)] = 1
        label_mask[r, len(ids) - option_len:len(ids)] = 1.0
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "label_mask": label_mask,
        "row_example": torch.tensor([e for e, _, _, _ in rows], dtype=torch.long),
        "row_candidate": torch.tensor([c for _, c, _, _ in rows], dtype=torch.long),
        "labels": torch.tensor([ex["label"] for ex in encoded], dtype=torch.long),
        "num_examples": len(encoded),
    }
    if "prompt_ids" in encoded[0]:
        batch["prompt_ids"] = [ex["prompt_ids"] for ex in encoded]
        batch["answers"] = [ex["answers"] for ex in encoded]
    return batch


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---- losses: loss_fn(model, micro_batch) -> (loss_sum, count) ----

def _token_logprobs(model, batch: dict) -> torch.Tensor:
    """[rows, T-1] float32: log p(token t+1 | tokens <= t) at label tokens, 0 elsewhere."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["label_mask"][:, 1:] > 0
    targets = batch["input_ids"][:, 1:][mask]
    picked = torch.log_softmax(logits[:, :-1][mask].float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    out[mask] = picked  # unique positions: deterministic, unlike index_add on a GPU
    return out


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


def loss_fn_for(task: Task, train_as_classification: bool = True):
    """The training loss of a task: classification_loss, or lm_loss (generation, or when asked)."""
    return classification_loss if task.is_classification and train_as_classification else lm_loss


# ---- evaluation ----

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


@functools.lru_cache(maxsize=4)
def _newline_ids(tokenizer) -> tuple[int, ...]:
    """Every token whose text holds a newline (Llama: <0x0A>; GPT-2/OPT: Ċ and merges of it)."""
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return tuple(i for i, piece in enumerate(pieces) if "\n" in piece)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts_ids: list[list[int]], max_new_tokens: int = 50,
                     synced_gpus: bool = False) -> list[str]:
    """Greedy answers, one prompt at a time (so no answer depends on how prompts are batched).

    Decoding stops at a newline or EOS and the text is cut at the first newline (MeZO).
    Under ZeRO-3 pass synced_gpus=True, and call it on every rank with as many prompts.
    """
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the Hugging Face model
    device = next(module.parameters()).device
    stop_ids = [*_newline_ids(tokenizer), tokenizer.eos_token_id]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = []
    for ids in prompts_ids:
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        out = module.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                              num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                              pad_token_id=pad_id, synced_gpus=synced_gpus)
        text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        answers.append(text.split("\n")[0].strip())
    return answers


# ---- metrics (SQuAD's normalisation, max over the gold answers) ----

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _f1_one(prediction: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, answers: list[str]) -> float:
    """Token F1 against the best-matching gold answer."""
    return max(_f1_one(prediction, gold) for gold in answers)


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(gold) for gold in answers))


def accuracy(predictions, labels) -> float:
    predictions, labels = list(predictions), list(labels)
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"accuracy needs as many predictions as labels, got {len(predictions)} and {len(labels)}")
    return sum(int(p) == int(g) for p, g in zip(predictions, labels)) / len(labels)
