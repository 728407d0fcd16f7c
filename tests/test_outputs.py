"""Every name a run writes to metrics.jsonl and summary.json is documented in docs/outputs.md."""

import json

import pytest

from tests.helpers import ROOT


def test_every_output_field_is_documented(straight):
    out, summary = straight
    doc = (ROOT / "docs" / "outputs.md").read_text()
    names = set(summary)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        names |= set(json.loads(line))
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/outputs.md does not document {missing}"
    versions_row = next(line for line in doc.splitlines() if line.startswith("| `versions` |"))
    assert all(name in versions_row for name in summary["versions"]), (summary["versions"], versions_row)


@pytest.mark.slow
def test_summary_provenance_and_one_log_file_per_rank(tmp_path):
    """summary.json names the hosts, devices, noise generator and config; logs/rank-00000.log keeps every INFO
    line (those logged before the output directory was checked too), is appended to on a resume and replaced by
    overwrite_output_dir."""
    import hashlib

    from curvzo_ds.noise.gaussian import NoiseSource
    from tests.helpers import CLI, COMMON, ENV, check_contract, run_cli

    out = tmp_path / "run"
    log = out / "logs" / "rank-00000.log"

    def train(steps: int, *extra: str) -> str:
        proc = run_cli(CLI + COMMON + ["--set", f"output_dir={out}", "--set", f"max_steps={steps}", *extra],
                              env=ENV, cwd=str(ROOT), capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return log.read_text()

    first = train(3)
    check_contract(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device_names"] == ["cpu"] and len(summary["hostnames"]) == 1
    assert summary["noise_generator"] == NoiseSource.ident
    config = json.loads((out / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    assert summary["config_hash"] == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert " INFO model demo:" in first and first.count(" INFO done:") == 1  # from Run() on, before the dir check
    # the resolved rate and eps, once per run; the done line pairs each test score with its step, checkpoint and
    # digest (here the best dev is the last step, so both pairs are the final weights')
    assert first.count("learning_rate 0.0003 (constant), zo_eps 0.01,") == 1, first
    best = summary["best_dev"]
    assert best["step"] == 3 and best["digest"] == summary["params_digest"]
    assert (f"done: 3 steps; best dev at step 3 ({out / 'checkpoint-3'}): test accuracy "
            f"{summary['test']['accuracy']:.4g}, digest {summary['params_digest']}; final step 3 "
            f"({out / 'checkpoint-3'}): test accuracy {summary['final']['test']['accuracy']:.4g}, digest "
            f"{summary['params_digest']}") in first, first
    resumed = train(5, "--resume")
    assert resumed.startswith(first) and resumed.count(" INFO done:") == 2 and "resumed from" in resumed
    assert json.loads((out / "summary.json").read_text())["config_hash"] != summary["config_hash"]  # max_steps
    replaced = train(2, "--set", "overwrite_output_dir=true")
    assert replaced.count(" INFO done: 2 steps") == 1 and "resumed from" not in replaced
