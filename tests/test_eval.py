"""Evaluation under ZeRO-3 with real processes: no hang in generation, the same metrics at 1, 2, 3 ranks; and a
user's own generation data (issue 48), trained end to end by `curvzo-ds train` at 1 and 2 ranks.

One torchrun launch per world size runs every scenario (tests/multirank/eval_worker.py).
"""

import json
import pathlib
import re
import shutil
import sys

import pytest

from curvzo_ds.data.stream import round_robin_slots
from curvzo_ds.tasks.task import EXAMPLES
from tests.f1_task import own_answers_task
from tests.helpers import ROOT, run_worker

WORKER = ROOT / "tests" / "multirank" / "eval_worker.py"
# The bundled completion and chat examples (the chat one with docs/tasks.md's template on the demo tokenizer), and
# objective=f1 on a task where F1 moves (tests/f1_task.py): each a `curvzo-ds train` at 1 and 2 ranks in the launches
# below. Three micro-batches a step: at 2 ranks one rank runs a zero-weight forward (f1: greedy generation padded to
# as many calls).
OWN_COMMON = ["--set", "max_steps=4", "--set", "eval_steps=4", "--set", "save_steps=4", "--set", "global_batch_size=6",
              "--set", "micro_batch_size=2", "--set", "max_new_tokens=8", "--set", "disable_tqdm=true",
              "--set", "report_to=none", "--set", "log_level=warning",
              "--deepspeed", str(ROOT / "ds_configs" / "zero3.json")]


def own_runs(tmp: pathlib.Path) -> dict[str, list[str]]:
    return {"completion": [*OWN_COMMON, "--set", f"task={EXAMPLES['completion']}"],
            "chat": [*OWN_COMMON, "--set", f"task={EXAMPLES['chat']}", "--set", f"tokenizer={tmp / 'chat-tokenizer'}"],
            "f1": [*OWN_COMMON, "--set", f"task={tmp / 'own-answers'}", "--set", "objective=f1",
                   "--set", "zo_eps=3e-4", "--set", "learning_rate=1e-5"],
            # perturbation=rademacher (issue 58): trained, evaluated and exported like the Gaussian completion run
            "completion_rademacher": [*OWN_COMMON, "--set", f"task={EXAMPLES['completion']}",
                                      "--set", "perturbation=rademacher"]}


def docs_chat_template() -> str:
    """The chat template docs/tasks.md gives for the demo tokenizer (its `my-tokenizer/chat_template.jinja`)."""
    text = (ROOT / "docs" / "tasks.md").read_text()
    return re.search(r"`my-tokenizer/chat_template.jinja`\n```jinja\n(.*?)\n```", text, re.S).group(1)


def launch(world: int, tmp: pathlib.Path) -> dict:
    return run_worker(world, WORKER, tmp / "own-data.json", tmp / f"out{world}.json", timeout=400)["results"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    shutil.copytree(ROOT / "curvzo_ds" / "assets" / "tokenizer-llama", tmp / "chat-tokenizer")
    (tmp / "chat-tokenizer" / "chat_template.jinja").write_text(docs_chat_template())
    own_answers_task(tmp / "own-answers", max_new_tokens=8)  # OWN_COMMON's max_new_tokens, the default seed
    (tmp / "own-data.json").write_text(json.dumps({"directory": str(tmp), "runs": own_runs(tmp)}))
    return {w: launch(w, tmp) for w in (1, 2, 3)}


def test_round_robin_slots_cover_every_part_once_in_equal_rounds():
    assert round_robin_slots(5, 0, 2) == [0, 2, 4]
    assert round_robin_slots(5, 1, 2) == [1, 3, None]
    assert round_robin_slots(1, 2, 3) == [None]
    assert round_robin_slots(0, 1, 3) == []
    for n in range(9):
        for world in range(1, 5):
            slots = [round_robin_slots(n, r, world) for r in range(world)]
            assert {len(s) for s in slots} == {-(-n // world)}
            assert sorted(j for s in slots for j in s if j is not None) == list(range(n))
            assert all(j % world == r for r, s in enumerate(slots) for j in s if j is not None)


def _lengths(calls):
    return [[len(new_ids) for _, new_ids, _ in rank] for rank in calls]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_generation_does_not_hang_when_ranks_stop_at_different_lengths(runs):
    for w in (2, 3):
        # zero.Init alone: transformers does not know about ZeRO-3, so only synced_gpus=True keeps ranks in step.
        zero_init = runs[w]["zero_init"]
        assert zero_init["partitioned"] and zero_init["hf_zero3_enabled"] is False
        for name, calls in (("zero_init", zero_init["calls"]), ("squad", runs[w]["squad"]["calls"])):
            assert len(calls) == w and len({len(rank) for rank in calls}) == 1, (name, _lengths(calls))
            assert all(synced is True for rank in calls for _, _, synced in rank)
            differ = [k for k, lengths in enumerate(zip(*_lengths(calls))) if len(set(lengths)) > 1]
            assert len(differ) >= 2, (name, w, _lengths(calls))  # the scenario really ends ranks apart


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_metrics_identical_at_1_2_3_ranks(runs):
    for name, metrics in (("sst2", {"loss", "accuracy"}), ("squad", {"loss", "f1", "exact_match"})):
        ref = runs[1][name]
        assert set(ref["dev"]) == set(ref["test"]) == metrics
        assert all(ref[s]["loss"] > 0 for s in ("dev", "test"))
        assert ref["sizes"] == ({"dev": 7, "test": 8} if name == "sst2" else {"dev": 5, "test": 6})
        for w in (2, 3):
            for split in ("dev", "test"):
                assert runs[w][name][split] == ref[split], (name, w, split)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_generated_answers_identical_at_1_2_3_ranks(runs):
    """F1 and EM of a random model are 0, so also compare every greedy continuation token for token."""
    answers = {}
    for w in (1, 2, 3):
        answers[w] = {}
        for rank in runs[w]["squad"]["calls"]:
            for prompt, new_ids, _ in rank:
                assert answers[w].setdefault(prompt, new_ids) == new_ids  # padding calls repeat a prompt
    assert len(answers[1]) == 11  # dev + test
    assert len({len(ids) for ids in answers[1].values()}) > 1
    assert answers[2] == answers[1] and answers[3] == answers[1]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_rank_0_prepares_data_first(runs):
    """Rank 0's body sleeps 0.3 s first: a rank that did not wait for it would start before it ends."""
    for w in (2, 3):
        first = runs[w]["first"]
        assert all(first[r][0] >= first[0][1] for r in range(1, w))
        # The group of ranks 1..W-1: its rank 0 is global rank 1, and global rank 0 takes no part.
        sub = runs[w]["first_subgroup"]
        assert sub[0] is None and sub[1] is not None
        assert all(sub[r][0] >= sub[1][1] for r in range(2, w))
        for name in ("sst2", "squad"):  # Run loads the tokenizer and the splits on rank 0 first
            times = runs[w][name]["load_times"]
            assert len(times[0]) == 2 and all(len(t) == 2 for t in times)
            assert all(start >= max(end for _, end in times[0]) for t in times[1:] for start, _ in t)


# ---- a user's own generation data, and objective=f1 (issue 48), through `curvzo-ds train` ----

@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_own_generation_data_trains_alike_at_1_and_2_ranks(runs):
    for name in ("completion", "chat", "f1", "completion_rademacher"):
        one, two = runs[1]["own_data"][name], runs[2]["own_data"][name]
        assert one["code"] == two["code"] == 0, name
        assert (one["summary"]["world_size"], two["summary"]["world_size"]) == (1, 2)
        assert one["summary"]["params_digest"] == two["summary"]["params_digest"], name
        assert one["summary"]["test"] == two["summary"]["test"] and {"loss", "f1", "exact_match"} <= set(
            one["summary"]["test"]), name
    # +-1 directions: recorded as such, another trajectory than the Gaussian run's
    for w in (1, 2):
        pm1, gaussian = runs[w]["own_data"]["completion_rademacher"]["summary"], runs[w]["own_data"]["completion"][
            "summary"]
        assert (pm1["perturbation"], gaussian["perturbation"]) == ("rademacher", "gaussian")
        assert pm1["noise_generator"] == "philox4x32-10-rademacher-v1" != gaussian["noise_generator"]
        assert pm1["params_digest"] != gaussian["params_digest"]
    # objective=f1: a step's losses are minus the mean F1 of the batch's greedy answers, an evaluation's loss minus
    # its f1; F1 moves: some step's two sides differ, so its projected gradient is not 0 and the two world sizes'
    # equal digests compare weights that moved
    for world in (1, 2):
        rows = [json.loads(line) for line in (pathlib.Path(runs[world]["own_data"]["f1"]["dir"]) / "metrics.jsonl")
                .read_text().splitlines()]
        steps = [r for r in rows if "split" not in r]
        assert len(steps) == 4 and all(-1 <= r[k] <= 0 for r in steps for k in ("loss_plus", "loss_minus"))
        assert any(r["loss_plus"] != r["loss_minus"] and r["projected_grad"] != 0 for r in steps), steps
        assert all(r["loss"] == pytest.approx(-r["f1"]) for r in rows if "split" in r)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_own_generation_data_exports_and_loads_in_transformers(runs, tmp_path, monkeypatch, capsys):
    """The 1-rank runs' last checkpoints exported (`curvzo-ds export`), checked against their params_digest
    (tests/check_run.py --export) and loaded by transformers, the chat one with its chat template; the +-1 run's
    too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from curvzo_ds.cli import main
    from tests import check_run

    for name in ("completion", "chat", "completion_rademacher"):
        run, export = pathlib.Path(runs[1]["own_data"][name]["dir"]), tmp_path / name
        assert main(["export", str(run / "checkpoint-4"), "--out", str(export)]) == 0
        monkeypatch.setattr(sys, "argv", ["check_run.py", str(run), "--export", str(export)])
        with pytest.raises(SystemExit) as done:
            check_run.main()
        assert done.value.code == 0, capsys.readouterr().out
        model, tokenizer = AutoModelForCausalLM.from_pretrained(str(export)), AutoTokenizer.from_pretrained(str(export))
        assert bool(tokenizer.chat_template) == (name == "chat")
        ids = torch.tensor([tokenizer.encode("3 + 5 =")])
        assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape[1] > ids.shape[1]
