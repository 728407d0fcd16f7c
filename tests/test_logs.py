"""metrics.jsonl is strict JSON, resumable; summary.json is written atomically; TensorBoard mirrors numbers."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch

from curvzo_ds.jsonio import to_jsonable, write_json_atomic
from curvzo_ds.sysinfo import peak_rss_bytes, versions
from curvzo_ds.train.logs import MetricsWriter, read_metrics


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_non_finite_and_array_scalars_become_strict_json(tmp_path):
    row = {"step": np.int64(3), "loss": float("nan"), "loss_plus": torch.tensor(float("inf")),
           "projected_grad": np.float32(-0.5), "nested": {"a": [1.0, float("-inf"), np.float64("nan")]},
           "ok": np.bool_(True), "skipped": "non-finite loss"}
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(row)
        # flushed per line: readable before close
        text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (got,) = lines(tmp_path / "metrics.jsonl")
    assert got == {"step": 3, "loss": None, "loss_plus": None, "projected_grad": -0.5,
                   "nested": {"a": [1.0, None, None]}, "ok": True, "skipped": "non-finite loss"}
    assert type(got["step"]) is int


def test_unknown_types_are_refused():
    with pytest.raises(TypeError, match="object"):
        to_jsonable({"x": object()})


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "run"), enabled=False, tensorboard=True)
    writer.write({"step": 1, "loss": 1.0})
    assert writer.truncate_after(0) == 0
    writer.close()
    assert not (tmp_path / "run").exists()


def test_truncate_after_matches_a_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 7)]
    rows.insert(4, {"step": 4, "split": "dev", "loss": 0.3, "accuracy": 0.5})
    with MetricsWriter(str(straight)) as writer:
        for row in rows:
            writer.write(row)
    # a run that died after step 5, with half a line written, resumed from checkpoint-4
    writer = MetricsWriter(str(resumed))
    for row in rows[:6]:
        writer.write(row)
    writer.close()
    with open(resumed / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 6, "lo')
    writer = MetricsWriter(str(resumed))
    assert writer.truncate_after(4) == 2  # step 5 and the broken line
    for row in rows[5:]:
        writer.write(row)
    writer.close()
    assert (resumed / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in read_metrics(str(resumed))] == [1, 2, 3, 4, 4, 5, 6]


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    write_json_atomic(str(path), {"final": {"loss": float("nan"), "accuracy": np.float64(0.75)}, "steps": 3})
    assert json.loads(path.read_text()) == {"final": {"loss": None, "accuracy": 0.75}, "steps": 3}
    write_json_atomic(str(path), {"steps": 4})
    assert json.loads(path.read_text()) == {"steps": 4}
    assert os.listdir(path.parent) == ["summary.json"]  # no temp file left behind
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"bad": object()})
    assert json.loads(path.read_text()) == {"steps": 4} and os.listdir(path.parent) == ["summary.json"]


def test_tensorboard_logs_numbers_per_split(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(str(tmp_path), tensorboard=True) as writer:
        writer.write({"step": 1, "loss": 0.9, "budget": 3, "skipped": "x", "loss_plus": float("nan")})
        writer.write({"step": 2, "loss": 0.8, "budget": 4})
        writer.write({"step": 2, "split": "dev", "loss": 0.7, "accuracy": 0.6})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/loss", "train/budget", "dev/loss", "dev/accuracy"}
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 0.9), (2, 0.8)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("dev/accuracy")] == [(2, 0.6)]


def test_tensorboard_events_after_the_resume_step_are_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(str(tmp_path), tensorboard=True) as writer:
        for step in (1, 2, 3):
            writer.write({"step": step, "loss": float(step)})
    with MetricsWriter(str(tmp_path), tensorboard=True) as writer:
        writer.truncate_after(1)
        writer.write({"step": 2, "loss": 20.0})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]


def test_peak_rss_grows_with_a_large_allocation():
    before = peak_rss_bytes()
    block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
    after = peak_rss_bytes()
    assert block.sum() > 0 and after >= before and after >= 64 * 1024 * 1024
    assert isinstance(after, int)


def test_versions():
    found = versions()
    assert set(found) == {"python", "curvzo_ds", "torch", "deepspeed", "transformers", "accelerate", "peft"}
    assert found["torch"].startswith(torch.__version__.split("+")[0])


@pytest.mark.parametrize("through_the_bar", [False, True])
def test_log_lines_in_a_terminal_are_not_glued_to_the_bar(monkeypatch, through_the_bar):
    """With the run's console logging and a tqdm bar on the same stream, a log line starts a line of its own only
    when it goes through the bar (progress_logging); without it the line is glued onto the bar (the control)."""
    import io
    import logging
    import re

    from tqdm import tqdm

    from curvzo_ds.train.logs import progress_logging, setup_logging

    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        setup_logging(0, "info")
        bar = tqdm(total=10, file=terminal, desc="curvzo", mininterval=0)
        with progress_logging(bar) if through_the_bar else contextlib.nullcontext():
            bar.update(1)
            logging.getLogger("curvzo_ds.train.run").info("step 1: dev loss 0.5")
        bar.close()
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    pieces = [p for p in re.split(r"[\r\n]", terminal.getvalue()) if "step 1: dev loss" in p]
    assert len(pieces) == 1
    glued = not re.match(r"\d{4}-\d\d-\d\d ", pieces[0])
    assert glued != through_the_bar, repr(pieces[0])
