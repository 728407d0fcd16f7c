"""`curvzo-ds export CKPT --out DIR [--merge-lora]`: a checkpoint to a Hugging Face directory that loads offline.

- Full fine-tuning: safetensors shards of the trainable tensors under their `save_pretrained` names,
  config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)`.
- LoRA: the peft adapter (adapter_model.safetensors, adapter_config.json naming its base model) in DIR:
  `AutoPeftModelForCausalLM.from_pretrained(DIR)`. The base is the run's `model`: a hub id as it is, a local
  directory by its path relative to the adapter (peft resolves it from the working directory, so the stdout
  line also gives `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)`); the built-in demo
  models have no path, so their base is saved to DIR/base and named "base".
- LoRA with `--merge-lora`: the merged model in DIR itself, the adapter in DIR/adapter.
Tensors are assembled one at a time from the ranks' slices; one process, no GPU needed. The export is written
beside DIR and renamed into place; a non-empty DIR is replaced only with `--overwrite`.
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
from .hub import offline_unless_reachable
from .models import DTYPES, build_model, load_tokenizer

MAX_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def export_checkpoint(checkpoint: str, out: str, merge_lora: bool = False, overwrite: bool = False) -> list[str]:
    """Write the export; returns what was written and how to load it, one line each.

    Everything is written into a staging directory beside `out` and renamed into place when complete, so `out` never
    holds a mix of two exports; a non-empty `out` is replaced only with `overwrite`."""
    manifest = read_manifest(checkpoint)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} is an existing file: pass a directory (it is created if missing)")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"--out {out} is not empty: an export into it would mix its files with the new ones; pass "
                          "--overwrite to replace it, or choose another directory")
    lora = bool(manifest.get("trainer", {}).get("lora"))
    if merge_lora and not lora:
        raise ConfigError(f"--merge-lora: {checkpoint} is a full fine-tuning checkpoint (no LoRA adapter to merge); "
                          "export it without --merge-lora")
    cfg = _run_config(checkpoint)
    if lora and cfg is None:
        raise ConfigError(f"{checkpoint} has no run_config.json: its LoRA base model is unknown")
    tensors = consolidated_state_dict(checkpoint)
    staging = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(os.path.abspath(out))}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        lines = _write_export(checkpoint, tensors, cfg, lora, merge_lora, staging, out)
        replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lines


def _write_export(checkpoint: str, tensors: dict, cfg: TrainConfig | None, lora: bool, merge_lora: bool,
                  staging: str, out: str) -> list[str]:
    """The export's files, written into `staging`; the lines name `out`, where they will be."""
    if not lora:
        _save_sharded(tensors, staging)
        _copy(checkpoint, staging, ("config.json", *TOKENIZER_FILES))
        return [f"wrote the model to {out}: AutoModelForCausalLM.from_pretrained({out!r})"]
    adapter = "adapter" if merge_lora else ""
    adapter_dir, out_adapter = os.path.join(staging, adapter), os.path.join(out, adapter).rstrip(os.sep)
    base_ref, base, base_dir = _base_model(cfg, staging, out, out_adapter)
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    adapter_config["base_model_name_or_path"] = base_ref
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    _copy(checkpoint, adapter_dir, TOKENIZER_FILES)
    if base_dir is None:  # a hub id: found from any directory
        lines = [f"wrote the LoRA adapter to {out_adapter} (base model {base_ref}): "
                 f"AutoPeftModelForCausalLM.from_pretrained({out_adapter!r})"]
    else:  # a path relative to the adapter; peft resolves it from the working directory
        lines = [f"wrote the LoRA adapter to {out_adapter} (base model {base_ref!r}, a path relative to the adapter, "
                 f"so AutoPeftModelForCausalLM.from_pretrained('.') works in {out_adapter}); from any directory: "
                 f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base_dir!r}), {out_adapter!r})"]
    if merge_lora:
        if base is None:
            if base_dir is None:
                offline_unless_reachable()
            base = AutoModelForCausalLM.from_pretrained(base_dir or base_ref, dtype=DTYPES[cfg.dtype],
                                                        trust_remote_code=cfg.trust_remote_code)
        with torch.no_grad():
            merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged.save_pretrained(staging)
        _copy(checkpoint, staging, TOKENIZER_FILES)
        lines.insert(0, f"wrote the merged model to {out}: AutoModelForCausalLM.from_pretrained({out!r})")
    return lines


def replace_dir(new: str, target: str) -> None:
    """Put the complete directory `new` at `target`: an old `target` is moved aside first and removed once the new
    one is in place, so `target` is always one export or the other, never a mix."""
    old = None
    if os.path.isdir(target):
        old = f"{new}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(new, target)
    if old:
        shutil.rmtree(old, ignore_errors=True)


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


def _base_model(cfg: TrainConfig, staging: str, out: str, adapter_dir: str):
    """(how the adapter names its base, the base model if it had to be built here, the base's directory or None for
    a hub id). A hub id stays a hub id. A local model directory is named by its path relative to `adapter_dir`, where
    the adapter will be. A demo model is built from its seed and saved to base/ in the export (staged in `staging`),
    named "base" or "../base" from the adapter, so that the export can be moved or copied as a whole."""
    if cfg.model in DEMO_MODELS:
        base, _ = build_model(resolve_presets(TrainConfig(**{**cfg.__dict__, "lora": False})), {})
        base.save_pretrained(os.path.join(staging, "base"))
        load_tokenizer(cfg).save_pretrained(os.path.join(staging, "base"))
        base_dir = os.path.join(out, "base")
        return os.path.relpath(base_dir, adapter_dir), base, base_dir
    if os.path.isdir(cfg.model):
        return os.path.relpath(os.path.abspath(cfg.model), os.path.abspath(adapter_dir)), None, cfg.model
    return cfg.model, None, None


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
