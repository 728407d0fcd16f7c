"""`curvzo-ds export CKPT --out DIR [--merge-lora]`: a checkpoint to a Hugging Face directory that loads offline.

Every front end (the CLI, `from_accelerator`, `ZOTrainer`) writes the same model record and files into its
checkpoints (checkpoint.write_model_files); export reads only those, so it works the same for all of them:
- Full fine-tuning: safetensors shards of the trained tensors under their `save_pretrained` names,
  config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)`.
- LoRA (peft): the adapter (adapter_model.safetensors, adapter_config.json naming its base model) in DIR:
  `AutoPeftModelForCausalLM.from_pretrained(DIR)`, or `PeftModel.from_pretrained(base, DIR)`. The base is the
  model the adapter was made on (its name or path); the built-in demo models have none, so their base is built
  from the run's config and saved to DIR/base.
- LoRA with `--merge-lora`: the merged model in DIR itself, the adapter in DIR/adapter.
What it cannot write faithfully it refuses in one line: a full model some of whose parameters were frozen (the
checkpoint lacks them), a model without a Hugging Face config, several adapters, tensors that are not peft's
adapter keys, a merge without a known base model, a checkpoint without a model record (an older curvzo_ds).
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
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ConfigError(f"{checkpoint} has no model record in its manifest (written by an older curvzo_ds): "
                          "export it with the curvzo_ds version that wrote it")
    if model["kind"] == "full":
        if merge_lora:
            raise ConfigError(f"--merge-lora: {checkpoint} is a full fine-tuning checkpoint (no LoRA adapter to "
                              "merge); export it without --merge-lora")
        return _export_full(checkpoint, model, out)
    return _export_adapter(checkpoint, model, out, merge_lora)


def _export_full(checkpoint: str, model: dict, out: str) -> list[str]:
    frozen = model["frozen"]
    if frozen:
        raise ConfigError(f"{checkpoint} holds the trained parameters only, and {len(frozen)} of the model's were "
                          f"frozen (e.g. {frozen[0]}): a model written from it would miss them; load your base model "
                          "and copy the checkpoint's tensors into it (checkpoint.consolidated_state_dict)")
    if not model["hf_config"]:
        raise ConfigError(f"{checkpoint} has no config.json: the model was not a Hugging Face model, and export "
                          "writes from_pretrained directories only (checkpoint.consolidated_state_dict gives the "
                          "tensors)")
    tensors = consolidated_state_dict(checkpoint)
    os.makedirs(out, exist_ok=True)
    _save_sharded(tensors, out)
    _copy(checkpoint, out, ("config.json", *TOKENIZER_FILES))
    return [f"wrote the model to {out}: AutoModelForCausalLM.from_pretrained({out!r})"]


def _export_adapter(checkpoint: str, model: dict, out: str, merge_lora: bool) -> list[str]:
    if len(model["adapters"]) != 1:
        raise ConfigError(f"{checkpoint} was trained with the peft adapters {model['adapters']}: export writes one "
                          "adapter; train one")
    tensors = consolidated_state_dict(checkpoint)
    keys = set(model["adapter_keys"])
    if set(tensors) != keys:
        odd = sorted(set(tensors) ^ keys)
        raise ConfigError(f"{checkpoint}: its tensors are not the keys of peft's adapter state dict ({odd[0]} is in "
                          "one and not the other; a modules_to_save or a non-LoRA adapter?): it cannot be written "
                          "as a peft adapter")
    base_ref, base = model["base_model"], None
    cfg = _run_config(checkpoint)  # the CLI's run: a demo model is built from it
    if base_ref is None and cfg is not None and cfg.model in DEMO_MODELS:
        base_ref, base = _demo_base(cfg, out)
    if merge_lora and base_ref is None:
        raise ConfigError(f"--merge-lora: {checkpoint} does not name its base model (the model had no name_or_path "
                          "when peft wrapped it): export the adapter without --merge-lora and merge it onto your base")
    os.makedirs(out, exist_ok=True)
    adapter_dir = os.path.join(out, "adapter") if merge_lora else out
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    adapter_config["base_model_name_or_path"] = base_ref
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    _copy(checkpoint, adapter_dir, TOKENIZER_FILES)
    if base_ref is None:
        lines = [f"wrote the LoRA adapter to {adapter_dir} (no base model recorded: the model had no name_or_path "
                 f"when peft wrapped it): PeftModel.from_pretrained(your_base_model, {adapter_dir!r})"]
    elif adapter_config.get("task_type") == "CAUSAL_LM":
        lines = [f"wrote the LoRA adapter to {adapter_dir} (base model {base_ref}): "
                 f"AutoPeftModelForCausalLM.from_pretrained({adapter_dir!r})"]
    else:  # peft's Auto classes need the task type in the adapter config
        lines = [f"wrote the LoRA adapter to {adapter_dir} (base model {base_ref}): PeftModel.from_pretrained("
                 f"AutoModelForCausalLM.from_pretrained({base_ref!r}), {adapter_dir!r})"]
    if merge_lora:
        if base is None:
            dtype = DTYPES[cfg.dtype] if cfg is not None else "auto"
            base = AutoModelForCausalLM.from_pretrained(base_ref, dtype=dtype,
                                                        trust_remote_code=cfg is not None and cfg.trust_remote_code)
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


def _demo_base(cfg: TrainConfig, out: str):
    """(how the adapter names its base, the base model): a demo model is built from the run's seed and saved to
    out/base (it has no hub id or path of its own)."""
    base, _ = build_model(resolve_presets(TrainConfig(**{**cfg.__dict__, "lora": False})), {})
    path = os.path.abspath(os.path.join(out, "base"))
    base.save_pretrained(path)
    load_tokenizer(cfg).save_pretrained(path)
    return path, base


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
