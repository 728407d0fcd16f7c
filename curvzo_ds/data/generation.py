"""Greedy answers for generation tasks (SQuAD, DROP, a completion or chat task), one prompt at a time."""

import functools

import torch

from curvzo_ds.data.losses import inner_module
from curvzo_ds.tasks.task import GENERATION


def stops_at_newline(task) -> bool:
    """Whether a task's answers end at the first newline (MeZO's SQuAD and DROP: the model learns " answer\n"). A
    completion or chat task's end at EOS (its completion, or its assistant turn, may span lines)."""
    return task.kind == GENERATION


@functools.lru_cache(maxsize=4)
def newline_ids(tokenizer) -> tuple[int, ...]:
    """Every token whose text holds a newline (Llama: <0x0A>; GPT-2/OPT: Ċ and merges of it)."""
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return tuple(i for i, piece in enumerate(pieces) if "\n" in piece)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts_ids: list[list[int]], max_new_tokens: int = 50,
                     synced_gpus: bool = False, stop_at_newline: bool = True) -> list[str]:
    """Greedy answers, one prompt at a time (so no answer depends on how prompts are batched).

    Decoding stops at a newline or EOS and the text is cut at the first newline (MeZO); with stop_at_newline=False
    (a completion or chat task) at EOS only, and the whole text is the answer.
    Under ZeRO-3 pass synced_gpus=True, and call it on every rank with as many prompts.
    """
    module = inner_module(model)  # a DeepSpeed engine wraps the Hugging Face model
    device = next(module.parameters()).device
    stop_ids = [*newline_ids(tokenizer), tokenizer.eos_token_id] if stop_at_newline else [tokenizer.eos_token_id]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = []
    for ids in prompts_ids:
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        out = module.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                              num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                              pad_token_id=pad_id, synced_gpus=synced_gpus)
        text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        answers.append((text.split("\n")[0] if stop_at_newline else text).strip())
    return answers
