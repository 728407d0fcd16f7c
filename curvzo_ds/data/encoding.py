"""Examples to token ids, and token ids to micro-batches (MeZO's choices).

encode:  one example -> {"input_ids": one row per candidate, "option_len", "label", ...}
collate: encoded examples -> a micro-batch of tensors, right-padded to its own longest row

Label tokens are the last `option_len` tokens of a row: the tokens of prompt+candidate
after their common prefix with the tokens of the prompt alone. That is MeZO's
len(prompt+candidate) - len(prompt) when the tokenizer does not merge across the
boundary, and still covers the answer when it does. Leading special tokens (Llama's <s>,
OPT's </s>) are kept when a row is cut from the left.

A completion or chat task (a task directory whose lines carry their text, docs/tasks.md) has one row per example:
the prompt and the completion followed by EOS, or the conversation rendered with the tokenizer's chat template.
Its label tokens are the completion's, or those of the last assistant turn (every assistant turn with
"assistant_turns": "all": several spans, "spans"); a line whose prompt max_length cuts to nothing is refused, naming
its file and line.
"""

import torch

from curvzo_ds.tasks import Task
from curvzo_ds.tasks.splits import WHERE
from curvzo_ds.tasks.task import CHAT, COMPLETION


def encode(task: Task, tokenizer, example: dict, max_length: int, train_as_classification: bool = True,
           max_new_tokens: int = 50) -> dict:
    """Token ids of one example, as plain Python lists.

    "cut" is True when a row was longer than max_length and lost tokens from the left; "prompt_kept" is the fewest
    prompt tokens any row kept (0: max_length left only special and label tokens); "needs" is the shortest
    max_length that keeps one prompt token in every row.
    Classification: one row per candidate (only the gold one when train_as_classification
    is False, for lm_loss), "label" = the gold row. Generation: one row, prompt + " answer\\n",
    plus "prompt_ids" (cut to max_length - max_new_tokens) and the gold "answers". A task whose candidates count
    more than one as correct (ReCoRD) adds "accepted", their indices. A completion or chat task: `encode_text`.
    """
    if task.has_own_text:
        return encode_text(task, tokenizer, example, max_length, max_new_tokens)
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
    if task.accepted is not None and len(rows) > 1:  # every candidate scored: which of them count as correct
        out["accepted"] = task.correct(example)
    if not task.is_classification:
        out["prompt_ids"] = _cut_left(prompt_ids, max_length - max_new_tokens, n_special)
        out["answers"] = task.answers(example)
    return out


def check_tokenizer(task: Task, tokenizer) -> None:
    """A chat task needs a tokenizer with a chat template: else one line that says how to give one."""
    if task.kind == CHAT and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task {task.name} is a chat task, but the tokenizer {tokenizer.name_or_path} has no chat "
                         "template to render its conversations: set tokenizer=DIR (or a hub id) to a tokenizer that "
                         "has one (\"chat_template\" in its tokenizer_config.json, or a chat_template.jinja beside "
                         "it; docs/tasks.md), or write the lines as a completion task")


def encode_text(task: Task, tokenizer, example: dict, max_length: int, max_new_tokens: int = 50) -> dict:
    """One row of a completion or chat example (the keys of `encode`'s generation rows, and "spans": the label
    tokens' [start, end) ranges in the row). Rows longer than max_length lose tokens from the left (leading special
    tokens kept); a prompt cut to nothing, in the row or in the generation prompt, is a ValueError naming the line."""
    where = example.get(WHERE, f"task {task.name}")
    if task.kind == COMPLETION:
        prompt_ids = tokenizer.encode(example["prompt"])
        ids = tokenizer.encode(example["prompt"] + example["completion"])
        if tokenizer.eos_token_id is not None and ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)  # the model learns where the completion ends (greedy decoding stops)
        spans = [(_common_prefix(prompt_ids, ids), len(ids))]
    else:
        prompt_ids, ids, spans = _render_chat(task, tokenizer, example, where)
    special = set(tokenizer.all_special_ids)
    n_keep = next((i for i, t in enumerate(ids) if t not in special), len(ids))  # leading special tokens (BOS)
    needs = n_keep + (len(ids) - spans[-1][0]) + 1  # the shortest max_length that keeps one prompt token
    total, cut = len(ids), len(ids) > max_length
    if cut:
        drop = len(ids) - max_length
        ids = _cut_left(ids, max_length, n_keep)
        spans = [(max(s - drop, n_keep), e - drop) for s, e in spans if e - drop > n_keep]
    prompt_kept = spans[-1][0] - n_keep if spans else 0
    if prompt_kept <= 0:
        raise ValueError(f"{where}: max_length={max_length} cuts the prompt to nothing (the line is {total} tokens); "
                         f"raise max_length to at least {needs}, or shorten the line")
    generation_ids = _cut_left(prompt_ids, max_length - max_new_tokens, n_keep)
    if not any(t not in special for t in generation_ids):
        raise ValueError(f"{where}: max_length={max_length} less max_new_tokens={max_new_tokens} leaves no token of "
                         "the prompt for greedy generation; raise max_length or lower max_new_tokens")
    return {"input_ids": [ids], "option_len": [len(ids) - spans[0][0]], "spans": [spans], "label": 0, "cut": cut,
            "prompt_kept": prompt_kept, "needs": needs, "prompt_ids": generation_ids, "answers": task.answers(example)}


def _render_chat(task: Task, tokenizer, example: dict, where: str) -> tuple[list[int], list[int], list[tuple]]:
    """(the prompt of the last assistant turn, the conversation, the label spans) as token ids of the tokenizer's
    chat template (tokenized as apply_chat_template tokenizes: no special tokens added; the template writes its
    own). A span: an assistant turn's tokens after the template's prompt for it, its end-of-turn tokens included."""
    messages = example["messages"]

    def ids_of(conversation: list[dict], prompt: bool) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        except Exception as err:  # the template's own refusal (jinja2's TemplateError, its raise_exception)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"{where}: the tokenizer's chat template refused this conversation ({reason})") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = ids_of(messages, False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans, prompt_ids = [], []
    for i in (turns if task.assistant_turns == "all" else turns[-1:]):
        prompt_ids = ids_of(messages[:i], True)
        start = _common_prefix(prompt_ids, ids)
        end = len(ids) if i == len(messages) - 1 else _common_prefix(ids_of(messages[:i + 1], False), ids)
        if end <= start:
            raise ValueError(f"{where}: assistant turn (message {i + 1}) adds no token to the chat template's prompt")
        spans.append((start, end))
    return prompt_ids, ids, spans


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
    num_examples (int); for generation also prompt_ids and answers (Python lists); where some
    candidates besides the gold one count as correct (ReCoRD) "accepted", their indices per example.
    """
    rows = [(e, c, ids, n) for e, ex in enumerate(encoded)
            for c, (ids, n) in enumerate(zip(ex["input_ids"], ex["option_len"]))]
    width = max(len(ids) for _, _, ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    label_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    spans = [s for ex in encoded for s in ex.get("spans", [None] * len(ex["input_ids"]))]
    for r, (_, _, ids, option_len) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, :len(ids)] = 1
        for start, end in spans[r] or [(len(ids) - option_len, len(ids))]:  # "spans": a chat task's assistant turns
            label_mask[r, start:end] = 1.0
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
    if "accepted" in encoded[0]:
        batch["accepted"] = [ex["accepted"] for ex in encoded]
    return batch


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
