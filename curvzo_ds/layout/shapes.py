"""The shapes of the models `curvzo-ds plan` plans, without their weights: a model's config (a built-in published
shape, a local model directory, or a hub id whose config is cached) and its causal LM on the meta device."""

from __future__ import annotations

import glob
import os
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, OPTConfig

from curvzo_ds.errors import ConfigError
from curvzo_ds.hub import offline_unless_reachable
from curvzo_ds.tasks import demo_model_config

_OPT = dict(vocab_size=50272, max_position_embeddings=2048, do_layer_norm_before=True)
_LLAMA = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
# The published config.json of each model (its shape; the weights are never read). The checkpoints are float16.
PUBLISHED = {
    "opt-125m": (OPTConfig, dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
                                 word_embed_proj_dim=768, **_OPT)),
    "opt-2.7b": (OPTConfig, dict(hidden_size=2560, ffn_dim=10240, num_hidden_layers=32, num_attention_heads=32,
                                 word_embed_proj_dim=2560, **_OPT)),
    "opt-6.7b": (OPTConfig, dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32,
                                 word_embed_proj_dim=4096, **_OPT)),
    "opt-13b": (OPTConfig, dict(hidden_size=5120, ffn_dim=20480, num_hidden_layers=40, num_attention_heads=40,
                                word_embed_proj_dim=5120, **_OPT)),
    "llama2-7b": (LlamaConfig, dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, **_LLAMA)),
    "llama2-13b": (LlamaConfig, dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                     num_attention_heads=40, num_key_value_heads=40, **_LLAMA)),
    "llama2-70b": (LlamaConfig, dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, **_LLAMA)),
}


def hidden_size_of(conf) -> int | None:
    """A transformers config's hidden size (`d_model` in some architectures), or None if it names neither."""
    return getattr(conf, "hidden_size", None) or getattr(conf, "d_model", None)


def published_key(name: str) -> str:
    """`facebook/opt-13b`, `OPT-13B` -> `opt-13b`; `meta-llama/Llama-2-7b-hf`, `llama-2-7b` -> `llama2-7b`."""
    key = name.lower().split("/")[-1].removesuffix("-hf")
    return re.sub(r"^llama-2", "llama2", key)


def model_config(model: str, trust_remote_code: bool = False):
    """(transformers config, bytes of its checkpoint files or None if unknown, "demo" | "dir" | "hub").

    `model` is "demo"/"demo-opt", a local model directory (with config.json), a name of `PUBLISHED`, or a hub id
    whose config is in the local cache.
    """
    if model in ("demo", "demo-opt"):
        return demo_model_config("opt" if model == "demo-opt" else "llama"), None, "demo"
    names = ", ".join(PUBLISHED)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"--model {model}: the directory has no config.json; pass a Hugging Face model "
                              f"directory, or one of {names}")
        files = glob.glob(os.path.join(model, "*.safetensors")) or glob.glob(os.path.join(model, "*.bin"))
        try:
            conf = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except ValueError as e:  # e.g. a model that ships its own code, without --trust-remote-code
            raise ConfigError(f"--model {model}: {' '.join(str(e).split())}") from None
        return conf, sum(os.path.getsize(f) for f in files) or None, "dir"
    if published_key(model) in PUBLISHED:
        cls, fields = PUBLISHED[published_key(model)]
        conf = cls(**fields)
        return conf, 2 * n_params(conf), "hub"  # float16 files
    offline_unless_reachable()
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code), None, "hub"
    except (OSError, ValueError):
        raise ConfigError(f"--model {model}: not a local model directory, not a built-in name ({names}, demo), and "
                          "its config is not in the hub cache (or the hub cannot be reached): pass a directory "
                          "holding its config.json") from None


def meta_model(conf) -> torch.nn.Module:
    """The causal LM of `conf` on the meta device: shapes and tying, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(conf)


def n_params(conf) -> int:
    return sum(p.numel() for p in meta_model(conf).parameters())
