"""`curvzo-ds plan`: per-rank memory of a model under ZeRO-3 with CurvZO, from its config alone (no weights)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .tasks import demo_model_config


def plan(model: str, world_size: int, dtype: str, fp32_master: bool) -> None:
    """Per-rank bytes for the weights and CurvZO's extra state, from the model config alone."""
    if model in ("demo", "demo-opt"):
        conf = demo_model_config("opt" if model == "demo-opt" else "llama")
    else:
        conf = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(conf)
    tensors = [p for p in m.parameters()]
    numel = sum(p.numel() for p in tensors)
    width = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    shard = sum(-(-p.numel() // world_size) for p in tensors)
    largest = max(p.numel() for p in tensors)
    print(f"{model}: {numel / 1e9:.3f} B parameters in {len(tensors)} tensors (blocks), world size {world_size}")
    print(f"  weights per rank (ZeRO-3 shard)      {shard * width / 2**30:8.2f} GiB")
    if fp32_master:
        print(f"  fp32 master copy of the shard        {shard * 4 / 2**30:8.2f} GiB")
    print(f"  largest gathered tensor (transient)  {largest * width / 2**30:8.2f} GiB")
    print(f"  noise buffer per tensor piece        {min(largest, 1 << 22) * 4 / 2**20:8.2f} MiB")
    print(f"  CurvZO state (scores, replicated)    {len(tensors) * 16 / 2**10:8.2f} KiB")
    print("  gradients, optimizer state           0 (zeroth order)")
