"""Evaluation under ZeRO-3 with real processes: no hang in generation, the same metrics at 1, 2, 3 ranks.

One torchrun launch per world size runs every scenario (tests/multirank/eval_worker.py).
"""

import pathlib

import pytest

from curvzo_ds.data.stream import round_robin_slots
from tests.helpers import ROOT, run_worker

WORKER = ROOT / "tests" / "multirank" / "eval_worker.py"


def launch(world: int, tmp: pathlib.Path) -> dict:
    return run_worker(world, WORKER, tmp / f"out{world}.json", timeout=180)["results"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
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
