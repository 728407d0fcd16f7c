"""Users' own training code under Accelerate, with no optimizer (the Trainer is in hf_trainer.py).

- `from_accelerator(accelerator, model, loss_fn, ...)` (exported as `curvzo_ds.from_accelerator`)
  cleans the Accelerate DeepSpeed config the way `--deepspeed` is cleaned (ds_config.py: optimizer
  and scheduler dropped, stages 1/2 refused, "auto" resolved), prepares the model (a DeepSpeedEngine
  with no optimizer) and returns a ZOEngine whose checkpoints go through `accelerator.save_state()`
  / `load_state()`.
- DeepSpeed's `engine.save_checkpoint` needs an optimizer: without one, rank 0 waits in a collective
  the other ranks never enter (docs/deepspeed.md). `build.install_checkpoint_hooks` replaces the engine's
  `save_checkpoint` / `load_checkpoint` with this project's shard-local checkpoint, so Accelerate,
  the Trainer and users' own calls all work, at any world size.
- The engine comes from the composition root, `train.build.engine_for(model, loss_fn, config)`, as
  for `build(cfg)`, `build_plain(cfg)` and `ZOTrainer`: the optimizer check, the ZOEngine, and a
  DeepSpeed engine's checkpoint hooks (`install_checkpoint_hooks`).
- `split_batch` (data/stream.py) cuts one global batch into `MicroBatches` (micro-batch j on rank
  j mod W), which makes a loop with an unsharded data loader independent of the number of ranks.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from curvzo_ds.checkpoint.manager import CheckpointManager
from curvzo_ds.config.ds_config import resolve_ds_config
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.engine import ZOEngine
from curvzo_ds.layout.shapes import hidden_size_of
from curvzo_ds.shard import ds_compat
from curvzo_ds.train.build import engine_for, install_checkpoint_hooks

log = logging.getLogger("curvzo_ds")
ZO_CHECKPOINT = "zo_checkpoint"  # the sub-directory of an accelerate.save_state() directory (no DeepSpeed)


def hidden_size(model) -> int | None:
    """The model's hidden size (for DeepSpeed's "auto" bucket sizes), or None if its config has none."""
    return hidden_size_of(getattr(ds_compat.module_of(model), "config", None))


def clean_deepspeed_config(config: dict, world_size: int, micro_batch_size: int, hidden_size: int | None) -> dict:
    """`config` edited in place to what a ZO run can use (the `--deepspeed` policy); returns it."""
    cleaned, _, notes = resolve_ds_config(config, world_size, hidden_size, micro_batch_size=micro_batch_size,
                                          global_batch_size=micro_batch_size * world_size)
    for note in notes:
        log.warning("deepspeed config: %s", note)
    config.clear()
    config.update(cleaned)
    return config


def align_accelerate_state(accelerator=None) -> None:
    """Make Accelerate's rank and world size those of torch.distributed when they disagree.

    On a machine without a GPU, Accelerate's DeepSpeed set-up leaves `num_processes` 1 and
    `process_index` 0 on every rank (accelerate 1.15, checked here), although torch.distributed
    has all ranks: every rank would then act as the main process (all writing the same
    `save_state` files) and data loaders would not be sharded. The launcher's ranks win.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    state = PartialState()
    if state.num_processes == world and state.process_index == rank:
        return
    log.warning("accelerate reports process %d of %d but torch.distributed has rank %d of %d (Accelerate's "
                "DeepSpeed set-up without a GPU): using torch.distributed's", state.process_index,
                state.num_processes, rank, world)
    local = int(os.environ.get("LOCAL_RANK", rank))
    for obj in (state, AcceleratorState() if accelerator is None else accelerator.state):
        obj.num_processes, obj.process_index, obj.local_process_index = world, rank, local


def from_accelerator(accelerator, model, loss_fn, config: ZOConfig | None = None, *, micro_batch_size: int = 1,
                     **overrides) -> ZOEngine:
    """A ZOEngine for an Accelerate loop: `model` (unprepared) is prepared with no optimizer.

    Under DeepSpeed the Accelerate config is cleaned like `--deepspeed` (optimizer and scheduler
    dropped, "auto" resolved, `micro_batch_size` as DeepSpeed's micro batch), and
    `accelerator.save_state()` / `load_state()` write and read this project's checkpoint.
    """
    align_accelerate_state(accelerator)
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    if plugin is not None and not ds_compat.is_ds_engine(model):
        clean_deepspeed_config(plugin.deepspeed_config, accelerator.num_processes, micro_batch_size,
                               hidden_size(model))
        model = accelerator.prepare(model)
    elif plugin is None:
        # No DDP wrapper: every rank applies the same update, so replicas stay equal without one.
        model = model.to(accelerator.device)
    engine = engine_for(model, loss_fn, config, **overrides)
    if not ds_compat.is_ds_engine(model):
        _register_accelerate_hooks(accelerator, engine)
    return engine


def _register_accelerate_hooks(accelerator, engine: ZOEngine) -> None:
    """Without DeepSpeed, save_state/load_state carry the ZO checkpoint in `<dir>/zo_checkpoint`."""
    def save(models, weights, output_dir):
        CheckpointManager(output_dir).save(engine, path=os.path.join(output_dir, ZO_CHECKPOINT))

    def load(models, input_dir):
        CheckpointManager(input_dir).load(engine, os.path.join(input_dir, ZO_CHECKPOINT))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


# install_checkpoint_hooks is documented here (docs/integrations.md) for users' own engines; it lives in the root.
__all__ = ["from_accelerator", "install_checkpoint_hooks", "engine_for", "clean_deepspeed_config",
           "align_accelerate_state", "hidden_size", "ZO_CHECKPOINT"]
