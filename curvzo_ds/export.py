"""`curvzo-ds export CKPT --out DIR [--merge-lora]`: a checkpoint to a Hugging Face directory that loads offline.

- Full fine-tuning: safetensors shards of the trainable tensors under their `save_pretrained` names,
  config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)`.
- LoRA: the peft adapter (adapter_model.safetensors, adapter_config.json naming its base model) in DIR:
  `AutoPeftModelForCausalLM.from_pretrained(DIR)`. The base is the run's `model` (a hub id or a local
  path); the built-in demo models have no path, so their base is saved to DIR/base and named there.
- LoRA with `--merge-lora`: the merged model in DIR itself, the adapter in DIR/adapter.
Tensors are assembled one at a time from the ranks' slices; one process, no GPU needed.
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
from .config import DEMO_MODELS, ConfigError, TrainConfig, field_names, resolve_presets
from .models import DTYPES, build_model, load_tokenizer

MAX_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def export_checkpoint(checkpoint: str, out: str, merge_lora: bool = False) -> list[str]:
    """Write the export; returns what was written and how to load it, one line each."""
    manifest = read_manifest(checkpoint)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} is an existing file: pass a directory (it is created if missing)")
    lora = bool(manifest.get("trainer", {}).get("lora"))
    if merge_lora and not lora:
        raise ConfigError(f"--merge-lora: {checkpoint} is a full fine-tuning checkpoint (no LoRA adapter to merge); "
                          "export it without --merge-lora")
    cfg = _run_config(checkpoint)
    tensors = consolidated_state_dict(checkpoint)
    os.makedirs(out, exist_ok=True)
    if not lora:
        _save_sharded(tensors, out)
        _copy(checkpoint, out, ("config.json", *TOKENIZER_FILES))
        return [f"wrote the model to {out}: AutoModelForCausalLM.from_pretrained({out!r})"]
    if cfg is None:
        raise ConfigError(f"{checkpoint} has no run_config.json: its LoRA base model is unknown")
    base_ref, base = _base_model(cfg, out)
    adapter_dir = os.path.join(out, "adapter") if merge_lora else out
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    adapter_config["base_model_name_or_path"] = base_ref
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    _copy(checkpoint, adapter_dir, TOKENIZER_FILES)
    lines = [f"wrote the LoRA adapter to {adapter_dir} (base model {base_ref}): "
             f"AutoPeftModelForCausalLM.from_pretrained({adapter_dir!r})"]
    if merge_lora:
        if base is None:
            base = AutoModelForCausalLM.from_pretrained(base_ref, dtype=DTYPES[cfg.dtype],
                                                        trust_remote_code=cfg.trust_remote_code)
        with torch.no_grad():
            merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged.save_pretrained(out)
        _copy(checkpoint, out, TOKENIZER_FILES)
        lines.insert(0, f"wrote the merged model to {out}: AutoModelForCausalLM.from_pretrained({out!r})")
    return lines


def _copy(src: str, dst: str, names) -> None:
    for name in names:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def _run_config(checkpoint: str) -> TrainConfig | None:
    path = os.path.join(checkpoint, "run_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    known = set(field_names())
    return TrainConfig(**{k: v for k, v in saved.items() if k in known})


def _base_model(cfg: TrainConfig, out: str):
    """(how the adapter names its base, the base model if it had to be built here). A hub id stays a hub id; a
    local path becomes absolute; a demo model is built from its seed and saved to out/base."""
    if cfg.model in DEMO_MODELS:
        base, _ = build_model(resolve_presets(TrainConfig(**{**cfg.__dict__, "lora": False})), {})
        path = os.path.abspath(os.path.join(out, "base"))
        base.save_pretrained(path)
        load_tokenizer(cfg).save_pretrained(path)
        return path, base
    if os.path.isdir(cfg.model):
        return os.path.abspath(cfg.model), None
    return cfg.model, None


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
