"""Tasks: how an example becomes a prompt, its candidate answers and its gold label.

The built-in prompts are MeZO's (princeton-nlp/MeZO, large_models/templates.py and
tasks.py), which the CurvZO paper follows. A classification task scores one
continuation per class after the prompt (its label word), or per choice of the example
(COPA's two choices, ReCoRD's entities: MeZO's candidate scoring); a generation task trains on
" <first answer>\n" after the prompt and is scored on the greedy answer.

A user's task directory (docs/tasks.md) is a classification task (a template and label words), or one of the
kinds whose lines carry their own text: `completion` ({"prompt", "completion"}: the loss covers the completion's
tokens) and `chat` ({"messages": [{"role", "content"}, ...]}, rendered with the tokenizer's chat template: the
loss covers the last assistant turn, or every one with "assistant_turns": "all"). data/encoding.py tokenizes them;
tasks/task_dir.py reads the directory (`load_task_dir`) and resolves a task's name or directory (`get_task`).
"""

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CLASSIFICATION = "classification"
GENERATION = "generation"  # a built-in task that generates its answer after a template (squad, drop)
COMPLETION = "completion"  # a task directory of {"prompt", "completion"} lines
CHAT = "chat"  # a task directory of {"messages": [...]} lines, rendered with the tokenizer's chat template
TEXT_KINDS = (COMPLETION, CHAT)  # the kinds whose lines carry their own text (no template)
TASK_DIR_KINDS = (CLASSIFICATION, COMPLETION, CHAT)
ROLES = ("system", "user", "assistant")
ASSISTANT_TURNS = ("last", "all")
BUNDLED_DATA = Path(__file__).resolve().parent / "data"
# A bundled example task directory of each kind whose lines carry their own text (docs/tasks.md shows them).
EXAMPLES = {COMPLETION: BUNDLED_DATA / "example-completion", CHAT: BUNDLED_DATA / "example-chat"}
TASK_DIR_METRICS = ("accuracy",)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # CLASSIFICATION, GENERATION, COMPLETION or CHAT
    metrics: tuple[str, ...]  # names from docs/contracts.md: accuracy, f1, exact_match
    prompt: Callable[[dict], str]
    fields: tuple[str, ...]  # fields every example must hold
    label_words: tuple[str, ...] = ()  # classification: the continuation of each class
    label: Callable[[dict], int] | None = None  # classification: the gold class index
    answers: Callable[[dict], list[str]] | None = None  # generation: the gold answers
    hub: tuple[str, str | None, str | None] | None = None  # load_dataset(path, name, revision=)
    num_dev: int = 500  # MeZO's dev size (CB, COPA: 100)
    data_dir: Path | None = None  # bundled samples, or the user's task directory
    choices: Callable[[dict], list[str]] | None = None  # classification: the example's own candidates (COPA, ReCoRD)
    accepted: Callable[[dict], list[int]] | None = None  # classification: every candidate counted correct (ReCoRD)
    assistant_turns: str = "last"  # chat: the turns the loss covers, "last" or "all"

    @property
    def is_classification(self) -> bool:
        return self.kind == CLASSIFICATION

    @property
    def has_own_text(self) -> bool:
        """A completion or chat task: its lines carry the text the model sees (no template, no candidates)."""
        return self.kind in TEXT_KINDS

    def candidates(self, example: dict) -> list[str]:
        """Continuations of the prompt: one per class (or choice), or the training target of a generation task (a
        completion or chat task: the gold text itself, which data/encoding.py tokenizes)."""
        if self.is_classification:
            return list(self.choices(example)) if self.choices else list(self.label_words)
        if self.has_own_text:
            return [self.answers(example)[0]]
        return [f" {self.answers(example)[0]}\n"]

    def correct(self, example: dict) -> list[int]:
        """The indices of every candidate that counts as correct (ReCoRD: each entity among the answers; MeZO's
        accuracy); the gold one alone elsewhere."""
        return self.accepted(example) if self.accepted else [self.gold(example)]

    def gold(self, example: dict) -> int:
        """Index of the correct candidate (0 for a generation task: its only candidate)."""
        return self.label(example) if self.is_classification else 0

    def check(self, example: dict, where: str) -> None:
        """Raise a ValueError naming `where` (file and line) if the example cannot be used."""
        if not isinstance(example, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}")
        if self.kind == COMPLETION:
            return _check_completion(example, where)
        if self.kind == CHAT:
            return _check_chat(example, where, self.assistant_turns)
        for field in self.fields:
            if field not in example:
                raise ValueError(f"{where}: missing field {field!r} that task {self.name!r} needs; "
                                 f"add it to every example (fields: {', '.join(self.fields)})")
            if example[field] is None:
                raise ValueError(f"{where}: field {field!r} is null; give it a value (a null would be shown as "
                                 f"'None' in the prompt)")
        try:
            if self.is_classification:
                gold, n = self.label(example), len(self.candidates(example))
                what = "choices" if self.choices else "label words"
                if not 0 <= gold < n:
                    raise ValueError(f"label {gold} is out of range for {n} {what}; use 0..{n - 1}")
            else:
                if not self.answers(example):
                    raise ValueError("no gold answer; give at least one")
            self.prompt(example)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise ValueError(f"{where}: {err}") from None


# ---- the lines of a completion or chat task ----

def _check_completion(example: dict, where: str) -> None:
    for field in ("prompt", "completion"):
        if field not in example:
            raise ValueError(f"{where}: missing field {field!r}; each line of a completion task is "
                             '{"prompt": "...", "completion": "..."}')
        if not isinstance(example[field], str):
            raise ValueError(f"{where}: field {field!r} is {type(example[field]).__name__}, not a string")
    if not example["completion"].strip():
        raise ValueError(f"{where}: the completion is empty; give the text the model should learn to write after "
                         "the prompt")
    if not example["prompt"].strip():
        raise ValueError(f"{where}: the prompt is empty; give the text that the completion follows")


def _check_chat(example: dict, where: str, assistant_turns: str = "last") -> None:
    shape = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
    if "messages" not in example:
        raise ValueError(f"{where}: missing field 'messages'; each line of a chat task is {shape}")
    messages = example["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, "
                         f"as in {shape}")
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {i} must be an object with \"role\" and \"content\", as in {shape}")
        if message["role"] not in ROLES:
            close = difflib.get_close_matches(str(message["role"]), ROLES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: message {i} has role {message['role']!r}, not one of {', '.join(ROLES)}{hint}")
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}: message {i}'s content is {type(message['content']).__name__}, not a string")
    last = messages[-1]
    if last["role"] != "assistant":
        raise ValueError(f"{where}: the conversation ends with a {last['role']} turn; it must end with an assistant "
                         "turn, the reply the model learns to write")
    turns = [i for i, m in enumerate(messages, 1) if m["role"] == "assistant"]
    for i in (turns if assistant_turns == "all" else turns[-1:]):
        if not messages[i - 1]["content"].strip():
            raise ValueError(f"{where}: assistant turn (message {i}) is empty; give the reply the model should learn")


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


def _strings(value, field: str) -> list[str]:
    """A list of strings as the hub stores it, or as a JSON string (a CSV cell)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{field} must be a list of strings, got {value!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field} must be a list of strings, got {value!r}")
    return value


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


def _multirc(ex):  # MultiRCTemplate
    return (f"{ex['paragraph']}\nQuestion: {ex['question']}\nI found this answer \"{ex['answer']}\". Is that correct? "
            "Yes or No?\n")


def _copa(ex):  # CopaTemplate: the premise without its final period, then " so " (effect) or " because " (cause)
    premise = ex["premise"].rstrip()
    if premise.endswith("."):
        premise = premise[:-1]
    conjunction = {"effect": " so ", "cause": " because "}.get(ex["question"])
    if conjunction is None:
        raise ValueError(f"question must be 'cause' or 'effect', got {ex['question']!r}")
    return premise + conjunction


def _copa_choice(choice: str) -> str:  # CopaTemplate's capitalization "correct": the first word in lower case, but "I"
    words = choice.split(" ")
    if words[0] != "I":
        words[0] = words[0].lower()
    return " ".join(words)


def _copa_choices(ex):
    return [_copa_choice(ex["choice1"]), _copa_choice(ex["choice2"])]


def _record(ex):  # ReCoRDTemplateGPT3: the passage's highlights as a list, then the query as one more item
    return ex["passage"].replace("@highlight\n", "- ") + "\n-"


def _record_choices(ex):  # the query with the placeholder filled by each entity, after "-"
    return [" " + ex["query"].replace("@placeholder", entity) for entity in _strings(ex["entities"], "entities")]


def _record_gold(ex):  # MeZO trains on the first answer's entity
    entities, answers = _strings(ex["entities"], "entities"), _strings(ex["answers"], "answers")
    if not answers:
        raise ValueError("answers is empty; give the entity (or entities) that fill the placeholder")
    if answers[0] not in entities:
        raise ValueError(f"answer {answers[0]!r} is not one of the entities {entities}")
    return entities.index(answers[0])


def _record_accepted(ex):  # MeZO's accuracy: the prediction is right when it is any answer's entity
    entities = _strings(ex["entities"], "entities")
    return sorted({entities.index(a) for a in _strings(ex["answers"], "answers") if a in entities})


def _squad(ex):
    return f"Title: {ex['title']}\nContext: {ex['context']}\nQuestion: {ex['question'].strip()}\nAnswer:"


def _drop(ex):
    return f"Passage: {ex['passage']}\nQuestion: {ex['question'].strip()}\nAnswer:"


def label_index(ex):
    """The example's "label" field as a class index (a built-in task's, or a task directory's)."""
    return _index(ex["label"])


def _builtin(name, prompt, fields, label_words=(), label=label_index, answers=None, hub=None, num_dev=500,
             choices=None, accepted=None):
    kind = GENERATION if answers else CLASSIFICATION
    metrics = ("f1", "exact_match") if answers else ("accuracy",)
    return Task(name=name, kind=kind, metrics=metrics, prompt=prompt, fields=fields,
                label_words=label_words, label=None if answers else label, answers=answers, hub=hub,
                num_dev=num_dev, data_dir=BUNDLED_DATA / name, choices=choices, accepted=accepted)


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
    _builtin("multirc", _multirc, ("paragraph", "question", "answer", "label"), ("No", "Yes"),
             hub=(_SUPER_GLUE, "multirc", _PARQUET)),
    _builtin("copa", _copa, ("premise", "choice1", "choice2", "question", "label"), choices=_copa_choices,
             hub=(_SUPER_GLUE, "copa", _PARQUET), num_dev=100),
    _builtin("record", _record, ("passage", "query", "entities", "answers"), label=_record_gold,
             choices=_record_choices, accepted=_record_accepted, hub=(_SUPER_GLUE, "record", _PARQUET)),
    _builtin("squad", _squad, ("title", "context", "question", "answers"),
             answers=lambda ex: _text_list(ex["answers"], "text"), hub=("rajpurkar/squad", None, None)),
    _builtin("drop", _drop, ("passage", "question", "answers_spans"),
             answers=lambda ex: _text_list(ex["answers_spans"], "spans"), hub=("ucinlp/drop", None, None)),
]}
TASK_NAMES = ("demo", *BUILTIN)
