"""The training stream `step_indices`: whole global batches from a per-epoch permutation seeded by (seed, epoch)."""

import pytest
import torch

from curvzo_ds.data import stream


def epoch_batches(epoch, n, batch, seed):
    per_epoch = n // batch
    return [stream.step_indices(epoch * per_epoch + k, n, batch, seed) for k in range(per_epoch)]


def test_batches_of_an_epoch_are_full_disjoint_and_drop_the_remainder():
    n, batch = 23, 5  # 4 batches per epoch; 3 examples left over each epoch
    for epoch in range(3):
        batches = epoch_batches(epoch, n, batch, seed=7)
        assert all(len(b) == batch for b in batches)
        seen = [i for b in batches for i in b]
        assert len(set(seen)) == len(seen) == 20 and set(seen) <= set(range(n))
    # The step after an epoch's last batch starts the next epoch: the left-over examples are not served first.
    first, second = epoch_batches(0, n, batch, 7), epoch_batches(1, n, batch, 7)
    assert stream.step_indices(4, n, batch, 7) == second[0]
    assert second != first


def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch():
    n = 24
    for epoch in range(3):
        # The batch size only cuts the epoch's permutation: every cut reads the same order.
        orders = [sum(epoch_batches(epoch, n, batch, seed=3), []) for batch in (3, 4, 5, 24)]
        assert orders[0] == orders[1] == orders[3]
        assert orders[2] == orders[0][:20]
        assert sorted(orders[0]) == list(range(n))
    epochs = [sum(epoch_batches(e, n, 4, seed=3), []) for e in range(3)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert sum(epoch_batches(0, n, 4, seed=4), []) != epochs[0]


def test_depends_only_on_its_arguments():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = [stream.step_indices(s, 50, 8, 11) for s in range(20)]
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is neither read nor advanced
    torch.manual_seed(12345)
    torch.rand(100)
    b = [stream.step_indices(s, 50, 8, 11) for s in reversed(range(20))][::-1]  # any order of calls
    assert a == b


def test_batch_larger_than_the_data_is_refused():
    with pytest.raises(ValueError, match="global_batch_size=9 is larger than the 8 training examples"):
        stream.step_indices(0, 8, 9, 0)
