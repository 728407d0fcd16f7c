"""Regenerate the bundled demo task and the two tiny tokenizers, deterministically.

    python tools/make_assets.py

Writes curvzo_ds/tasks/data/demo/ (a synthetic sentiment task) and
curvzo_ds/assets/tokenizer-{llama,opt}/, BPE tokenizers trained on all bundled text.
Running it twice gives the same bytes.
"""

import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import GPT2Tokenizer, LlamaTokenizer  # noqa: E402

from curvzo_ds.tasks import BUILTIN, get_task, read_jsonl  # noqa: E402
from curvzo_ds.tasks.demo import tokenizer_dir  # noqa: E402

DEMO_DIR = ROOT / "curvzo_ds" / "tasks" / "data" / "demo"
SEED = 1234
SIZES = {"train": 2000, "dev": 200, "test": 200}
VOCAB_SIZE = 1024

# Short sentences, four sentiment words per class: kept this simple so that plain MeZO visibly
# trains a randomly initialised demo Llama (lr 5e-4, eps 1e-3, batch 16, seed 0: dev accuracy
# 0.6 at step 500, 0.8 at 750, 0.9 at 1000 when this was written). Longer sentences did not learn.
SUBJECTS = ["the movie", "the film", "the show", "the story", "the acting", "the plot", "the ending",
            "the music", "the cast", "the book", "the meal", "the service", "the hotel", "the game",
            "the concert", "the trip", "the album", "the script"]
VERBS = ["was", "is", "felt", "seemed", "looked", "sounded"]
ADVERBS = ["", "", "really ", "very ", "truly ", "quite ", "so ", "pretty "]
WORDS = [["bad", "awful", "boring", "dull"], ["good", "wonderful", "excellent", "lovely"]]  # label 0, 1


def sentence(rng: random.Random, label: int) -> str:
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(ADVERBS)}{rng.choice(WORDS[label])}."
    return text[0].upper() + text[1:]


def make_demo() -> None:
    rng = random.Random(SEED)
    seen = set()
    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    spec = {"name": "demo", "template": "{sentence} It was", "label_words": [" terrible", " great"],
            "metric": "accuracy"}
    (DEMO_DIR / "task.json").write_text(json.dumps(spec, indent=1) + "\n")
    for split_name, size in SIZES.items():
        lines = []
        while len(lines) < size:
            label = rng.randrange(2)
            text = sentence(rng, label)
            if text not in seen:
                seen.add(text)
                lines.append(json.dumps({"sentence": text, "label": label}) + "\n")
        (DEMO_DIR / f"{split_name}.jsonl").write_text("".join(lines))


def corpus() -> list[str]:
    """Every prompt of every bundled example followed by each of its candidates."""
    texts = []
    for name in ["demo", *BUILTIN]:
        task = get_task(name)
        for path in sorted(task.data_dir.glob("*.jsonl")):
            for _, example in read_jsonl(path):
                texts += [task.prompt(example) + c for c in task.candidates(example)]
    return texts


def train_bpe(texts: list[str], pre_tokenizer, special: list[str], alphabet: list[str]) -> tuple[dict, list]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def make_llama(texts: list[str]) -> None:
    # Newlines are left out of the training text, so that (as in Llama) they fall back to <0x0A>.
    lines = [line for text in texts for line in text.split("\n") if line]
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    vocab, merges = train_bpe(lines, metaspace, ["<unk>", "<s>", "</s>"], [])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    ordered = ["<unk>", "<s>", "</s>", *byte_tokens]
    ordered += [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in ordered]
    tokenizer = LlamaTokenizer(vocab={t: i for i, t in enumerate(ordered)}, merges=merges,
                               add_bos_token=True, add_eos_token=False, pad_token="<unk>")
    save(tokenizer, tokenizer_dir("llama"))


def make_opt(texts: list[str]) -> None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<s>", "<pad>", "</s>", "<unk>"]  # OPT's ids 0..3
    vocab, merges = train_bpe(texts, byte_level, special, pre_tokenizers.ByteLevel.alphabet())
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, bos_token="</s>", eos_token="</s>",
                              unk_token="<unk>", pad_token="<pad>", add_bos_token=True)
    save(tokenizer, tokenizer_dir("opt"))


def save(tokenizer, directory: Path) -> None:
    """save_pretrained, with the demo model's length. The BOS rule lives in tokenizer.json's
    post-processor: transformers 5 does not save add_bos_token."""
    shutil.rmtree(directory, ignore_errors=True)
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved["model_max_length"] = 512
    config_path.write_text(json.dumps(dict(sorted(saved.items())), indent=2) + "\n")
    for path in sorted(directory.iterdir()):
        print(f"  {path.relative_to(ROOT)}  {path.stat().st_size} bytes")


def main() -> None:
    make_demo()
    texts = corpus()
    print(f"demo task written; training tokenizers on {len(texts)} texts")
    make_llama(texts)
    make_opt(texts)


if __name__ == "__main__":
    main()
