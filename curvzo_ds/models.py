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

from curvzo_ds.config.schema import DEMO_MODELS, TrainConfig
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


def model_hidden_size(cfg: TrainConfig) -> int | None:
    """The hidden size, for DeepSpeed's "auto" bucket sizes (read from the config only)."""
    if cfg.model in DEMO_MODELS:
        return demo_model_config(demo_kind(cfg.model)).hidden_size
    probe_hub(cfg.model)
    try:
        conf = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise FileNotFoundError(f"model={cfg.model!r}: no such local directory, and the hub could not be reached "
                                f"({e.__class__.__name__}); pass a local path") from None
    except ValueError as e:
        raise refused("model", cfg.model, e) from None
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


def load_tokenizer(cfg: TrainConfig):
    if cfg.tokenizer is None and cfg.model in DEMO_MODELS:
        tok = load_demo_tokenizer(demo_kind(cfg.model))
    else:
        probe_hub(cfg.tokenizer or cfg.model, "tokenizer" if cfg.tokenizer else "model")
        try:
            tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
        except ValueError as e:
            raise refused("tokenizer" if cfg.tokenizer else "model", cfg.tokenizer or cfg.model, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def build_model(cfg: TrainConfig, ds_config: dict, group=None, mpu=None):
    """(model, keep_alive): the causal LM, LoRA-wrapped when asked, ready for deepspeed.initialize.

    `group` (hybrid sharding): the shard group that `zero.Init` partitions a hub model over while it loads."""
    dtype = DTYPES[cfg.dtype]
    keep_alive = None
    if cfg.model in DEMO_MODELS:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(demo_model_config(demo_kind(cfg.model))).to(dtype)
    else:
        probe_hub(cfg.model)
        if ds_config.get("zero_optimization", {}).get("stage") == 3:
            keep_alive = HfDeepSpeedConfig(ds_config)
        with ds_compat.zero_init_group(group if keep_alive is not None else None, mpu):
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype,
                                                         trust_remote_code=cfg.trust_remote_code)
        whole = [n for n, p in model.named_parameters() if not hasattr(p, "ds_id")] if keep_alive is not None else []
        if whole:  # zero.Init did not take: every rank would hold the full model
            raise RuntimeError(f"{cfg.model} loaded without zero.Init partitioning ({len(whole)} tensors whole, "
                               f"e.g. {whole[0]}); is the transformers/deepspeed pair supported?")
    if cfg.lora:
        model.requires_grad_(False)
        torch.manual_seed(cfg.seed + 1)  # every rank must create the same adapters (docs/deepspeed.md)
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_target_modules),
                          lora_dropout=0.0, task_type="CAUSAL_LM")
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            raise ConfigError(f"lora_target_modules={cfg.lora_target_modules}: {e}") from None
    return model, keep_alive
