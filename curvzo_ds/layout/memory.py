"""The memory model of `curvzo-ds plan`: per-rank memory of CurvZO training under ZeRO-3, from the model's config
alone (no weights).

The model is built on the meta device, so a 70B model plans in seconds on a laptop. Every figure is bytes per
rank; docs/plan.md states each formula, shows the plans of OPT-2.7B to Llama-2-70B, and checks the planned peak
against measured ones. Names below: N parameters, K ranks sharing one ZeRO-3 partition (the shard group, K = W by
default), w bytes per element of the weights' dtype, B sequences per forward on one rank, T tokens per sequence.
"""

from __future__ import annotations

import re

import torch

from curvzo_ds.config.ds_config import load_ds_config, resolve_ds_config
from curvzo_ds.config.quantization import QUANTIZATIONS, VALUES_TEXT, Quantization, is_quantized, quantization_lacks
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.plan import TABLE_ROW, GiB, Plan
from curvzo_ds.layout.prefetch import SMALL_BLOCK, gather_peak, shard_elements
from curvzo_ds.layout.shapes import PUBLISHED, hidden_size_of, meta_model, model_config, published_key

# A CPU run only (--device cpu), measured here (docs/plan.md): the process memory a run adds above the imported
# libraries besides its tensors (DeepSpeed's engine and hooks, tokenizer, data, compiled noise kernel).
RUNTIME_CPU = 35 * 2**20
WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of a linear layer's weight that bitsandbytes quantises (models.quantization_config), with its
# statistics: 4bit is nf4, two weights a byte, and one fp32 absmax per block of 64 weights (no double quantisation:
# 0.5 + 4/64); 8bit is LLM.int8, a byte a weight and one fp32 scale per output row (`QUANT_ROW`).
QUANT_WIDTH = {Quantization.NF4.value: 0.5 + 4 / 64, Quantization.INT8.value: 1.0}
QUANT_ROW = {Quantization.NF4.value: 0, Quantization.INT8.value: 4}
ADAPTER_WIDTH = 4  # peft keeps LoRA adapters in fp32 (autocast_adapter_dtype), and stage 0 leaves them so
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_memory(text: str) -> int:
    """"80GiB", "80 GiB", "80G" (binary), "80GB" (decimal), "1.5TiB", "512MiB" or bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m or (m.group(3) == "i"):
        raise ConfigError(f"--gpu-memory {text}: use a size such as 80GiB, 80GB or 40G")
    power = " kmgt".index(m.group(2) or " ")
    base = 1000 if m.group(3) == "b" and m.group(2) else 1024
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        # Nothing fits in no memory; a plan that says so with rc 0 hides a typo.
        raise ConfigError(f"--gpu-memory {text}: must be more than 0; use a size such as 80GiB, 80GB or 40G")
    return size


def zero_settings(deepspeed: str | dict | None, dtype: str, offload: str, world_size: int, hidden: int | None):
    """(ZeRO config as DeepSpeed reads it, dtype, offload): the DeepSpeed config (a file's path, read by
    config.ds_config's one reader, or the dict a run read) mapped by config.ds_config's mapping, as `curvzo-ds train`
    maps it (its bf16/fp16 and offload_param win; "auto" sizes resolved from the hidden size), DeepSpeed's defaults
    for every key it leaves out (stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters 1e9,
    stage3_param_persistence_threshold 1e5 elements)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    user = load_ds_config(deepspeed) if isinstance(deepspeed, str) else (
        deepspeed or {"zero_optimization": {"stage": 3}})
    ds, mapped, _ = resolve_ds_config(user, world_size, hidden, dtype=dtype, offload_param=offload)
    zero = dict(ds["zero_optimization"])
    if zero.pop("stage") not in (3, "auto"):
        raise ConfigError(f"--deepspeed {_name(deepspeed)}: curvzo-ds plan plans ZeRO stage 3; set "
                          "zero_optimization.stage to 3")
    return DeepSpeedZeroConfig(**zero), mapped["dtype"], mapped["offload_param"]


def trained_extent(run, steps: int) -> tuple[int, int, int]:
    """Train a built run (train.build) for `steps` steps; return the largest forward it made: (rows, tokens per row,
    label positions), what `curvzo-ds plan` takes as --batch, --seq-len and --label-positions. The measured side of
    a plan's check (tests/test_plan.py, benchmarks/quant_rss.py)."""
    rows = seq = positions = 0
    for t in range(steps):
        batches = run.batch(t)
        for mb in batches.items:
            rows, seq = max(rows, mb["input_ids"].shape[0]), max(seq, mb["input_ids"].shape[1])
            positions = max(positions, int((mb["label_mask"][:, 1:] > 0).any(0).sum()))
        run.engine.step(batches)
    return rows, seq, positions


def activation_bytes(conf, names: list[str], seq_len: int, width: int, label_positions: int = 1) -> int:
    """Bytes of forward activations for one sequence of T tokens, inference style (torch.no_grad, no KV cache):
    one layer's live set at a time, plus the attention mask and the logits at label positions.

    w * T * (2H + max(4H + 3H_kv, c * I))  + T^2 (boolean mask)  + P * V * (w + 8)
    residual stream and normed input (2H); attention: q, rotated q, output and its contiguous copy (4H) with k, v
    and rotated k (3 H_kv), SDPA never holding T x T scores; MLP: c = 3 for a gated MLP (act(gate), up, product),
    2 otherwise (fc1, act); P label positions of logits (`logits_to_keep`), upcast to float32 and log-softmaxed.
    """
    hidden = hidden_size_of(conf)
    heads = conf.num_attention_heads
    kv = (getattr(conf, "num_key_value_heads", None) or heads) * (hidden // heads)
    inter = getattr(conf, "intermediate_size", None) or getattr(conf, "ffn_dim", None) or 4 * hidden
    gated = any("gate_proj" in n or "gate_up_proj" in n for n in names)
    per_token = 2 * hidden + max(4 * hidden + 3 * kv, (3 if gated else 2) * inter)
    return width * seq_len * per_token + seq_len * seq_len + label_positions * conf.vocab_size * (width + 8)


def training_activation_bytes(conf, seq_len: int, width: int, label_positions: int = 1) -> int:
    """One sequence's activations kept for a backward pass (for the AdamW figure): Korthikanti et al. (2022), Eq. 1
    without the attention-score term (SDPA keeps no T x T scores): 34 * T * H bytes per layer at 16 bits (scaled
    by w / 2), plus the same logits as the forward."""
    hidden = hidden_size_of(conf)
    per_layer = 34 * seq_len * hidden * width // 2
    return conf.num_hidden_layers * per_layer + label_positions * conf.vocab_size * (width + 8)


def plan_memory(model: str = "demo", world_size: int = 1, shard_group_size: int | None = None,
                dtype: str = "bfloat16", offload: str = "none", batch: int = 4, seq_len: int = 512,
                gpu_memory: int | str = 80 * GiB, fp32_master: bool | str = "auto", deepspeed: str | dict | None = None,
                device: str = "gpu", label_positions: int = 1, trust_remote_code: bool = False,
                num_directions: int = 1, quantization: str = "none", lora_r: int = 0,
                lora_target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Plan:
    """The plan of one rank (rank 0, the largest). Raises ConfigError for what cannot be planned. `dtype="auto"`: the
    model config's torch_dtype when it names one of fp32, bf16, fp16, else bf16. `lora_r` >= 1 plans a LoRA run
    (the base frozen, adapters of rank r on the linear layers named `lora_target_modules` trained); `quantization`
    (4bit, 8bit; it needs LoRA, and stage 0: one shard group of 1, no offload) holds the base's linear weights
    as bitsandbytes does (QUANT_WIDTH)."""
    dtype, fp32_master, group, memory = _checked_arguments(
        dtype=dtype, fp32_master=fp32_master, world_size=world_size, shard_group_size=shard_group_size, batch=batch,
        seq_len=seq_len, label_positions=label_positions, num_directions=num_directions, offload=offload,
        device=device, quantization=quantization, lora_r=lora_r, gpu_memory=gpu_memory)
    conf, checkpoint, source = model_config(model, trust_remote_code)
    zero, dtype, offload, dtype_from = _weights_dtype(conf, dtype, deepspeed, offload, world_size)
    width = WIDTH[dtype]
    net = meta_model(conf)
    named = list(net.named_parameters())  # tied tensors once
    numels = [p.numel() for _, p in named]
    n = sum(numels)
    persistent = persistent_tensors(numels, zero)
    ids = {id(p): i for i, (_, p) in enumerate(named)}
    calls = [[ids[id(p)] for p in m.parameters(recurse=False)] for m in net.modules()]  # each module's own tensors
    largest_module = max((sum(numels[i] for i in m) for m in calls), default=0)

    stored = width * sum(shard_elements(k, group) for k in numels)  # the base in the weights' dtype
    # Offloaded parameters are fetched to the GPU module by module even at K = 1 (ZeRO-3's partitioned_param_
    # coordinator copies from the host instead of all-gathering), and the persistent ones stay there whole.
    fetched = group > 1 or offload == "cpu" and device == "gpu"
    whole = width * sum(numels[i] for i in persistent) if fetched else 0
    # the tensors a step perturbs: every one, or the LoRA adapters (in fp32); the base as held
    trained, shard, quantized, dequant = (numels, stored, 0, 0) if not lora_r else _lora_base(
        net, lora_r, tuple(lora_target_modules), model, quantization, numels, ids, width, stored)
    masters, rule = _fp32_copies(named, numels, persistent, group, dtype, fp32_master, lora_r)
    step_copy = _step_copy(named, numels, persistent, fetched, group, width, dtype, fp32_master, lora_r,
                           num_directions)

    gathered = allocator = 0
    if fetched:
        gathered, small = gather_peak(calls, numels, persistent, group, zero, width, gloo=device == "cpu")
        allocator = small if device == "cpu" else 0
    tied = 0
    if source != "demo":
        every = [p for _, p in net.named_parameters(remove_duplicate=False)]
        tied = width * sum(shard_elements(numels[ids[id(p)]], group) for p in every) - stored
    runtime = RUNTIME_CPU if device == "cpu" else 0

    per_row = activation_bytes(conf, [nm for nm, _ in named], seq_len, width, label_positions)
    if source == "demo" or checkpoint is None:  # a demo model is built whole on every rank, then partitioned
        checkpoint = width * n
    load = checkpoint + shard + (2 if group > 1 else 1) * width * largest_module + runtime

    return Plan(
        model=model, params=n, tensors=len(numels), world_size=world_size, group=group, dtype=dtype, offload=offload,
        device=device, batch=batch, seq_len=seq_len, memory=memory, bucket=zero.prefetch_bucket_size,
        live=zero.max_live_parameters, persistence=zero.param_persistence_threshold,
        persistent_elements=sum(numels[i] for i in persistent), largest_module=largest_module, shard=shard,
        persistent=whole, master=4 * sum(masters), master_rule=rule, gathered=gathered, allocator=allocator,
        tied=tied, runtime=runtime, per_row=per_row,
        table=TABLE_ROW * (len(trained) * (2 if fetched else 1) if lora_r else len(numels) + len(persistent)),
        zo_state=16 * 8 * len(trained),
        checkpoint=checkpoint, load=load,
        adamw_states=_adamw_states(n, largest_module, world_size, offload, lora_r, shard, trained, group),
        adamw_per_row=training_activation_bytes(conf, seq_len, width, label_positions), dtype_from=dtype_from,
        directions=num_directions, step_copy=step_copy, quantization=quantization, quantized_elements=quantized,
        lora_r=lora_r, adapters=ADAPTER_WIDTH * sum(shard_elements(k, group) for k in trained) if lora_r else 0,
        dequant=dequant)


def _checked_arguments(*, dtype, fp32_master, world_size, shard_group_size, batch, seq_len, label_positions,
                       num_directions, offload, device, quantization, lora_r, gpu_memory):
    """(dtype by its torch name or "auto", fp32_master as auto/True/False, the shard group, the memory in bytes)
    from plan's arguments; a ConfigError in one line, naming the flag, for one it cannot plan."""
    dtype = DTYPE_NAMES.get(dtype, dtype)
    if dtype not in WIDTH and dtype != "auto":
        raise ConfigError(f"--dtype {dtype}: use auto, bf16, fp16 or fp32")
    if isinstance(fp32_master, str) and fp32_master != "auto":
        fp32_master = {"true": True, "false": False}.get(fp32_master.lower(), fp32_master)
    if fp32_master not in ("auto", True, False):
        raise ConfigError(f"--fp32-master-weights {fp32_master}: use auto, true or false")
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: use an integer >= 1")
    group = world_size if shard_group_size is None else shard_group_size
    if not 1 <= group <= world_size or world_size % group:
        raise ConfigError(f"--shard-group-size {shard_group_size}: use a divisor of --world-size {world_size} "
                          "(ranks that share one ZeRO-3 partition)")
    for flag, value in (("--batch", batch), ("--seq-len", seq_len), ("--label-positions", label_positions),
                        ("--num-directions", num_directions)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: use an integer >= 1")
    if offload not in ("none", "cpu") or device not in ("gpu", "cpu"):
        raise ConfigError(f"--offload {offload} / --device {device}: use none or cpu / gpu or cpu")
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {quantization}: use {VALUES_TEXT}")
    if quantization_lacks(quantization, lora=lora_r >= 1, zero3=group > 1, offload=offload != "none"):
        raise ConfigError(f"--quantization {quantization}: a bitsandbytes base is frozen under LoRA (--lora-r >= 1) "
                          f"and whole on every rank (stage 0): plan it with --shard-group-size 1 and no --offload, "
                          f"not --lora-r {lora_r} --shard-group-size {group} --offload {offload}")
    memory = parse_memory(gpu_memory) if isinstance(gpu_memory, str) else int(gpu_memory)
    return dtype, fp32_master, group, memory


def _weights_dtype(conf, dtype: str, deepspeed, offload: str, world_size: int):
    """(ZeRO config, the weights' dtype, offload, where the dtype came from when --dtype did not name it): "auto"
    is the model config's torch_dtype, else bf16; a DeepSpeed config's bf16/fp16 section wins."""
    dtype_from = ""
    if dtype == "auto":
        dtype = config_dtype(conf)
        dtype_from = "the model config's torch_dtype" if dtype else "--dtype auto: no torch_dtype in the model config"
        dtype = dtype or "bfloat16"
    asked = dtype
    zero, dtype, offload = zero_settings(deepspeed, dtype, offload, world_size, hidden_size_of(conf))
    if dtype != asked:
        dtype_from = f"the deepspeed config {_name(deepspeed)}"
    return zero, dtype, offload, dtype_from


def persistent_tensors(numels: list[int], zero) -> set[int]:
    """DeepSpeed's persistence rule (parameter_offload.mark_persistent_parameters): small tensors, in order, up to
    stage3_model_persistence_threshold elements in all."""
    persistent, kept = set(), 0
    for i, k in enumerate(numels):
        if k + kept <= zero.model_persistence_threshold and k <= zero.param_persistence_threshold:
            persistent.add(i)
            kept += k
    return persistent


def _lora_base(net, lora_r: int, targets: tuple[str, ...], model: str, quantization: str, numels: list[int], ids,
               width: int, stored: int) -> tuple[list[int], int, int, int]:
    """A LoRA run: (the adapters' elements, the base's bytes as held, its quantised elements, the bytes of the
    largest weight dequantised for its matmul). A quantised base holds its linear weights as bitsandbytes does
    (QUANT_WIDTH, QUANT_ROW)."""
    trained, quantized_weights = lora_shapes(net, lora_r, targets, model)
    if not is_quantized(quantization):
        return trained, stored, 0, 0
    quantized = sum(numels[ids[id(p)]] for p in quantized_weights)
    rows = sum(p.shape[0] for p in quantized_weights)
    shard = stored + int(quantized * (QUANT_WIDTH[quantization] - width)) + QUANT_ROW[quantization] * rows
    return trained, shard, quantized, width * max((p.numel() for p in quantized_weights), default=0)


def _fp32_copies(named, numels, persistent, group: int, dtype: str, fp32_master, lora_r: int):
    """(elements of each fp32 copy, the rule in words): of each bf16/fp16 tensor that fp32_master keeps (every one,
    or auto's 1-D ones), its shard, or all of it if persistent; none for float32 or LoRA (fp32 adapters)."""
    masters = []
    if dtype != "float32" and fp32_master and not lora_r:
        masters = [k if i in persistent else shard_elements(k, group) for i, (k, (_, p)) in
                   enumerate(zip(numels, named)) if fp32_master is True or p.dim() == 1]
    rule = {True: "every tensor", False: "none", "auto": "auto: 1-D tensors"}[fp32_master]
    if dtype == "float32" or lora_r:
        rule = "none: the LoRA adapters are fp32" if lora_r else "none: float32 is edited exactly"
    return masters, rule


def _step_copy(named, numels, persistent, fetched: bool, group: int, width: int, dtype: str, fp32_master,
               lora_r: int, num_directions: int) -> int:
    """A step of several directions writes the bf16/fp16 tensors it edits in place from a copy of them taken at its
    start (shard/perturb.py): the region of each tensor without an fp32 copy, in the weights' dtype."""
    if dtype == "float32" or num_directions == 1 or lora_r:
        return 0
    kept = [fp32_master is True or (fp32_master == "auto" and p.dim() == 1) for _, p in named]
    return width * sum(k if i in persistent and fetched else shard_elements(k, group)
                       for i, k in enumerate(numels) if not kept[i])


def _adamw_states(n: int, largest_module: int, world_size: int, offload: str, lora_r: int, shard: int,
                  trained: list[int], group: int) -> int:
    """First-order AdamW's model states, for comparison: DeepSpeed's own estimate, the figure
    estimate_zero3_model_states_mem_needs_all_live prints (that one counts parameters by data_ptr(), 0 for every
    meta tensor): 18 bytes per parameter over the ranks + 4 x the largest layer; with offload_param cpu,
    DeepSpeed's offload case (4 x the largest layer). LoRA: AdamW on the same adapters, the base as held, and fp32
    weight, gradient and two moments per adapter."""
    if lora_r:
        return shard + 16 * sum(shard_elements(k, group) for k in trained)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, states, _ = estimate_zero3_model_states_mem_needs(
        n, largest_module, num_gpus_per_node=world_size, num_nodes=1, cpu_offload=offload == "cpu",
        cpu_offload_params=offload == "cpu", zero_init=True)
    return states


def lora_shapes(net, r: int, targets: tuple[str, ...], model: str) -> tuple[list[int], list]:
    """(the elements of each LoRA adapter tensor, the weights bitsandbytes quantises) of the meta model `net`: peft
    puts A (r x in) and B (out x r) on each linear layer whose name is a target or ends with ".target"; transformers
    quantises the weight of every linear layer but the output embedding (its `get_keys_to_not_convert`)."""
    head = net.get_output_embeddings()
    linears = [(name, m) for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    trained = [n for name, m in linears if any(name == t or name.endswith(f".{t}") for t in targets)
               for n in (r * m.in_features, m.out_features * r)]
    if not trained:
        raise ConfigError(f"--lora-target-modules {','.join(targets)}: no linear layer of {model} is named so")
    return trained, [m.weight for _, m in linears if m is not head]


def _name(deepspeed: str | dict | None) -> str:
    return deepspeed if isinstance(deepspeed, str) else "of the run"


def config_dtype(conf) -> str | None:
    """The dtype a model config names, if it is one plan knows (transformers reads a config.json's `torch_dtype`,
    the older key, into `dtype` too)."""
    named = getattr(conf, "dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else None
    return name if name in WIDTH else None


def summary_table(models: list[str], world_sizes: list[int], **kwargs) -> str:
    """A Markdown table of plans: per model and world size, the per-rank figures in GiB and the verdict."""
    rows = ["| model | W | shard | gathered | tied dup. | activations | fp32 copy | CurvZO total | "
            "AdamW (DeepSpeed + act.) | verdict | largest batch |", "|" + "---|" * 11]
    for name in models:
        for w in world_sizes:
            p = plan_memory(name, w, **kwargs)
            g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
            rows.append(f"| {name} | {w} | {g(p.shard)} | {g(p.gathered)} | {g(p.tied)} | {g(p.activations)} | "
                        f"{g(p.master)} | {g(p.total)} | {g(p.adamw)} | {'fits' if p.fits else 'does not fit'} | "
                        f"{p.max_batch} |")
    return "\n".join(rows)


__all__ = ["GiB", "PUBLISHED", "SMALL_BLOCK", "TABLE_ROW",
           "Plan", "activation_bytes", "gather_peak", "parse_memory",
           "plan_memory", "published_key", "shard_elements", "summary_table"]
