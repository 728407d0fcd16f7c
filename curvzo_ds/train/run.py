"""`curvzo-ds train` / `eval`: wires config, model, data, engine, evaluation, checkpoints and logs.

One call is one rank of the job (or the whole job in one process). Nothing here does math or
writes files itself: the engine steps, evaluate.py evaluates, the CheckpointManager saves, rotates
and resumes, logs.py writes metrics. In the manner of torchtitan's trainer, `run_train` is the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time

import deepspeed
from deepspeed.accelerator import get_accelerator

from curvzo_ds import data as D
from curvzo_ds.checkpoint.manager import CheckpointManager, load_checkpoint, verify_checkpoint
from curvzo_ds.config.ds_config import load_ds_config, resolve_ds_config
from curvzo_ds.config.ds_policy import MAPPED_FIELDS
from curvzo_ds.config.schema import (
    RESUME_MAY_CHANGE,
    TrainConfig,
    differences,
    field_names,
    resolve_presets,
    sources_of,
    to_dict,
    zo_part,
)
from curvzo_ds.data.stream import MicroBatches, micro_batch_indices
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import ConfigError, Preempted, RanksDisagree
from curvzo_ds.jsonio import dumps, write_json_atomic
from curvzo_ds.models import build_model, load_tokenizer, model_hidden_size
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.comm import main_process_first
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.shard.distributed import GroupMPU, Topology, init_distributed, pin_threads
from curvzo_ds.sysinfo import device_name, peak_rss_bytes, versions
from curvzo_ds.tasks import get_task, load_splits
from curvzo_ds.tasks.splits import data_source
from curvzo_ds.train.evaluate import Evaluator
from curvzo_ds.train.integrations import accelerate_ds_config
from curvzo_ds.train.logs import RunLog, log_to_file, setup_logging
from curvzo_ds.train.signals import Fault, StopRequest

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


def step_batch(cfg: TrainConfig, train_data: list[dict], pad_token_id: int, step: int) -> MicroBatches:
    """The global batch of update `step` (0-based): the same examples and micro-batches at any world size."""
    parts = micro_batch_indices(step, len(train_data), cfg.global_batch_size, cfg.micro_batch_size, cfg.seed)
    return MicroBatches([D.collate([train_data[i] for i in part], pad_token_id) for part in parts])


class Run:
    """Everything a train or eval job needs, built the same way on every rank."""

    def __init__(self, cfg: TrainConfig):
        rank, _, _ = init_distributed(cfg.ddp_timeout)
        setup_logging(rank, cfg.log_level)
        self.threads = pin_threads(cfg.threads)
        self.topology = Topology.create(cfg.shard_group_size)  # the shard and replica groups, once
        self.topology.check_directions(cfg.num_directions)
        cfg = resolve_presets(cfg)
        user_ds = load_ds_config(cfg.deepspeed) if cfg.deepspeed else accelerate_ds_config()
        # Each replica group processes the whole global batch: DeepSpeed's data-parallel world is the shard group.
        # A mapped key given explicitly (--set or the YAML) that the DeepSpeed config sets otherwise is refused.
        self.ds_config, mapped, notes = resolve_ds_config(
            user_ds, self.topology.shard.world_size, model_hidden_size(cfg), explicit=sources_of(cfg),
            where=f"--deepspeed {cfg.deepspeed}" if cfg.deepspeed else "the Accelerate config",
            **{k: getattr(cfg, k) for k in MAPPED_FIELDS})
        for note in notes:
            log.warning("deepspeed config: %s", note)
        cfg = dataclasses.replace(cfg, **mapped)
        cfg.validate()
        accelerator = get_accelerator()
        if cfg.dtype == "float16" and not accelerator.is_fp16_supported():  # else DeepSpeed's ValueError, later
            raise ConfigError(f"dtype=float16: DeepSpeed's {accelerator.device_name()} accelerator has no float16 "
                              "on this machine; use dtype=bfloat16 or dtype=float32")
        self.cfg = cfg
        if self.rank == 0:
            warn_idle_ranks(cfg, self.topology.shard.world_size)
        try:  # the task and its data are the user's: their errors are one line (exit 2), on every rank
            with main_process_first(self.topology.job):  # rank 0 fills the download and tokenizer caches first
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
        shard_group = self.topology.shard.group
        mpu = GroupMPU(shard_group) if shard_group is not None else None
        model, self._keep_alive = build_model(cfg, self.ds_config, shard_group, mpu)
        if self.topology.replica_group is not None:
            ds_compat.sync_replicas(model, self.topology.replica_group)
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=self.ds_config, mpu=mpu)
        self.device = self.ds_engine.device
        loss = D.loss_fn_for(self.task, cfg.train_as_classification)
        self.loss_fn = lambda m, mb: loss(m, D.to_device(mb, self.device))
        self.engine = ZOEngine(self.ds_engine, self.loss_fn, zo_part(cfg), topology=self.topology)
        check_data_agrees(self.topology.job, self.train_data, self.eval_data)
        self.evaluator = Evaluator(self.ds_engine, self.task, self.tokenizer, self.eval_data, cfg.micro_batch_size,
                                   self.topology.job, self.device, cfg.max_new_tokens, loss, cfg.eval_steps)
        log.info("model %s: %d trainable tensors (%d blocks, %d parameters), world size %d, %d threads per rank",
                 cfg.model, len(self.engine.entries), self.engine.num_blocks, self.engine.num_params,
                 self.topology.job.world_size, self.threads)

    @property
    def rank(self) -> int:
        return self.topology.job.rank

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

    def batch(self, step: int) -> MicroBatches:
        return step_batch(self.cfg, self.train_data, self.tokenizer.pad_token_id, step)

    def evaluate(self, split: str) -> dict:
        return self.evaluator.evaluate(split)

    def checkpoints(self, states: dict | None = None) -> CheckpointManager:
        """The run's checkpoint manager: the model files and the tokenizer go into every checkpoint, and
        run_config.json, which `--resume`, `eval --resume` and export read."""
        cfg = self.cfg
        return CheckpointManager(cfg.output_dir, save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit,
                                 metric=self.task.metrics[0], tokenizer=self.tokenizer, states=states,
                                 write_extra=self.write_run_config)

    def write_run_config(self, directory: str) -> None:
        with open(os.path.join(directory, "run_config.json"), "w") as f:
            json.dump(to_dict(self.cfg), f, indent=1)


def check_data_agrees(job, train_data: list[dict], eval_data: dict) -> None:
    """Every rank must have tokenized the same data: a hash of it is compared across the job."""
    h = hashlib.sha256(json.dumps([train_data, eval_data], sort_keys=True).encode()).hexdigest()
    hashes = job.all_gather_object(h)
    if len(set(hashes)) != 1:
        raise RanksDisagree(f"ranks tokenized different data (hashes {sorted(set(hashes))}): check that every rank "
                            "reads the same files with the same tokenizer")


class Clock:
    """The wall seconds a run has trained, over resumes: a stateful component of the checkpoints."""

    def __init__(self):
        self.before, self.start = 0.0, time.time()

    def seconds(self) -> float:
        return self.before + time.time() - self.start

    def state_dict(self) -> dict:
        return {"seconds": self.seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.before, self.start = state.get("seconds", 0.0), time.time()


def run_train(cfg: TrainConfig, resume: str | bool | None = None) -> dict:
    """The training run: set up (resume and output directory checked first), loop, final evaluations, summary."""
    start = time.time()
    run = Run(cfg)
    cfg, engine = run.cfg, run.engine
    clock = Clock()
    manager = run.checkpoints(states={"clock": clock})
    _start(run, manager, resume)
    record = RunLog(cfg, run.rank, [b.name for b in engine.blocks], engine.step_count)
    try:
        with record.progress(), StopRequest() as stop:
            _loop(run, manager, record, clock, stop)
    finally:
        record.end_steps()
    if not _resumed_at(run, manager.path_for(engine.step_count)):
        manager.maybe_save(engine, last=True)  # the last step is saved (a resume that took no step is not rewritten)
    step = engine.step_count  # the weights' steps: the best checkpoint may be loaded below to evaluate test
    digest = params_digest(engine.entries, run.topology.job)
    final, best, test = _final_evaluations(run, manager, record)
    best = _with_digest(run, best, step, digest)
    record.close()
    return _finish(run, manager, step, digest, final, best, test, time.time() - start)


def _loop(run: Run, manager: CheckpointManager, record: RunLog, clock: Clock, stop: StopRequest) -> None:
    """Step until max_steps, one update per pass, the details in the components. On a stop request (any rank's
    signal, agreed through the step's all-reduce) every rank saves the same checkpoint and Preempted is raised."""
    cfg, engine, evaluator, job = run.cfg, run.engine, run.evaluator, run.topology.job
    fault = Fault(run.rank)  # tests only (CURVZO_DS_FAULT); does nothing otherwise
    engine.loss_fn = fault.wrap_loss(engine.loss_fn, engine)
    flat = FlatLossWatch(cfg.flat_loss_steps)
    while engine.step_count < cfg.max_steps:
        fault.before_step(engine, engine.step_count + 1)
        # the update: +eps z, forwards, -2 eps z, forwards, one all-reduce (the step's one host sync, which also
        # carries every rank's stop flag), the update
        r = engine.step(run.batch(engine.step_count), stop_requested=stop.requested)
        step = r.step
        # record the step; warn once if the loss never moves
        record.step(r, clock.seconds())
        flat.observe(r)
        # every consistency_steps: the ranks compare a hash of their ZO state
        if cfg.consistency_steps and step % cfg.consistency_steps == 0:
            check_state_agrees(engine, step)
        # pre-emption: save (unless this step is saved), leave together
        if r.stop:
            manager.maybe_save(engine, last=True)
            job.barrier()  # under srun --kill-on-bad-exit the first exit ends the rest
            raise Preempted(f"stopped on a signal ({stop.signal_name or 'received by another rank'}) at step {step}, "
                            f"after saving {manager.path_for(step)}: resume with --resume")
        # evaluate on dev; a new best is saved at once, and protected from rotation
        if evaluator.should_eval(step):
            dev = evaluator.evaluate("dev", step)
            record.evaluation(step, "dev", dev)
            log.info("step %d: dev %s", step, _fmt(dev))
            if manager.track(step, dev):
                manager.save(engine)
        # checkpoint every save_steps and at the last step
        manager.maybe_save(engine, last=step == cfg.max_steps)


def _resumed_at(run: Run, checkpoint: str) -> bool:
    """Whether the run resumed from `checkpoint` itself: a resume that took no step (max_steps equal to the
    checkpoint's step) does not write it again (its eval.json stays)."""
    loaded = getattr(run, "resumed_from", None)
    # the loaded checkpoint may have been rotated away by the steps taken since
    return (bool(loaded) and os.path.isdir(loaded) and os.path.isdir(checkpoint)
            and os.path.samefile(loaded, checkpoint))


def check_state_agrees(engine: ZOEngine, step: int) -> None:
    """The ranks compare a hash of their ZO state (engine.state_hash); a difference stops every rank."""
    hashes = engine.topology.job.all_gather_object(engine.state_hash())
    if len(set(hashes)) > 1:
        raise RanksDisagree(f"ranks disagree on the ZO state at step {step} (hashes by rank: {hashes}): a rank has "
                            "another build, data or configuration; the run stops")


def _start(run: Run, manager: CheckpointManager, resume) -> None:
    """Everything is checked before the first byte goes to output_dir: the resume target and its compatibility,
    the directory itself (another run, a file, no space, no permission). Then the log file, the resumed state (the
    weights, the ZO state and the manager's components) and config.json."""
    cfg, engine = run.cfg, run.engine
    path = run.resumed_from = manager.resume_path(resume)
    if path:
        check_resume(run, path)
    prepare_output_dir(cfg, bool(resume), run.topology.job)
    log_to_file(os.path.join(cfg.output_dir, "logs", f"rank-{run.rank:05d}.log"), append=bool(resume))
    if path:
        manager.load(engine, path)
        log.info("resumed from %s at step %d", path, engine.step_count)
    elif resume:
        log.warning("--resume: no complete checkpoint in %s, starting from step 0", cfg.output_dir)
    if cfg.static_mask and engine.static_mask is None:  # a resumed run has the checkpoint's mask
        engine.fit_static_mask([run.batch(t) for t in range(cfg.static_mask_batches)])
    if run.rank == 0:
        write_json_atomic(os.path.join(cfg.output_dir, "config.json"), to_dict(cfg))


def _final_evaluations(run: Run, manager: CheckpointManager, record: RunLog) -> tuple:
    """(final, best, test): the end-of-run dev and test evaluations (marked "final": a resumed run drops them, a
    longer run has none), the best dev evaluation, and the test metrics at the best-dev checkpoint (MeZO's rule:
    its weights are loaded for that when an earlier step was better)."""
    step, evaluator = run.engine.step_count, run.evaluator
    final = {}
    if "dev" in run.eval_data:
        last = evaluator.last.get("dev")
        if last and last[0] == step:
            final["dev"] = last[1]
        else:
            final["dev"] = evaluator.evaluate("dev", step)
            record.evaluation(step, "dev", final["dev"], final=True)
    if "test" in run.eval_data:
        final["test"] = evaluator.evaluate("test", step)
        record.evaluation(step, "test", final["test"], final=True)
    test = final.get("test")
    best = manager.best
    if "dev" in final and (best is None or best["step"] == step or manager.is_better(final["dev"])):
        best = {"step": step, "metrics": final["dev"], "checkpoint": manager.path_for(step)}
    elif best and "test" in run.eval_data:
        load_checkpoint(run.engine, best["checkpoint"])
        test = evaluator.evaluate("test")
    return final, best, test


def _with_digest(run: Run, best: dict | None, step: int, digest: str) -> dict | None:
    """The best-dev result with its parameters' digest: the final one, or that of its checkpoint (loaded here unless
    _final_evaluations already loaded it to evaluate test)."""
    if best is None or best["step"] == step:
        return best and {**best, "digest": digest}
    if run.engine.step_count != best["step"]:
        load_checkpoint(run.engine, best["checkpoint"])
    return {**best, "digest": params_digest(run.engine.entries, run.topology.job)}


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
    cfg, engine, job = run.cfg, run.engine, run.topology.job
    ranks = job.all_gather_object((peak_rss_bytes(), socket.gethostname(), device_name(run.device)))
    rss, hostnames, device_names = (list(column) for column in zip(*ranks))
    summary = {
        "params_digest": digest,
        "world_size": job.world_size,
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
    job.barrier()
    return summary


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


def check_resume(run: Run, path: str) -> None:
    """Check that the checkpoint can continue this run: the keys that change the trajectory match its run config
    (config.RESUME_MAY_CHANGE lists those that may differ), and max_steps is not below its step. Each mismatch is a
    one-line ConfigError naming the key."""
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
    results["params_digest"] = params_digest(run.engine.entries, run.topology.job)
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
