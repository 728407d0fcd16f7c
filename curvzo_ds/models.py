"""Models: the built-in tiny demo models, or any causal LM by hub id or path (tokenizers: the one loader,
tasks/tokenizer.py's `load_tokenizer`, which this module re-exports).

Under ZeRO-3 a hub model is built inside `zero.Init` by `from_pretrained` while a live
`HfDeepSpeedConfig` exists (docs/deepspeed.md), so no rank ever holds the full model; keep the
returned `keep_alive` object for the whole run (dropping it makes `generate()` hang).
The demo models are tiny and built whole on every rank from a config and a fixed seed;
`deepspeed.initialize` partitions them.
"""

from __future__ import annotations

import logging

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from curvzo_ds.config.schema import DEMO_MODELS
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.shapes import hidden_size_of
from curvzo_ds.shard import ds_compat
from curvzo_ds.tasks import demo_model_config
from curvzo_ds.tasks.tokenizer import load_tokenizer, probe_hub, refused  # the one tokenizer loader, and its checks

__all__ = ["DTYPES", "build_model", "demo_kind", "load_tokenizer", "model_hidden_size", "probe_hub", "refused"]

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
