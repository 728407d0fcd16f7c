"""Tasks, their prompts, the split rule, task directories and the bundled assets."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.tasks import (
    BUILTIN,
    TASK_NAMES,
    demo_model_config,
    get_task,
    load_splits,
    load_tokenizer,
    tokenizer_dir,
)
from curvzo_ds.tasks.task import BUNDLED_DATA
from tests.helpers import ENV, ROOT


def key(example):
    return json.dumps(example, sort_keys=True)


# ---- built-in tasks ----

@pytest.mark.parametrize("name", TASK_NAMES)
def test_builtin_task_loads_bundled_samples(name):
    task = get_task(name)
    splits = load_splits(task, seed=0, num_train=4, num_dev=2, num_eval=3, data_dir="samples")
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [4, 2, 3]
    for example in splits["train"] + splits["dev"] + splits["test"]:
        prompt = task.prompt(example)
        assert isinstance(prompt, str) and len(prompt) > 10
        if task.is_classification:
            assert task.metrics == ("accuracy",)
            assert 0 <= task.gold(example) < len(task.candidates(example)) >= 2
        else:
            assert task.metrics == ("f1", "exact_match")
            answers = task.answers(example)
            assert answers and all(isinstance(a, str) and a for a in answers)
            assert task.candidates(example) == [f" {answers[0]}\n"]


MEZO_PROMPTS = {  # (example, prompt, label words, gold index), following MeZO's templates.py
    "sst2": ({"sentence": " a fine film . ", "label": 1}, "a fine film . It was", (" terrible", " great"), 1),
    "rte": ({"premise": "P.", "hypothesis": "H", "label": 1},
            'P.\nDoes this mean that "H" is true? Yes or No?\n', ("Yes", "No"), 1),
    "cb": ({"premise": "P.", "hypothesis": "H", "label": 2},
           'Suppose P. Can we infer that "H"? Yes, No, or Maybe?\n', ("Yes", "No", "Maybe"), 2),
    "boolq": ({"passage": "P.", "question": "is it", "answer": False}, "P. Is it?\n", ("Yes", "No"), 1),
    "wsc": ({"text": "T.", "span1_text": "Anna", "span2_text": "She", "label": 1},
            'T.\nIn the previous sentence, does the pronoun "she" refer to Anna? Yes or No?\n', ("No", "Yes"), 1),
    "wic": ({"word": "w", "sentence1": "A.", "sentence2": "B.", "label": 0},
            'Does the word "w" have the same meaning in these two sentences? Yes, No?\nA.\nB.\n', ("No", "Yes"), 0),
}


@pytest.mark.parametrize("name", sorted(MEZO_PROMPTS))
def test_classification_prompts_follow_mezo(name):
    example, prompt, words, gold = MEZO_PROMPTS[name]
    task = get_task(name)
    assert task.prompt(example) == prompt
    assert task.candidates(example) == list(words)
    assert task.gold(example) == gold


def test_generation_prompts_follow_mezo():
    squad = {"title": "T", "context": "C.", "question": " Q? ", "answers": {"text": ["a", "b"], "answer_start": [0, 1]}}
    assert get_task("squad").prompt(squad) == "Title: T\nContext: C.\nQuestion: Q?\nAnswer:"
    assert get_task("squad").answers(squad) == ["a", "b"]
    drop = {"passage": "P.", "question": "Q?", "answers_spans": {"spans": ["3"], "types": ["number"]}}
    assert get_task("drop").prompt(drop) == "Passage: P.\nQuestion: Q?\nAnswer:"
    assert get_task("drop").candidates(drop) == [" 3\n"]


def test_cb_default_dev_is_100_and_others_500(tmp_path):
    assert get_task("cb").num_dev == get_task("copa").num_dev == 100  # MeZO's mezo.sh: DEV=100 for CB and Copa
    assert all(t.num_dev == 500 for n, t in BUILTIN.items() if n not in ("cb", "copa"))
    rows = [{"premise": f"p{i}.", "hypothesis": f"h{i}", "label": i % 3} for i in range(250)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:56]))
    splits = load_splits("cb", seed=1, num_train=32, data_dir=tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [32, 100, 56]
    # The CLI's defaults (num_train 1000, num_dev None) give MeZO's CB split: 100 dev, the other 150 to train.
    cfg = TrainConfig(task="cb", data_dir=str(tmp_path))
    splits = load_splits("cb", cfg.seed, cfg.num_train, cfg.num_dev, cfg.num_eval, cfg.data_dir)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [150, 100, 56]


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="neither a built-in task"):
        get_task("nope")
    with pytest.raises(ValueError, match="lower case: 'sst2'"):
        get_task("SST2")


# ---- the split rule ----

def write_sst2(directory, n_train, n_validation=0):
    rows = [{"sentence": f"sentence {i} .", "label": i % 2, "idx": i} for i in range(n_train)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if n_validation:
        rows = [{"sentence": f"held out {i} .", "label": i % 2, "idx": i} for i in range(n_validation)]
        (directory / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sampling_is_mezos_rule_deterministic_and_disjoint(tmp_path):
    write_sst2(tmp_path, 1000, 300)
    splits = load_splits("sst2", seed=7, num_train=64, num_dev=None, num_eval=100, data_dir=tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [64, 500, 100]
    # MeZO: permute train with the seed; train first, dev next. Test: permuted validation, first num_eval.
    order = np.random.RandomState(7).permutation(1000)
    assert [ex["idx"] for ex in splits["train"]] == order[:64].tolist()
    assert [ex["idx"] for ex in splits["dev"]] == order[64:564].tolist()
    assert [ex["idx"] for ex in splits["test"]] == np.random.RandomState(7).permutation(300)[:100].tolist()
    again = load_splits("sst2", seed=7, num_train=64, num_dev=None, num_eval=100, data_dir=tmp_path)
    assert again == splits
    other = load_splits("sst2", seed=8, num_train=64, num_dev=None, num_eval=100, data_dir=tmp_path)
    assert {key(e) for e in other["train"]} != {key(e) for e in splits["train"]}
    assert not {key(e) for e in splits["train"]} & {key(e) for e in splits["dev"]}


def test_num_eval_none_takes_whole_validation_in_order(tmp_path):
    write_sst2(tmp_path, 50, 20)
    splits = load_splits("sst2", seed=3, num_train=10, num_dev=5, num_eval=None, data_dir=tmp_path)
    assert [ex["idx"] for ex in splits["test"]] == list(range(20))


def test_small_train_pool_is_cut_without_overlap(tmp_path, caplog):
    caplog.set_level("INFO", logger="curvzo_ds")
    write_sst2(tmp_path, 20, 5)
    splits = load_splits("sst2", seed=0, num_train=1000, num_dev=500, data_dir=tmp_path)
    assert len(splits["dev"]) == 4 and len(splits["train"]) == 16  # dev would take all: cut to a fifth
    assert not {key(e) for e in splits["train"]} & {key(e) for e in splits["dev"]}
    splits = load_splits("sst2", seed=0, num_train=1000, num_dev=15, data_dir=tmp_path)
    assert len(splits["dev"]) == 15 and len(splits["train"]) == 5  # dev kept whole, train takes the rest
    assert not {key(e) for e in splits["train"]} & {key(e) for e in splits["dev"]}
    # The log says it in words, not as Python dicts such as {'dev': 500} or {}
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "drawing 4 for dev" in text and "15 for dev held out" in text and "{" not in text, text


def test_csv_data_dir(tmp_path):
    (tmp_path / "train.csv").write_text('sentence,label\n"good , fun .",1\n"bad .",0\n"dull .",0\n"fine .",1\n'
                                        '"great .",1\n"poor .",0\n')
    splits = load_splits("sst2", seed=0, num_train=2, num_dev=1, num_eval=1, data_dir=tmp_path)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [2, 1, 1]
    example = splits["train"][0]
    assert get_task("sst2").gold(example) == int(example["label"])


def test_hub_failure_names_the_three_ways_out(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="Three ways out: fill the cache .* data_dir=DIR .* data_dir=samples"):
        load_splits("rte", seed=0, num_train=4)  # the default source of a built-in task is the hub


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_builtin_task_reads_its_hub_dataset_by_default(tmp_path):
    """The hub path for real: `datasets.load_dataset` on the task's dataset (here a local dataset directory in
    the hub's layout, since this machine has no hub), its validation split as the test pool."""
    import dataclasses

    rows = [{"sentence": f"s{i} .", "label": i % 2, "idx": i} for i in range(40)]
    _jsonl(tmp_path / "train.jsonl", rows[:30])
    _jsonl(tmp_path / "validation.jsonl", rows[30:])
    task = dataclasses.replace(get_task("sst2"), hub=(str(tmp_path), None, None))
    splits = load_splits(task, seed=0, num_train=20, num_dev=5, num_eval=None)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [20, 5, 10]
    assert {e["sentence"] for e in splits["test"]} == {f"s{i} ." for i in range(30, 40)}
    samples = load_splits(task, seed=0, num_train=4, num_dev=2, num_eval=2, data_dir="samples")
    assert not {e["sentence"] for e in samples["train"]} & {r["sentence"] for r in rows}


def test_a_datasets_save_to_disk_directory(tmp_path):
    import datasets

    rows = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 2, "idx": i} for i in range(30)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:20]),
                          "validation": datasets.Dataset.from_list(rows[20:])}).save_to_disk(str(tmp_path / "rte"))
    splits = load_splits("rte", seed=1, num_train=10, num_dev=4, num_eval=None, data_dir=tmp_path / "rte")
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [10, 4, 10]
    assert {e["premise"] for e in splits["test"]} == {f"p{i}" for i in range(20, 30)}


@pytest.mark.slow
def test_offline_without_a_cache_is_one_line_with_exit_2(tmp_path):
    """The real CLI, the real hub id, HF_DATASETS_OFFLINE=1 and an empty cache: one line, the three ways out."""
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "curvzo_ds.cli", "train", "--set", "task=sst2", "--set",
                           f"output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("curvzo-ds train: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "nyu-mll/glue" in errors[0] and "data_dir=samples" in errors[0], errors


# ---- task directories ----

def make_task_dir(path, spec=None, train=None, dev=None):
    spec = spec or {"name": "mine", "template": "{text} It was", "label_words": [" bad", " good"],
                    "metric": "accuracy"}
    path.mkdir(exist_ok=True)
    (path / "task.json").write_text(json.dumps(spec))
    train = train if train is not None else [json.dumps({"text": f"t{i}", "label": i % 2}) for i in range(40)]
    (path / "train.jsonl").write_text("\n".join(train) + "\n")
    if dev is not None:
        (path / "dev.jsonl").write_text("\n".join(dev) + "\n")
    return path


def test_task_dir_missing_splits_come_from_train(tmp_path):
    task = get_task(str(make_task_dir(tmp_path / "t")))
    assert (task.name, task.kind, task.metrics) == ("mine", "classification", ("accuracy",))
    assert task.prompt({"text": "x", "label": 0}) == "x It was"
    splits = load_splits(task, seed=0, num_train=10, num_dev=5, num_eval=6)
    sets = [{key(e) for e in splits[s]} for s in ("train", "dev", "test")]
    assert [len(s) for s in sets] == [10, 5, 6]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])


def test_task_dir_with_dev_file(tmp_path):
    dev = [json.dumps({"text": f"d{i}", "label": 1}) for i in range(7)]
    splits = load_splits(str(make_task_dir(tmp_path / "t", dev=dev)), seed=0, num_train=10, num_dev=3)
    assert {e["text"] for e in splits["dev"]} <= {f"d{i}" for i in range(7)} and len(splits["dev"]) == 3


def test_demo_is_a_bundled_task_dir():
    task = get_task("demo")
    assert task.label_words == (" terrible", " great") and task.prompt({"sentence": "Fun."}) == "Fun. It was"
    splits = load_splits(task, seed=0)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [2000, 200, 200]
    sets = [{e["sentence"] for e in splits[s]} for s in ("train", "dev", "test")]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert 0.4 < np.mean([e["label"] for e in splits["train"]]) < 0.6
    assert sum(p.stat().st_size for p in (BUNDLED_DATA / "demo").iterdir()) < 300_000


@pytest.mark.parametrize("spec_change, message", [
    ({"label_words": None}, "missing field 'label_words'"),
    ({"metric": "f1"}, "metric 'f1' is not supported"),
    ({"template": "no fields"}, "must name example fields"),
    ({"label_words": [" one"]}, "at least two"),
    ({"lable_words": [" bad", " good"]}, "unknown field 'lable_words'; did you mean 'label_words'"),
    ({"colour": "red"}, "unknown field 'colour'; the known fields are name, template"),
])
def test_task_json_errors(tmp_path, spec_change, message):
    spec = {"name": "mine", "template": "{text} It was", "label_words": [" bad", " good"], "metric": "accuracy"}
    spec.update(spec_change)
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        get_task(str(make_task_dir(tmp_path / "t", spec=spec)))


@pytest.mark.parametrize("bad_line, message", [
    ('{"txt": "a", "label": 0}', r"train.jsonl line 2: missing field 'text'"),
    ('{"text": "a", "label": 2}', r"train.jsonl line 2: label 2 is out of range for 2 label words; use 0..1"),
    ('{"text": "a", "label": "yes"}', r"train.jsonl line 2: label must be a non-negative integer"),
    ('{"text": "a", "label": 0', r"train.jsonl line 2: not valid JSON"),
])
def test_task_dir_line_errors(tmp_path, bad_line, message):
    train = ['{"text": "ok", "label": 1}', bad_line, '{"text": "ok", "label": 0}']
    task = get_task(str(make_task_dir(tmp_path / "t", train=train)))
    with pytest.raises(ValueError, match=message):
        load_splits(task, seed=0, num_train=1)


def test_task_dir_without_task_json(tmp_path):
    with pytest.raises(ValueError, match="no task.json"):
        get_task(str(tmp_path))


# ---- the bundled tokenizers and model configs ----

def test_tokenizers_bos_rules_differ():
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(str(tokenizer_dir("llama")))
    opt = AutoTokenizer.from_pretrained(str(tokenizer_dir("opt")))
    assert (llama.bos_token, llama.eos_token, llama.unk_token, llama.pad_token) == ("<s>", "</s>", "<unk>", "<unk>")
    assert (opt.bos_token, opt.eos_token, opt.pad_token) == ("</s>", "</s>", "<pad>")
    ids = llama.encode("It was great")
    assert ids[0] == llama.convert_tokens_to_ids("<s>") and llama.eos_token_id not in ids
    ids = opt.encode("It was great")
    assert ids[0] == opt.convert_tokens_to_ids("</s>") == opt.eos_token_id and ids.count(opt.eos_token_id) == 1
    for tokenizer in (llama, opt):
        assert 1000 <= len(tokenizer) <= 2000
        assert tokenizer.decode(tokenizer.encode("Is it?\nYes"), skip_special_tokens=True) == "Is it?\nYes"


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_demo_model_config(kind):
    from transformers import AutoModelForCausalLM

    config = demo_model_config(kind)
    tokenizer = load_tokenizer(kind)
    assert config.vocab_size == len(tokenizer) and config.pad_token_id == tokenizer.pad_token_id
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    logits = model(input_ids=torch.tensor([tokenizer.encode("It was")])).logits
    assert logits.shape[-1] == len(tokenizer)
    if kind == "opt":
        assert config.dropout == 0.1  # so that the engine's eval-mode forcing is observable
    assert demo_model_config(kind, vocab_size=2048).vocab_size == 2048
    with pytest.raises(ValueError, match="not one of llama, opt"):
        tokenizer_dir("gpt")


# ---- MeZO's remaining tasks (issue 48 §2): MultiRC, COPA, ReCoRD ----

def test_multirc_copa_record_prompts_follow_mezo():
    """princeton-nlp/MeZO large_models/templates.py: MultiRCTemplate, CopaTemplate (capitalization "correct"),
    ReCoRDTemplateGPT3; tasks.py: COPA's candidates are its two choices, ReCoRD's its entities (the answers' indices
    all count as right; training takes the first answer's)."""
    multirc = {"paragraph": "P.", "question": "Q?", "answer": "A", "label": 1}
    assert get_task("multirc").prompt(multirc) == ('P.\nQuestion: Q?\nI found this answer "A". Is that correct? '
                                                   'Yes or No?\n')
    assert get_task("multirc").candidates(multirc) == ["No", "Yes"] and get_task("multirc").gold(multirc) == 1
    copa = get_task("copa")
    effect = {"premise": "The glass fell.", "choice1": "It broke.", "choice2": "I laughed.", "question": "effect",
              "label": 1}
    assert copa.prompt(effect) == "The glass fell so " and copa.candidates(effect) == ["it broke.", "I laughed."]
    assert copa.prompt({**effect, "question": "cause"}) == "The glass fell because " and copa.gold(effect) == 1
    record = get_task("record")
    example = {"passage": "Text.\n@highlight\nOne\n@highlight\nTwo", "query": "@placeholder won.",
               "entities": ["Ann", "Bo", "Ann Lee"], "answers": ["Ann Lee", "Ann"]}
    assert record.prompt(example) == "Text.\n- One\n- Two\n-"
    assert record.candidates(example) == [" Ann won.", " Bo won.", " Ann Lee won."]
    assert record.gold(example) == 2 and record.correct(example) == [0, 2]
    with pytest.raises(ValueError, match="answer 'Cy' is not one of the entities"):
        record.check({**example, "answers": ["Cy"]}, "x")
    with pytest.raises(ValueError, match="question must be 'cause' or 'effect'"):
        copa.check({**effect, "question": "why"}, "x")
    assert [BUILTIN[n].hub for n in ("multirc", "copa", "record")] == [
        ("aps/super_glue", n, "refs/convert/parquet") for n in ("multirc", "copa", "record")]


# ---- a user's own generation data (issue 48 §1): completion and chat task directories ----

def test_the_bundled_completion_and_chat_examples_load():
    from curvzo_ds.tasks.task import EXAMPLES

    for kind, path in EXAMPLES.items():
        task = get_task(str(path))
        assert (task.kind, task.metrics, task.has_own_text) == (kind, ("f1", "exact_match"), True)
        assert sorted(json.loads((path / "task.json").read_text())) == ["kind", "name"]  # all a task.json needs
        splits = load_splits(task, seed=0, num_train=None, num_dev=None, num_eval=None)
        assert all(len(splits[s]) >= 6 for s in ("train", "dev", "test"))
        example = splits["dev"][0]
        gold = example["completion"] if kind == "completion" else example["messages"][-1]["content"]
        assert task.answers(example) == [gold] and example["_where"].startswith(f"{path}/dev.jsonl line ")


def write_text_task(path, kind, lines, **spec):
    path.mkdir(exist_ok=True)
    (path / "task.json").write_text(json.dumps({"name": "mine", "kind": kind, **spec}))
    (path / "train.jsonl").write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
GOOD_COMPLETION = {"prompt": "2 + 2 =", "completion": " four"}


@pytest.mark.parametrize("kind, bad_line, message", [
    ("completion", {"prompt": "2 + 2 ="}, "train.jsonl line 2: missing field 'completion'"),
    ("completion", {"completion": " four"}, "train.jsonl line 2: missing field 'prompt'"),
    ("completion", {"prompt": "2 + 2 =", "completion": " "}, "train.jsonl line 2: the completion is empty"),
    ("completion", {"prompt": "", "completion": " four"}, "train.jsonl line 2: the prompt is empty"),
    ("completion", {"prompt": 4, "completion": " four"}, "train.jsonl line 2: field 'prompt' is int, not a string"),
    ("chat", {"turns": []}, "train.jsonl line 2: missing field 'messages'"),
    ("chat", {"messages": []}, "train.jsonl line 2: field 'messages' must be a non-empty list"),
    ("chat", {"messages": [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
     "train.jsonl line 2: message 1 has role 'human', not one of system, user, assistant"),
    ("chat", {"messages": [{"role": "usr", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
     "did you mean 'user'"),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}]},
     "train.jsonl line 2: the conversation ends with a user turn; it must end with an assistant turn"),
    ("chat", {"messages": [{"role": "user", "text": "Hi"}, {"role": "assistant", "content": "Hello."}]},
     "train.jsonl line 2: message 1 must be an object with \"role\" and \"content\""),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
     r"train.jsonl line 2: assistant turn \(message 2\) is empty"),
])
def test_text_task_line_errors_name_the_file_and_line(tmp_path, kind, bad_line, message):
    good = GOOD_COMPLETION if kind == "completion" else GOOD_CHAT
    task = get_task(str(write_text_task(tmp_path / "t", kind, [good, bad_line, good])))
    with pytest.raises(ValueError, match=message):
        load_splits(task, seed=0, num_train=1)


def test_every_assistant_turn_is_checked_when_the_loss_covers_them_all(tmp_path):
    line = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "},
                         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    assert load_splits(str(write_text_task(tmp_path / "last", "chat", [line] * 3)), seed=0, num_train=1)
    task = get_task(str(write_text_task(tmp_path / "all", "chat", [line] * 3, assistant_turns="all")))
    assert task.assistant_turns == "all"
    with pytest.raises(ValueError, match=r"line 1: assistant turn \(message 2\) is empty"):
        load_splits(task, seed=0, num_train=1)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "compleition"}, "kind 'compleition' is not one of classification, completion, chat "
                              r"\(did you mean 'completion'\?\)"),
    ({"kind": "completion", "template": "{text}"}, "unknown field 'template'; the known fields of a completion task "
                                                  "are name, kind"),
    ({"kind": "chat", "assistant_turn": "all"}, "unknown field 'assistant_turn'; did you mean 'assistant_turns'"),
    ({"kind": "chat", "assistant_turns": "first"}, "\"assistant_turns\" is 'first', not one of 'last', 'all'"),
    ({"kind": "completion", "name": ""}, "\"name\" must be a non-empty string"),
])
def test_text_task_json_errors(tmp_path, spec, message):
    path = tmp_path / "t"
    path.mkdir()
    (path / "task.json").write_text(json.dumps({"name": "mine", **spec}))
    (path / "train.jsonl").write_text(json.dumps(GOOD_COMPLETION) + "\n")
    with pytest.raises(ValueError, match=message):
        get_task(str(path))


def test_a_classification_task_json_may_name_its_kind(tmp_path):
    spec = {"name": "mine", "kind": "classification", "template": "{text} It was", "label_words": [" a", " b"],
            "metric": "accuracy"}
    assert get_task(str(make_task_dir(tmp_path / "t", spec=spec))).kind == "classification"


# ---- the one tokenizer loader ----

def test_one_tokenizer_loader_for_kinds_demo_models_sections_and_directories(tmp_path):
    from curvzo_ds import models
    from curvzo_ds.config.sections import section
    from curvzo_ds.errors import ConfigError
    from curvzo_ds.tasks import demo

    assert models.load_tokenizer is load_tokenizer is demo.load_tokenizer  # one function, importable from each
    ids = load_tokenizer("llama").encode("It was")
    assert load_tokenizer("demo").encode("It was") == ids
    assert load_tokenizer(section(TrainConfig(), "model")).encode("It was") == ids
    assert load_tokenizer(section(TrainConfig(model="demo-opt"), "model")).encode("It was") == \
        load_tokenizer("opt").encode("It was")
    load_tokenizer("opt").save_pretrained(str(tmp_path / "tok"))
    from_dir = load_tokenizer(section(TrainConfig(tokenizer=str(tmp_path / "tok")), "model"))
    assert from_dir.encode("It was") == load_tokenizer("opt").encode("It was") and from_dir.pad_token_id is not None
    with pytest.raises(ConfigError, match="tokenizer='/no/such/dir': no such directory"):
        load_tokenizer("/no/such/dir")
