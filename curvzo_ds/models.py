"""Models: the built-in tiny demo models, or any causal LM by hub id or path (tokenizers: the one loader,
tasks/tokenizer.py's `load_tokenizer`, which this module re-exports).

Under ZeRO-3 a hub model is built inside `zero.Init` by `from_pretrained` while a live
`HfDeepSpeedConfig` exists (docs/deepspeed.md), so no rank ever holds the full model; keep the
returned `keep_alive` object for the whole run (dropping it makes `generate()` hang).
The demo models are tiny and built whole on every rank from a config and a fixed seed;
`deepspeed.initialize` partitions them.

`quantization` (4bit, 8bit): the base is loaded by bitsandbytes through transformers' BitsAndBytesConfig, frozen,
and LoRA-wrapped (the config requires lora=true and stage 0); a demo model is built as above, then saved and loaded
quantised, so that its base is the quantised copy of the same weights. bitsandbytes is imported only then.
"""

from __future__ import annotations

import logging
import os
import tempfile

import torch
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM

from curvzo_ds.config.presets import DEMO_MODELS
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.shapes import hidden_size_of
from curvzo_ds.shard import ds_compat
from curvzo_ds.tasks import demo_model_config
from curvzo_ds.tasks.tokenizer import load_tokenizer, probe_hub, refused  # the one tokenizer loader, and its checks

__all__ = ["DTYPES", "build_model", "demo_kind", "keep_stored_format", "load_tokenizer", "model_hidden_size",
           "own_memory", "probe_hub", "quantization_config", "refused"]

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

    `model_cfg`: the config's `model` section (config.sections: model, dtype, trust_remote_code, the LoRA keys,
    quantization); `seed`: the engine section's, for the demo model's weights and the LoRA adapters.

    `group` (hybrid sharding): the shard group that `zero.Init` partitions a hub model over while it loads."""
    dtype = DTYPES[model_cfg.dtype]
    keep_alive = None
    quantized = quantization_config(model_cfg.quantization, dtype)  # None for quantization=none
    if model_cfg.model in DEMO_MODELS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(demo_model_config(demo_kind(model_cfg.model))).to(dtype)
        if quantized is not None:
            model = quantized_copy(model, quantized, dtype)
    else:
        probe_hub(model_cfg.model)
        if ds_config.get("zero_optimization", {}).get("stage") == 3:
            from transformers.integrations import HfDeepSpeedConfig  # imports DeepSpeed: not at the top (inputs.py)

            keep_alive = HfDeepSpeedConfig(ds_config)
        where = {} if quantized is None else {"quantization_config": quantized, "device_map": {"": load_device()}}
        with ds_compat.zero_init_group(group if keep_alive is not None else None, mpu):
            model = AutoModelForCausalLM.from_pretrained(model_cfg.model, dtype=dtype,
                                                         trust_remote_code=model_cfg.trust_remote_code, **where)
        whole = ([n for n, p in model.named_parameters() if not ds_compat.zero_init_partitioned(p)]
                 if keep_alive is not None else [])
        if whole:  # zero.Init did not take: every rank would hold the full model
            raise RuntimeError(f"{model_cfg.model} loaded without zero.Init partitioning ({len(whole)} tensors whole, "
                               f"e.g. {whole[0]}); is the transformers/deepspeed pair supported?")
    if quantized is not None:
        keep_stored_format(model)
        own_memory(model)
    if model_cfg.lora:
        from peft import LoraConfig, get_peft_model  # here, not at the top: peft (and the bitsandbytes it imports)
        # is a third of a training process's start-up, and only LoRA runs use it
        model.requires_grad_(False)
        torch.manual_seed(seed + 1)  # every rank must create the same adapters (docs/deepspeed.md)
        lora = LoraConfig(r=model_cfg.lora_r, lora_alpha=model_cfg.lora_alpha,
                          target_modules=list(model_cfg.lora_target_modules), lora_dropout=0.0, task_type="CAUSAL_LM")
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            raise ConfigError(f"lora_target_modules={model_cfg.lora_target_modules}: {e}") from None
    return model, keep_alive


def quantization_config(quantization: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for `quantization`, or None for "none". 4bit: nf4 in blocks of 64 weights,
    each block's absmax one fp32 (no double quantisation), computing in the run's dtype; 8bit: LLM.int8, an int8
    weight with one fp32 scale per output row. bitsandbytes is imported here only: a missing package is one line
    that names the extra."""
    if quantization == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401  the optional extra, imported only when asked for
    except ImportError as e:
        raise ConfigError(f"quantization={quantization} needs bitsandbytes, which cannot be imported ({e}): "
                          "pip install 'curvzo_ds[quant]', or set quantization=none") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**quantization_kwargs(quantization, dtype))


def quantization_kwargs(quantization: str, dtype: torch.dtype) -> dict:
    """The BitsAndBytesConfig arguments of `quantization` (4bit or 8bit), the one statement of how a run quantises
    its base: `quantization_config` builds it, and export's load hint prints it."""
    if quantization == "4bit":
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": dtype,
                "bnb_4bit_use_double_quant": False}
    return {"load_in_8bit": True}


def load_device() -> str:
    """Where bitsandbytes quantises a hub model while it loads: this rank's accelerator (the CPU on a CPU run)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def keep_stored_format(model) -> None:
    """On a CPU with AVX512-bf16, bitsandbytes repacks a 4-bit weight at its first forward in eval mode (its absmax
    rounded to bf16), and every later forward computes differently: a run's losses would depend on when it first
    evaluated, and a resumed run would leave the uninterrupted one. Each 4-bit layer keeps the stored format."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def own_memory(model) -> None:
    """Loaded on the CPU, the tensors bitsandbytes leaves unquantised (embeddings, norms, the head) are views of the
    checkpoint's memory map, which then keeps resident every page that quantising read (the full-precision base):
    copies of their own let the map go. On a GPU they were copied there already."""
    for p in model.parameters():
        if p.device.type == "cpu" and p.is_floating_point():
            p.data = p.data.clone()


def quantized_copy(model, quantized, dtype: torch.dtype):
    """`model` (a demo model built from its config) saved and loaded again through `quantized`, the way a hub model
    loads: the same weights, quantised. It keeps no name (as the model built from its config has none), so that its
    checkpoints and exports name no temporary directory as their base."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the save and load of a tiny model are no progress a user waits for
    try:
        with tempfile.TemporaryDirectory(prefix="curvzo-quantize-") as directory:
            # not save_pretrained: under a process group it writes on rank 0 only, and each rank has a directory
            model.config.save_pretrained(directory)
            save_model(model, os.path.join(directory, "model.safetensors"))  # tied tensors once
            del model
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, quantization_config=quantized,
                                                         device_map={"": load_device()})
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.name_or_path = model.config._name_or_path = ""
    return model
