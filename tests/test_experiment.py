"""The end-to-end experiment of issue 19 in its CI size (experiments/pipeline.py --config ci): one task, one seed,
a few steps. It checks the pipeline's shape, not its numbers: the tables, the figures, and the run cache.
Measured: 12 s on an idle core, 56 s on the loaded shared machine; in the slow tier (it trains through the CLI's
code for several runs)."""

import math
import os

import pytest

from experiments import language, pipeline
from experiments.core import sha256_file


@pytest.mark.slow
def test_pipeline_ci_config_end_to_end(tmp_path):
    out = tmp_path / "out"
    pipeline.main(["--config", "ci", "--out", str(out)])
    tables = (out / "tables.md").read_text()
    assert "| sentiment | full | mezo |" in tables and "| sentiment | full | curvzo-paper |" in tables
    assert "| unbiased_element |" in tables  # the diagnostic's table
    for name in ("convergence_full.png", "diagnose/diagnose_normalized.png", "diagnose/diagnose.json"):
        assert (out / name).stat().st_size > 0
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 2
    assert all((out / "tasks" / "sentiment" / f).exists() for f in ("task.json", "train.jsonl", "dev.jsonl"))
    log_lines = (out / "progress.log").read_text().count(" run ")
    pipeline.main(["--config", "ci", "--out", str(out)])  # a rerun takes every run from the cache
    assert (out / "progress.log").read_text().count(" run ") == log_lines
    assert sorted((out / "runs").glob("*.json")) == runs


def test_the_small_model_ships_as_its_weights(tmp_path):
    """The horizon's small model (3,000 steps of pretraining) is the shipped file on any machine, not this CPU's
    pretraining: its zero-shot `sentiment` dev loss is the committed runs' 0.2285, and a cached directory of the same
    settings holding other weights (another CPU's pretraining) is replaced."""
    from curvzo_ds.train.plain import PlainRun

    lines = []
    path = pipeline.pretrain(str(tmp_path), 3000, lines.append)
    weights = os.path.join(path, "model.safetensors")
    assert sha256_file(weights) == pipeline.SHIPPED[os.path.basename(path)[len("model-"):]]
    assert "the shipped weights" in lines[-1]
    sizes = (pipeline.DATA["num_train"], pipeline.DATA["num_dev"], pipeline.DATA["num_test"])
    cfg = pipeline.base_config(path, language.write_task(str(tmp_path), "sentiment", 0, *sizes), 1e-3, 0, 1)
    assert math.isclose(PlainRun(cfg).evaluate("dev")["loss"], 0.2284751, rel_tol=1e-5)

    with open(weights, "r+b") as f:  # another machine's pretraining: other bytes under the same name
        f.seek(-8, os.SEEK_END)
        f.write(b"\x00" * 8)
    assert pipeline.pretrain(str(tmp_path), 3000, lines.append) == path
    assert "replacing" in lines[-2] and "the shipped weights" in lines[-1]
    assert sha256_file(weights) == pipeline.SHIPPED[os.path.basename(path)[len("model-"):]]
    count = len(lines)
    pipeline.pretrain(str(tmp_path), 3000, lines.append)  # cached: nothing to do, nothing logged
    assert len(lines) == count
