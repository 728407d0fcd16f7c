"""Where examples come from, and MeZO's rule for sampling train / dev / test from them.

Sources (`data_dir`): unset, the Hugging Face hub dataset of a built-in task (through `datasets`, with
its cache and HF_DATASETS_OFFLINE), or the files of a task directory or of the demo task; "samples", the
10-16 examples bundled with each built-in task (for tests and a first look); a path, a local directory of
train/validation (or test) JSONL or CSV files in the hub's fields, or a `datasets` directory written by
`save_to_disk`.

The split rule (MeZO, large_models/run.py): the train pool is permuted with
`numpy.random.RandomState(seed)`; train is the first `num_train` of that order and dev
the next `num_dev`; a test split drawn from train (a task directory without test.jsonl)
takes the `num_eval` after those. A pool smaller than that keeps the held-out splits whole and
gives train the rest (CB: 250 examples, 150 train and 100 dev); one too small to leave any
train cuts each held-out split to a fifth of the pool. A split given as its own file is subsampled with the
same permutation rule (test: the whole file, in order, when `num_eval` is None). The
result is a pure function of the inputs, so every rank of any world size sees the same.
"""

import csv
import io
import json
import logging
from pathlib import Path

import numpy as np

from curvzo_ds.hub import offline_unless_reachable
from curvzo_ds.tasks.task import Task
from curvzo_ds.tasks.task_dir import get_task

log = logging.getLogger(__name__)
SPLIT_FILES = {"train": ("train",), "dev": ("dev",), "test": ("test", "validation")}
WHERE = "_where"  # the file and line of a completion or chat example, in the example (no field of its own)


def data_source(task: Task, data_dir: str | Path | None) -> str:
    """Where the examples of `task` come from: "hub", "files" (the task's own), or "dir" (a path)."""
    if data_dir is None:
        return "hub" if task.hub is not None else "files"
    if str(data_dir) == "hub":
        return "hub"
    if str(data_dir) == "samples":
        return "files"
    return "dir"


def load_splits(task: Task | str, seed: int, num_train: int | None = None, num_dev: int | None = None,
                num_eval: int | None = None, data_dir: str | Path | None = None) -> dict[str, list[dict]]:
    """Return {"train": [...], "dev": [...], "test": [...]}, lists of plain dict examples.

    num_train=None takes what is left of train after dev (and test); num_dev=None is the task's default
    (500, CB 100); num_eval=None is the whole test split (when test is drawn from train: as many as dev).
    data_dir: see the module docstring.
    """
    task = get_task(task)
    source = data_source(task, data_dir)
    if source == "hub":
        pools = _read_hub(task)
    elif source == "files":
        if task.data_dir is None:
            raise ValueError(f"task {task.name!r} has no files of its own; leave data_dir unset or pass a directory")
        pools = read_split_files(task, task.data_dir)
    elif (Path(data_dir) / "dataset_dict.json").is_file():
        pools = _read_saved(task, Path(data_dir))
    else:
        pools = read_split_files(task, Path(data_dir))
    return split(pools, seed, num_train, task.num_dev if num_dev is None else num_dev, num_eval)


def split(pools: dict[str, list], seed: int, num_train: int | None, num_dev: int,
          num_eval: int | None) -> dict[str, list]:
    """MeZO's sampling; pools holds "train" and optionally "dev" and "test"."""
    train = pools["train"]
    held = {}  # splits drawn from train, in the order they follow the train examples
    if "dev" not in pools:
        held["dev"] = num_dev
    if "test" not in pools:
        held["test"] = num_dev if num_eval is None else num_eval
    n = len(train)

    def words(sizes: dict) -> str:
        # Users read the log; "8 for dev, 8 for test" reads better than a Python dict, and "none" better than {}.
        return ", ".join(f"{v} for {k}" for k, v in sizes.items()) or "none"

    if sum(held.values()) >= n:  # a small sample: held-out splits would leave no train
        cut = {k: min(v, n // 5) for k, v in held.items()}
        log.warning("train holds %d examples, not more than the held-out %s; drawing %s from it", n, words(held),
                    words(cut))
        held = cut
    rest = n - sum(held.values())
    n_train = rest if num_train is None else min(num_train, rest)
    if num_train is not None and n_train < num_train:  # MeZO: held-out splits first, train takes the rest
        log.info("train holds %d examples: %s held out, %d for train (num_train=%d)", n, words(held), n_train,
                 num_train)
    order = _permutation(seed, n)
    out = {"train": [dict(train[i]) for i in order[:n_train]]}
    start = n_train
    for name, size in held.items():
        out[name] = [dict(train[i]) for i in order[start:start + size]]
        start += size
    if "dev" in pools:
        out["dev"] = _subset(pools["dev"], seed, num_dev)
    if "test" in pools:
        test = pools["test"]
        out["test"] = [dict(ex) for ex in test] if num_eval is None else _subset(test, seed, num_eval)
    return out


def _permutation(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).permutation(n).tolist()


def _subset(examples: list, seed: int, num: int) -> list:
    return [dict(examples[i]) for i in _permutation(seed, len(examples))[:num]]


def read_split_files(task: Task, directory: Path) -> dict[str, list[dict]]:
    """train.(jsonl|csv) and, if present, dev.* and test.* (or validation.*), checked against the task."""
    if not directory.is_dir():
        raise ValueError(f"data_dir {directory} is not a directory; it should hold train.jsonl "
                         f"(or train.csv) and validation.jsonl")
    pools = {}
    for split_name, stems in SPLIT_FILES.items():
        path = next((directory / f"{s}{e}" for s in stems for e in (".jsonl", ".csv")
                     if (directory / f"{s}{e}").is_file()), None)
        if path is None:
            continue
        rows = read_csv(path) if path.suffix == ".csv" else read_jsonl(path)
        for line, example in rows:
            task.check(example, f"{path} line {line}")
            if task.has_own_text:  # where its encoding's errors point (data/encoding.py: a prompt max_length cuts)
                example[WHERE] = f"{path} line {line}"
        pools[split_name] = [example for _, example in rows]
    if "train" not in pools:
        raise ValueError(f"{directory}: no train.jsonl or train.csv; put the training examples there, "
                         f"one JSON object per line")
    if not pools["train"]:
        raise ValueError(f"{directory}: the train file holds no examples")
    return pools


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line raises naming its number."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} line {line_no}: byte {raw[err.start]:#04x} at column {err.start + 1} is not "
                                 "UTF-8; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {line_no}: not valid JSON ({err.msg} at column "
                                 f"{err.colno}); each line must be one JSON object") from None
    return rows


def read_csv(path: Path) -> list[tuple[int, dict]]:
    """Rows of a CSV file with a header line; cells stay strings (the task converts them)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_no = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path} line {line_no}: byte {raw[err.start]:#04x} is not "
                         "UTF-8; save the file as UTF-8") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    return [(reader.line_num, dict(row)) for row in reader]


def _read_hub(task: Task) -> dict[str, list[dict]]:
    if task.hub is None:
        raise ValueError(f"task {task.name!r} has no hub dataset; leave data_dir unset to use its own files")
    path, name, revision = task.hub
    offline_unless_reachable()  # an unreachable hub fails at once below, from the cache
    try:
        import datasets

        dataset = datasets.load_dataset(path, name, revision=revision)
    except Exception as err:  # offline, not cached, renamed: all end the same way for the user
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ValueError(
            f"task {task.name}: could not load the dataset {path}{f' ({name})' if name else ''} from the Hugging "
            f"Face hub or its cache ({reason}). Three ways out: fill the cache once with network access (then "
            f"HF_DATASETS_OFFLINE=1 works), pass data_dir=DIR (train and validation .jsonl/.csv files in the "
            f"hub's fields, or a datasets save_to_disk directory), or data_dir=samples for the bundled "
            f"examples") from None
    return _pools(task, dataset, path)


def _read_saved(task: Task, directory: Path) -> dict[str, list[dict]]:
    """A `datasets.DatasetDict.save_to_disk` directory with a train split and validation (or test, dev)."""
    import datasets

    return _pools(task, datasets.load_from_disk(str(directory)), str(directory))


def _pools(task: Task, dataset, where: str) -> dict[str, list[dict]]:
    """train, dev and test pools of a DatasetDict: its "validation" (or "test") split is the test pool (MeZO
    evaluates on the hub's validation data), "dev" a dev pool when there is one."""
    if "train" not in dataset:
        raise ValueError(f"{where}: no train split (it has {', '.join(dataset)})")
    pools = {"train": [dict(r) for r in dataset["train"]]}
    test = next((s for s in ("validation", "test") if s in dataset), None)
    if test:
        pools["test"] = [dict(r) for r in dataset[test]]
    if "dev" in dataset:
        pools["dev"] = [dict(r) for r in dataset["dev"]]
    for split_name, examples in pools.items():
        for i, example in enumerate(examples):
            task.check(example, f"{where} {split_name} row {i}")
    return pools
