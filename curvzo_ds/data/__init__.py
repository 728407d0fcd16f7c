"""Data: the world-size-independent step stream, encoding, losses, generation and metrics.

- `stream`: which examples a step uses, micro-batches, and which rank runs which (the core promise);
- `encoding`: examples to token ids, token ids to padded micro-batches;
- `losses`: `loss_fn(model, micro_batch) -> (loss_sum, count)` and the classification scores;
- `generation`: greedy answers for generation tasks;
- `metrics`: accuracy, F1, exact match.
"""

from curvzo_ds.data.encoding import collate, encode, to_device
from curvzo_ds.data.generation import generate_answers, newline_ids
from curvzo_ds.data.losses import (
    candidate_scores,
    classification_eval,
    classification_loss,
    inner_module,
    lm_loss,
    loss_fn_for,
    mean_loss,
    predict_classification,
)
from curvzo_ds.data.metrics import accuracy, exact_match, f1, normalize_answer
from curvzo_ds.data.stream import (
    MicroBatches,
    chunks,
    micro_batch_indices,
    round_robin_slots,
    split_batch,
    step_indices,
)

__all__ = [
    "encode", "collate", "to_device", "loss_fn_for", "classification_loss", "lm_loss", "candidate_scores",
    "predict_classification", "classification_eval", "mean_loss", "generate_answers", "accuracy", "f1", "exact_match",
    "normalize_answer", "newline_ids", "MicroBatches", "split_batch", "step_indices", "chunks", "micro_batch_indices",
    "round_robin_slots", "inner_module",
]
