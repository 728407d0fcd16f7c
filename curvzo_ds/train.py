"""`curvzo-ds train` / `eval`: wires config, model, data, engine, evaluation, checkpoints and logs.

One call is one rank of the job (or the whole job in one process). Nothing here does math:
the engine steps, evaluate.py evaluates, checkpoint.py saves, logs.py writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

import torch

from . import checkpoint as ckpt
from . import data as D
from .comm import Comm, main_process_first
from .config import ConfigError, TrainConfig, resolve_presets, to_dict, zo_part
from .digest import params_digest
from .distributed import init_distributed, pin_threads
from .engine import MicroBatches, ZOEngine
from .evaluate import chunks, evaluate
from .logs import MetricsWriter, peak_rss_bytes, versions, write_json_atomic

log = logging.getLogger("curvzo_ds")


def step_indices(step: int, num_examples: int, global_batch_size: int, seed: int) -> list[int]:
    """The examples of update `step` (0-based): a world-size-independent stream.

    Each epoch is a permutation seeded by (seed, epoch), cut into whole global batches (the
    remainder of an epoch is dropped: no padding samples, no partial batches).
    """
    per_epoch = num_examples // global_batch_size
    if per_epoch == 0:
        raise ValueError(f"global_batch_size={global_batch_size} is larger than the {num_examples} training "
                         "examples: lower global_batch_size or raise num_train")
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_examples, generator=gen)
    return perm[k * global_batch_size:(k + 1) * global_batch_size].tolist()


def setup_logging(rank: int, level: str) -> None:
    lvl = getattr(logging, level.upper()) if rank == 0 else logging.WARNING
    logging.basicConfig(level=lvl, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Run:
    """Everything a train or eval job needs, built the same way on every rank."""

    def __init__(self, cfg: TrainConfig):
        import deepspeed

        from .ds_config import load_ds_config, resolve_ds_config
        from .integrations import accelerate_ds_config
        from .models import build_model, load_tokenizer, model_hidden_size
        from .tasks import get_task, load_splits

        self.rank, self.world, self.local_rank = init_distributed()
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
        idx = step_indices(step, len(self.train_data), cfg.global_batch_size, cfg.seed)
        return MicroBatches([D.collate([self.train_data[i] for i in idx[part.start:part.stop]],
                                       self.tokenizer.pad_token_id)
                             for part in chunks(len(idx), cfg.micro_batch_size)])

    def evaluate(self, split: str) -> dict:
        return evaluate(self.ds_engine, self.task, self.tokenizer, self.eval_data[split], self.cfg.micro_batch_size,
                        self.engine.comm, self.device, self.cfg.max_new_tokens, self.base_loss)

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
    state = {"best_dev": None, "seconds": 0.0}
    path = _resume_path(out, resume)
    if path:
        state.update(ckpt.load_checkpoint(engine, path))
        log.info("resumed from %s at step %d", path, engine.step_count)
    elif resume:
        log.warning("--resume: no complete checkpoint in %s, starting from step 0", out)
    metric_name = run.task.metrics[0]
    writer = MetricsWriter(out, enabled=run.rank == 0, tensorboard=_tensorboard(cfg) and run.rank == 0)
    writer.truncate_after(engine.step_count)
    bar = _progress(cfg, run.rank, engine.step_count)
    seconds0, t0 = state["seconds"], time.time()
    saved = None
    last_dev = None
    try:
        while engine.step_count < cfg.max_steps:
            r = engine.step(run.micro_batches(engine.step_count))
            step = r.step
            row = r.as_dict()
            row["seconds"] = seconds0 + time.time() - t0
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                writer.write(row)
            if bar is not None:
                bar.set_postfix(loss=f"{r.loss:.4f}" if r.loss is not None else "-",
                                budget=f"{r.budget:.1f}", blocks=r.n_selected, refresh=False)
                bar.update(1)
            if "dev" in run.eval_data and cfg.eval_steps and step % cfg.eval_steps == 0:
                last_dev = (step, run.evaluate("dev"))
                writer.write({"step": step, "split": "dev", **last_dev[1]})
                log.info("step %d: dev %s", step, _fmt(last_dev[1]))
                if _better(last_dev[1], state["best_dev"], metric_name):
                    state["best_dev"] = {"step": step, "metrics": last_dev[1]}
                    _save(run, state, seconds0 + time.time() - t0, best=True)
                    saved = step
            if (cfg.save_steps and step % cfg.save_steps == 0 or step == cfg.max_steps) and saved != step:
                _save(run, state, seconds0 + time.time() - t0)
                saved = step
    finally:
        if bar is not None:
            bar.close()
    step = engine.step_count
    if saved != step:
        _save(run, state, seconds0 + time.time() - t0)
    final_path = os.path.join(out, f"checkpoint-{step}")
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
    best = state["best_dev"]
    test = final.get("test")
    if "dev" in final and (best is None or best["step"] == step or _better(final["dev"], best, metric_name)):
        best = {"step": step, "metrics": final["dev"], "checkpoint": final_path}
    elif best and "test" in run.eval_data:
        ckpt.load_checkpoint(engine, best["checkpoint"])  # MeZO: report test at the best dev point
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
        log.info("done: %d steps, test %s %s, digest %s", cfg.max_steps, metric_name,
                 (test or {}).get(metric_name), digest)
    comm.barrier()
    return summary


def run_eval(cfg: TrainConfig, resume: str | bool | None = None) -> dict:
    """Evaluate a checkpoint (or the initial model) on dev and test; writes eval.json."""
    run = Run(cfg)
    path = _resume_path(run.cfg.output_dir, resume)
    if path:
        ckpt.load_checkpoint(run.engine, path)
    results = {s: run.evaluate(s) for s in run.eval_data}
    results["step"] = run.engine.step_count
    results["params_digest"] = params_digest(run.engine.entries, run.engine.comm)
    if run.rank == 0:
        os.makedirs(run.cfg.output_dir, exist_ok=True)
        write_json_atomic(os.path.join(run.cfg.output_dir, "eval.json"), results)
        print(json.dumps(results, indent=1))
    return results


def _resume_path(out: str, resume) -> str | None:
    if not resume:
        return None
    if resume is True:
        return ckpt.latest_checkpoint(out)
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    return resume


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _better(metrics: dict, best: dict | None, name: str) -> bool:
    value = metrics.get(name)
    return value is not None and (best is None or value > best["metrics"].get(name, float("-inf")))


def _save(run: Run, state: dict, seconds: float, best: bool = False) -> str:
    trainer = {"best_dev": state["best_dev"], "seconds": seconds, "model": run.cfg.model, "lora": run.cfg.lora,
               "task": run.cfg.task}
    if best:
        state["best_dev"]["checkpoint"] = os.path.join(run.cfg.output_dir, f"checkpoint-{run.engine.step_count}")
    path = ckpt.save_checkpoint(run.engine, run.cfg.output_dir, trainer, run.write_extra)
    log.info("saved %s%s", path, " (best dev so far)" if best else "")
    if run.rank == 0:
        protect = state["best_dev"]["checkpoint"] if state["best_dev"] else None
        ckpt.rotate_checkpoints(run.cfg.output_dir, run.cfg.save_total_limit, protect=protect)
    run.engine.comm.barrier()
    return path


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


class LogProgress:
    """The progress bar's figures as a log line every `interval` seconds, for logs that are files (cluster jobs):
    a tqdm bar there is one endless line of carriage returns."""

    def __init__(self, total: int, start: int, interval: float):
        self.total, self.n, self.start, self.interval = total, start, start, interval
        self.t0 = self.last = time.time()
        self.postfix = {}

    def update(self, n: int) -> None:
        self.n += n
        now = time.time()
        if now - self.last >= self.interval or self.n == self.total:
            self.last = now
            rate = (self.n - self.start) / max(now - self.t0, 1e-9)
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            log.info("step %d/%d (%.0f%%) %s, %.2f steps/s, ETA %s", self.n, self.total, 100 * self.n / self.total,
                     extra, rate, time.strftime("%H:%M:%S", time.gmtime(eta)) if eta < 8.64e4 else f"{eta:.0f}s")

    def set_postfix(self, refresh: bool = True, **kw) -> None:
        self.postfix = kw

    def close(self) -> None:
        pass


def _progress(cfg: TrainConfig, rank: int, start: int):
    """A tqdm bar on rank 0 when stderr is a terminal, else log lines (every `progress_interval` seconds)."""
    if rank != 0 or cfg.disable_tqdm:
        return None
    if not sys.stderr.isatty():
        return LogProgress(cfg.max_steps, start, cfg.progress_interval)
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=start, desc="curvzo", unit="step", dynamic_ncols=True)
