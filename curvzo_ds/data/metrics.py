"""Task metrics: accuracy, and SQuAD's token F1 and exact match (normalised, max over the gold answers)."""

import re
import string
from collections import Counter

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
    """The fraction of predictions equal to their label; a label that is a list (ReCoRD: every entity that answers)
    counts a prediction among it as right."""
    predictions, labels = list(predictions), list(labels)
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"accuracy needs as many predictions as labels, got {len(predictions)} and {len(labels)}")
    right = (int(p) in g if isinstance(g, list | tuple) else int(p) == int(g) for p, g in zip(predictions, labels))
    return sum(right) / len(labels)
