"""The run's inputs and their checks, apart from the model: the dtype against DeepSpeed's accelerator, the task, the
tokenizer and the encoded data (`load_data`, `checked_data`), the global batch of each step, and the data checks
that `build` runs on every rank and `curvzo-ds train --check` once before any rank starts."""

from __future__ import annotations

import hashlib
import json
import logging

from curvzo_ds import data as D
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.config.sections import section
from curvzo_ds.data.stream import MicroBatches, micro_batch_indices
from curvzo_ds.errors import ConfigError, RanksDisagree
from curvzo_ds.models import load_tokenizer
from curvzo_ds.tasks import get_task, load_splits
from curvzo_ds.tasks.splits import data_source

log = logging.getLogger("curvzo_ds")


def check_dtype(dtype: str) -> None:
    """float16 where DeepSpeed's accelerator has none: one line (else DeepSpeed's ValueError, later). DeepSpeed is
    imported for float16 only: `train --check`, the launch scripts' preflight, needs it for nothing else."""
    if dtype != "float16":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ConfigError(f"dtype=float16: DeepSpeed's {accelerator.device_name()} accelerator has no float16 "
                          "on this machine; use dtype=bfloat16 or dtype=float32")


def load_data(data_cfg, model_cfg, seed: int) -> tuple:
    """(task, tokenizer, encoded train examples, {"dev"/"test": encoded examples}) as `curvzo-ds train` uses them.
    `data_cfg`: the config's `data` section (the task, its sizes, the encoding); `model_cfg`: its `model` section
    (the tokenizer); `seed`: the engine section's, which draws the splits."""
    task = get_task(data_cfg.task)
    D.check_objective(task, data_cfg.objective)  # a metric the task has no use for: one line before any loading
    tokenizer = load_tokenizer(model_cfg)
    D.check_tokenizer(task, tokenizer)  # a chat task needs a chat template
    splits = load_splits(task, seed, data_cfg.num_train, data_cfg.num_dev, data_cfg.num_eval, data_cfg.data_dir)
    enc = lambda ex, cls: D.encode(task, tokenizer, ex, data_cfg.max_length, cls,  # noqa: E731
                                   data_cfg.max_new_tokens)
    every_candidate = data_cfg.train_as_classification or data_cfg.objective == "accuracy"  # accuracy scores them all
    return (task, tokenizer, [enc(ex, every_candidate) for ex in splits["train"]],
            {s: [enc(ex, True) for ex in splits[s]] for s in ("dev", "test") if splits[s]})


def step_batch(data_cfg, seed: int, train_data: list[dict], pad_token_id: int, step: int) -> MicroBatches:
    """The global batch of update `step` (0-based): the same examples and micro-batches at any world size.
    `data_cfg`: the `data` section (the batch sizes); `seed`: the engine section's, which orders the examples."""
    parts = micro_batch_indices(step, len(train_data), data_cfg.global_batch_size, data_cfg.micro_batch_size, seed)
    return MicroBatches([D.collate([train_data[i] for i in part], pad_token_id) for part in parts])


def warn_idle_ranks(data_cfg, group_size: int) -> None:
    """A global batch of fewer micro-batches than the ranks that share it leaves ranks with no examples: they run
    zero-weight forwards only (ZeRO-3's gathers are collective), so the job is as slow as one with more data."""
    parts = -(-data_cfg.global_batch_size // data_cfg.micro_batch_size)
    if parts < group_size:
        log.warning("global_batch_size=%d in micro-batches of %d is %d micro-batch%s per step for %d ranks: %d of "
                    "them get no examples and only keep ZeRO-3's gathers in step: give each rank a micro-batch "
                    "(global_batch_size >= %d x micro_batch_size), or start fewer ranks", data_cfg.global_batch_size,
                    data_cfg.micro_batch_size, parts, "" if parts == 1 else "es", group_size, group_size - parts,
                    group_size)


def checked_data(cfg: TrainConfig) -> tuple:
    """`load_data` with the checks that need no model (`warn_cut`): the task and its data are the user's, so their
    errors are one line (ConfigError, exit 2). `build` runs it on every rank, `curvzo-ds train --check` once before
    any rank starts."""
    try:
        task, tokenizer, train_data, eval_data = load_data(section(cfg, "data"), section(cfg, "model"), cfg.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    warn_cut(section(cfg, "data"), train_data, eval_data)
    return task, tokenizer, train_data, eval_data


def warn_cut(data_cfg, train_data: list[dict], eval_data: dict) -> None:
    """One warning when examples were cut to max_length; a ConfigError when it cut away every training example's
    prompt (the model would learn its label tokens from nothing)."""
    if train_data and not any(ex["prompt_kept"] for ex in train_data):
        needs = max(ex["needs"] for ex in train_data)
        raise ConfigError(f"max_length={data_cfg.max_length} cuts away the prompt of every training example (only the "
                          f"label tokens are left): raise max_length to at least {needs}, or leave it at its "
                          f"default ({TrainConfig.max_length})")
    cut = sum(ex["cut"] for data in (train_data, *eval_data.values()) for ex in data)
    if cut:
        total = len(train_data) + sum(len(d) for d in eval_data.values())
        log.warning("%d of %d examples are longer than max_length=%d tokens and were cut from the left "
                    "(their label tokens kept); raise max_length to keep them whole", cut, total, data_cfg.max_length)


def check_batch_fits(data_cfg, task, train_data: list[dict]) -> None:
    """A global batch larger than the training pool: one line naming the pool's size and what sets it."""
    n = len(train_data)
    if n >= data_cfg.global_batch_size:
        return
    source = data_source(task, data_cfg.data_dir)
    where = {"hub": "the hub dataset", "files": "the bundled samples" if data_cfg.data_dir == "samples" else
             f"the files of task {task.name}", "dir": f"data_dir={data_cfg.data_dir}"}[source]
    if n >= data_cfg.num_train:
        fix = "lower global_batch_size or raise num_train"
    else:
        fix = (f"only {n} are left after dev and test are drawn: lower global_batch_size, or give more "
               "training data" + (" (leave data_dir unset for the hub dataset)" if data_cfg.data_dir == "samples"
                                  else ""))
    raise ConfigError(f"global_batch_size={data_cfg.global_batch_size} is larger than the {n} training examples "
                      f"(num_train={data_cfg.num_train}, from {where}): {fix}")


def check_data_agrees(job, train_data: list[dict], eval_data: dict) -> None:
    """Every rank must have tokenized the same data: a hash of it is compared across the job."""
    h = hashlib.sha256(json.dumps([train_data, eval_data], sort_keys=True).encode()).hexdigest()
    hashes = job.all_gather_object(h)
    if len(set(hashes)) != 1:
        raise RanksDisagree(f"ranks tokenized different data (hashes {sorted(set(hashes))}): check that every rank "
                            "reads the same files with the same tokenizer")
