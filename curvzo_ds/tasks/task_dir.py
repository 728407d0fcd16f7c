"""A user's task directory (docs/tasks.md): `load_task_dir` reads its task.json, checks it and builds the `Task`
(classification, completion or chat), and `get_task` resolves a task's name (a built-in task, the bundled demo) or
directory. The `Task` class, the kinds and the built-in tasks are in tasks/task.py.
"""

import difflib
import json
import string
from pathlib import Path

from curvzo_ds.tasks.task import (
    ASSISTANT_TURNS,
    BUILTIN,
    BUNDLED_DATA,
    CHAT,
    CLASSIFICATION,
    COMPLETION,
    TASK_DIR_KINDS,
    TASK_DIR_METRICS,
    TASK_NAMES,
    Task,
    label_index,
)


def get_task(name_or_dir: str | Path) -> Task:
    """A built-in task by its lower-case name, or a task directory (task.json + train.jsonl)."""
    if isinstance(name_or_dir, Task):
        return name_or_dir
    key = str(name_or_dir)
    if key == "demo":
        return load_task_dir(BUNDLED_DATA / "demo")
    if key in BUILTIN:
        return BUILTIN[key]
    if Path(key).is_dir():
        return load_task_dir(key)
    hint = f"; names are lower case: {key.lower()!r}" if key.lower() in TASK_NAMES else ""
    raise ValueError(f"task {key!r} is neither a built-in task ({', '.join(TASK_NAMES)}) nor a "
                     f"directory holding task.json{hint}")


def load_task_dir(path: str | Path) -> Task:
    """A user's task: task.json names its kind (classification, the default; completion; chat) and, for a
    classification task, the template, label words and metric."""
    path = Path(path)
    spec_path = path / "task.json"
    if not spec_path.is_file():
        raise ValueError(f"{path}: no task.json; a task directory holds task.json and train.jsonl "
                         f"(optionally dev.jsonl, test.jsonl)")
    try:
        spec = json.loads(spec_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{spec_path}: not valid UTF-8 JSON ({err})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{spec_path}: expected a JSON object with name, template, label_words, metric")
    kind = spec.get("kind", CLASSIFICATION)
    if kind not in TASK_DIR_KINDS:
        close = difflib.get_close_matches(str(kind), TASK_DIR_KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{spec_path}: kind {kind!r} is not one of {', '.join(TASK_DIR_KINDS)}{hint}")
    # Each kind's fields with an example value; the required ones first (a classification task's kind is optional).
    example = ({"name": "my-task", "template": "{text} It was", "label_words": [" terrible", " great"],
                "metric": "accuracy"} if kind == CLASSIFICATION else {"name": "my-task", "kind": kind})
    optional = {CLASSIFICATION: {"kind": CLASSIFICATION}, COMPLETION: {}, CHAT: {"assistant_turns": "last"}}[kind]
    known = {**example, **optional}
    # A misspelt key (lable_words) ignored in silence would surface later as a confusing "missing field"
    # or not at all; name it, as unknown config keys are named.
    for key in spec:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = (f"did you mean {close[0]!r}?" if close else
                    f"the known fields {'of a ' + kind + ' task ' if kind != CLASSIFICATION else ''}are "
                    f"{', '.join(known)}")
            raise ValueError(f"{spec_path}: unknown field {key!r}; {hint}")
    for key in example:
        if key not in spec:
            raise ValueError(f"{spec_path}: missing field {key!r}; add it, for example "
                             f"\"{key}\": {json.dumps(example[key])}")
    name = spec["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{spec_path}: \"name\" must be a non-empty string")
    if kind != CLASSIFICATION:
        return _text_task_dir(path, spec_path, name, kind, spec.get("assistant_turns", "last"))
    template, label_words, metric = (spec[k] for k in ("template", "label_words", "metric"))
    if not isinstance(template, str):
        raise ValueError(f"{spec_path}: \"template\" must be a string such as \"{{text}} It was\"")
    try:
        fields = tuple(dict.fromkeys(f for _, f, _, _ in string.Formatter().parse(template) if f is not None))
    except ValueError as err:
        raise ValueError(f"{spec_path}: bad template {template!r} ({err}); write fields as {{name}} "
                         f"and literal braces as {{{{ }}}}") from None
    if not fields or any(not f.isidentifier() for f in fields):
        raise ValueError(f"{spec_path}: template {template!r} must name example fields as plain "
                         f"{{field}} placeholders, such as \"{{text}} It was\"")
    if (not isinstance(label_words, list) or len(label_words) < 2
            or not all(isinstance(w, str) and w for w in label_words)):
        raise ValueError(f"{spec_path}: \"label_words\" must be a list of at least two non-empty "
                         f"strings, such as [\" terrible\", \" great\"]")
    if len(set(label_words)) != len(label_words):
        raise ValueError(f"{spec_path}: \"label_words\" {label_words} repeats a word; the classes would be "
                         f"indistinguishable (the loss would stay at ln {len(label_words)}): give each class its own "
                         "word")
    if metric not in TASK_DIR_METRICS:
        raise ValueError(f"{spec_path}: metric {metric!r} is not supported for a task directory; "
                         f"use {' or '.join(map(repr, TASK_DIR_METRICS))}")
    _need_train(path)
    return Task(name=name, kind=CLASSIFICATION, metrics=(metric,),
                prompt=lambda ex: template.format(**{f: ex[f] for f in fields}),
                fields=(*fields, "label"), label_words=tuple(label_words), label=label_index, data_dir=path)


def _need_train(path: Path) -> None:
    if not any((path / f"train{ext}").is_file() for ext in (".jsonl", ".csv")):
        raise ValueError(f"{path}: no train.jsonl; a task directory needs one example per line")


def _text_task_dir(path: Path, spec_path: Path, name: str, kind: str, assistant_turns) -> Task:
    """A completion or chat task directory: its lines carry their text; it reports exact_match and f1 of greedy
    generation (and the loss)."""
    if assistant_turns not in ASSISTANT_TURNS:
        raise ValueError(f"{spec_path}: \"assistant_turns\" is {assistant_turns!r}, not one of "
                         f"{', '.join(map(repr, ASSISTANT_TURNS))} (the loss covers the last assistant turn, or all)")
    _need_train(path)
    if kind == COMPLETION:
        return Task(name=name, kind=COMPLETION, metrics=("f1", "exact_match"), prompt=lambda ex: ex["prompt"],
                    fields=("prompt", "completion"), answers=lambda ex: [ex["completion"]], data_dir=path)
    return Task(name=name, kind=CHAT, metrics=("f1", "exact_match"), prompt=_transcript, fields=("messages",),
                answers=_last_reply, data_dir=path, assistant_turns=assistant_turns)


# ---- a chat line as a Task reads it ----

def _last_reply(example: dict) -> list[str]:
    return [example["messages"][-1]["content"]]


def _transcript(example: dict) -> str:
    """A chat line as plain text (for reading; the model sees the tokenizer's chat template, data/encoding.py)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in example["messages"][:-1]) + "assistant:"
