"""Issue 47's items B and C: experiments/calibrate.py (the null and power of the metrics, MeZO against MeZO on the
small pipeline model) and experiments/x_dev.py (the curvature along the gradient on SmolLM2's dev loss). Fast tests
of their arithmetic; the scripts end to end at their `ci` configs in the slow tier."""

import json
import math

import numpy as np
import pytest
import torch

from experiments import calibrate as cal
from experiments import x_dev as x
from experiments.stats import rloo_per_forward


def test_the_warp_reads_each_curve_at_f_over_k():
    f = np.arange(0, 801, 40, dtype=float)
    y = np.stack([np.where(f > 0, -0.5 * np.log(np.where(f > 0, f, 1.0)), 0.0) + c for c in (0.0, 0.1)])
    at = np.array([0, 40, 240, 400], dtype=float)
    got = cal.warped(f, y, at, 0.6)
    # log-log linear curves: read exactly at f / 0.6 (between points too); between 0 and 40: linear in forwards
    assert got[:, 2:] == pytest.approx(-0.5 * np.log(at[2:] / 0.6) + np.array([[0.0], [0.1]]))
    assert got[0, 1] == pytest.approx(y[0, 1] + (math.log(40 / 0.6) - math.log(40)) / math.log(2) * (y[0, 2] - y[0, 1]))
    assert got[:, 0] == pytest.approx(y[:, 0])


def test_the_rloo_formula_gives_docs_algorithm_figures():
    # docs/algorithm.md §2: q = 4: 1.5 at x = 0, 1.17 at 0.2, 1.0 at 0.5; q = 8: 1.75 at 0, 1.20 at 0.09, 0.88 at 0.25
    assert [round(rloo_per_forward(4, v), 2) for v in (0, 0.2, 0.5)] == [1.5, 1.17, 1.0]
    assert [round(rloo_per_forward(8, v), 2) for v in (0, 0.09, 0.25)] == [1.75, 1.2, 0.88]
    # no q reaches x0.6 of MeZO's forwards (a per-forward ratio of 1/0.6) above the threshold, and some q does below
    t = x.x_for_ratio(1 / 0.6)
    assert 0 < t < 0.05
    assert max(rloo_per_forward(q, t * 1.01) for q in range(2, 65)) < 1 / 0.6
    assert max(rloo_per_forward(q, t * 0.99) for q in range(2, 65)) > 1 / 0.6


@pytest.mark.slow
def test_x_dev_ci_end_to_end(tiny_model, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        x.main(["--config", "ci", "--model", tiny_model, "--out", str(tmp_path), "--draws", "2"])
    finally:
        torch.set_num_threads(threads)
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("sentiment-*.json"))]
    assert sorted(r["step"] for r in recs) == [0, 2] and all(len(r["draws"]) == 2 for r in recs)
    zero = next(r for r in recs if r["step"] == 0)
    assert zero["loss"] == pytest.approx(zero["evaluate"]["loss"], rel=1e-9)  # L is the curves' dev loss
    for r in recs:
        assert set(r["along_g"]) == {"0.001", "0.01"} and r["checks"][0].keys() == {"0.3", "1"}
        assert all(math.isfinite(d["zhz"]) for d in r["draws"])
    table = (tmp_path / "table-ci.md").read_text()
    assert "| sentiment | zero-shot |" in table and "| sentiment | MeZO step 2 |" in table
    # a rerun with more draws adds draws to the cached checkpoints (no new gradient)
    x.main(["--config", "ci", "--model", tiny_model, "--out", str(tmp_path), "--draws", "3"])
    torch.set_num_threads(threads)
    again = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("sentiment-*.json"))]
    assert [len(r["draws"]) for r in again] == [3, 3] and [r["along_g"] for r in again] == [r["along_g"] for r in recs]
    capsys.readouterr()


@pytest.mark.slow
def test_calibrate_ci_end_to_end(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        cal.main(["--config", "ci", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    finally:
        torch.set_num_threads(threads)
    runs = [json.loads(p.read_text()) for p in (tmp_path / "out" / "runs").glob("*.json")]
    assert len(runs) == cal.CONFIGS["ci"]["seeds"]
    assert len({round(r["curve"][0]["subset_loss"], 9) for r in runs}) == 1  # the same subset whatever the seed
    res = json.loads((tmp_path / "out" / "results-ci.json").read_text())
    assert set(res["summary"]) == {"subset: null", "subset: warp 0.6", "full: null", "full: warp 0.6"}
    assert all(len(rows) == cal.CONFIGS["ci"]["splits"] for rows in res["splits"].values())
    table = (tmp_path / "out" / "table-ci.md").read_text()
    assert table.count("| subset |") == 2 and table.count("| full |") == 2
    capsys.readouterr()
