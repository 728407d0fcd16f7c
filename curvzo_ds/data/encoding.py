"""Examples to token ids, and token ids to micro-batches (MeZO's choices).

encode:  one example -> {"input_ids": one row per candidate, "option_len", "label", ...}
collate: encoded examples -> a micro-batch of tensors, right-padded to its own longest row

Label tokens are the last `option_len` tokens of a row: the tokens of prompt+candidate
after their common prefix with the tokens of the prompt alone. That is MeZO's
len(prompt+candidate) - len(prompt) when the tokenizer does not merge across the
boundary, and still covers the answer when it does. Leading special tokens (Llama's <s>,
OPT's </s>) are kept when a row is cut from the left.
"""

import torch

from curvzo_ds.tasks import Task


def encode(task: Task, tokenizer, example: dict, max_length: int, train_as_classification: bool = True,
           max_new_tokens: int = 50) -> dict:
    """Token ids of one example, as plain Python lists.

    "cut" is True when a row was longer than max_length and lost tokens from the left; "prompt_kept" is the fewest
    prompt tokens any row kept (0: max_length left only special and label tokens); "needs" is the shortest
    max_length that keeps one prompt token in every row.
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
    rows, option_lens, cut, kept, needs = [], [], False, [], 0
    for candidate in candidates:
        ids = tokenizer.encode((prompt + candidate).strip(" "))
        option_len = len(ids) - _common_prefix(prompt_ids, ids)
        if option_len == 0:
            raise ValueError(f"task {task.name}: candidate {candidate!r} adds no token to the prompt")
        cut |= len(ids) > max_length
        needs = max(needs, n_special + option_len + 1)
        ids = _cut_left(ids, max_length, n_special)
        kept.append(max(0, len(ids) - n_special - option_len))
        rows.append(ids)
        option_lens.append(min(option_len, len(ids) - 1))
    out = {"input_ids": rows, "option_len": option_lens, "label": label, "cut": cut, "prompt_kept": min(kept),
           "needs": needs}
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
