"""`ZOTrainer`: a `transformers.Trainer` trained by CurvZO, with no optimizer and no gradients.

`train()` is replaced by a loop that steps a ZOEngine; the rest is the Trainer's own: the data
loaders, callbacks (logging, report_to), `evaluate()`, the seed and TrainerState. Under DeepSpeed
the model is prepared alone (no optimizer) after the config is cleaned like `--deepspeed`, and the
engine's checkpoint calls go to this project's shard-local checkpoint (train/build.py's
`install_checkpoint_hooks`), through the same CheckpointManager as the CLI.
"""

from __future__ import annotations

import logging
import math
import os
import time

from accelerate import skip_first_batches
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput, set_seed

from curvzo_ds.checkpoint.manager import CheckpointManager
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.engine import StepResult, ZOEngine
from curvzo_ds.train.build import engine_for
from curvzo_ds.train.integrations import align_accelerate_state, clean_deepspeed_config, hidden_size

log = logging.getLogger("curvzo_ds")


class ZOTrainer(Trainer):
    """`ZOTrainer(model=..., args=TrainingArguments(...), train_dataset=..., zo_config=ZOConfig(...))`.

    From TrainingArguments: learning_rate, weight_decay, lr_scheduler_type (constant or linear),
    max_steps (or num_train_epochs), seed, the logging / eval / save strategies and steps,
    save_total_limit, metric_for_best_model, report_to and `deepspeed`. The ZO method's own
    options come from `zo_config`. `loss_fn(model, batch)` returns `(loss_sum, count)`; it defaults to the
    Trainer's `compute_loss`, a mean loss, as `(mean, 1)`. Each rank steps on its own batch of the
    sharded loader, so the trajectory depends on the world size (the CLI, or `split_batch` in an
    Accelerate loop, does not). Checkpoints: `output_dir/checkpoint-<step>/` in this project's
    format with trainer_state.json; `train(resume_from_checkpoint=...)` continues bit for bit.
    """

    def __init__(self, *args, zo_config: ZOConfig | None = None, loss_fn=None, **kwargs):
        super().__init__(*args, **kwargs)
        align_accelerate_state(self.accelerator)
        args = self.args
        if args.load_best_model_at_end or str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            raise ValueError("load_best_model_at_end and save_strategy='best' are not supported by ZOTrainer: use "
                             "save_strategy='steps' with metric_for_best_model (the best checkpoint is kept through "
                             "rotation; state.best_model_checkpoint names it)")
        for key in ("learning_rate", "seed"):
            if zo_config is not None and getattr(zo_config, key) not in (None, getattr(args, key)):
                log.warning("zo_config.%s=%s is replaced by TrainingArguments.%s=%s", key, getattr(zo_config, key),
                            key, getattr(args, key))
        self.zo_config = zo_config
        self.zo_loss_fn = loss_fn
        self.zo_engine: ZOEngine | None = None
        metric = self.args.metric_for_best_model
        self.zo_checkpoints = CheckpointManager(
            self.args.output_dir, save_total_limit=self.args.save_total_limit,
            metric=(metric if metric.startswith("eval_") else f"eval_{metric}") if metric else None,
            greater_is_better=self.args.greater_is_better is not False, tokenizer=self.processing_class,
            write_extra=lambda directory: self.state.save_to_json(os.path.join(directory, "trainer_state.json")))

    def create_optimizer(self, model=None):
        raise RuntimeError("ZOTrainer has no optimizer: CurvZO updates the weights in place in ZOTrainer.train")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        raise NotImplementedError("ZOTrainer saves shard-local checkpoints (output_dir/checkpoint-<step>); make a "
                                  "Hugging Face model directory with `curvzo-ds export CKPT --out DIR`")

    # ---------------------------------------------------------------- set-up
    def _zo_overrides(self, max_steps: int) -> dict:
        args = self.args
        sched = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
        if sched not in ("constant", "linear"):
            raise ValueError(f"lr_scheduler_type={sched!r} is not supported by ZOTrainer: use constant or linear")
        if getattr(args, "warmup_steps", 0) or getattr(args, "warmup_ratio", 0):
            raise ValueError("warmup_steps/warmup_ratio are not supported by ZOTrainer: set them to 0")
        if args.gradient_accumulation_steps != 1:
            raise ValueError(f"gradient_accumulation_steps={args.gradient_accumulation_steps} is not supported by "
                             "ZOTrainer (one ZO step per batch): set it to 1 and raise per_device_train_batch_size")
        return dict(learning_rate=args.learning_rate, weight_decay=args.weight_decay, lr_scheduler_type=sched,
                    max_steps=max_steps, seed=args.seed)

    def _zo_loss(self, model, batch):
        return self.compute_loss(model, self._prepare_inputs(batch)), 1  # a mean loss: each rank's batch weighs 1

    def _zo_setup(self, max_steps: int) -> ZOEngine:
        overrides = self._zo_overrides(max_steps)
        if self.zo_engine is not None:
            return self.zo_engine
        if self.is_deepspeed_enabled:
            hf = self.accelerator.state.deepspeed_plugin.hf_ds_config
            hf.trainer_config_finalize(self.args, self.model, max_steps)
            clean_deepspeed_config(hf.config, self.args.world_size, self.args.per_device_train_batch_size,
                                   hidden_size(self.model))
            model = self.model_wrapped = self.deepspeed = self.accelerator.prepare(self.model)
        else:
            model = self.model.to(self.args.device)
        # the optimizer check, the engine and (under DeepSpeed) its checkpoint hooks, as every front end
        self.zo_engine = engine_for(model, self.zo_loss_fn or self._zo_loss, self.zo_config, **overrides)
        return self.zo_engine

    def _zo_max_steps(self, per_epoch: int | None = None) -> int:
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        if per_epoch is None:
            per_epoch = len(self.get_train_dataloader()) if self.train_dataset is not None else 0
        return math.ceil(args.num_train_epochs * per_epoch)

    def evaluation_loop(self, *args, **kwargs):
        """evaluate() and predict(): under DeepSpeed, prepare the model without an optimizer first (the
        Trainer would otherwise prepare it itself, from a config that still holds the optimizer sections)."""
        if self.zo_engine is None and self.is_deepspeed_enabled:
            self._zo_setup(self._zo_max_steps())
        return super().evaluation_loop(*args, **kwargs)

    # ---------------------------------------------------------------- the loop
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs) -> TrainOutput:
        if kwargs:
            raise TypeError(f"ZOTrainer.train() got unexpected arguments {sorted(kwargs)}")
        if trial is not None:
            raise ValueError("ZOTrainer does not support hyper-parameter search trials")
        args = self.args
        set_seed(args.seed)
        self.is_in_train = True
        loader = self.get_train_dataloader()
        per_epoch = len(loader)
        if per_epoch == 0:
            raise ValueError("the training data loader is empty: check train_dataset and the batch size")
        max_steps = self._zo_max_steps(per_epoch)
        engine = self._zo_setup(max_steps)
        # As Trainer._init_training_state: stateful callbacks saved with the state, restored on resume.
        self.state = TrainerState(stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                                      if isinstance(cb, ExportableState)])
        if resume_from_checkpoint:
            path = self.zo_checkpoints.resume_path(resume_from_checkpoint)
            if path is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {args.output_dir}")
            self.zo_checkpoints.load(engine, path)  # the weights, the ZO state and the best evaluation
            self.state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
            self._load_callback_state()
            log.info("resumed from %s at step %d", path, engine.step_count)
        # Sets is_world_process_zero / is_local_process_zero for this rank (the file holds rank 0's).
        self.state.init_training_references(self, max_steps, math.ceil(max_steps / per_epoch), None)
        self.state.compute_steps(args, max_steps)
        self.state.train_batch_size = args.per_device_train_batch_size
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.eval_dataset is not None:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        start, self._zo_window, self._zo_all, metrics = time.time(), [], [], {}
        epoch, skip = divmod(self.state.global_step, per_epoch)
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            batches = loader
            if skip:  # resume mid-epoch: the same batches as the uninterrupted run
                batches, skip = skip_first_batches(loader, skip), 0
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for batch in batches:
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                r = engine.step(batch)
                self.state.global_step, self.state.epoch = r.step, r.step / per_epoch
                if r.loss is not None:
                    self._zo_window.append(r.loss)
                    self._zo_all.append(r.loss)
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                metrics = self._zo_log_save_evaluate(r, metrics, ignore_keys_for_eval)
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
            epoch += 1
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            metrics = self._zo_log_save_evaluate(None, metrics, ignore_keys_for_eval)
        self.is_in_train = False
        train_loss = sum(self._zo_all) / len(self._zo_all) if self._zo_all else float("nan")
        out = {"train_runtime": time.time() - start, "train_loss": train_loss, "zo_skipped_steps": engine.skipped_total}
        self.log(dict(out))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, out)

    def _zo_log_save_evaluate(self, r: StepResult | None, metrics: dict, ignore_keys) -> dict:
        if self.control.should_log and self._zo_window:
            row = {"loss": sum(self._zo_window) / len(self._zo_window)}
            self._zo_window.clear()
            if r is not None:
                row.update(learning_rate=r.learning_rate, zo_budget=r.budget, zo_blocks=r.n_selected,
                           zo_param_fraction=r.param_fraction)
                if r.projected_grad is not None:
                    row["zo_projected_grad"] = r.projected_grad
            self.log(row)
        self.control.should_log = False
        if self.control.should_evaluate and self.eval_dataset is not None:
            metrics = self.evaluate(ignore_keys=ignore_keys)  # every rank takes part (ZeRO-3 gathers)
            self._zo_track_best(metrics)
        self.control.should_evaluate = False
        if self.control.should_save:
            self._zo_save()
            self.control.should_save = False
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return metrics

    # ---------------------------------------------------------------- checkpoints
    def _zo_save(self) -> str:
        """The checkpoint of this step through the manager, which writes the model files like every front end's,
        and trainer_state.json (the Trainer's own state, its best-model fields taken from the manager)."""
        manager, step = self.zo_checkpoints, self.state.global_step
        if manager.best is not None and manager.best["step"] == step:  # the weights evaluated best are these
            self.state.best_model_checkpoint = manager.path_for(step)
        return manager.save(self.zo_engine)

    def _zo_track_best(self, metrics: dict) -> None:
        """The best `metric_for_best_model` so far (the manager's), mirrored into the TrainerState."""
        manager = self.zo_checkpoints
        if not manager.metric:
            return
        if manager.metric not in metrics:
            raise KeyError(f"metric_for_best_model={self.args.metric_for_best_model!r}: the evaluation gave no "
                           f"{manager.metric!r} (it gave {sorted(metrics)})")
        if manager.track(self.state.global_step, metrics):
            self.state.best_metric, self.state.best_global_step = metrics[manager.metric], self.state.global_step
