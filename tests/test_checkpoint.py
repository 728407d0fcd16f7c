"""The checkpoint writer in one process: round trip, and a failure that leaves nothing half-written.

Multi-rank checkpoints (any world size to any other) are covered by test_app's resume tests and by
test_integrations (accelerate save_state/load_state at 2 ranks).
"""

import os

import pytest
import torch

from curvzo_ds import checkpoint as ckpt
from curvzo_ds.engine import ZOEngine


def engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    x = torch.randn(16, 4)
    return ZOEngine(model, lambda m, b: (m(b).square().mean(), 1), method="mezo", learning_rate=1e-2), x


def weights(e):
    return [p.detach().clone() for p in e.module.parameters()]


def test_round_trip_restores_weights_and_state(tmp_path):
    e, x = engine()
    e.step(x)
    path = ckpt.write_checkpoint(e, str(tmp_path / "ck"), {"note": 1})
    saved, step = weights(e), e.step_count
    e.step(x)
    assert e.step_count == step + 1
    assert ckpt.load_checkpoint(e, path) == {"note": 1}
    assert e.step_count == step
    assert all(torch.equal(a, b) for a, b in zip(weights(e), saved))


def test_a_failure_on_rank_0_is_raised_and_leaves_no_complete_checkpoint(tmp_path):
    e, x = engine()
    e.step(x)
    first = ckpt.save_checkpoint(e, str(tmp_path))
    e.step(x)

    def broken(directory):
        raise OSError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.save_checkpoint(e, str(tmp_path), write_extra=broken)
    with pytest.raises(RuntimeError, match="not JSON serializable"):
        ckpt.save_checkpoint(e, str(tmp_path), trainer_state={"t": torch.zeros(1)})
    assert [p for _, p in ckpt.list_checkpoints(str(tmp_path))] == [first]  # only the complete one
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoint-2"))


def test_a_corrupt_incomplete_or_foreign_checkpoint_is_refused_by_name(tmp_path):
    import json

    e, x = engine()
    e.step(x)
    path = ckpt.write_checkpoint(e, str(tmp_path / "ck"))
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    rank_file = os.path.join(path, sorted(manifest["files"])[0])
    with open(rank_file, "r+b") as f:  # flip one byte of the tensor data at the end of the file
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="checksum mismatch"):
        ckpt.load_checkpoint(e, path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(e, path)
    other = ZOEngine(torch.nn.Sequential(torch.nn.Linear(4, 3)), lambda m, b: (m(b).sum(), 1), method="mezo")
    good = ckpt.write_checkpoint(e, str(tmp_path / "good"))
    with pytest.raises(ValueError, match="does not match this model's trainable parameters"):
        ckpt.load_checkpoint(other, good)


def test_deepspeeds_latest_file_names_the_checkpoint_and_rotation_keeps_the_best(tmp_path):
    """CheckpointManager: mark_latest writes DeepSpeed's `latest` file, tagged_latest reads it back; rotation to
    save_total_limit keeps the newest checkpoints and the tracked best one."""
    e, x = engine()
    manager = ckpt.CheckpointManager(str(tmp_path), e.world, save_total_limit=1, metric="accuracy")
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        manager.tagged_latest()
    for step, accuracy in ((1, 0.9), (2, 0.5), (3, 0.6)):
        e.step(x)
        manager.track(step, {"accuracy": accuracy})
        path = manager.save(e, mark_latest=True)
        assert manager.tagged_latest() == path == str(tmp_path / f"checkpoint-{step}")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
