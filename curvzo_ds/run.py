"""`curvzo-ds train` / `eval`: wires config, model, data, engine, evaluation, checkpoints and logs.

One call is one rank of the job (or the whole job in one process). Nothing here does math or
writes files itself: the engine steps, evaluate.py evaluates, the CheckpointManager saves, rotates
and resumes, logs.py writes metrics. In the manner of torchtitan's trainer, `run_train` is the loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import deepspeed

from . import data as D
from .checkpoint import CheckpointManager, load_checkpoint
from .comm import Comm, main_process_first
from .config import ConfigError, TrainConfig, resolve_presets, to_dict, zo_part
from .data.stream import MicroBatches, micro_batch_indices, step_indices
from .digest import params_digest
from .distributed import init_distributed, pin_threads
from .ds_config import load_ds_config, resolve_ds_config
from .engine import ZOEngine
from .evaluate import evaluate
from .integrations import accelerate_ds_config
from .jsonio import write_json_atomic
from .logs import MetricsWriter, make_progress, setup_logging
from .models import build_model, load_tokenizer, model_hidden_size
from .sysinfo import peak_rss_bytes, versions
from .tasks import get_task, load_splits

log = logging.getLogger("curvzo_ds")


class Run:
    """Everything a train or eval job needs, built the same way on every rank."""

    def __init__(self, cfg: TrainConfig):
        self.rank, self.world, self.local_rank = init_distributed(cfg.ddp_timeout)
        setup_logging(self.rank, cfg.log_level)
        self.threads = pin_threads(cfg.threads)
        cfg = resolve_presets(cfg)
        cfg.validate()
        user_ds = load_ds_config(cfg.deepspeed) if cfg.deepspeed else accelerate_ds_config()
        self.ds_config, notes = resolve_ds_config(user_ds, cfg, self.world, model_hidden_size(cfg))
        for note in notes:
            log.warning("deepspeed config: %s", note)
        cfg.validate()
        self.cfg = cfg
        try:  # the task and its data are the user's: their errors are one line (exit 2), on every rank
            with main_process_first(Comm()):  # the group of the engine's Comm below
                self.task = get_task(cfg.task)
                self.tokenizer = load_tokenizer(cfg)
                splits = load_splits(self.task, cfg.seed, cfg.num_train, cfg.num_dev, cfg.num_eval, cfg.data_dir)
            enc = lambda ex, cls: D.encode(self.task, self.tokenizer, ex, cfg.max_length, cls, cfg.max_new_tokens)
            self.train_data = [enc(ex, cfg.train_as_classification) for ex in splits["train"]]
            self.eval_data = {s: [enc(ex, True) for ex in splits[s]] for s in ("dev", "test") if splits[s]}
            step_indices(0, len(self.train_data), cfg.global_batch_size, cfg.seed)  # refuses a batch > the data
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model, self._keep_alive = build_model(cfg, self.ds_config)
        self.is_lora = cfg.lora
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
        self.device = self.ds_engine.device
        loss = D.loss_fn_for(self.task, cfg.train_as_classification)
        self.loss_fn = lambda m, mb: loss(m, D.to_device(mb, self.device))
        self.base_loss = loss
        self.engine = ZOEngine(self.ds_engine, self.loss_fn, zo_part(cfg))
        self._check_data_agrees()
        log.info("model %s: %d trainable tensors (%d blocks, %d parameters), world size %d, %d threads per rank",
                 cfg.model, len(self.engine.entries), self.engine.num_blocks, self.engine.num_params,
                 self.world, self.threads)

    def _check_data_agrees(self) -> None:
        h = hashlib.sha256(json.dumps([self.train_data, self.eval_data], sort_keys=True).encode()).hexdigest()
        hashes = self.engine.comm.all_gather_object(h)
        if len(set(hashes)) != 1:
            raise RuntimeError(f"ranks tokenized different data (hashes {sorted(set(hashes))}): check that every "
                               "rank reads the same files with the same tokenizer")

    def micro_batches(self, step: int) -> MicroBatches:
        cfg = self.cfg
        parts = micro_batch_indices(step, len(self.train_data), cfg.global_batch_size, cfg.micro_batch_size, cfg.seed)
        return MicroBatches([D.collate([self.train_data[i] for i in part], self.tokenizer.pad_token_id)
                             for part in parts])

    def evaluate(self, split: str) -> dict:
        return evaluate(self.ds_engine, self.task, self.tokenizer, self.eval_data[split], self.cfg.micro_batch_size,
                        self.engine.comm, self.device, self.cfg.max_new_tokens, self.base_loss)

    def checkpoints(self) -> CheckpointManager:
        cfg = self.cfg
        return CheckpointManager(cfg.output_dir, self.engine.comm, save_total_limit=cfg.save_total_limit,
                                 metric=self.task.metrics[0])

    def write_extra(self, directory: str) -> None:
        """Rank 0 adds what an export needs: the model config, the tokenizer, the LoRA config."""
        module = self.ds_engine.module
        base = module.get_base_model() if self.is_lora else module
        base.config.to_json_file(os.path.join(directory, "config.json"))
        self.tokenizer.save_pretrained(directory)
        if self.is_lora:
            module.peft_config["default"].save_pretrained(directory)
        with open(os.path.join(directory, "run_config.json"), "w") as f:
            json.dump(to_dict(self.cfg), f, indent=1)


def run_train(cfg: TrainConfig, resume: str | bool | None = None) -> dict:
    start = time.time()
    run = Run(cfg)
    cfg, engine, comm = run.cfg, run.engine, run.engine.comm
    out = cfg.output_dir
    if run.rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=1)
    manager = run.checkpoints()
    seconds0 = 0.0
    path = manager.resume_path(resume)
    if path:
        trainer = load_checkpoint(engine, path)
        manager.best, seconds0 = trainer.get("best_dev"), trainer.get("seconds", 0.0)
        log.info("resumed from %s at step %d", path, engine.step_count)
    elif resume:
        log.warning("--resume: no complete checkpoint in %s, starting from step 0", out)
    writer = MetricsWriter(out, enabled=run.rank == 0, tensorboard=_tensorboard(cfg) and run.rank == 0)
    writer.truncate_after(engine.step_count)
    bar = make_progress(cfg, run.rank, engine.step_count)
    t0 = time.time()
    seconds = lambda: seconds0 + time.time() - t0

    def save(best: bool = False) -> None:
        state = {"best_dev": manager.best, "seconds": seconds(), "model": cfg.model, "lora": cfg.lora,
                 "task": cfg.task}
        log.info("saved %s%s", manager.save(engine, state, run.write_extra), " (best dev so far)" if best else "")

    saved = last_dev = None
    try:
        while engine.step_count < cfg.max_steps:
            r = engine.step(run.micro_batches(engine.step_count))
            step = r.step
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                writer.write({**r.as_dict(), "seconds": seconds()})
            if bar is not None:
                bar.set_postfix(loss=f"{r.loss:.4f}" if r.loss is not None else "-",
                                budget=f"{r.budget:.1f}", blocks=r.n_selected, refresh=False)
                bar.update(1)
            if "dev" in run.eval_data and cfg.eval_steps and step % cfg.eval_steps == 0:
                last_dev = (step, run.evaluate("dev"))
                writer.write({"step": step, "split": "dev", **last_dev[1]})
                log.info("step %d: dev %s", step, _fmt(last_dev[1]))
                if manager.track(step, last_dev[1]):
                    save(best=True)
                    saved = step
            if (cfg.save_steps and step % cfg.save_steps == 0 or step == cfg.max_steps) and saved != step:
                save()
                saved = step
    finally:
        if bar is not None:
            bar.close()
    step = engine.step_count
    if saved != step:
        save()
    final_path = manager.path_for(step)
    digest = params_digest(engine.entries, comm)
    # End-of-run evaluations are marked "final": a resumed run drops them (a longer run has none).
    final = {}
    if "dev" in run.eval_data:
        final["dev"] = last_dev[1] if last_dev and last_dev[0] == step else run.evaluate("dev")
        if not (last_dev and last_dev[0] == step):
            writer.write({"step": step, "split": "dev", "final": True, **final["dev"]})
    if "test" in run.eval_data:
        final["test"] = run.evaluate("test")
        writer.write({"step": step, "split": "test", "final": True, **final["test"]})
    test = final.get("test")
    best = manager.best
    if "dev" in final and (best is None or best["step"] == step or manager.is_better(final["dev"])):
        best = {"step": step, "metrics": final["dev"], "checkpoint": final_path}
    elif best and "test" in run.eval_data:
        load_checkpoint(engine, best["checkpoint"])  # MeZO: report test at the best dev point
        test = run.evaluate("test")
    writer.close()
    rss = comm.all_gather_object(peak_rss_bytes())
    summary = {
        "params_digest": digest,
        "world_size": run.world,
        "method": cfg.method,
        "seed": cfg.seed,
        "steps": cfg.max_steps,
        "final": final,
        "best_dev": ({"step": best["step"], **best["metrics"]} if best else None),
        "test": test,
        "skipped_steps": engine.skipped_total,
        "num_blocks": engine.num_blocks,
        "num_params": engine.num_params,
        "checkpoint": final_path,
        "wall_seconds": time.time() - start,
        "peak_rss_bytes": rss,
        "threads": run.threads,
        "versions": versions(),
    }
    if run.rank == 0:
        write_json_atomic(os.path.join(out, "summary.json"), summary)
        log.info("done: %d steps, test %s %s, digest %s", cfg.max_steps, manager.metric,
                 (test or {}).get(manager.metric), digest)
    comm.barrier()
    return summary


def run_eval(cfg: TrainConfig, resume: str | bool | None = None) -> dict:
    """Evaluate a checkpoint (or the initial model) on dev and test; writes eval.json."""
    run = Run(cfg)
    path = run.checkpoints().resume_path(resume)
    if path:
        load_checkpoint(run.engine, path)
    results = {s: run.evaluate(s) for s in run.eval_data}
    results["step"] = run.engine.step_count
    results["params_digest"] = params_digest(run.engine.entries, run.engine.comm)
    if run.rank == 0:
        os.makedirs(run.cfg.output_dir, exist_ok=True)
        write_json_atomic(os.path.join(run.cfg.output_dir, "eval.json"), results)
        print(json.dumps(results, indent=1))
    return results


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _tensorboard(cfg: TrainConfig) -> bool:
    if cfg.report_to == "none":
        return False
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        if cfg.report_to == "tensorboard":
            raise
        return False
    return True
