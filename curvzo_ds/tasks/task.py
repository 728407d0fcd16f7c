"""Tasks: how an example becomes a prompt, its candidate answers and its gold label.

The built-in prompts are MeZO's (princeton-nlp/MeZO, large_models/templates.py and
tasks.py), which the CurvZO paper follows. A classification task scores one
continuation per class after the prompt (its label word); a generation task trains on
" <first answer>\n" after the prompt and is scored on the greedy answer.
"""

import difflib
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CLASSIFICATION = "classification"
GENERATION = "generation"
BUNDLED_DATA = Path(__file__).resolve().parent / "data"
TASK_DIR_METRICS = ("accuracy",)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # CLASSIFICATION or GENERATION
    metrics: tuple[str, ...]  # names from docs/contracts.md: accuracy, f1, exact_match
    prompt: Callable[[dict], str]
    fields: tuple[str, ...]  # fields every example must hold
    label_words: tuple[str, ...] = ()  # classification: the continuation of each class
    label: Callable[[dict], int] | None = None  # classification: the gold class index
    answers: Callable[[dict], list[str]] | None = None  # generation: the gold answers
    hub: tuple[str, str | None, str | None] | None = None  # load_dataset(path, name, revision=)
    num_dev: int = 500  # MeZO's dev size (CB: 100)
    data_dir: Path | None = None  # bundled samples, or the user's task directory

    @property
    def is_classification(self) -> bool:
        return self.kind == CLASSIFICATION

    def candidates(self, example: dict) -> list[str]:
        """Continuations of the prompt: one per class, or the training target of a generation task."""
        if self.is_classification:
            return list(self.label_words)
        return [f" {self.answers(example)[0]}\n"]

    def gold(self, example: dict) -> int:
        """Index of the correct candidate (0 for a generation task: its only candidate)."""
        return self.label(example) if self.is_classification else 0

    def check(self, example: dict, where: str) -> None:
        """Raise a ValueError naming `where` (file and line) if the example cannot be used."""
        if not isinstance(example, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}")
        for field in self.fields:
            if field not in example:
                raise ValueError(f"{where}: missing field {field!r} that task {self.name!r} needs; "
                                 f"add it to every example (fields: {', '.join(self.fields)})")
            if example[field] is None:
                raise ValueError(f"{where}: field {field!r} is null; give it a value (a null would be shown as "
                                 f"'None' in the prompt)")
        try:
            if self.is_classification:
                gold = self.label(example)
                if not 0 <= gold < len(self.label_words):
                    raise ValueError(f"label {gold} is out of range for {len(self.label_words)} label "
                                     f"words; use 0..{len(self.label_words) - 1}")
            else:
                if not self.answers(example):
                    raise ValueError("no gold answer; give at least one")
            self.prompt(example)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise ValueError(f"{where}: {err}") from None


# ---- field helpers (hub rows, JSONL and CSV cells all go through these) ----

def _index(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError(f"label must be a non-negative integer, got {value!r}")
    return int(value)


def _truthy(value) -> bool:
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"answer must be true or false, got {value!r}")
        return value.strip().lower() in ("true", "1")
    return bool(value)


def _text_list(value, key: str) -> list[str]:
    """Answers as stored by the hub ({key: [...]}) or in a JSONL/CSV file (a list, a JSON string or text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [value]
    if isinstance(value, dict):
        value = value[key]
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _question(text: str) -> str:
    text = text if text.endswith("?") else text + "?"
    return text[0].upper() + text[1:]


# ---- MeZO's templates ----

def _sst2(ex):
    return f"{ex['sentence'].strip()} It was"


def _rte(ex):
    return f"{ex['premise']}\nDoes this mean that \"{ex['hypothesis']}\" is true? Yes or No?\n"


def _cb(ex):
    return f"Suppose {ex['premise']} Can we infer that \"{ex['hypothesis']}\"? Yes, No, or Maybe?\n"


def _boolq(ex):  # MeZO's default BoolQ template (its version 2, BoolQTemplateV3)
    return f"{ex['passage']} {_question(ex['question'])}\n"


def _wsc(ex):
    return (f"{ex['text']}\nIn the previous sentence, does the pronoun \"{ex['span2_text'].lower()}\" "
            f"refer to {ex['span1_text']}? Yes or No?\n")


def _wic(ex):
    return (f"Does the word \"{ex['word']}\" have the same meaning in these two sentences? Yes, No?\n"
            f"{ex['sentence1']}\n{ex['sentence2']}\n")


def _squad(ex):
    return f"Title: {ex['title']}\nContext: {ex['context']}\nQuestion: {ex['question'].strip()}\nAnswer:"


def _drop(ex):
    return f"Passage: {ex['passage']}\nQuestion: {ex['question'].strip()}\nAnswer:"


def _label(ex):
    return _index(ex["label"])


def _builtin(name, prompt, fields, label_words=(), label=_label, answers=None, hub=None, num_dev=500):
    kind = GENERATION if answers else CLASSIFICATION
    metrics = ("f1", "exact_match") if answers else ("accuracy",)
    return Task(name=name, kind=kind, metrics=metrics, prompt=prompt, fields=fields,
                label_words=label_words, label=None if answers else label, answers=answers, hub=hub,
                num_dev=num_dev, data_dir=BUNDLED_DATA / name)


_SUPER_GLUE = "aps/super_glue"  # script-based on the hub: read its parquet export
_PARQUET = "refs/convert/parquet"
BUILTIN = {task.name: task for task in [
    _builtin("sst2", _sst2, ("sentence", "label"), (" terrible", " great"), hub=("nyu-mll/glue", "sst2", None)),
    _builtin("rte", _rte, ("premise", "hypothesis", "label"), ("Yes", "No"), hub=(_SUPER_GLUE, "rte", _PARQUET)),
    _builtin("cb", _cb, ("premise", "hypothesis", "label"), ("Yes", "No", "Maybe"),
             hub=(_SUPER_GLUE, "cb", _PARQUET), num_dev=100),
    _builtin("boolq", _boolq, ("passage", "question", "answer"), ("Yes", "No"),
             label=lambda ex: 0 if _truthy(ex["answer"]) else 1, hub=("google/boolq", None, None)),
    _builtin("wsc", _wsc, ("text", "span1_text", "span2_text", "label"), ("No", "Yes"),
             hub=(_SUPER_GLUE, "wsc.fixed", _PARQUET)),
    _builtin("wic", _wic, ("word", "sentence1", "sentence2", "label"), ("No", "Yes"),
             hub=(_SUPER_GLUE, "wic", _PARQUET)),
    _builtin("squad", _squad, ("title", "context", "question", "answers"),
             answers=lambda ex: _text_list(ex["answers"], "text"), hub=("rajpurkar/squad", None, None)),
    _builtin("drop", _drop, ("passage", "question", "answers_spans"),
             answers=lambda ex: _text_list(ex["answers_spans"], "spans"), hub=("ucinlp/drop", None, None)),
]}
TASK_NAMES = ("demo", *BUILTIN)


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
    """A user's classification task: task.json names the template, label words and metric."""
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
    example = {"name": "my-task", "template": "{text} It was", "label_words": [" terrible", " great"],
               "metric": "accuracy"}
    # A misspelt key (lable_words) ignored in silence would surface later as a confusing "missing field"
    # or not at all; name it, as unknown config keys are named.
    for key in spec:
        if key not in example:
            close = difflib.get_close_matches(key, list(example), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the known fields are {', '.join(example)}"
            raise ValueError(f"{spec_path}: unknown field {key!r}; {hint}")
    for key in example:
        if key not in spec:
            raise ValueError(f"{spec_path}: missing field {key!r}; add it, for example "
                             f"\"{key}\": {json.dumps(example[key])}")
    name, template, label_words, metric = (spec[k] for k in example)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{spec_path}: \"name\" must be a non-empty string")
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
    if not any((path / f"train{ext}").is_file() for ext in (".jsonl", ".csv")):
        raise ValueError(f"{path}: no train.jsonl; a task directory needs one example per line")
    return Task(name=name, kind=CLASSIFICATION, metrics=(metric,),
                prompt=lambda ex: template.format(**{f: ex[f] for f in fields}),
                fields=(*fields, "label"), label_words=tuple(label_words), label=_label, data_dir=path)
