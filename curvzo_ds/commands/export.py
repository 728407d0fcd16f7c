"""`curvzo-ds export CKPT --out DIR [--merge-lora]`: a checkpoint to a Hugging Face directory that loads offline.

Every front end (the CLI, `from_accelerator`, `ZOTrainer`) writes the same model record and files into its
checkpoints (checkpoint.write.write_model_files); export reads those and the checkpoint's run_config.json
(config.load.read_run_config), so it works the same for all of them:
- Full fine-tuning: safetensors shards of the trained tensors under their `save_pretrained` names,
  config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)`.
- LoRA (peft): the adapter (adapter_model.safetensors, adapter_config.json naming its base model) in DIR:
  `AutoPeftModelForCausalLM.from_pretrained(DIR)`, or `PeftModel.from_pretrained(base, DIR)`. The base is the
  model the adapter was made on: a hub id as it is, a local directory by its path relative to the adapter (peft
  resolves it from the working directory, so the stdout line also gives `PeftModel.from_pretrained(
  AutoModelForCausalLM.from_pretrained(BASE), DIR)`); the built-in demo models have no path, so their base is built
  from the run's config, saved to DIR/base and named "base".
- LoRA with `--merge-lora`: the merged model in DIR itself, the adapter in DIR/adapter.
What it cannot write faithfully it refuses in one line: a full model some of whose parameters were frozen (the
checkpoint lacks them), a model without a Hugging Face config, several adapters, tensors that are not peft's
adapter keys, a merge without a known base model, a checkpoint without a model record (an older curvzo_ds).
Tensors are assembled one at a time from the ranks' slices; one process, no GPU needed. The export is written
beside DIR and renamed into place. DIR is locked meanwhile as a run locks its output_dir; an earlier export there is
replaced only with `--overwrite`, and a run's directory (live or finished) or any other files never (`lock_out`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from curvzo_ds.checkpoint.format import (
    checkpoint_containing,
    consolidated_state_dict,
    own_file,
    verify_checkpoint,
)
from curvzo_ds.checkpoint.write import publish_dir
from curvzo_ds.config.load import saved_config
from curvzo_ds.config.presets import DEMO_MODELS, resolve_presets
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.hub import offline_unless_reachable
from curvzo_ds.jsonio import honour_umask

log = logging.getLogger("curvzo_ds")
MAX_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def export_checkpoint(checkpoint: str, out: str, merge_lora: bool = False, overwrite: bool = False) -> list[str]:
    """Write the export; returns what was written and how to load it, one line each.

    Everything is written into a staging directory beside `out` and renamed into place when complete, so `out` never
    holds a mix of two exports; `out` is locked meanwhile, and an earlier export there is replaced only with
    `overwrite`, a run's directory (live or finished) never (`lock_out`)."""
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"{checkpoint}: no such checkpoint directory")
    verified: set = set()
    manifest = verify_checkpoint(checkpoint, verified)  # the whole checkpoint, before anything is written
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} is an existing file: pass a directory (it is created if missing)")
    inside = checkpoint_containing(out)
    if inside or os.path.realpath(checkpoint).startswith(os.path.join(os.path.realpath(out), "")):
        where = f"inside the checkpoint {inside}" if inside else f"a directory that holds {checkpoint}"
        raise ConfigError(f"--out {out} is {where}: the export would write into (or replace) the checkpoint it "
                          "reads; choose a directory outside it")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ConfigError(f"{checkpoint} has no model record in its manifest (written by an older curvzo_ds): "
                          "export it with the curvzo_ds version that wrote it")
    fields = {"full": {"hf_config": bool, "frozen": list},
              "peft": {"adapters": list, "adapter_keys": list, "base_model": (str, type(None))}}.get(model.get("kind"))
    if fields is None or not all(isinstance(model.get(k), t) for k, t in fields.items()):
        raise ConfigError(f"{checkpoint}/manifest.json: its model record {str(model)[:80]} is damaged: the checkpoint "
                          "is corrupt")
    if model["kind"] == "full" and merge_lora:
        raise ConfigError(f"--merge-lora: {checkpoint} is a full fine-tuning checkpoint (no LoRA adapter to "
                          "merge); export it without --merge-lora")
    staging = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(os.path.abspath(out))}.tmp")
    created = not os.path.isdir(out)
    lock, published = None, False
    try:
        lock = lock_out(out, overwrite)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            if model["kind"] == "full":
                lines = _export_full(checkpoint, model, staging, out, verified)
            else:
                lines = _export_adapter(checkpoint, model, staging, out, merge_lora, verified)
            for root, _, files in os.walk(staging):  # safetensors files are created 0600 whatever the umask
                for name in files:
                    honour_umask(os.path.join(root, name))
            publish_dir(staging, out)  # the locked directory (and its lock file) goes, the new one comes
            published = True
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:  # the checkpoint was read already: a write that failed
        raise ConfigError(f"--out {out} cannot be written ({e.strerror or e}): fix its permissions, free space, or "
                          "choose another directory") from None
    finally:
        if lock is not None:
            lock.release()
        if created and not published:  # a refused or failed export leaves no --out behind
            with contextlib.suppress(OSError):
                os.rmdir(out)
    return lines


# What an export writes, and from_pretrained reads: `--overwrite` replaces a directory of these names only.
EXPORT_FILES = frozenset(("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                          "adapter_model.safetensors", "adapter_config.json", "added_tokens.json", *TOKENIZER_FILES))
EXPORT_DIRS = ("base", "adapter")  # a demo model's base beside its adapter; --merge-lora's adapter


def lock_out(out: str, overwrite: bool):
    """Make --out and take its lock (train/outputs.RunLock, as a run does its output_dir) for the export, so that no
    run starts there meanwhile; then refuse, in one line naming what is there, a directory the export must not
    replace: one a live run holds, one that holds a run (live or finished: config.json, metrics.jsonl,
    checkpoints), one that holds anything an export does not write, and, without `overwrite`, an earlier export.
    `--overwrite` replaces an earlier export only. Returns the lock (None where the file system has none)."""
    from curvzo_ds.train.outputs import RunLock, held_run_files

    os.makedirs(out, exist_ok=True)
    lock = RunLock.take(out, refusal=lambda holder, pid: (
        f"--out {out} is in use by a live run ({holder}): an export never writes into a run's directory; choose "
        "another --out"))
    try:
        held = [n for n in held_run_files(out) if n != "config.json" or _is_run_config(os.path.join(out, n))]
        odd = _not_an_export(out)
        shown = lambda names: ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")  # noqa: E731
        if held:
            raise ConfigError(f"--out {out} holds a run ({shown(held)}): an export never replaces a run's files, "
                              "live or finished (--overwrite replaces an earlier export only); choose another --out, "
                              f"such as {os.path.join(out, 'export')}")
        if odd:
            raise ConfigError(f"--out {out} holds files that no export writes ({shown(odd)}): --overwrite replaces "
                              "an earlier export only; choose another --out")
        if not overwrite and any(n != RunLock.NAME for n in os.listdir(out)):
            raise ConfigError(f"--out {out} is not empty: it holds an earlier export, and an export into it would mix "
                              "its files with the new ones; pass --overwrite to replace it, or choose another "
                              "directory")
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def _not_an_export(directory: str, prefix: str = "") -> list[str]:
    """The entries of `directory` that no export writes (EXPORT_FILES, model-NNNNN-of-NNNNN.safetensors, base/ and
    adapter/ of the same), a link among them, or a config.json that is a run's; sorted, a directory with a /."""
    from curvzo_ds.train.outputs import RunLock

    odd = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == RunLock.NAME and not prefix:
            continue
        if os.path.islink(path):
            odd.append(prefix + name)
        elif os.path.isdir(path):
            odd += _not_an_export(path, f"{prefix}{name}/") if name in EXPORT_DIRS and not prefix else \
                [f"{prefix}{name}/"]
        elif not (name in EXPORT_FILES or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)) or \
                (name == "config.json" and _is_run_config(path)):
            odd.append(prefix + name)
    return odd


def _is_run_config(path: str) -> bool:
    """Whether config.json is anything but a Hugging Face model config (a run's output_dir/config.json holds the
    run's keys, output_dir among them; a model's names its model_type)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or "model_type" not in config or "output_dir" in config


def _export_full(checkpoint: str, model: dict, staging: str, out: str, verified: set) -> list[str]:
    """The files of a full model, written into `staging`; the lines name `out`, where they will be."""
    frozen = model["frozen"]
    if frozen:
        raise ConfigError(f"{checkpoint} holds the trained parameters only, and {len(frozen)} of the model's were "
                          f"frozen (e.g. {frozen[0]}): a model written from it would miss them; load your base model "
                          "and copy the checkpoint's tensors into it (checkpoint.format.consolidated_state_dict)")
    if not model["hf_config"]:
        raise ConfigError(f"{checkpoint} has no config.json: the model was not a Hugging Face model, and export "
                          "writes from_pretrained directories only (checkpoint.format.consolidated_state_dict gives "
                          "tensors)")
    own_file(checkpoint, "config.json")  # listed in the record: a checkpoint without it is partial
    _save_sharded(consolidated_state_dict(checkpoint, verified), staging)
    _copy(checkpoint, staging, ("config.json", *TOKENIZER_FILES))
    return [f"wrote the model to {out}: AutoModelForCausalLM.from_pretrained({out!r})"]


def _export_adapter(checkpoint: str, model: dict, staging: str, out: str, merge_lora: bool,
                    verified: set) -> list[str]:
    """The adapter (and with `merge_lora` the merged model), written into `staging`; the lines name `out`."""
    if len(model["adapters"]) != 1:
        raise ConfigError(f"{checkpoint} was trained with the peft adapters {model['adapters']}: export writes one "
                          "adapter; train one")
    tensors = consolidated_state_dict(checkpoint, verified)
    keys = set(model["adapter_keys"])
    if set(tensors) != keys:
        odd = sorted(set(tensors) ^ keys)
        raise ConfigError(f"{checkpoint}: its tensors are not the keys of peft's adapter state dict ({odd[0]} is in "
                          "one and not the other; a modules_to_save or a non-LoRA adapter?): it cannot be written "
                          "as a peft adapter")
    cfg = saved_config(checkpoint)  # the CLI's run (None for another front end's): a demo model is built from it
    adapter = "adapter" if merge_lora else ""
    adapter_dir, out_adapter = os.path.join(staging, adapter), os.path.join(out, adapter).rstrip(os.sep)
    base_ref, base, base_dir = _base_model(model["base_model"], cfg, staging, out, out_adapter)
    if merge_lora and base_ref is None:
        raise ConfigError(f"--merge-lora: {checkpoint} does not name its base model (the model had no name_or_path "
                          "when peft wrapped it): export the adapter without --merge-lora and merge it onto your base")
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    try:
        with open(own_file(checkpoint, "adapter_config.json"), encoding="utf-8") as f:
            adapter_config = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{checkpoint}/adapter_config.json is not valid JSON ({e}): the checkpoint is "
                          "corrupt") from None
    if not isinstance(adapter_config, dict):
        raise ConfigError(f"{checkpoint}/adapter_config.json holds no JSON object: the checkpoint is corrupt")
    adapter_config["base_model_name_or_path"] = base_ref
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    _copy(checkpoint, adapter_dir, TOKENIZER_FILES)
    if base_ref is None:
        lines = [f"wrote the LoRA adapter to {out_adapter} (no base model recorded: the model had no name_or_path "
                 f"when peft wrapped it): PeftModel.from_pretrained(your_base_model, {out_adapter!r})"]
    elif base_dir is not None:  # a path relative to the adapter; peft resolves it from the working directory
        lines = [f"wrote the LoRA adapter to {out_adapter} (base model {base_ref!r}, a path relative to the adapter, "
                 f"so AutoPeftModelForCausalLM.from_pretrained('.') works in {out_adapter}); from any directory: "
                 f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base_dir!r}), {out_adapter!r})"]
    elif adapter_config.get("task_type") == "CAUSAL_LM":  # a hub id: found from any directory
        lines = [f"wrote the LoRA adapter to {out_adapter} (base model {base_ref}): "
                 f"AutoPeftModelForCausalLM.from_pretrained({out_adapter!r})"]
    else:  # peft's Auto classes need the task type in the adapter config
        lines = [f"wrote the LoRA adapter to {out_adapter} (base model {base_ref}): PeftModel.from_pretrained("
                 f"AutoModelForCausalLM.from_pretrained({base_ref!r}), {out_adapter!r})"]
    if base_ref is not None and cfg is not None and cfg.quantization != "none":
        lines = [_quantised_hint(cfg, out_adapter, base_ref, base_dir)]
    if merge_lora:
        if cfg is not None and cfg.quantization != "none":
            log.warning("--merge-lora: the adapter was trained against the %s-quantised base; it is merged into the "
                        "full-precision base %s, whose outputs differ from those it was trained with (the adapter "
                        "in %s with a quantised base reproduces the run)", cfg.quantization, base_ref, out_adapter)
        from peft import PeftModel  # here, not at the top: a bad checkpoint path is refused without importing them
        from transformers import AutoModelForCausalLM

        from curvzo_ds.models import DTYPES

        if base is None:
            if base_dir is None:
                offline_unless_reachable()
            dtype = DTYPES[cfg.dtype] if cfg is not None else "auto"
            base = AutoModelForCausalLM.from_pretrained(base_dir or base_ref, dtype=dtype,
                                                        trust_remote_code=cfg is not None and cfg.trust_remote_code)
        with torch.no_grad():
            merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged.save_pretrained(staging)
        _copy(checkpoint, staging, TOKENIZER_FILES)
        lines.insert(0, f"wrote the merged model to {out}: AutoModelForCausalLM.from_pretrained({out!r})")
    return lines


def _quantised_hint(cfg: TrainConfig, out_adapter: str, base_ref: str, base_dir: str | None) -> str:
    """The load line of an adapter trained on a quantised base: the base loaded quantised as the run loaded it
    (models.quantization_kwargs), for peft's Auto classes and a plain from_pretrained load it in full precision,
    whose outputs differ from those the adapter was trained with."""
    from curvzo_ds.models import DTYPES, quantization_kwargs

    bnb = ", ".join(f"{k}={v!r}" for k, v in quantization_kwargs(cfg.quantization, DTYPES[cfg.dtype]).items())
    return (f"wrote the LoRA adapter to {out_adapter} (base model {base_ref!r}, trained on the base quantised to "
            f"{cfg.quantization}: load the base quantised as the run did, not in full precision): "
            f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base_dir or base_ref!r}, "
            f"quantization_config=BitsAndBytesConfig({bnb})), {out_adapter!r})")


def _base_model(recorded: str | None, cfg: TrainConfig | None, staging: str, out: str, adapter_dir: str):
    """(how the adapter names its base, the base model if it had to be built here, the base's directory or None).
    `recorded` is the model record's base (its name_or_path when peft wrapped it). A hub id stays a hub id. A local
    model directory is named by its path relative to `adapter_dir`, where the adapter will be. A demo model (no
    name of its own) is built from the run's seed and saved to base/ in the export (staged in `staging`), named
    "base" or "../base" from the adapter, so that the export can be moved or copied as a whole."""
    if recorded is None and cfg is not None and cfg.model in DEMO_MODELS:
        from curvzo_ds.models import build_model, load_tokenizer

        base_cfg = resolve_presets(dataclasses.replace(cfg, lora=False, quantization="none"))  # full precision
        base, _ = build_model(section(base_cfg, "model"), base_cfg.seed, {})
        base.save_pretrained(os.path.join(staging, "base"))
        load_tokenizer(section(cfg, "model")).save_pretrained(os.path.join(staging, "base"))
        base_dir = os.path.join(out, "base")
        return os.path.relpath(base_dir, adapter_dir), base, base_dir
    if recorded is not None and os.path.isdir(recorded):
        return os.path.relpath(os.path.abspath(recorded), os.path.abspath(adapter_dir)), None, recorded
    return recorded, None, None


def _copy(src: str, dst: str, names) -> None:
    """The files of `names` that checkpoint `src` has (a link is refused: own_file) into `dst`."""
    for name in names:
        if os.path.lexists(os.path.join(src, name)):
            shutil.copy(own_file(src, name), os.path.join(dst, name))


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


# The command: its parser and its handler (cli.py builds the parser from every command's `register`).


def register(sub) -> None:
    p = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint")
    p.add_argument("checkpoint", help="a checkpoint directory (output_dir/checkpoint-N)")
    p.add_argument("--out", required=True, help="the directory to write (from_pretrained loads it)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA runs: write the merged model to --out itself and the adapter to --out/adapter")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (the new one is renamed into place when complete); a "
                        "directory that holds a run, or other files, is never replaced")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    for line in export_checkpoint(args.checkpoint, args.out, args.merge_lora, args.overwrite):
        print(line)
