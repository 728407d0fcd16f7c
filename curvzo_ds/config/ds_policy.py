"""The DeepSpeed policy in one table: what a shard-local zeroth-order engine refuses, maps, or drops.

Read by the config mapping (ds_config.py, a user's `--deepspeed` file or Accelerate config), by the
engine's check of a DeepSpeed engine a user built themselves (ds_compat.check_engine_supported), and
by the `zero_stage` key (schema.py), so each refusal is stated once, with its reason and its fix.
docs/deepspeed.md shows the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _int_above_one(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 1


@dataclass(frozen=True)
class Refusal:
    """A DeepSpeed setting the engine cannot serve: `key` is its dotted path in a DeepSpeed config."""

    key: str
    refuses: Callable[[Any], bool]
    reason: str
    fix: str

    def message(self, value: Any) -> str:
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        return f"{self.key}={shown} is not supported: {self.reason}. {self.fix}"


REFUSALS = (  # checked in this order: parallelism first, then ZeRO
    Refusal("pipeline.stages", _int_above_one, "curvzo_ds shards with ZeRO-3 only", "Remove the pipeline section"),
    Refusal("tensor_parallel.autotp_size", _int_above_one, "curvzo_ds shards with ZeRO-3 only",
            "Remove the tensor_parallel section"),
    Refusal("sequence_parallel_size", _int_above_one, "curvzo_ds shards with ZeRO-3 only", "Remove the key"),
    Refusal("zero_optimization.stage", lambda v: v in (1, 2) and not isinstance(v, bool),
            "ZeRO stages 1 and 2 require an optimizer in DeepSpeed 0.19.8, and CurvZO has none",
            "Use zero_optimization.stage 3 (or 0 for no ZeRO)"),
    Refusal("zero_optimization.zero_hpz_partition_size", _int_above_one,
            "hpZ gathers read a secondary copy of the weights that the engine's in-place edits of each rank's "
            "primary shard never reach", "Remove zero_hpz_partition_size or set it to 1"),
    Refusal("zero_optimization.mics_shard_size", lambda v: _int_above_one(v) or v == 1,
            "MiCS was removed from DeepSpeed 0.19.8; curvzo_ds's hybrid sharding does the same",
            "Remove mics_shard_size and set shard_group_size to that value (docs/scaling.md)"),
    Refusal("zero_optimization.zero_quantized_weights", lambda v: v is True,
            "the shards are int8 and cannot take the engine's small in-place perturbations",
            "Set zero_quantized_weights to false"),
    Refusal("zero_optimization.zero_quantized_nontrainable_weights", lambda v: v is True,
            "the shards are int8 and cannot take the engine's small in-place perturbations",
            "Set zero_quantized_nontrainable_weights to false"),
    Refusal("zero_optimization.offload_param.device", lambda v: str(v).endswith("nvme"),
            "the engine edits each shard in place, and NVMe-offloaded shards are not in memory",
            'Use "cpu" or remove offload_param'),
)
REFUSAL_BY_KEY = {r.key: r for r in REFUSALS}

# The TrainConfig fields a DeepSpeed config can set.
MAPPED_FIELDS = ("global_batch_size", "micro_batch_size", "dtype", "zero_stage", "offload_param")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# ZeRO-3 sizes we honour; "auto" for the first three is resolved from the hidden size (HF's rule).
HONOURED_ZERO_SIZES = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                       "stage3_max_live_parameters", "stage3_max_reuse_distance")

# Top-level keys dropped with a warning, and why.
DROPPED = {
    "optimizer": "a DeepSpeed optimizer would cost fp32 master weights and Adam state, and CurvZO takes no gradient "
                 "step: set learning_rate and lr_scheduler_type instead",
    "scheduler": "a DeepSpeed scheduler would cost fp32 master weights and Adam state, and CurvZO takes no gradient "
                 "step: set learning_rate and lr_scheduler_type instead",
    "activation_checkpointing": "it only saves memory for a backward pass, and CurvZO runs forwards only",
    "amp": "the precision is set by dtype (or bf16/fp16.enabled)",
    "torch_autocast": "the precision is set by dtype (or bf16/fp16.enabled)",
}
MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet")
MONITOR_REASON = ("DeepSpeed's monitors log optimizer steps, which CurvZO does not take: metrics go to metrics.jsonl, "
                  "and to TensorBoard, W&B, MLflow and the like with report_to (report_to=tensorboard,wandb)")

# Keys that only configure gradients, DeepSpeed's optimizer, data loader or checkpoint engine.
QUIET_DROP = ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
              "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
              "seq_parallel_communication_data_type", "sparse_gradients", "data_types", "checkpoint",
              "dataloader_drop_last", "managed_gradient_accumulation", "elasticity")

# DeepSpeed's own logging and profiling: harmless, handed to DeepSpeed as written.
QUIET_PASS = ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler",
              "comms_logger", "timers", "log_level", "disable_python_gc", "aio", "compile",
              "pipeline", "tensor_parallel", "sequence_parallel_size")  # the last three only when not refused

FP16_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                     "consecutive_hysteresis", "min_loss_scale", "auto_cast")


def lookup(config: dict, key: str) -> Any:
    """The value at dotted `key` in a nested config dict, or None."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def refusal(config: dict) -> str | None:
    """The message of the first refused setting in `config` (a nested DeepSpeed config dict), or None."""
    for r in REFUSALS:
        value = lookup(config, r.key)
        if value is not None and r.refuses(value):
            return r.message(value)
    return None
