"""A completion task on which objective=f1 moves: the gold completion of each prompt is the first words of the demo
model's own greedy answer at its initial weights (the run's seed), so the F1 of a step's answers starts between 0 and
1 and changes when a perturbation changes an answer. On SQuAD's samples the random demo model's F1 is 0 at every
step and point, so a step's L+ and L- are equal and nothing moves: a test there could not fail for F1.
"""

import json
import pathlib

from curvzo_ds.tasks.task import EXAMPLES

PROMPTS = [json.loads(line)["prompt"] for split in ("train", "dev", "test")
           for line in (EXAMPLES["completion"] / f"{split}.jsonl").read_text().splitlines()]
SIZES = {"train": 12, "dev": 2, "test": 2}


def own_answers_task(directory: pathlib.Path, seed: int = 42, max_new_tokens: int = 8, keep_words: int = 1
                     ) -> pathlib.Path:
    """Write the task directory (task.json and SIZES examples per split, from the bundled completion prompts) whose
    completions are the first `keep_words` words of the demo model's greedy answers (at `seed`'s initial weights,
    `max_new_tokens` new tokens, as objective=f1 generates them); return it."""
    from curvzo_ds import data as D
    from curvzo_ds.config.resolve import resolve
    from curvzo_ds.config.schema import TrainConfig
    from curvzo_ds.config.sections import section
    from curvzo_ds.models import build_model
    from curvzo_ds.tasks import load_tokenizer

    cfg = resolve(TrainConfig(seed=seed, report_to="none"))
    model, _ = build_model(section(cfg, "model"), cfg.seed, {})
    tokenizer = load_tokenizer(section(cfg, "model"))
    prompts = PROMPTS[:sum(SIZES.values())]
    answers = D.generate_answers(model, tokenizer, [tokenizer.encode(p) for p in prompts], max_new_tokens,
                                 stop_at_newline=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "task.json").write_text(json.dumps({"name": "own-answers", "kind": "completion"}))
    at = 0
    for split, n in SIZES.items():
        rows = [{"prompt": p, "completion": " " + " ".join(a.split()[:keep_words])}
                for p, a in zip(prompts[at:at + n], answers[at:at + n])]
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        at += n
    return directory
