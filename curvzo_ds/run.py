"""`curvzo-ds train` / `eval`: wires config, model, data, engine, evaluation, checkpoints and logs.

One call is one rank of the job (or the whole job in one process). Nothing here does math or
writes files itself: the engine steps, evaluate.py evaluates, the CheckpointManager saves, rotates
and resumes, logs.py writes metrics. In the manner of torchtitan's trainer, `run_train` is the loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import time

import deepspeed

from . import data as D
from . import ds_compat
from .checkpoint import CheckpointManager, load_checkpoint, verify_checkpoint
from .comm import Comm, main_process_first
from .config import (
    RESUME_MAY_CHANGE,
    ConfigError,
    TrainConfig,
    differences,
    field_names,
    resolve_presets,
    to_dict,
    zo_part,
)
from .data.stream import MicroBatches, micro_batch_indices
from .digest import params_digest
from .distributed import GroupMPU, init_distributed, pin_threads, shard_groups
from .ds_config import load_ds_config, resolve_ds_config
from .engine import ZOEngine
from .evaluate import evaluate
from .integrations import accelerate_ds_config
from .jsonio import dumps, write_json_atomic
from .logs import MetricsWriter, log_to_file, make_progress, progress_logging, setup_logging
from .models import build_model, load_tokenizer, model_hidden_size
from .pilog import PiWriter
from .signals import Fault, Preempted, RanksDisagree, StopRequest
from .sysinfo import device_name, peak_rss_bytes, versions
from .tasks import get_task, load_splits
from .tasks.splits import data_source

log = logging.getLogger("curvzo_ds")


def warn_idle_ranks(cfg: TrainConfig, group_size: int) -> None:
    """A global batch of fewer micro-batches than the ranks that share it leaves ranks with no examples: they run
    zero-weight forwards only (ZeRO-3's gathers are collective), so the job is as slow as one with more data."""
    parts = -(-cfg.global_batch_size // cfg.micro_batch_size)
    if parts < group_size:
        log.warning("global_batch_size=%d in micro-batches of %d is %d micro-batch%s per step for %d ranks: %d of "
                    "them get no examples and only keep ZeRO-3's gathers in step: give each rank a micro-batch "
                    "(global_batch_size >= %d x micro_batch_size), or start fewer ranks", cfg.global_batch_size,
                    cfg.micro_batch_size, parts, "" if parts == 1 else "es", group_size, group_size - parts,
                    group_size)


def load_data(cfg: TrainConfig) -> tuple:
    """(task, tokenizer, encoded train examples, {"dev"/"test": encoded examples}) as `curvzo-ds train` uses them."""
    task = get_task(cfg.task)
    tokenizer = load_tokenizer(cfg)
    splits = load_splits(task, cfg.seed, cfg.num_train, cfg.num_dev, cfg.num_eval, cfg.data_dir)
    enc = lambda ex, cls: D.encode(task, tokenizer, ex, cfg.max_length, cls, cfg.max_new_tokens)  # noqa: E731
    return (task, tokenizer, [enc(ex, cfg.train_as_classification) for ex in splits["train"]],
            {s: [enc(ex, True) for ex in splits[s]] for s in ("dev", "test") if splits[s]})


class Run:
    """Everything a train or eval job needs, built the same way on every rank."""

    def __init__(self, cfg: TrainConfig):
        self.rank, self.world, self.local_rank = init_distributed(cfg.ddp_timeout)
        setup_logging(self.rank, cfg.log_level)
        self.threads = pin_threads(cfg.threads)
        cfg = resolve_presets(cfg)
        cfg.validate()
        group_size = cfg.shard_group_size or self.world
        if self.world % group_size or cfg.num_directions % (self.world // group_size):
            raise ConfigError(f"shard_group_size={group_size} must divide the world size {self.world}, and "
                              f"num_directions={cfg.num_directions} must be a multiple of the number of replica "
                              f"groups ({self.world // group_size if self.world % group_size == 0 else '?'}): every "
                              "group evaluates its own directions")
        # None, None: ZeRO-3 over the whole world (the default)
        self.shard_group, self.replica_group = shard_groups(group_size)
        user_ds = load_ds_config(cfg.deepspeed) if cfg.deepspeed else accelerate_ds_config()
        # Each replica group processes the whole global batch: DeepSpeed's data-parallel world is the group.
        self.ds_config, notes = resolve_ds_config(user_ds, cfg, group_size, model_hidden_size(cfg),
                                                  f"--deepspeed {cfg.deepspeed}" if cfg.deepspeed else
                                                  "the Accelerate config")
        for note in notes:
            log.warning("deepspeed config: %s", note)
        cfg.validate()
        self.cfg = cfg
        if self.rank == 0:
            warn_idle_ranks(cfg, group_size)
        try:  # the task and its data are the user's: their errors are one line (exit 2), on every rank
            with main_process_first(Comm()):  # rank 0 fills the download and tokenizer caches first
                self.task, self.tokenizer, self.train_data, self.eval_data = load_data(cfg)
            cut = sum(ex["cut"] for data in (self.train_data, *self.eval_data.values()) for ex in data)
            if cut:
                total = len(self.train_data) + sum(len(d) for d in self.eval_data.values())
                log.warning("%d of %d examples are longer than max_length=%d tokens and were cut from the left "
                            "(their label tokens kept); raise max_length to keep them whole", cut, total,
                            cfg.max_length)
            self._check_batch_fits()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        mpu = GroupMPU(self.shard_group) if self.shard_group is not None else None
        model, self._keep_alive = build_model(cfg, self.ds_config, self.shard_group, mpu)
        if self.replica_group is not None:
            ds_compat.sync_replicas(model, self.replica_group)
        self.is_lora = cfg.lora
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=self.ds_config, mpu=mpu)
        self.device = self.ds_engine.device
        loss = D.loss_fn_for(self.task, cfg.train_as_classification)
        self.loss_fn = lambda m, mb: loss(m, D.to_device(mb, self.device))
        self.base_loss = loss
        self.engine = ZOEngine(self.ds_engine, self.loss_fn, zo_part(cfg), group=self.shard_group)
        self._check_data_agrees()
        log.info("model %s: %d trainable tensors (%d blocks, %d parameters), world size %d, %d threads per rank",
                 cfg.model, len(self.engine.entries), self.engine.num_blocks, self.engine.num_params,
                 self.world, self.threads)

    def _check_batch_fits(self) -> None:
        """A global batch larger than the training pool: one line naming the pool's size and what sets it."""
        cfg, n = self.cfg, len(self.train_data)
        if n >= cfg.global_batch_size:
            return
        source = data_source(self.task, cfg.data_dir)
        where = {"hub": "the hub dataset", "files": "the bundled samples" if cfg.data_dir == "samples" else
                 f"the files of task {self.task.name}", "dir": f"data_dir={cfg.data_dir}"}[source]
        if n >= cfg.num_train:
            fix = "lower global_batch_size or raise num_train"
        else:
            fix = (f"only {n} are left after dev and test are drawn: lower global_batch_size, or give more "
                   "training data" + (" (leave data_dir unset for the hub dataset)" if cfg.data_dir == "samples"
                                      else ""))
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} is larger than the {n} training examples "
                          f"(num_train={cfg.num_train}, from {where}): {fix}")

    def _check_data_agrees(self) -> None:
        h = hashlib.sha256(json.dumps([self.train_data, self.eval_data], sort_keys=True).encode()).hexdigest()
        hashes = self.engine.world.all_gather_object(h)
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
                        self.engine.world, self.device, self.cfg.max_new_tokens, self.base_loss)

    def checkpoints(self) -> CheckpointManager:
        cfg = self.cfg
        return CheckpointManager(cfg.output_dir, self.engine.world, save_total_limit=cfg.save_total_limit,
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
    """The training run: set up (resume and output directory checked first), loop, final evaluations, summary."""
    start = time.time()
    run = Run(cfg)
    cfg, engine = run.cfg, run.engine
    manager = run.checkpoints()
    seconds0 = _start(run, manager, resume)
    writer = MetricsWriter(cfg.output_dir, enabled=run.rank == 0, tensorboard=_tensorboard(cfg) and run.rank == 0)
    writer.truncate_after(engine.step_count)
    # pi per block for `curvzo-ds plot` (docs/outputs.md); MeZO's is all 1, so it writes none
    pi_log = PiWriter(cfg.output_dir, [b.name for b in engine.blocks], enabled=run.rank == 0 and cfg.method != "mezo")
    pi_log.truncate_after(engine.step_count)
    bar = make_progress(cfg, run.rank, engine.step_count)
    t0 = time.time()
    seconds = lambda: seconds0 + time.time() - t0

    def save(best: bool = False) -> str:
        state = {"best_dev": manager.best, "seconds": seconds(), "model": cfg.model, "lora": cfg.lora,
                 "task": cfg.task}
        saved_path = manager.save(engine, state, run.write_extra)
        log.info("saved %s%s", saved_path, " (best dev so far)" if best else "")
        return saved_path

    try:
        with progress_logging(bar), StopRequest() as stop:  # log lines go through the bar in a terminal
            last_dev, saved = _loop(run, writer, pi_log, bar, manager, save, seconds, stop)
    finally:
        pi_log.close()
        if bar is not None:
            bar.close()
    if saved != engine.step_count and not _resumed_at(run, manager.path_for(engine.step_count)):
        save()
    step = engine.step_count  # the weights' steps: the best checkpoint may be loaded below to evaluate test
    digest = params_digest(engine.entries, engine.world)
    final, best, test = _final_evaluations(run, manager, writer, last_dev)
    best = _with_digest(run, best, step, digest)
    writer.close()
    return _finish(run, manager, step, digest, final, best, test, time.time() - start)


def _resumed_at(run: Run, checkpoint: str) -> bool:
    """Whether the run resumed from `checkpoint` itself: a resume that took no step (max_steps equal to the
    checkpoint's step) does not write it again (its eval.json stays)."""
    loaded = getattr(run, "resumed_from", None)
    return bool(loaded) and os.path.isdir(checkpoint) and os.path.samefile(loaded, checkpoint)


def _start(run: Run, manager: CheckpointManager, resume) -> float:
    """Everything is checked before the first byte goes to output_dir: the resume target and its compatibility,
    the directory itself (another run, a file, no space, no permission). Then the log file, the resumed state and
    config.json. Returns the seconds the resumed run had already trained."""
    cfg, engine = run.cfg, run.engine
    path = run.resumed_from = manager.resume_path(resume)
    trainer = check_resume(run, path) if path else None
    prepare_output_dir(cfg, bool(resume), engine.world)
    log_to_file(os.path.join(cfg.output_dir, "logs", f"rank-{run.rank:05d}.log"), append=bool(resume))
    seconds0 = 0.0
    if path:
        load_checkpoint(engine, path)
        manager.best, seconds0 = trainer.get("best_dev"), trainer.get("seconds", 0.0)
        log.info("resumed from %s at step %d", path, engine.step_count)
    elif resume:
        log.warning("--resume: no complete checkpoint in %s, starting from step 0", cfg.output_dir)
    if cfg.static_mask and engine.static_mask is None:  # a resumed run has the checkpoint's mask
        engine.fit_static_mask([run.micro_batches(t) for t in range(cfg.static_mask_batches)])
    if run.rank == 0:
        write_json_atomic(os.path.join(cfg.output_dir, "config.json"), to_dict(cfg))
    return seconds0


def _final_evaluations(run: Run, manager: CheckpointManager, writer: MetricsWriter, last_dev) -> tuple:
    """(final, best, test): the end-of-run dev and test evaluations (marked "final": a resumed run drops them, a
    longer run has none), the best dev evaluation, and the test metrics at the best-dev checkpoint (MeZO's rule:
    its weights are loaded for that when an earlier step was better)."""
    step = run.engine.step_count
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
        best = {"step": step, "metrics": final["dev"], "checkpoint": manager.path_for(step)}
    elif best and "test" in run.eval_data:
        load_checkpoint(run.engine, best["checkpoint"])
        test = run.evaluate("test")
    return final, best, test


def _with_digest(run: Run, best: dict | None, step: int, digest: str) -> dict | None:
    """The best-dev result with its parameters' digest: the final one, or that of its checkpoint (loaded here unless
    _final_evaluations already loaded it to evaluate test)."""
    if best is None or best["step"] == step:
        return best and {**best, "digest": digest}
    if run.engine.step_count != best["step"]:
        load_checkpoint(run.engine, best["checkpoint"])
    return {**best, "digest": params_digest(run.engine.entries, run.engine.world)}


def done_line(metric: str, step: int, best: dict | None, test: dict | None, final: dict, checkpoint: str,
              digest: str) -> str:
    """The run's last log line: the best-dev checkpoint's test score and digest (MeZO's rule), then the final
    weights' (summary.json's `best_dev`, `test`, `final` and `params_digest`)."""
    score = lambda metrics: f"test {metric} {_fmt_value((metrics or {}).get(metric))}"  # noqa: E731
    parts = [f"done: {step} steps"]
    if best:
        parts.append(f"best dev at step {best['step']} ({best['checkpoint']}): {score(test)}, digest {best['digest']}")
    parts.append(f"final step {step} ({checkpoint}): {score(final.get('test'))}, digest {digest}")
    return "; ".join(parts)


def _finish(run: Run, manager: CheckpointManager, step: int, digest: str, final: dict, best: dict | None,
            test: dict | None, wall_seconds: float) -> dict:
    """summary.json (rank 0) and the done line for a run that ended at `step`; every rank returns the summary."""
    cfg, engine = run.cfg, run.engine
    # One entry per rank of the whole job (engine.world; engine.comm is the shard group).
    ranks = engine.world.all_gather_object((peak_rss_bytes(), socket.gethostname(), device_name(run.device)))
    rss, hostnames, device_names = (list(column) for column in zip(*ranks))
    summary = {
        "params_digest": digest,
        "world_size": run.world,
        "method": cfg.method,
        "seed": cfg.seed,
        "steps": step,  # the steps the weights have (a resume past max_steps is refused)
        "final": final,
        "best_dev": ({"step": best["step"], **best["metrics"], "checkpoint": best["checkpoint"],
                      "digest": best["digest"]} if best else None),
        "test": test,
        "skipped_steps": engine.skipped_total,
        "num_blocks": engine.num_blocks,
        "num_params": engine.num_params,
        "checkpoint": manager.path_for(step),
        "wall_seconds": wall_seconds,
        "peak_rss_bytes": rss,
        "threads": run.threads,
        "versions": versions(),
        "hostnames": hostnames,
        "device_names": device_names,
        "noise_generator": engine.noise.ident,
        "config_hash": config_hash(to_dict(cfg)),
    }
    if run.rank == 0:
        write_json_atomic(os.path.join(cfg.output_dir, "summary.json"), summary)
        log.info("%s", done_line(manager.metric, step, best, test, final, manager.path_for(step), digest))
    engine.world.barrier()
    return summary


def _loop(run: Run, writer: MetricsWriter, pi_log: PiWriter, bar, manager: CheckpointManager, save, seconds,
          stop: StopRequest):
    """Step until max_steps, logging, evaluating on dev and saving as configured; returns (last dev, last save).

    On a stop request (any rank's signal, agreed through the step's all-reduce) it saves and raises Preempted.
    Every `consistency_steps` steps the ranks compare a hash of their ZO state and stop if they differ.
    """
    cfg, engine = run.cfg, run.engine
    fault = Fault(run.rank)
    engine.loss_fn = fault.wrap_loss(engine.loss_fn, engine)
    saved = last_dev = None
    flat = FlatLossWatch(cfg.flat_loss_steps)
    while engine.step_count < cfg.max_steps:
        upcoming = engine.step_count + 1  # the step the next update makes, as its metrics line counts it
        fault.before_step(engine, upcoming)
        if pi_log.enabled and (upcoming % cfg.logging_steps == 0 or upcoming == cfg.max_steps):
            pi_log.write(upcoming, engine.sampler.probabilities(engine.step_count).pi)  # the pi this update draws from
        r = engine.step(run.micro_batches(engine.step_count), stop_requested=stop.requested)
        step = r.step
        if step % cfg.logging_steps == 0 or step == cfg.max_steps or r.stop:
            writer.write({**r.as_dict(), "seconds": seconds()})
        if bar is not None:
            bar.set_postfix(loss=f"{r.loss:.4f}" if r.loss is not None else "-",
                            budget=f"{r.budget:.1f}", blocks=r.n_selected, refresh=False)
            bar.update(1)
        flat.observe(r)
        if cfg.consistency_steps and step % cfg.consistency_steps == 0:
            hashes = engine.world.all_gather_object(engine.state_hash())
            if len(set(hashes)) > 1:
                raise RanksDisagree(f"ranks disagree on the ZO state at step {step} (hashes by rank: {hashes}): a "
                                    "rank has another build, data or configuration; the run stops")
        if r.stop:
            path = save() if saved != step else manager.path_for(step)
            engine.world.barrier()  # leave together: under srun --kill-on-bad-exit the first exit ends the rest
            raise Preempted(f"stopped on a signal ({stop.signal_name or 'received by another rank'}) at step {step}, "
                            f"after saving {path}: resume with --resume")
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
    return last_dev, saved


class FlatLossWatch:
    """Warns once when the loss stays exactly the same, with a projected gradient of 0, for `steps` steps in a row:
    the perturbation never reaches the loss."""

    def __init__(self, steps: int):
        self.steps, self.run, self.last, self.warned = steps, 0, None, False

    def observe(self, r) -> None:
        if not self.steps or self.warned or r.loss is None:
            return
        self.run = self.run + 1 if (r.projected_grad == 0.0 and r.loss == self.last) else 0
        self.last = r.loss
        if self.run >= self.steps:
            self.warned = True
            log.warning("the loss has been exactly %.6g with a projected gradient of 0 for %d steps: the perturbation "
                        "does not reach the loss. Likely causes: zo_eps below the weights' dtype spacing (raise "
                        "zo_eps or use fp32_master_weights=true), label words that the tokenizer maps to the same "
                        "tokens, or the trained parameters (LoRA targets) not on the loss's path", r.loss, self.run)


def check_resume(run: Run, path: str) -> dict:
    """The checkpoint's trainer state, after checking it can continue this run: the keys that change the trajectory
    match its run config (config.RESUME_MAY_CHANGE lists those that may differ), and max_steps is not below its
    step. Each mismatch is a one-line ConfigError naming the key."""
    manifest = verify_checkpoint(path)
    config_path = os.path.join(path, "run_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            saved = json.load(f)
        keys = [k for k in field_names() if k not in RESUME_MAY_CHANGE]
        changed = differences(saved, to_dict(run.cfg), keys)
        if changed:
            raise ConfigError(f"--resume {path}: {'; '.join(changed)}: these keys change the trajectory and must "
                              "match the checkpoint's run (max_steps, eval_steps, logging and the like may change)")
    step = int(manifest.get("step", 0))
    if step > run.cfg.max_steps:
        raise ConfigError(f"--resume {path}: max_steps={run.cfg.max_steps} is below the checkpoint's step {step}: "
                          f"set max_steps >= {step}")
    try:
        run.engine.check_state(manifest["engine"])
    except ValueError as e:
        raise ConfigError(f"--resume {path}: {e}") from None
    return manifest.get("trainer", {})


RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "tensorboard", "eval.json", "logs")


def prepare_output_dir(cfg: TrainConfig, resuming: bool, comm) -> None:
    """Refuse an output_dir that is a file, or that holds another run unless resumed or overwrite_output_dir; make
    it (emptied of the old run when overwriting) and check it takes a small write, all before training."""
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output_dir={out} is a file: choose a directory")
    held = sorted(n for n in (os.listdir(out) if os.path.isdir(out) else [])
                  if n in RUN_FILES or n.startswith("checkpoint-"))
    if held and not resuming and not cfg.overwrite_output_dir:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"output_dir={out} already holds a run ({shown}): pass --resume to continue it, set "
                          "overwrite_output_dir=true to replace it, or choose another output_dir")
    error = None
    if comm.rank == 0:
        try:
            if held and not resuming:  # overwrite_output_dir: the old run goes
                for name in held:
                    target = os.path.join(out, name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
                log.warning("overwrite_output_dir: removed %s from %s", ", ".join(held), out)
            probe_write(out)
        except OSError as e:
            error = (f"output_dir={out} cannot be written ({e.strerror or e}): free space, fix its permissions, or "
                     "choose another output_dir")
    error = comm.broadcast_object(error)
    if error:
        raise ConfigError(error)


def probe_write(directory: str, size: int = 1 << 16) -> None:
    """Create `directory` and write, flush and remove a small file there (raises OSError when it cannot)."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def run_eval(cfg: TrainConfig, resume: str | bool | None = None) -> dict | None:
    """Evaluate a checkpoint on dev and test; rank 0 writes output_dir/eval.json and returns the results (other ranks
    return None). Without `resume` it evaluates the untrained model and writes nothing (only the CLI's stdout has the
    result), and it refuses an output_dir that holds a run: there the result would pass for the run's."""
    if not resume:
        refuse_untrained_eval_of_a_run(cfg.output_dir)
    run = Run(cfg)
    path = run.checkpoints().resume_path(resume)
    if path:
        load_checkpoint(run.engine, path)
    results = {s: run.evaluate(s) for s in run.eval_data}
    results["step"] = run.engine.step_count
    results["params_digest"] = params_digest(run.engine.entries, run.engine.comm)
    if run.rank == 0:
        if not path:
            log.info("evaluated the untrained model (no --resume); nothing written: pass --resume CHECKPOINT to "
                     "evaluate a checkpoint")
            return results
        os.makedirs(run.cfg.output_dir, exist_ok=True)
        write_json_atomic(os.path.join(run.cfg.output_dir, "eval.json"), results)
        log.info("wrote %s", os.path.join(run.cfg.output_dir, "eval.json"))
        return results
    return None


def refuse_untrained_eval_of_a_run(out: str) -> None:
    """`eval` without --resume next to a run: one line that points to --resume (issue 28)."""
    held = sorted(n for n in (os.listdir(out) if os.path.isdir(out) else [])
                  if n in RUN_FILES or n.startswith("checkpoint-"))
    if held:
        raise ConfigError(f"output_dir={out} holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}), "
                          "and without --resume eval would evaluate the untrained model: pass --resume for its newest "
                          "checkpoint (or --resume CHECKPOINT), or set output_dir to another directory to evaluate "
                          "the untrained model")


def config_hash(config: dict) -> str:
    """The run config's hash: "sha256:" + the hex SHA-256 of its canonical JSON (sorted keys, no spaces, ASCII),
    as recomputed from config.json with json.load and json.dumps(..., sort_keys=True, separators=(",", ":"))."""
    return "sha256:" + hashlib.sha256(dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fmt_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


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
