"""`Plan`: one rank's memory in bytes as the planner counts it (layout/memory.py, `plan_memory`), the totals and the
verdict read from it (`steady`, `total`, `fits`, `max_batch`), and the report `curvzo-ds plan` prints (`format`).
"""

from __future__ import annotations

import dataclasses

from curvzo_ds.noise.rows import ROW_BYTES

GiB = 2**30
TABLE_ROW = ROW_BYTES  # bytes of one row of the Perturber's row table (noise/rows.py)


@dataclasses.dataclass
class Plan:
    """One rank's memory, in bytes. `device` is GPU memory (on a CPU run, --device cpu: the process's memory);
    `host` is CPU memory beside a GPU. Each field's formula is in its comment (names: layout/memory.py's
    docstring)."""

    model: str
    params: int  # N, every tensor once (tied ones once)
    tensors: int  # the model's tensors (full fine-tuning: CurvZO's blocks at block_granularity=tensor)
    world_size: int
    group: int  # K
    dtype: str
    offload: str
    device: str  # "gpu" or "cpu"
    batch: int
    seq_len: int
    memory: int  # the memory to fit in, per rank
    bucket: int  # stage3_prefetch_bucket_size (elements)
    live: int  # stage3_max_live_parameters (elements)
    persistence: int  # stage3_param_persistence_threshold (elements)
    persistent_elements: int  # elements of the tensors at or under the persistence threshold
    largest_module: int  # elements of the largest module's own parameters (what ZeRO-3 gathers at once)
    shard: int  # w * sum over tensors of ceil(numel / K)
    persistent: int  # w * persistent_elements: whole on every rank from the second forward on (0 at K = 1 unless
    #                  offloaded)
    master: int  # 4 * region of each bf16/fp16 tensor with an fp32 copy (region: its shard, or all if persistent)
    master_rule: str
    gathered: int  # the peak of gathered parameters over one forward at K > 1 or offloaded (`gather_peak`)
    allocator: int  # CPU: the high-water mark of gathered blocks under SMALL_BLOCK, kept by the allocator
    tied: int  # w * shard of each tied duplicate: from_pretrained partitions it, then ties it away; its shard
    #            stays in a reference cycle until Python's next full collection
    runtime: int  # CPU: RUNTIME_CPU; 0 on a GPU
    per_row: int  # activation bytes of one sequence of T tokens (`activation_bytes`)
    table: int  # TABLE_ROW per stored copy of a tensor (its shard, and a persistent one's replica): the Perturber's
    #            row table, on the device and pinned on the host
    zo_state: int  # 16 float64 per block: scores, sizes, warm-up sums, and the step's pi, mask and all-reduce
    checkpoint: int  # rank 0 while loading: the checkpoint's bytes (from_pretrained maps every file on rank 0)
    load: int  # rank 0's peak while loading: checkpoint + shard + w * largest module (twice at K > 1: gathered
    #            and copied) + runtime
    adamw_states: int  # DeepSpeed's ZeRO-3 model-state estimate for AdamW (GPU bytes)
    adamw_per_row: int  # activations of one sequence kept for backward (`training_activation_bytes`)
    dtype_from: str = ""  # where dtype came from when --dtype was not given
    directions: int = 1  # q, num_directions
    step_copy: int = 0  # q > 1: w * region of each bf16/fp16 tensor without an fp32 copy: the step's copy of the
    #                     weights it edits in place (shard/perturb.py); fp32 weights and master-kept ones: none
    quantization: str = "none"  # none, 8bit or 4bit: the base's linear weights as bitsandbytes holds them
    quantized_elements: int = 0  # weights of the quantised linear layers (all but the output embedding's)
    lora_r: int = 0  # a LoRA run's rank (0: full fine-tuning): the base frozen, the adapters the trained tensors
    adapters: int = 0  # ADAPTER_WIDTH * shard of the LoRA adapters, r (in + out) per targeted linear layer
    dequant: int = 0  # quantised: w * the largest quantised weight, dequantised for one matmul at a time

    @property
    def activations(self) -> int:
        return self.batch * self.per_row

    @property
    def adamw(self) -> int:
        """First-order AdamW under the same ZeRO-3 config: DeepSpeed's estimate + B x activations for backward."""
        return self.adamw_states + self.batch * self.adamw_per_row

    @property
    def host(self) -> int:
        """CPU memory beside the GPU after loading: the shard and its fp32 copy when offloaded (the fp32 copy lives
        where the weights do), and the pinned row table."""
        return (self.shard + self.master + self.step_copy if self.offload == "cpu" else 0) + self.table

    def _fixed(self) -> int:
        """What does not grow with B, in the memory the verdict is about."""
        fixed = self.persistent + self.gathered + self.allocator + self.tied + self.zo_state + self.runtime + \
            self.dequant
        with_weights = self.shard + self.adapters + self.master + self.step_copy  # where the weights live
        if self.device == "cpu":
            return fixed + with_weights + self.table
        return fixed + (with_weights if self.offload == "none" else 0) + self.table

    @property
    def steady(self) -> int:
        """The peak after loading: what the steps need."""
        return self._fixed() + self.activations

    @property
    def total(self) -> int:
        """The peak to fit: GPU memory after loading; on a CPU run (--device cpu) all the process holds after
        loading, or rank 0's loading peak when that is larger."""
        return max(self.steady, self.load) if self.device == "cpu" else self.steady

    @property
    def fits(self) -> bool:
        return self.total <= self.memory

    @property
    def max_batch(self) -> int:
        """The largest B with total <= memory at T tokens (0: none)."""
        if self._fixed() >= self.memory or (self.device == "cpu" and self.load > self.memory):
            return 0
        return (self.memory - self._fixed()) // max(self.per_row, 1)

    def format(self) -> str:
        where = "process memory (a CPU run)" if self.device == "cpu" else "GPU memory"
        host = " [host]" if self.device == "gpu" else ""
        if self.quantization != "none":
            bits = {"4bit": "nf4, 0.5 B + an fp32 absmax per 64 weights", "8bit": "int8, 1 B + an fp32 scale per row"}
            weights = (f"base weights: {self.quantized_elements / 1e9:.3f} B quantised {self.quantization} "
                       f"({bits[self.quantization]}), the rest {self.dtype}")
        else:
            weights = f"weight shard (1/{self.group} of every tensor)"
        rows = [
            (weights + (host if self.offload == "cpu" else ""), self.shard),
            (f"persistent parameters, whole ({self.persistent_elements / 1e6:.2f} M elements, each <= "
             f"{self.persistence:.0e})", self.persistent),
            (f"fp32 copy ({self.master_rule}, beside the weights)" + (host if self.offload == "cpu" else ""),
             self.master),
            (f"gathered parameters (peak over a forward; prefetch bucket {self.bucket:.0e}, live limit "
             f"{self.live:.0e})", self.gathered),
            ("tied duplicate left by loading (until Python's next full collection)", self.tied),
            (f"forward activations ({self.batch} x {self.seq_len} tokens)", self.activations),
            (f"row table ({TABLE_ROW} bytes per stored copy of a tensor)", self.table),
            ("ZO state (16 float64 per block)", self.zo_state),
            (f"copy of bf16/fp16 weights for a step of {self.directions} direction{'s' * (self.directions != 1)} "
             "(those without an fp32 copy; none at q = 1)" + (host if self.offload == "cpu" else ""), self.step_copy),
        ]
        if self.lora_r:
            rows[1:1] = [(f"LoRA adapters (r={self.lora_r}, fp32: the trained tensors)", self.adapters)]
        if self.quantization != "none":
            rows.insert(-1, ("one quantised weight dequantised for its matmul (the largest)", self.dequant))
        if self.device == "gpu":
            rows += [("host memory beside the GPU (offloaded shard and fp32 copy, row table)", self.host),
                     ("host memory on rank 0 while loading (the checkpoint)", self.checkpoint)]
        else:
            rows += [("allocator: freed gathered blocks under 32 MiB kept in the heap", self.allocator),
                     ("runtime: the run's objects besides tensors (measured)", self.runtime),
                     ("peak while loading, rank 0 (checkpoint + shard + largest module)", self.load)]
        rows += [("total CurvZO per rank", self.total),
                 (f"first-order AdamW, same ZeRO-3 (DeepSpeed {self.adamw_states / GiB:.2f} GiB + activations "
                  f"for backward; {self.adamw / max(self.total, 1):.1f}x)" if not self.lora_r else
                  f"first-order AdamW on the adapters (base + 16 B per adapter weight {self.adamw_states / GiB:.2f} "
                  f"GiB + activations for backward; {self.adamw / max(self.total, 1):.1f}x)", self.adamw)]
        width = max(len(label) for label, _ in rows)
        lora = f" LoRA r={self.lora_r}, base {self.quantization};" if self.quantization != "none" else (
            f" LoRA r={self.lora_r};" if self.lora_r else "")
        lines = [f"curvzo-ds plan: {self.model}, {self.params / 1e9:.3f} B parameters in {self.tensors} tensors;{lora} "
                 f"world size {self.world_size}, shard group {self.group}, {self.dtype}"
                 f"{f' ({self.dtype_from})' if self.dtype_from else ''}, offload_param "
                 f"{self.offload}; {where} per rank {self.memory / GiB:.1f} GiB"]
        lines += [f"  {label:<{width}} {value / GiB:9.3f} GiB" for label, value in rows]
        lines.append(f"  largest batch that fits at {self.seq_len} tokens: {self.max_batch}")
        lines.append(f"{'fits' if self.fits else 'does not fit'}: {self.total / GiB:.2f} GiB of "
                     f"{self.memory / GiB:.1f} GiB per rank")
        return "\n".join(lines)
