"""The composition root, the one place a run is put together:
- `build(cfg)` makes the `Job` that `curvzo-ds train`, `eval` and `bench` run, on every rank alike;
- `build_plain(cfg)` makes the one-process, DeepSpeed-free Job of `diagnose` and experiments/;
- `engine_for(model, loss_fn, config)` puts the ZOEngine on a model that its caller built and prepared: both
  builds end with it, and the front ends (`from_accelerator`, `ZOTrainer`) call it with the user's model, which
  they own with the data and the loop (docs/architecture.md says why they do not call `build`).

Each component is built from its own config section (config.sections). The builds share the data (`load_data`,
`step_batch`) and the task's loss. Nothing here trains or writes to
output_dir (the Job's CheckpointManager, created by `Job.checkpoints`, writes run_config.json into each checkpoint);
`build` starts the process group, the logging to stderr and the thread pinning, and the model, tokenizer and data
loaders fill their download caches.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
from accelerate.utils import DeepSpeedPlugin

from curvzo_ds import data as D
from curvzo_ds.checkpoint.manager import CheckpointManager
from curvzo_ds.config.ds_config import load_ds_config
from curvzo_ds.config.resolve import resolve, resolve_run, zo_part
from curvzo_ds.config.schema import TrainConfig, ZOConfig
from curvzo_ds.config.sections import section
from curvzo_ds.data.stream import MicroBatches
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.choice import choose_layout
from curvzo_ds.models import build_model, model_hidden_size
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.comm import Comm, main_process_first
from curvzo_ds.shard.distributed import GroupMPU, Topology, init_distributed, pin_threads
from curvzo_ds.train.evaluate import Evaluator
from curvzo_ds.train.inputs import (
    check_batch_fits,
    check_data_agrees,
    check_dtype,
    checked_data,
    load_data,
    step_batch,
    warn_idle_ranks,
)
from curvzo_ds.train.logs import setup_logging
from curvzo_ds.train.outputs import write_run_config

log = logging.getLogger("curvzo_ds")


@dataclasses.dataclass
class Job:
    """What a run needs, built once: the resolved config, the ranks' topology, the task and its encoded data, the
    model (a DeepSpeed engine, or the module of a plain Job), the ZOEngine and the evaluator."""

    cfg: TrainConfig
    topology: Topology | None  # None in a plain Job (one process, no process group)
    threads: int | None
    task: Any
    tokenizer: Any
    train_data: list[dict]
    eval_data: dict[str, list[dict]]
    model: Any
    loss: Callable  # the task's loss on a micro-batch, (model, micro_batch) -> (loss_sum, count)
    engine: ZOEngine
    evaluator: Evaluator
    device: torch.device
    keep_alive: Any = None  # what build_model returned to be held for the run's length
    layout: dict | None = None  # summary.json's `layout` (Layout.record); None in a plain Job

    @property
    def rank(self) -> int:
        return self.topology.job.rank if self.topology is not None else 0

    def batch(self, step: int) -> MicroBatches:
        return step_batch(section(self.cfg, "data"), self.cfg.seed, self.train_data, self.tokenizer.pad_token_id, step)

    def evaluate(self, split: str) -> dict:
        return self.evaluator.evaluate(split)

    def checkpoints(self, states: dict | None = None) -> CheckpointManager:
        """The run's checkpoint manager: the model files and the tokenizer go into every checkpoint, and
        run_config.json, which `--resume`, `eval --resume` and export read."""
        # run_config.json is the Job's config when the checkpoint is written (a resume may take its checkpoint's
        # perturbation after this manager is made: train/run.py's start)
        return CheckpointManager.of(section(self.cfg, "checkpoint"), metric=self.task.metrics[0],
                                    tokenizer=self.tokenizer, states=states,
                                    write_extra=lambda directory: write_run_config(self.cfg, directory))


def build(cfg: TrainConfig) -> Job:
    """The Job of `curvzo-ds train` / `eval` on this rank: the process group and topology, the config resolved (the
    presets, the DeepSpeed config mapped), the data checked, the model under DeepSpeed ZeRO-3, the engine, the
    evaluator. Every user error is a ConfigError, raised on every rank."""
    cfg = resolve(cfg)  # the presets, once (a config the CLI resolved has them), and the one validation
    rank, _, _ = init_distributed(cfg.ddp_timeout)
    setup_logging(rank, cfg.log_level)
    if len(cfg.config_files) > 1:
        log.info("config: %s merged in this order (a key in a later file wins; --set over all)",
                 ", ".join(cfg.config_files))
    elif cfg.config_files:
        log.info("config: %s", cfg.config_files[0])
    threads = pin_threads(cfg.threads)
    user_ds = load_ds_config(cfg.deepspeed) if cfg.deepspeed else accelerate_ds_config()  # read once, not edited
    layout = choose_layout(cfg, user_ds)  # layout/: zero_stage and shard_group_size, "auto" decided
    topology = Topology.create(layout.group)  # the shard and replica groups, once
    cfg, ds_config = resolve_config(cfg, topology, {"zero_stage": layout.zero_stage, "shard_group_size": layout.group},
                                    user_ds)
    if topology.job.rank == 0:
        warn_idle_ranks(section(cfg, "data"), topology.shard.world_size)
    with main_process_first(topology.job):  # rank 0 fills the download and tokenizer caches first
        task, tokenizer, train_data, eval_data = checked_data(cfg)
    check_batch_fits(section(cfg, "data"), task, train_data)
    shard_group = topology.shard.group
    mpu = GroupMPU(shard_group) if shard_group is not None else None
    model, keep_alive = build_model(section(cfg, "model"), cfg.seed, ds_config, shard_group, mpu)
    if topology.replica_group is not None:
        ds_compat.sync_replicas(model, topology.replica_group)
    if layout.zero_stage == 0:  # DeepSpeed's bf16 section there makes a BF16_Optimizer (fp32 copies of every
        ds_config = {k: v for k, v in ds_config.items() if k != "bf16"}  # parameter); build_model cast the weights
    ds_engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu)
    device = ds_engine.device
    loss = D.loss_fn_for(task, section(cfg, "data"), tokenizer,
                         synced_generation=layout.zero_stage == 3 and topology.job.world_size > 1)
    engine = engine_for(ds_engine, lambda m, mb: loss(m, D.to_device(mb, device)), zo_part(cfg), topology=topology)
    check_data_agrees(topology.job, train_data, eval_data)
    evaluator = Evaluator.of(section(cfg, "eval"), section(cfg, "data"), ds_engine, task, tokenizer, eval_data,
                             topology.job, device, loss)
    log.info("model %s: %d trainable tensors (%d blocks, %d parameters), world size %d, %d threads per rank",
             cfg.model, len(engine.entries), engine.num_blocks, engine.num_params, topology.job.world_size, threads)
    return Job(cfg, topology, threads, task, tokenizer, train_data, eval_data, ds_engine, loss, engine, evaluator,
               device, keep_alive, layout.record())


def build_plain(cfg: TrainConfig, sampler: Callable | None = None, device: str | torch.device = "cpu") -> Job:
    """A one-process Job on a plain model (no DeepSpeed, no process group), built from the same presets, splits,
    micro-batches and loss as `build`, so that its steps are those of a one-rank training run. A static mask
    (static_mask=true) is fitted here, and learning_rate auto's rate chosen, as `curvzo-ds train` does before
    step 1. `sampler`: ZOEngine's (what makes the engine's sampler; None: CurvZOSampler). `device`: where the
    model, the batches and the noise live (the CPU unless told, e.g. "cuda" for experiments/ on a GPU)."""
    cfg = resolve(cfg)
    device = torch.device(device)
    task, tokenizer, train_data, eval_data = load_data(section(cfg, "data"), section(cfg, "model"), cfg.seed)
    model, keep_alive = build_model(section(cfg, "model"), cfg.seed, {})
    loss = D.loss_fn_for(task, section(cfg, "data"), tokenizer)
    if device.type != "cpu":  # moved only when asked: a 4/8-bit base may refuse `.to`
        model.to(device)
    engine = engine_for(model, lambda m, mb: loss(m, D.to_device(mb, device)), zo_part(cfg), sampler=sampler)
    evaluator = Evaluator.of(section(cfg, "eval"), section(cfg, "data"), model, task, tokenizer, eval_data,
                             Comm(None), device, loss)
    job = Job(cfg, None, None, task, tokenizer, train_data, eval_data, model, loss, engine, evaluator, device,
              keep_alive)
    if cfg.static_mask:
        engine.fit_static_mask([job.batch(t) for t in range(cfg.static_mask_batches)])
    if engine.rate.needs_choice:  # learning_rate: auto, on the first train batches as `curvzo-ds train` measures it
        engine.choose_rate([job.batch(t) for t in range(cfg.auto_rate_probes)])
    return job


def accelerate_ds_config() -> dict | None:
    """The DeepSpeed config of the Accelerate config that `accelerate launch` started this process with
    (its ACCELERATE_* variables: zero_stage, offload devices, deepspeed_config_file, mixed_precision), as
    Accelerate builds it; None when the launch is not a DeepSpeed one. `curvzo-ds train` maps it like a
    `--deepspeed` file."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    plugin = DeepSpeedPlugin()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16"):
        plugin.set_mixed_precision(precision)  # adds the bf16/fp16 section, as the Accelerator does
    elif precision != "no":
        raise ConfigError(f"mixed_precision={precision!r} in the Accelerate config: use no, bf16 or fp16")
    config = copy.deepcopy(plugin.deepspeed_config)
    if "ACCELERATE_DEEPSPEED_ZERO_STAGE" not in os.environ:  # no zero_stage in the Accelerate config (Accelerate's
        config.get("zero_optimization", {}).pop("stage", None)  # default, 2): curvzo-ds train's own, auto
    return config


def refuse_optimizer(ds_engine) -> None:
    opt = ds_compat.optimizer_of(ds_engine)
    if opt is not None:
        raise ValueError(f"this DeepSpeed engine was created with an optimizer ({type(opt).__name__}), which "
                         "holds fp32 master weights and Adam state that CurvZO never uses. Prepare the model alone, "
                         "with no optimizer in the DeepSpeed config, or pass the unprepared model to "
                         "curvzo_ds.from_accelerator.")


def engine_for(model, loss_fn, config: ZOConfig | None = None, **options) -> ZOEngine:
    """The ZOEngine on a model its caller built and prepared: the step of the composition root that every front
    end takes (`build`, `build_plain`, `from_accelerator`, `ZOTrainer`). A DeepSpeed engine that holds an optimizer
    is refused, and a DeepSpeed engine's `save_checkpoint` / `load_checkpoint` are routed to this project's
    checkpoint (`install_checkpoint_hooks`). `options` are ZOEngine's keyword arguments (`topology`, `group`,
    ZOConfig keys)."""
    is_ds = ds_compat.is_ds_engine(model)
    if is_ds:
        refuse_optimizer(model)
    engine = ZOEngine(model, loss_fn, config, **options)
    if is_ds:
        install_checkpoint_hooks(model, engine)
    return engine


def install_checkpoint_hooks(ds_engine, engine: ZOEngine) -> None:
    """Route `ds_engine.save_checkpoint` / `load_checkpoint` to the shard-local ZO checkpoint.

    The signatures are DeepSpeed's: `save_checkpoint(save_dir, tag=None, client_state=None, ...)`
    writes `save_dir/tag` (tag defaults to `global_step<N>`) and a `latest` file;
    `load_checkpoint(load_dir, tag=None, ...)` returns `(path, client_state)`.
    """
    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **_ignored):
        tag = str(tag) if tag is not None else f"global_step{engine.step_count}"
        CheckpointManager(save_dir).save(engine, path=os.path.join(save_dir, tag), mark_latest=save_latest,
                                         extra_state={"client_state": client_state or {}})
        return True

    def load_checkpoint(load_dir, tag=None, **_ignored):
        manager = CheckpointManager(load_dir)
        path = manager.tagged_latest() if tag is None else os.path.join(load_dir, str(tag))
        trainer = manager.load(engine, path)
        return path, trainer.get("client_state", {})

    ds_engine.save_checkpoint = save_checkpoint
    ds_engine.load_checkpoint = load_checkpoint


def resolve_config(cfg: TrainConfig, topology: Topology, decided: dict, user_ds: dict | None
                   ) -> tuple[TrainConfig, dict]:
    """(the config with its presets, the layout `decided` (choose_layout) and the DeepSpeed-mapped keys applied,
    resolved, the DeepSpeed config)."""
    # Each replica group processes the whole global batch: DeepSpeed's data-parallel world is the shard group.
    # A mapped key given explicitly (--set or the YAML) that the DeepSpeed config sets otherwise is refused. A
    # config the CLI resolved is not validated again (config.resolve): the mapping checks what it sets.
    hidden_size = model_hidden_size(section(cfg, "model"))
    cfg, ds_config, notes = resolve_run(
        cfg, world_size=topology.shard.world_size, hidden_size=hidden_size,
        user_ds=user_ds, where=f"--deepspeed {cfg.deepspeed}" if cfg.deepspeed else "the Accelerate config",
        chosen=decided)
    for note in notes:
        log.warning("deepspeed config: %s", note)
    check_dtype(cfg.dtype)
    return cfg, ds_config
