"""The checkpoint writer in one process: round trip, and a failure that leaves nothing half-written.

Multi-rank checkpoints (any world size to any other) are covered by test_app's resume tests and by
test_integrations (accelerate save_state/load_state at 2 ranks).
"""

import os

import pytest
import torch

from curvzo_ds.checkpoint import manager as ckpt
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
    manager = ckpt.CheckpointManager(str(tmp_path), save_total_limit=1, metric="accuracy")
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        manager.tagged_latest()
    for step, accuracy in ((1, 0.9), (2, 0.5), (3, 0.6)):
        e.step(x)
        manager.track(step, {"accuracy": accuracy})
        path = manager.save(e, mark_latest=True)
        assert manager.tagged_latest() == path == str(tmp_path / f"checkpoint-{step}")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]


class Counter:
    """A stateful component, as a front end registers one (the CLI's clock)."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_the_manager_saves_when_due_once_per_step_and_restores_its_components(tmp_path):
    """maybe_save: every save_steps and at the last step, never twice for a step (a best saved off schedule counts);
    load: the weights and ZO state, the best evaluation and each component's state, as they were at that step."""
    e, x = engine()
    counter = Counter()
    manager = ckpt.CheckpointManager(str(tmp_path), save_steps=2, metric="accuracy", states={"counter": counter})
    written = []
    for step in range(1, 6):
        e.step(x)
        counter.n = 10 * step
        if step == 3 and manager.track(3, {"accuracy": 0.7}):
            manager.save(e)
            at_3 = weights(e)
        if step == 4:
            assert not manager.track(4, {"accuracy": 0.6})
        written.append(manager.maybe_save(e, last=step == 5))
    path = manager.path_for
    assert written == [None, path(2), None, path(4), path(5)]
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 3, 4, 5]
    fresh_counter = Counter()
    fresh = ckpt.CheckpointManager(str(tmp_path), metric="accuracy", states={"counter": fresh_counter})
    fresh.load(e, path(4))
    assert e.step_count == 4 and fresh_counter.n == 40
    assert fresh.best == {"step": 3, "metrics": {"accuracy": 0.7}, "checkpoint": path(3)}
    fresh.load(e, path(3))
    assert e.step_count == 3 and fresh_counter.n == 30 and all(torch.equal(a, b) for a, b in zip(weights(e), at_3))


def test_a_checkpoint_from_before_the_components_resumes_its_best_and_its_seconds(tmp_path):
    """Before issue 27 the CLI kept the trainer state flat ({"best_dev", "seconds", ...}): a resume still gets the best
    evaluation (which rotation must keep) and the seconds trained."""
    from curvzo_ds.train.loop import Clock

    e, x = engine()
    e.step(x)
    best = {"step": 1, "metrics": {"accuracy": 0.8}, "checkpoint": str(tmp_path / "checkpoint-1")}
    path = ckpt.write_checkpoint(e, str(tmp_path / "checkpoint-1"), {"best_dev": best, "seconds": 5.0,
                                                                     "model": "demo", "lora": False, "task": "demo"})
    clock = Clock()
    manager = ckpt.CheckpointManager(str(tmp_path), metric="accuracy", states={"clock": clock})
    manager.load(e, path)
    assert manager.best == best and 5.0 <= clock.seconds() < 60.0


def test_a_damaged_manifest_is_refused_in_one_line_before_any_tensor_is_read(tmp_path):
    """Issue 45 §3: a manifest without a tensor's entry or a slice, or with a tensor of another shape, was a
    traceback under --resume; every such manifest (and a rank file whose header disagrees with it) is now a
    ConfigError naming the file and the problem, from verify_checkpoint and load_checkpoint alike."""
    import json
    import shutil

    from curvzo_ds.checkpoint.format import verify_checkpoint
    from curvzo_ds.errors import ConfigError

    e, x = engine()
    e.step(x)
    good = ckpt.write_checkpoint(e, str(tmp_path / "good"))
    first = sorted(json.loads(open(os.path.join(good, "manifest.json")).read())["tensors"])[0]

    def edit(name, change):
        path = str(tmp_path / name)
        shutil.copytree(good, path)
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        change(manifest)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        return path

    cases = {
        "no-tensor": (lambda m: m["tensors"].pop(first), "which it lists in no tensors entry"),
        "no-slice": (lambda m: next(iter(m["slices"].values())).pop(first), f"holds elements 0.. of {first}"),
        "shape": (lambda m: m["tensors"][first].update(shape=[3, 3]), "is not the product of its shape [3, 3]"),
        "bounds": (lambda m: next(iter(m["slices"].values()))[first].__setitem__(1, 10 ** 9), "is outside its"),
        "dtype": (lambda m: m["tensors"][first].update(dtype="nosuch"), "has no dtype ('nosuch')"),
        "step": (lambda m: m.update(step="three"), "step 'three' is not a step number"),
        "engine": (lambda m: m.pop("engine"), "holds no engine state"),
    }
    for name, (change, words) in cases.items():
        path = edit(name, change)
        for check in (verify_checkpoint, lambda p: ckpt.load_checkpoint(e, p)):
            with pytest.raises(ConfigError, match=None) as raised:
                check(path)
            assert words in str(raised.value) and "\n" not in str(raised.value), (name, str(raised.value))
    # a consistent manifest of another shape: the model's check names both shapes
    other = edit("other-shape", lambda m: m["tensors"]["0.weight"].update(shape=[m["tensors"]["0.weight"]["numel"]]))
    with pytest.raises(ConfigError, match="0.weight has the shape"):
        ckpt.load_checkpoint(e, other)


def test_only_the_checkpoints_own_files_are_read_and_every_file_is_checksummed(tmp_path):
    """A rank file that is a link to a file outside the checkpoint is refused (it was followed), and so is any other
    file the manifest lists (`other_files`: written with every checkpoint) that changed since it was written."""
    import json
    import shutil

    from curvzo_ds.checkpoint.format import checkpoint_containing, verify_checkpoint
    from curvzo_ds.errors import ConfigError

    e, x = engine()
    e.step(x)
    good = ckpt.write_checkpoint(e, str(tmp_path / "good"), write_extra=lambda d: open(f"{d}/extra.json", "w").close())
    manifest = verify_checkpoint(good)
    assert list(manifest["other_files"]) == ["extra.json"]
    linked = str(tmp_path / "linked")
    shutil.copytree(good, linked)
    rank = os.path.join(linked, sorted(manifest["files"])[0])
    os.rename(rank, str(tmp_path / "outside.safetensors"))
    os.symlink(str(tmp_path / "outside.safetensors"), rank)
    with pytest.raises(ConfigError, match="is a link .*only files inside the checkpoint directory are read"):
        verify_checkpoint(linked)
    with pytest.raises(ConfigError, match="is a link"):
        ckpt.load_checkpoint(e, linked)
    changed = str(tmp_path / "changed")
    shutil.copytree(good, changed)
    with open(os.path.join(changed, "extra.json"), "w") as f:
        json.dump({"x": 1}, f)
    with pytest.raises(ConfigError, match="checksum mismatch for .*extra.json"):
        verify_checkpoint(changed)
    assert checkpoint_containing(os.path.join(good, "sub", "dir")) == os.path.realpath(good)
    assert checkpoint_containing(good) == os.path.realpath(good)
    assert checkpoint_containing(str(tmp_path)) is None
