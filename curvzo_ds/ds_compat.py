"""Every DeepSpeed private attribute this project reads lives here (DESIGN.md §3, §5).

ZeRO-3 facts used (deepspeed 0.19.8, checked by running):
- a partitioned parameter has `ds_tensor`, a 1-D shard of P = ceil(ds_numel / W) elements;
  rank r of `ds_process_group` owns flat indices [r*P, min((r+1)*P, ds_numel)), the rest of the
  last shards is padding that is never gathered;
- `ds_persist` parameters stay gathered (`ds_status == AVAILABLE`) from the second forward on,
  so an edit must reach `p.data` as well as `ds_tensor`;
- outside a forward `p.data` of a non-persistent parameter has shape (0,).
"""

from __future__ import annotations

import contextlib

import torch


def is_ds_engine(obj) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return False
    return isinstance(obj, DeepSpeedEngine)


def is_partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_numel")


def full_numel(p: torch.nn.Parameter) -> int:
    return int(p.ds_numel) if is_partitioned(p) else p.numel()


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)


def owned_range(p: torch.nn.Parameter) -> tuple[int, int]:
    """The global flat range [lo, hi) of the parameter stored in this rank's shard."""
    import torch.distributed as dist

    numel = int(p.ds_numel)
    part = int(p.ds_tensor.numel())
    rank = dist.get_rank(group=p.ds_process_group)
    lo = min(rank * part, numel)
    return lo, min(lo + part, numel)


def shard_view(p: torch.nn.Parameter, length: int) -> torch.Tensor:
    """The first `length` elements of this rank's shard (the rest is padding)."""
    return p.ds_tensor.data.view(-1)[:length]


def is_persistent(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "ds_persist", False))


def is_available(p: torch.nn.Parameter) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE and p.data.numel() == full_numel(p)


def gathered(params, modifier_rank=None):
    """Gather the full values of ZeRO-3 parameters for the body of a `with` (a collective)."""
    params = [p for p in params if is_partitioned(p)]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def check_engine_supported(engine) -> None:
    """Refuse DeepSpeed set-ups a shard-local scheme cannot serve, with the reason and the fix."""
    stage = engine.zero_optimization_stage()
    if stage in (1, 2):
        raise ValueError(f"ZeRO stage {stage} is not supported: DeepSpeed 0.19.8 requires an optimizer for "
                         "stages 1 and 2, and CurvZO has none. Use zero_optimization.stage 3 (or 0).")
    zc = engine.zero_optimization() if stage else None
    if zc is not None:
        if getattr(zc, "zero_hpz_partition_size", 1) > 1:
            raise ValueError("zero_hpz_partition_size > 1 (hpZ) is not supported: gathers read a secondary "
                             "copy of the weights that the engine's in-place edits of the primary shard never "
                             "reach. Remove zero_hpz_partition_size or set it to 1.")
        if getattr(zc, "zero_quantized_weights", False):
            raise ValueError("zero_quantized_weights is not supported: the shards are int8 and cannot take "
                             "a small Gaussian perturbation. Set zero_quantized_weights to false.")
    if getattr(engine, "pipeline_parallelism", False):
        raise ValueError("pipeline parallelism is not supported by curvzo_ds; use ZeRO-3 alone")


def optimizer_of(engine):
    """The engine's optimizer, or None. ZeRO-3 without one keeps a `DeepSpeedZeRoOffload` in
    `engine.optimizer`: it only gathers and releases parameters, it holds no optimizer state."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    opt = getattr(engine, "optimizer", None)
    return None if opt is None or isinstance(opt, DeepSpeedZeRoOffload) else opt


def module_of(model) -> torch.nn.Module:
    return model.module if is_ds_engine(model) else model
