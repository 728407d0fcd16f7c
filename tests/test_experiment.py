"""The end-to-end experiment of issue 19 in its CI size (experiments/pipeline.py --config ci): one task, one seed,
a few steps. It checks the pipeline's shape, not its numbers: the tables, the figures, and the run cache.
Measured: 12 s on an idle core, 56 s on the loaded shared machine; in the slow tier (it trains through the CLI's
code for several runs)."""

import pytest

from experiments import pipeline


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
