"""Models and tokenizers: the built-in tiny demo models, or any causal LM by hub id or path.

Under ZeRO-3 a hub model is built inside `zero.Init` by `from_pretrained` while a live
`HfDeepSpeedConfig` exists (docs/deepspeed.md), so no rank ever holds the full model; keep the
returned `keep_alive` object for the whole run (dropping it makes `generate()` hang).
The demo models are tiny and built whole on every rank from a config and a fixed seed;
`deepspeed.initialize` partitions them.
"""

from __future__ import annotations

import logging
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

from curvzo_ds.config.schema import DEMO_MODELS
from curvzo_ds.errors import ConfigError
from curvzo_ds.hub import offline_unless_reachable
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.shapes import hidden_size_of
from curvzo_ds.tasks import demo_model_config
from curvzo_ds.tasks import load_tokenizer as load_demo_tokenizer

log = logging.getLogger("curvzo_ds")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def demo_kind(model: str) -> str:
    return "opt" if model == "demo-opt" else "llama"


def model_hidden_size(model_cfg) -> int | None:
    """The hidden size, for DeepSpeed's "auto" bucket sizes (read from the config only). `model_cfg`: the
    config's `model` section (config.sections)."""
    if model_cfg.model in DEMO_MODELS:
        return demo_model_config(demo_kind(model_cfg.model)).hidden_size
    probe_hub(model_cfg.model)
    try:
        conf = AutoConfig.from_pretrained(model_cfg.model, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as e:
        raise FileNotFoundError(f"model={model_cfg.model!r}: no such local directory, and the hub could not be reached "
                                f"({e.__class__.__name__}); pass a local path") from None
    except ValueError as e:
        raise refused("model", model_cfg.model, e) from None
    return hidden_size_of(conf)


def refused(key: str, value: str, e: ValueError) -> ConfigError:
    """transformers' refusal to load `value` (often several lines), as one line naming the key."""
    if "trust_remote_code" in str(e):
        return ConfigError(f"{key}={value!r} ships its own Python code, which runs only with trust_remote_code=true: "
                           "set it if you trust that code")
    return ConfigError(f"{key}={value!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def probe_hub(name: str, key: str = "model") -> None:
    """Before a hub id is resolved: one probe, so that an unreachable hub fails at once (hub.py). A name that can
    only be a path (absolute, ./ ../ ~, or more than one /) and is no directory is refused here: the hub would
    answer it with a page of tracebacks about repo ids."""
    if os.path.isdir(name):
        return
    if os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1:
        raise ConfigError(f"{key}={name!r}: no such directory; give a local directory (one from save_pretrained) "
                          "or a hub id such as facebook/opt-125m")
    offline_unless_reachable()


def load_tokenizer(model_cfg):
    """The tokenizer of the config's `model` section (`tokenizer`, else `model`; `trust_remote_code`)."""
    if model_cfg.tokenizer is None and model_cfg.model in DEMO_MODELS:
        tok = load_demo_tokenizer(demo_kind(model_cfg.model))
    else:
        name, key = model_cfg.tokenizer or model_cfg.model, "tokenizer" if model_cfg.tokenizer else "model"
        probe_hub(name, key)
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
        except ValueError as e:
            raise refused(key, name, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def build_model(model_cfg, seed: int, ds_config: dict, group=None, mpu=None):
    """(model, keep_alive): the causal LM, LoRA-wrapped when asked, ready for deepspeed.initialize.

    `model_cfg`: the config's `model` section (config.sections: model, dtype, trust_remote_code, the LoRA keys);
    `seed`: the engine section's, for the demo model's weights and the LoRA adapters.

    `group` (hybrid sharding): the shard group that `zero.Init` partitions a hub model over while it loads."""
    dtype = DTYPES[model_cfg.dtype]
    keep_alive = None
    if model_cfg.model in DEMO_MODELS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(demo_model_config(demo_kind(model_cfg.model))).to(dtype)
    else:
        probe_hub(model_cfg.model)
        if ds_config.get("zero_optimization", {}).get("stage") == 3:
            keep_alive = HfDeepSpeedConfig(ds_config)
        with ds_compat.zero_init_group(group if keep_alive is not None else None, mpu):
            model = AutoModelForCausalLM.from_pretrained(model_cfg.model, dtype=dtype,
                                                         trust_remote_code=model_cfg.trust_remote_code)
        whole = [n for n, p in model.named_parameters() if not hasattr(p, "ds_id")] if keep_alive is not None else []
        if whole:  # zero.Init did not take: every rank would hold the full model
            raise RuntimeError(f"{model_cfg.model} loaded without zero.Init partitioning ({len(whole)} tensors whole, "
                               f"e.g. {whole[0]}); is the transformers/deepspeed pair supported?")
    if model_cfg.lora:
        model.requires_grad_(False)
        torch.manual_seed(seed + 1)  # every rank must create the same adapters (docs/deepspeed.md)
        lora = LoraConfig(r=model_cfg.lora_r, lora_alpha=model_cfg.lora_alpha,
                          target_modules=list(model_cfg.lora_target_modules), lora_dropout=0.0, task_type="CAUSAL_LM")
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            raise ConfigError(f"lora_target_modules={model_cfg.lora_target_modules}: {e}") from None
    return model, keep_alive
