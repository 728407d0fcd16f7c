"""Encoding (label spans, BOS, truncation), collation, the two losses, evaluation and metrics."""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.config.sections import section
from curvzo_ds.data import (
    accuracy,
    classification_eval,
    classification_loss,
    collate,
    encode,
    exact_match,
    f1,
    generate_answers,
    lm_loss,
    loss_fn_for,
    newline_ids,
    predict_classification,
)
from curvzo_ds.tasks import TASK_NAMES, Task, demo_model_config, get_task, load_splits, load_tokenizer

KINDS = ["llama", "opt"]
BOS = {"llama": "<s>", "opt": "</s>"}


@pytest.fixture(scope="module", params=KINDS)
def tokenizer(request):
    tok = load_tokenizer(request.param)
    tok.kind = request.param
    return tok


def tiny_model(kind):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(demo_model_config(kind)).eval()


# ---- encode ----

@pytest.mark.parametrize("name", TASK_NAMES)
def test_label_span_decodes_to_the_label_word(tokenizer, name):
    task = get_task(name)
    bos = tokenizer.convert_tokens_to_ids(BOS[tokenizer.kind])
    for example in load_splits(task, seed=0, num_train=6, num_dev=1, num_eval=2, data_dir="samples")["train"]:
        enc = encode(task, tokenizer, example, max_length=512)
        candidates = task.candidates(example)
        assert len(enc["input_ids"]) == len(candidates) and enc["label"] == task.gold(example)
        for ids, option_len, candidate in zip(enc["input_ids"], enc["option_len"], candidates):
            assert ids[0] == bos and ids.count(bos) == 1
            assert tokenizer.decode(ids[-option_len:]).strip() == candidate.strip()
            prompt = tokenizer.decode(ids[:-option_len], skip_special_tokens=True)
            assert prompt.strip() == task.prompt(example).strip()
        if not task.is_classification:
            assert enc["prompt_ids"] == tokenizer.encode(task.prompt(example))
            assert enc["answers"] == task.answers(example)


def test_label_span_survives_a_merge_across_the_boundary(tokenizer):
    # "The film was gr" + "eat": the tokenizer merges "gr"+"eat" into one token " great", so
    # MeZO's len(prompt+answer) - len(prompt) is -1 here; the span must still be that token.
    prompt = "The film was gr"
    assert len(tokenizer.encode(prompt + "eat")) < len(tokenizer.encode(prompt))
    task = Task(name="merge", kind="classification", metrics=("accuracy",), prompt=lambda ex: prompt,
                fields=(), label_words=("eat", "ass"), label=lambda ex: 0)
    enc = encode(task, tokenizer, {}, max_length=64)
    spans = [tokenizer.decode(ids[-n:]) for ids, n in zip(enc["input_ids"], enc["option_len"])]
    assert spans[0].strip() == "great"  # the merged token, which holds all of the answer
    assert spans[1].endswith("ass")
    for ids, option_len in zip(enc["input_ids"], enc["option_len"]):
        assert ids[:-option_len] == tokenizer.encode(prompt)[:len(ids) - option_len]  # the rest is prompt


def test_left_truncation_keeps_bos_and_answer(tokenizer):
    task = get_task("squad")
    example = load_splits(task, seed=0, num_train=1, num_dev=1, num_eval=1, data_dir="samples")["train"][0]
    full = encode(task, tokenizer, example, max_length=512)
    cut = encode(task, tokenizer, example, max_length=20, max_new_tokens=8)
    ids, full_ids = cut["input_ids"][0], full["input_ids"][0]
    assert len(full_ids) > 20 and len(ids) == 20
    assert ids[0] == full_ids[0] == tokenizer.convert_tokens_to_ids(BOS[tokenizer.kind])
    assert ids[1:] == full_ids[-19:] and cut["option_len"] == full["option_len"]
    assert len(cut["prompt_ids"]) == 12 and cut["prompt_ids"][1:] == full["prompt_ids"][-11:]


def test_train_as_lm_keeps_only_the_gold_row(tokenizer):
    task = get_task("cb")
    example = {"premise": "It rained.", "hypothesis": "it rained", "label": 2}
    enc = encode(task, tokenizer, example, max_length=128, train_as_classification=False)
    assert enc["label"] == 0 and len(enc["input_ids"]) == 1
    assert tokenizer.decode(enc["input_ids"][0][-enc["option_len"][0]:]).strip() == "Maybe"


# ---- collate ----

def test_collate_pads_to_this_micro_batch_only():
    encoded = [
        {"input_ids": [[1, 5, 6, 7], [1, 5, 6, 8, 9]], "option_len": [1, 2], "label": 1},
        {"input_ids": [[1, 4], [1, 3]], "option_len": [1, 1], "label": 0},
        {"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]], "option_len": [1, 1], "label": 0},
    ]
    batch = collate(encoded[:2], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 0], [1, 5, 6, 8, 9], [1, 4, 0, 0, 0], [1, 3, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1] * 5, [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["label_mask"].tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert batch["label_mask"].dtype == torch.float32
    assert batch["row_example"].tolist() == [0, 0, 1, 1] and batch["row_candidate"].tolist() == [0, 1, 0, 1]
    assert batch["labels"].tolist() == [1, 0] and batch["num_examples"] == 2
    assert collate(encoded, pad_id=0)["input_ids"].shape == (6, 8)  # a longer example widens only its batch
    assert collate(encoded[1:2], pad_id=0)["input_ids"].shape == (2, 2)


# ---- losses: hand-computed on a model whose log-probabilities are known ----

class FixedModel(torch.nn.Module):
    """p(token v) = (v + 1) / 10 for v in 0..3 at every position, whatever the input."""

    def forward(self, input_ids, attention_mask):
        logits = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0])).expand(*input_ids.shape, 4)
        return SimpleNamespace(logits=logits)


HAND_BATCH = [  # token ids double as vocabulary indices of FixedModel
    {"input_ids": [[0, 1, 3], [0, 1, 0, 1]], "option_len": [1, 2], "label": 0},
    {"input_ids": [[0, 2], [0, 3], [0, 1]], "option_len": [1, 1, 1], "label": 2},
]


def test_classification_loss_hand_computed():
    batch = collate(HAND_BATCH, pad_id=2)
    # example 0: candidate scores are MEAN log-probs of label tokens (MeZO normalises by length)
    a, b = math.log(0.4), (math.log(0.1) + math.log(0.2)) / 2
    ce0 = math.log(math.exp(a) + math.exp(b)) - a
    s = [math.log(0.3), math.log(0.4), math.log(0.2)]
    ce1 = math.log(sum(math.exp(x) for x in s)) - s[2]
    loss_sum, count = classification_loss(FixedModel(), batch)
    assert count.item() == 2
    assert loss_sum.item() == pytest.approx(ce0 + ce1, rel=1e-6)  # float32 log-softmax
    assert predict_classification(FixedModel(), batch).tolist() == [0, 1]
    loss_sum2, count2, predictions = classification_eval(FixedModel(), batch)
    assert (loss_sum2.item(), count2.item(), predictions.tolist()) == (loss_sum.item(), 2, [0, 1])


def test_lm_loss_hand_computed():
    batch = collate(HAND_BATCH, pad_id=2)
    loss_sum, count = lm_loss(FixedModel(), batch)  # gold rows only: [.., 3] and [.., 1]
    assert count.item() == 2
    assert loss_sum.item() == pytest.approx(-(math.log(0.4) + math.log(0.2)), rel=1e-6)
    assert loss_fn_for(get_task("sst2")) is classification_loss
    assert loss_fn_for(get_task("sst2"), data_keys(train_as_classification=False)) is lm_loss
    assert loss_fn_for(get_task("squad")) is lm_loss


# ---- losses on the tiny models, against a per-row unpadded reference ----

def reference_row_logprobs(model, ids, option_len):
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return [logprobs[t - 1, ids[t]].item() for t in range(len(ids) - option_len, len(ids))]


@pytest.mark.parametrize("kind", KINDS)
def test_losses_match_unpadded_reference(kind):
    tokenizer, model = load_tokenizer(kind), tiny_model(kind)
    task = get_task("cb")
    examples = load_splits(task, seed=0, num_train=3, num_dev=1, num_eval=1, data_dir="samples")["train"]
    encoded = [encode(task, tokenizer, ex, max_length=128) for ex in examples]
    batch = collate(encoded, tokenizer.pad_token_id)
    assert (batch["attention_mask"] == 0).any()  # padding is present and must not matter
    expected_ce = expected_nll = n_tokens = 0.0
    for enc in encoded:
        scores = []
        for c, (ids, option_len) in enumerate(zip(enc["input_ids"], enc["option_len"])):
            token_lp = reference_row_logprobs(model, ids, option_len)
            scores.append(sum(token_lp) / len(token_lp))
            if c == enc["label"]:
                expected_nll -= sum(token_lp)
                n_tokens += len(token_lp)
        expected_ce += math.log(sum(math.exp(s) for s in scores)) - scores[enc["label"]]
    with torch.no_grad():
        loss_sum, count = classification_loss(model, batch)
        nll_sum, token_count = lm_loss(model, batch)
    # fp32 forward: relative error of a few 1e-7 per logit; 1e-5 leaves a wide margin
    assert count.item() == 3 and loss_sum.item() == pytest.approx(expected_ce, rel=1e-5)
    assert token_count.item() == n_tokens and nll_sum.item() == pytest.approx(expected_nll, rel=1e-5)
    gold_only = collate([encode(task, tokenizer, ex, 128, train_as_classification=False) for ex in examples],
                        tokenizer.pad_token_id)
    with torch.no_grad():
        gold_sum, gold_count = lm_loss(model, gold_only)
    assert gold_count.item() == n_tokens and gold_sum.item() == pytest.approx(expected_nll, rel=1e-5)


# ---- generation ----

def test_newline_tokens_found(tokenizer):
    ids = newline_ids(tokenizer)
    expected = "<0x0A>" if tokenizer.kind == "llama" else "Ċ"
    assert tokenizer.convert_tokens_to_ids(expected) in ids
    assert all("\n" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_answers_is_greedy_and_cut_at_newline(kind):
    tokenizer, model = load_tokenizer(kind), tiny_model(kind)
    task = get_task("squad")
    examples = load_splits(task, seed=0, num_train=2, num_dev=1, num_eval=1, data_dir="samples")["train"]
    prompts = [encode(task, tokenizer, ex, max_length=128, max_new_tokens=6)["prompt_ids"] for ex in examples]
    stops = set(newline_ids(tokenizer)) | {tokenizer.eos_token_id}
    expected = []
    with torch.no_grad():
        for ids in prompts:  # greedy decoding by hand, no cache
            ids = list(ids)
            for _ in range(6):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] in stops:
                    break
            text = tokenizer.decode(ids[len(prompts[len(expected)]):], skip_special_tokens=True)
            expected.append(text.split("\n")[0].strip())
    engine = SimpleNamespace(module=model)  # a DeepSpeed engine exposes the model as .module
    assert generate_answers(engine, tokenizer, prompts, max_new_tokens=6) == expected
    assert all("\n" not in answer for answer in expected)


# ---- metrics ----

def test_squad_metrics_on_known_pairs():
    assert f1("the Eiffel Tower", ["Eiffel Tower in Paris"]) == pytest.approx(2 / 3)  # P=1, R=1/2
    assert f1("Paris", ["London", "in Paris"]) == pytest.approx(2 / 3)  # best gold: P=1, R=1/2
    assert f1("red", ["blue"]) == 0.0
    assert exact_match("The Cat!", ["cat"]) == 1.0
    assert exact_match("a cat", ["dog", "the  cat."]) == 1.0
    assert exact_match("cats", ["cat"]) == 0.0
    assert accuracy([1, 0, 2, 2], [1, 1, 2, 0]) == 0.5
    with pytest.raises(ValueError):
        accuracy([1], [1, 0])


def test_logits_only_at_label_positions_equal_the_full_forward():
    """Losses compute the head only where a label token is predicted (logits_to_keep): the same log-probabilities
    as slicing a full forward, to fp32 rounding (the head's matmul sees fewer rows: 1e-5 relative)."""
    from curvzo_ds.data import losses

    tok = load_tokenizer("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(demo_model_config("llama")).eval()
    task = get_task("sst2")
    examples = load_splits(task, 0, 8, 2, 2, data_dir="samples")["train"]
    batch = collate([encode(task, tok, ex, 64) for ex in examples], tok.pad_token_id)
    calls = []
    real = model.forward
    model.forward = lambda *a, **k: calls.append(k.get("logits_to_keep")) or real(*a, **k)
    with torch.no_grad():
        kept = losses._token_logprobs(model, batch)
        full_logits = real(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert calls[0] is not None and 0 < len(calls[0]) < batch["input_ids"].shape[1] - 1
    mask = batch["label_mask"][:, 1:] > 0
    full = torch.log_softmax(full_logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    assert torch.equal(kept == 0, ~mask)
    assert torch.allclose(kept[mask], full[mask], rtol=1e-5, atol=1e-6)


# ---- a completion or chat task's rows (issue 48 §1) ----

# A small chat template for the bundled Llama tokenizer (which has none): a role header per turn, EOS after each
# assistant turn, and the header of the reply for add_generation_prompt.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def chat_tokenizer():
    tok = load_tokenizer("llama")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def example_task(kind):
    from curvzo_ds.tasks.task import EXAMPLES

    return get_task(str(EXAMPLES[kind]))


def test_a_completion_row_labels_the_completion_and_eos(tokenizer):
    task = example_task("completion")
    example = {"prompt": "Write the sum in words.\n3 + 5 =", "completion": " eight", "_where": "f line 7"}
    enc = encode(task, tokenizer, example, max_length=512, max_new_tokens=8)
    ids, [(start, end)] = enc["input_ids"][0], enc["spans"][0]
    assert end == len(ids) and ids[-1] == tokenizer.eos_token_id and enc["option_len"] == [end - start]
    assert tokenizer.decode(ids[start:-1]).strip() == "eight"
    assert enc["prompt_ids"] == tokenizer.encode(example["prompt"]) and enc["answers"] == [" eight"]
    batch = collate([enc, enc], tokenizer.pad_token_id)
    assert batch["label_mask"].sum().item() == 2 * (end - start) and batch["answers"] == [[" eight"]] * 2
    # lm_loss's count is the number of label tokens (docs/contracts.md)
    assert lm_loss(tiny_model(tokenizer.kind), batch)[1].item() == 2 * (end - start)
    cut = encode(task, tokenizer, example, max_length=end - start + 3, max_new_tokens=2)
    assert len(cut["input_ids"][0]) == end - start + 3 and cut["input_ids"][0][0] == ids[0]  # BOS kept
    assert cut["input_ids"][0][-(end - start):] == ids[start:] and cut["cut"] and cut["prompt_kept"] == 2
    with pytest.raises(ValueError, match=r"f line 7: max_length=\d+ cuts the prompt to nothing .* raise max_length to "
                                         rf"at least {end - start + 2}"):
        encode(task, tokenizer, example, max_length=end - start + 1, max_new_tokens=0)
    with pytest.raises(ValueError, match="f line 7: max_length=12 less max_new_tokens=11 leaves no token of the "
                                         "prompt"):
        encode(task, tokenizer, example, max_length=12, max_new_tokens=11)


@pytest.mark.parametrize("turns", ["last", "all"])
def test_a_chat_row_labels_the_assistant_turns(turns):
    import dataclasses

    tok = chat_tokenizer()
    task = dataclasses.replace(example_task("chat"), assistant_turns=turns)
    example = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                            {"role": "assistant", "content": "Goodbye."}]}
    enc = encode(task, tok, example, max_length=512)
    ids = enc["input_ids"][0]
    assert tok.decode(ids) == tok.apply_chat_template(example["messages"], tokenize=False)
    labelled = [tok.decode(ids[s:e]) for s, e in enc["spans"][0]]
    assert labelled == (["Hello.</s>\n", "Goodbye.</s>\n"] if turns == "all" else ["Goodbye.</s>\n"])
    assert tok.decode(enc["prompt_ids"]) == tok.apply_chat_template(example["messages"][:-1], tokenize=False,
                                                                    add_generation_prompt=True)
    assert enc["answers"] == ["Goodbye."]
    mask = collate([enc], tok.pad_token_id)["label_mask"][0]
    assert mask.sum().item() == sum(e - s for s, e in enc["spans"][0])


def test_a_chat_task_needs_a_chat_template_and_the_templates_refusal_names_the_line():
    from curvzo_ds.data import check_tokenizer

    with pytest.raises(ValueError, match="is a chat task, but the tokenizer .* has no chat template .* set "
                                         "tokenizer=DIR"):
        check_tokenizer(example_task("chat"), load_tokenizer("llama"))
    check_tokenizer(example_task("chat"), chat_tokenizer())
    check_tokenizer(example_task("completion"), load_tokenizer("llama"))
    tok = chat_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}x"
    example = {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}],
               "_where": "chat.jsonl line 3"}
    with pytest.raises(ValueError, match=r"chat.jsonl line 3: the tokenizer's chat template refused this "
                                         r"conversation \(no system turns\)"):
        encode(example_task("chat"), tok, example, max_length=64)


# ---- objective: the metric itself as the step's loss (issue 48 §3) ----

def data_keys(**keys):
    """The config's data section with `keys` set, as `curvzo-ds train` hands it to loss_fn_for."""
    return section(TrainConfig(**keys), "data")


def test_loss_fn_for_each_objective_and_the_refusals():
    from curvzo_ds.data import F1Loss, accuracy_loss

    tok = load_tokenizer("llama")
    assert loss_fn_for(get_task("sst2"), data_keys(objective="accuracy")) is accuracy_loss
    f1_loss = loss_fn_for(get_task("squad"), data_keys(objective="f1", max_new_tokens=4, micro_batch_size=3), tok)
    assert isinstance(f1_loss, F1Loss) and (f1_loss.micro_batch_size, f1_loss.stop_at_newline) == (3, True)
    assert not loss_fn_for(example_task("chat"), data_keys(objective="f1"), tok).stop_at_newline  # ends at EOS
    assert loss_fn_for(example_task("completion")) is lm_loss
    with pytest.raises(ValueError, match="objective=accuracy needs a classification task .* task squad is a "
                                         "generation task"):
        loss_fn_for(get_task("squad"), data_keys(objective="accuracy"))
    with pytest.raises(ValueError, match="objective=f1 needs a generation task .* task sst2 is a classification"):
        loss_fn_for(get_task("sst2"), data_keys(objective="f1"), tok)
    with pytest.raises(ValueError, match="objective=f1 generates answers in every forward: loss_fn_for needs the "
                                         "tokenizer"):
        loss_fn_for(get_task("squad"), data_keys(objective="f1"))


def test_accuracy_objective_hand_computed():
    from curvzo_ds.data import accuracy_loss

    batch = collate(HAND_BATCH, pad_id=2)  # FixedModel predicts candidates 0 and 1; the golds are 0 and 2
    loss_sum, count = accuracy_loss(FixedModel(), batch)
    assert (loss_sum.item(), count.item()) == (-1.0, 2.0) and loss_sum.dtype == torch.float64
    batch["accepted"] = [[0], [1, 2]]  # ReCoRD: any answer's entity is right
    assert accuracy_loss(FixedModel(), batch)[0].item() == -2.0
    assert accuracy([0, 1], [[0], [1, 2]]) == 1.0 and accuracy([2, 1], [[0, 1], 1]) == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_f1_objective_is_minus_the_f1_of_the_greedy_answers(kind):
    tokenizer, model = load_tokenizer(kind), tiny_model(kind)
    task = get_task("squad")
    examples = load_splits(task, seed=0, num_train=3, num_dev=1, num_eval=1, data_dir="samples")["train"]
    batch = collate([encode(task, tokenizer, ex, 128, max_new_tokens=4) for ex in examples], tokenizer.pad_token_id)
    answers = generate_answers(model, tokenizer, batch["prompt_ids"], max_new_tokens=4)
    batch["answers"] = [[answers[0]], ["no such words"], [answers[2] + " and more"]]  # F1 1, 0 and below 1
    expected = -sum(f1(a, g) for a, g in zip(answers, batch["answers"]))
    calls = []
    real = model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape) or real(**kw)
    loss = loss_fn_for(task, data_keys(objective="f1", max_new_tokens=4, micro_batch_size=4), tokenizer)
    loss_sum, count = loss(model, batch)
    assert (loss_sum, count) == (pytest.approx(expected), 3.0) and -2 < expected <= -1
    assert len(calls) == 4  # micro_batch_size generate() calls, the short micro-batch padded: ranks stay in step
