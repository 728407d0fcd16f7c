"""Every DeepSpeed private attribute this project reads lives here (docs/deepspeed.md).

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

from curvzo_ds.config.ds_policy import REFUSALS, refusal


def is_ds_engine(obj) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return False
    return isinstance(obj, DeepSpeedEngine)


def is_partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_numel")


def zero_init_partitioned(p: torch.nn.Parameter) -> bool:
    """True for a parameter that zero.Init (or deepspeed.initialize at stage 3) took over: it has a `ds_id`."""
    return hasattr(p, "ds_id")


def shard_address(p: torch.nn.Parameter) -> int:
    """The address of this rank's shard storage (a partitioned parameter's `ds_tensor`)."""
    return p.ds_tensor.data_ptr()


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


def storage_device(p: torch.nn.Parameter) -> torch.device:
    """Where the parameter's values live between forwards: its shard's device under ZeRO-3."""
    return p.ds_tensor.device if is_partitioned(p) else p.device


def shard_view(p: torch.nn.Parameter, length: int) -> torch.Tensor:
    """The first `length` elements of this rank's shard (the rest is padding)."""
    return p.ds_tensor.data.view(-1)[:length]


def is_persistent(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "ds_persist", False))


_AVAILABLE = None


def is_available(p: torch.nn.Parameter) -> bool:
    global _AVAILABLE
    if _AVAILABLE is None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        _AVAILABLE = ZeroParamStatus.AVAILABLE
    return getattr(p, "ds_status", None) == _AVAILABLE and p.data.numel() == full_numel(p)


@contextlib.contextmanager
def zero_init_group(group, mpu=None):
    """While open, every `deepspeed.zero.Init` (transformers' `from_pretrained` opens one under ZeRO-3) partitions
    over `group` instead of the whole world: hybrid sharding for hub models. transformers passes no group, so
    the class is swapped for one that fills in `data_parallel_group` and `mpu` (DeepSpeed's own arguments for
    this; the mpu makes its batch-size check count the group's ranks)."""
    if group is None:
        yield
        return
    import deepspeed

    original = deepspeed.zero.Init

    class GroupInit(original):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("data_parallel_group", group)
            kwargs.setdefault("mpu", mpu)
            super().__init__(*args, **kwargs)

    deepspeed.zero.Init = GroupInit
    try:
        yield
    finally:
        deepspeed.zero.Init = original


def sync_replicas(module: torch.nn.Module, replica_group) -> None:
    """Copy replica group 0's weights to the other groups: each rank receives its shard (or whole tensor) from the
    rank of group 0 that holds the same one. transformers' ZeRO-3 loading fills the partitions from global rank
    0's reads only, which leaves the other shard groups unset."""
    import torch.distributed as dist

    src = dist.get_global_rank(replica_group, 0)
    for p in module.parameters():
        dist.broadcast(p.ds_tensor if is_partitioned(p) else p.data, src=src, group=replica_group)


def gather_persistent(params) -> None:
    """Gather ZeRO-3 persistent parameters that no forward has gathered yet (a collective of the shard group).
    They then stay gathered, as after their first forward."""
    missing = [p for p in params if is_partitioned(p) and is_persistent(p) and not is_available(p)]
    if missing:
        missing[0].all_gather(param_list=missing)


def forget_backward(engine, params) -> None:
    """After a backward through a ZeRO-3 module outside DeepSpeed's engine (the static_mask probe): free the gathered
    copies of non-persistent parameters that it left behind (the first module's post-backward release does not run
    when its inputs need no gradient), and drop the parameter coordinator's recorded trace, which now holds the
    backward's order and would keep every parameter gathered after a forward, waiting for that backward (with the
    coordinator's cached release sets). The next forward then gathers from the shards and records a forward-only
    trace. Values are unchanged."""
    offload = getattr(engine, "optimizer", None)
    coordinator = offload.get_param_coordinator() if hasattr(offload, "get_param_coordinator") else None
    if coordinator is not None:
        coordinator.release_backward_leftovers()
    partitioned = [p for p in params if is_partitioned(p)]
    for p in partitioned:
        p.ds_active_sub_modules.clear()  # a module whose release did not run still holds it
    left = [p for p in partitioned if not is_persistent(p) and is_available(p)]
    if left:
        left[0].partition(param_list=left, has_been_updated=False)
    if coordinator is not None:
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        # Which parameters a module releases is cached per (module, step) across traces: drop the backward's answers.
        cached = getattr(type(coordinator), "_PartitionedParameterCoordinator__params_to_release", None)
        while cached is not None and not hasattr(cached, "cache_clear"):  # inside DeepSpeed's nvtx wrapper's closure
            cached = next((c.cell_contents for c in getattr(cached, "__closure__", None) or ()
                           if callable(c.cell_contents)), None)
        if cached is None:
            raise RuntimeError("this DeepSpeed version's parameter coordinator has no cached release sets to clear: "
                               "static_mask is not supported with it under ZeRO-3")
        cached.cache_clear()


def gathered(params, modifier_rank=None):
    """Gather the full values of ZeRO-3 parameters for the body of a `with` (a collective)."""
    params = [p for p in params if is_partitioned(p)]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def engine_settings(engine) -> dict:
    """The settings of a built DeepSpeed engine that ds_policy.REFUSALS names, as a nested config dict."""
    stage = engine.zero_optimization_stage()
    zero: dict = {"stage": stage}
    # The engine's DeepSpeedZeroConfig (engine.zero_optimization() is only a bool: whether ZeRO is on).
    zc = engine._config.zero_config if stage else None
    if zc is not None:
        for r in REFUSALS:
            parts = r.key.split(".")
            if parts[0] != "zero_optimization":
                continue
            value = zc
            for part in parts[1:]:
                value = getattr(value, part, None)
            if value is not None:
                node = zero
                for part in parts[1:-1]:
                    node = node.setdefault(part, {})
                node[parts[-1]] = getattr(value, "value", value)  # enums (offload device) as their value
    settings = {"zero_optimization": zero}
    if getattr(engine, "pipeline_parallelism", False):
        settings["pipeline"] = {"stages": int(getattr(engine, "num_stages", 2))}
    return settings


def check_engine_supported(engine) -> None:
    """Refuse DeepSpeed set-ups a shard-local scheme cannot serve (ds_policy.REFUSALS), with the reason and fix."""
    message = refusal(engine_settings(engine))
    if message:
        raise ValueError(message)


def optimizer_of(engine):
    """The engine's optimizer, or None. ZeRO-3 without one keeps a `DeepSpeedZeRoOffload` in
    `engine.optimizer`: it only gathers and releases parameters, it holds no optimizer state."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    opt = getattr(engine, "optimizer", None)
    return None if opt is None or isinstance(opt, DeepSpeedZeRoOffload) else opt


def module_of(model) -> torch.nn.Module:
    return model.module if is_ds_engine(model) else model
