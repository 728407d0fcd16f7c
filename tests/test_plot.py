"""`plot_runs` draws a valid PNG from run directories and names a bad one."""

from __future__ import annotations

import json
import math
import random

import pytest

from curvzo_ds.plot import _moving_average, plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(path, method, steps=200, seed=0, with_test=True):
    rng = random.Random(seed)
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in range(1, steps + 1):
            loss = 0.7 * math.exp(-step / (150 + 50 * seed)) + 0.05 * rng.random()
            row = {"step": step, "loss": None if step == 7 else loss, "budget": 3, "seconds": step * 0.1}
            f.write(json.dumps(row) + "\n")
            if step % 50 == 0:
                f.write(json.dumps({"step": step, "split": "dev", "loss": loss, "accuracy": 0.5 + step / 1000}) + "\n")
        if with_test:
            f.write(json.dumps({"step": steps, "split": "test", "loss": 0.3, "accuracy": 0.66, "f1": 0.6}) + "\n")
    (path / "summary.json").write_text(json.dumps({"method": method, "steps": steps}))
    return str(path)


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == PNG_SIGNATURE and header[12:16] == b"IHDR"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_plot_two_runs(tmp_path):
    runs = [make_run(tmp_path / "curvzo-s0", "curvzo"), make_run(tmp_path / "mezo-s0", "mezo", seed=1)]
    out = plot_runs(runs, str(tmp_path / "figs" / "compare.png"))
    assert out == str(tmp_path / "figs" / "compare.png")
    width, height = png_size(out)
    assert width > 500 and height > 200


def test_plot_defaults_into_the_first_run_and_needs_no_summary(tmp_path):
    run = make_run(tmp_path / "run", "curvzo", steps=5, with_test=False)
    (tmp_path / "run" / "summary.json").unlink()
    out = plot_runs([run])
    assert out.endswith("metrics.png") and png_size(out)[0] > 0


def test_bad_run_dirs_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*metrics.jsonl"):
        plot_runs([str(tmp_path / "empty")], str(tmp_path / "x.png"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="blank"):
        plot_runs([str(tmp_path / "blank")], str(tmp_path / "x.png"))
    with pytest.raises(ValueError):
        plot_runs([], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_moving_average():
    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert _moving_average([2.0, 4.0], 1) == [2.0, 4.0]
