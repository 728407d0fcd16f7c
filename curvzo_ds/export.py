"""`curvzo-ds export`: a checkpoint to a Hugging Face model directory (one process, offline).

Full fine-tuning: safetensors shards of the trainable tensors under their `save_pretrained`
names, config.json and the tokenizer, loadable with `from_pretrained`. LoRA: the peft adapter
(adapter_model.safetensors + adapter_config.json), and with `--merge-lora` also the merged
model in `merged/`. Tensors are assembled one at a time from the ranks' slices.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from .checkpoint import consolidated_state_dict, read_manifest
from .config import DEMO_MODELS, TrainConfig, resolve_presets
from .models import DTYPES, build_model, load_tokenizer

MAX_SHARD_BYTES = 2 << 30
_COPY = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def export_checkpoint(checkpoint: str, out: str, merge_lora: bool = False) -> str:
    manifest = read_manifest(checkpoint)
    trainer = manifest.get("trainer", {})
    tensors = consolidated_state_dict(checkpoint)
    os.makedirs(out, exist_ok=True)
    lora = bool(trainer.get("lora"))
    for name in _COPY + (("adapter_config.json",) if lora else ()):
        src = os.path.join(checkpoint, name)
        if os.path.exists(src) and not (lora and name == "config.json"):
            shutil.copy(src, os.path.join(out, name))
    if lora:
        save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
        if merge_lora:
            _merge(checkpoint, out)
        return out
    _save_sharded(tensors, out)
    return out


def _save_sharded(tensors: dict, out: str) -> None:
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name].contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def _merge(checkpoint: str, out: str) -> None:
    """Base model + adapter, merged, saved under out/merged (needs the base model's weights)."""
    with open(os.path.join(checkpoint, "run_config.json")) as f:
        run_cfg = json.load(f)
    cfg = TrainConfig(**run_cfg)
    if cfg.model in DEMO_MODELS:
        cfg = resolve_presets(TrainConfig(**{**run_cfg, "lora": False}))
        base, _ = build_model(cfg, {})
    else:
        base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype])
    with torch.no_grad():
        merged = PeftModel.from_pretrained(base, out).merge_and_unload()
    merged.save_pretrained(os.path.join(out, "merged"))
    load_tokenizer(cfg).save_pretrained(os.path.join(out, "merged"))
