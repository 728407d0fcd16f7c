"""Data: the world-size-independent step stream, encoding, losses, generation and metrics.

- `stream`: which examples a step uses, micro-batches, and which rank runs which (the core promise);
- `encoding`: examples to token ids, token ids to padded micro-batches;
- `losses`: `loss_fn(model, micro_batch) -> (loss_sum, count)` and the classification scores;
- `objectives`: which loss a run takes (`loss_fn_for`), the metric objectives (`accuracy`, `f1`) among them;
- `generation`: greedy answers for generation tasks;
- `metrics`: accuracy, F1, exact match.
"""

from curvzo_ds.data.encoding import check_tokenizer, collate, encode, to_device
from curvzo_ds.data.generation import generate_answers, newline_ids, stops_at_newline
from curvzo_ds.data.losses import (
    candidate_scores,
    classification_eval,
    classification_loss,
    inner_module,
    lm_loss,
    mean_loss,
    predict_classification,
)
from curvzo_ds.data.metrics import accuracy, exact_match, f1, normalize_answer
from curvzo_ds.data.objectives import OBJECTIVES, F1Loss, Objective, accuracy_loss, check_objective, loss_fn_for
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
    "round_robin_slots", "inner_module", "check_tokenizer", "stops_at_newline", "OBJECTIVES", "Objective", "F1Loss",
    "accuracy_loss", "check_objective",
]
