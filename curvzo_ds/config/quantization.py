"""The `quantization` key (docs/config.md): its values and its rule, stated once for the config's validation, the
layout's choice (layout/choice.py), the memory planner (layout/memory.py) and the model loader (models.py).

The rule: a base quantised by bitsandbytes is frozen, so only LoRA adapters train (it needs `lora`), and it is whole
on every rank, so it takes stage 0: ZeRO-3 cannot partition it nor offload it. Each caller words the fix in its
own terms (a `--set` key, the DeepSpeed file, a `plan` flag).
"""

from __future__ import annotations

import enum


class Quantization(str, enum.Enum):
    """The `quantization` key."""

    NONE = "none"
    INT8 = "8bit"  # bitsandbytes' LLM.int8: an int8 weight and one fp32 scale per output row
    NF4 = "4bit"  # nf4 in blocks of 64 weights, each block's absmax one fp32 (no double quantisation)


QUANTIZATIONS = tuple(q.value for q in Quantization)
VALUES_TEXT = "none, 8bit or 4bit"
NEEDS_LORA = "the quantised base is frozen and only LoRA adapters train"
NEEDS_STAGE_0 = "a bitsandbytes base is whole on every rank; ZeRO-3 cannot partition or offload it"


def is_quantized(quantization: str) -> bool:
    return quantization != Quantization.NONE.value


def quantization_lacks(quantization: str, *, lora: bool, zero3: bool, offload: bool) -> str | None:
    """What a run with `quantization` lacks under the rule: "lora" (no LoRA), "stage 0" (ZeRO-3 or a parameter
    offload), or None (nothing: an unquantised run, or one that keeps the rule)."""
    if not is_quantized(quantization):
        return None
    if not lora:
        return "lora"
    if zero3 or offload:
        return "stage 0"
    return None


__all__ = ["NEEDS_LORA", "NEEDS_STAGE_0", "QUANTIZATIONS", "VALUES_TEXT", "Quantization", "is_quantized",
           "quantization_lacks"]
