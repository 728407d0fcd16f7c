"""Evaluation under ZeRO-3: examples in fixed micro-batches, micro-batch j on rank j mod W; `Evaluator` holds a
run's evaluation schedule.

Every rank runs the same number of forwards (and of `generate` calls, with synced_gpus), so
the collective gathers stay in step; the micro-batches and their padding do not depend on the
world size, so the metrics are identical at any number of ranks.

The split's `loss` is the run's training loss over it (docs/contracts.md): with objective=accuracy or f1, minus the
metric, taken from the same forward or the same greedy answers as the metric (no second pass).
"""

from __future__ import annotations

import torch

from curvzo_ds import data as D
from curvzo_ds.data.stream import chunks, round_robin_slots
from curvzo_ds.shard.forwards import eval_mode


@torch.no_grad()
def evaluate(model, task, tokenizer, encoded: list[dict], micro_batch_size: int, comm, device,
             max_new_tokens: int, loss_fn) -> dict:
    """The split's loss and the task's metrics, the same on every rank."""
    parts = chunks(len(encoded), micro_batch_size)
    w = comm.world_size
    results = []
    with eval_mode(D.inner_module(model)):
        for j in round_robin_slots(len(parts), comm.rank, w):
            idx = parts[j if j is not None else 0]
            batch = D.to_device(D.collate([encoded[i] for i in idx], tokenizer.pad_token_id), device)
            if task.is_classification and loss_fn in (D.classification_loss, D.accuracy_loss):
                loss_sum, count, pred = D.classification_eval(model, batch)  # one forward for both
            elif isinstance(loss_fn, D.F1Loss):
                loss_sum = count = 0.0  # from the answers generated below
            else:
                loss_sum, count = loss_fn(model, batch)
                pred = D.predict_classification(model, batch) if task.is_classification else None
            row = {"chunk": j, "loss_sum": float(loss_sum), "count": float(count)}
            if task.is_classification:
                row["pred"] = pred.tolist()
                row["labels"] = batch.get("accepted", batch["labels"].tolist())  # ReCoRD: every right entity
                if loss_fn is D.accuracy_loss:
                    row["loss_sum"] = -sum(D.accuracy([p], [g]) for p, g in zip(row["pred"], row["labels"]))
            else:
                # Each generate() is collective under ZeRO-3: as many calls on every rank, so a short
                # last part is padded with its first prompt (answers do not depend on the batching).
                prompts = batch["prompt_ids"]
                padded = prompts + prompts[:1] * (len(parts[0]) - len(prompts))
                answers = D.generate_answers(model, tokenizer, padded, max_new_tokens, synced_gpus=w > 1,
                                             stop_at_newline=D.stops_at_newline(task))
                row["pred"] = answers[:len(prompts)]
                row["gold"] = batch["answers"]
                if isinstance(loss_fn, D.F1Loss):
                    row["loss_sum"] = -sum(D.f1(p, g) for p, g in zip(row["pred"], row["gold"]))
                    row["count"] = float(len(prompts))
            if j is not None:
                results.append(row)
    rows = sorted((row for part in comm.all_gather_object(results) for row in part), key=lambda x: x["chunk"])
    loss = D.mean_loss((row["loss_sum"], row["count"]) for row in rows)
    out = {"loss": loss if any(row["count"] for row in rows) else None}
    if task.is_classification:
        preds = [p for row in rows for p in row["pred"]]
        labels = [g for row in rows for g in row["labels"]]
        out["accuracy"] = D.accuracy(preds, labels) if labels else None
    else:
        preds = [p for row in rows for p in row["pred"]]
        golds = [g for row in rows for g in row["gold"]]
        out["f1"] = sum(D.f1(p, g) for p, g in zip(preds, golds)) / max(len(golds), 1)
        out["exact_match"] = sum(D.exact_match(p, g) for p, g in zip(preds, golds)) / max(len(golds), 1)
    return out


class Evaluator:
    """A run's evaluations: `should_eval(step)` (dev every `eval_steps`), `evaluate(split, step)`, and the last
    result of each split (`last[split] = (step, metrics)`), so that the end of a run need not evaluate again.

    `of(eval_cfg, data_cfg, ...)` builds it from the config's `eval` section (eval_steps) and the `data` section's
    micro_batch_size and max_new_tokens; `add_split(name, examples)` adds a split of encoded examples (experiments/
    evaluate a fixed dev subset so)."""

    def __init__(self, model, task, tokenizer, data: dict[str, list[dict]], comm, device, loss_fn, *,
                 micro_batch_size: int, max_new_tokens: int, eval_steps: int = 0):
        self.model, self.task, self.tokenizer, self.data = model, task, tokenizer, dict(data)
        self.micro_batch_size, self.comm, self.device = micro_batch_size, comm, device
        self.max_new_tokens, self.loss_fn, self.eval_steps = max_new_tokens, loss_fn, eval_steps
        self.last: dict[str, tuple[int, dict]] = {}

    @classmethod
    def of(cls, eval_cfg, data_cfg, model, task, tokenizer, data: dict[str, list[dict]], comm, device,
           loss_fn) -> Evaluator:
        """The evaluator of a run's `eval` section (config.sections: eval_steps) and `data` section (the evaluation's
        micro_batch_size and the generation's max_new_tokens)."""
        return cls(model, task, tokenizer, data, comm, device, loss_fn, micro_batch_size=data_cfg.micro_batch_size,
                   max_new_tokens=data_cfg.max_new_tokens, eval_steps=eval_cfg.eval_steps)

    def add_split(self, name: str, examples: list[dict]) -> None:
        """Evaluate `examples` (encoded as the run's splits are) as the split `name`; an existing name is refused."""
        if name in self.data:
            raise ValueError(f"the evaluator already has a split {name!r}")
        self.data[name] = list(examples)

    def should_eval(self, step: int) -> bool:
        return "dev" in self.data and bool(self.eval_steps) and step % self.eval_steps == 0

    def evaluate(self, split: str, step: int | None = None) -> dict:
        """The split's metrics (collective); with `step`, remembered as the split's last result at that step."""
        metrics = evaluate(self.model, self.task, self.tokenizer, self.data[split], self.micro_batch_size,
                           self.comm, self.device, self.max_new_tokens, self.loss_fn)
        if step is not None:
            self.last[split] = (step, metrics)
        return metrics
