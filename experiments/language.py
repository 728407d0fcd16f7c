"""A small generated language, its word-level tokenizer, a pre-training corpus and three classification tasks.

Sentences: `NP VERB NP [and NP VERB NP] .`, NP = [the | a] [not] [ADJ] NOUN[s]. Structure to learn:
- agreement: a singular subject takes VERB+s, a plural one the bare VERB;
- selection: `eat` takes food, `hold` takes tools, `chase` takes animals (the other verbs take any noun);
- sentiment: positive and negative adjectives, `not` flips the adjective after it.
Tasks (task-directory format, docs/tasks.md): `sentiment` (bad / good), `agreement` (no / yes: is the
sentence well formed?), `topic` (animal / food / tool: the category of the first noun). The corpus also holds
each task's prompt followed by the right answer 80% of the time, so the pre-trained model starts above chance.
"""

from __future__ import annotations

import json
import os
import random

NOUNS = {"animal": ["cat", "dog", "bird", "fish", "horse", "mouse"],
         "food": ["apple", "bread", "cheese", "soup", "rice", "cake"],
         "tool": ["hammer", "knife", "spoon", "saw", "brush", "rope"]}
VERBS = {"eat": "food", "hold": "tool", "chase": "animal", "see": None, "like": None, "find": None}
POSITIVE, NEGATIVE, NEUTRAL = ["good", "nice", "happy", "fresh"], ["bad", "sad", "dirty", "broken"], ["big", "red"]
TEMPLATES = {"sentiment": ("{text} it was", [" bad", " good"]),
             "agreement": ("{text} correct ?", [" no", " yes"]),
             "topic": ("{text} topic :", [" animal", " food", " tool"])}
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
CORPUS_VERSION = 2  # part of the pre-trained model's cache key: bump it when the corpus changes


def vocabulary() -> list[str]:
    words = ["the", "a", "not", "and", "."] + POSITIVE + NEGATIVE + NEUTRAL
    for nouns in NOUNS.values():
        words += nouns + [n + "s" for n in nouns]
    for verb in VERBS:
        words += [verb, verb + "s"]
    for template, labels in TEMPLATES.values():
        words += template.replace("{text}", "").split() + [w.strip() for w in labels]
    words += list(NOUNS)
    return SPECIAL + sorted(set(words))


def noun_phrase(rng: random.Random, category: str | None, plural: bool) -> tuple[list[str], str, int]:
    """(words, category, sentiment) of one noun phrase."""
    category = category or rng.choice(list(NOUNS))
    noun = rng.choice(NOUNS[category]) + ("s" if plural else "")
    words, sentiment = [], 0
    det = rng.choice(["the", "the", "a", ""]) if not plural else rng.choice(["the", ""])
    if det:
        words.append(det)
    if rng.random() < 0.6:
        adj = rng.choice(POSITIVE + NEGATIVE + NEUTRAL)
        sign = 1 if adj in POSITIVE else -1 if adj in NEGATIVE else 0
        if sign and rng.random() < 0.25:
            words.append("not")
            sign = -sign
        words.append(adj)
        sentiment += sign
    return words + [noun], category, sentiment


def clause(rng: random.Random, well_formed: bool = True) -> tuple[list[str], str, int]:
    """(words, subject category, sentiment) of NP VERB NP; `well_formed=False` breaks the agreement."""
    plural = rng.random() < 0.5
    subject, category, s1 = noun_phrase(rng, None, plural)
    verb = rng.choice(list(VERBS))
    verb_form = verb if plural == well_formed else verb + "s"
    obj, _, s2 = noun_phrase(rng, VERBS[verb], rng.random() < 0.5)
    return subject + [verb_form] + obj, category, s1 + s2


def sentence(rng: random.Random, well_formed: bool = True) -> tuple[str, str, int]:
    """(text, category of the first subject, sentiment)."""
    words, category, sentiment = clause(rng, well_formed)
    if rng.random() < 0.3:
        more, _, s = clause(rng, well_formed or rng.random() < 0.5)
        words += ["and"] + more
        sentiment += s
    return " ".join(words + ["."]), category, sentiment


def example(task: str, rng: random.Random) -> dict:
    """One labelled example of `task` ({"text", "label"})."""
    if task == "agreement":
        label = rng.randrange(2)
        text, _, _ = sentence(rng, well_formed=bool(label))
        return {"text": text, "label": label}
    while True:
        text, category, sentiment = sentence(rng)
        if task == "topic":
            return {"text": text, "label": list(NOUNS).index(category)}
        if sentiment:
            return {"text": text, "label": int(sentiment > 0)}


def corpus_line(rng: random.Random, right: float = 0.8) -> str:
    """A pre-training line: a plain sentence, or a task prompt with its answer (right with probability `right`)."""
    if rng.random() < 0.6:
        return sentence(rng)[0]
    task = rng.choice(list(TEMPLATES))
    ex = example(task, rng)
    template, labels = TEMPLATES[task]
    label = ex["label"] if rng.random() < right else rng.randrange(len(labels))
    return template.format(text=ex["text"]) + labels[label]


def write_tokenizer(path: str) -> None:
    """A word-level fast tokenizer (split on spaces, [BOS] in front), saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", vocab["[BOS]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")
    fast.save_pretrained(path)


def write_task(root: str, task: str, seed: int, num_train: int, num_dev: int, num_test: int) -> str:
    """A task directory (task.json, train/dev/test.jsonl); returns its path."""
    rng = random.Random(f"{task}-{seed}")
    template, labels = TEMPLATES[task]
    return write_task_dir(os.path.join(root, task), task, template, labels,
                          {"train": num_train, "dev": num_dev, "test": num_test}, lambda split: example(task, rng))


def write_task_dir(path: str, name: str, template: str, labels: list[str], sizes: dict[str, int], make) -> str:
    """docs/tasks.md's files in `path`: task.json, and `sizes[split]` rows of `make(split)` per split, in order."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "task.json"), "w") as f:
        json.dump({"name": name, "template": template, "label_words": labels, "metric": "accuracy"}, f)
    for split, n in sizes.items():
        with open(os.path.join(path, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                f.write(json.dumps(make(split)) + "\n")
    return path
