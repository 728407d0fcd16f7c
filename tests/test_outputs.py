"""Every name a run writes to metrics.jsonl and summary.json is documented in docs/outputs.md."""

import json
import os

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
    overwrite_output_dir. A resume that asks for another perturbation keeps its checkpoint's (issue 58)."""
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
    # the resume asks for +-1 directions: the run keeps its checkpoint's Gaussian ones, says so, and records them
    resumed = train(5, "--resume", "--set", "perturbation=rademacher")
    assert resumed.startswith(first) and resumed.count(" INFO done:") == 2 and "resumed from" in resumed
    assert "draws perturbation=gaussian; it keeps it (perturbation=rademacher is not taken" in resumed
    after = json.loads((out / "summary.json").read_text())
    assert after["config_hash"] != summary["config_hash"]  # max_steps
    assert after["perturbation"] == summary["perturbation"] == "gaussian"
    assert after["noise_generator"] == NoiseSource.ident
    assert json.loads((out / "config.json").read_text())["perturbation"] == "gaussian"
    assert json.loads((out / "checkpoint-5" / "run_config.json").read_text())["perturbation"] == "gaussian"
    replaced = train(2, "--set", "overwrite_output_dir=true")
    assert replaced.count(" INFO done: 2 steps") == 1 and "resumed from" not in replaced


class OneRank:
    """The job's communicator of a one-rank job, for the output-directory policy alone."""

    rank, world_size = 0, 1

    def broadcast_object(self, value):
        return value


def test_a_live_run_is_locked_and_a_killed_ones_lock_is_not_stale(tmp_path):
    """Issue 45 §2: rank 0 holds an flock on output_dir/.curvzo-ds.lock for the run; a second take is refused in one
    line naming the holder; the kernel drops the lock of a killed holder, so its left-over file locks nothing."""
    import signal
    import subprocess

    from curvzo_ds.errors import ConfigError
    from curvzo_ds.train.outputs import RunLock

    first = RunLock.take(str(tmp_path))
    holder = json.loads((tmp_path / RunLock.NAME).read_text())
    with pytest.raises(ConfigError, match=rf"is in use by a live run \(pid {holder['pid']} on .*kill -INT "
                                          rf"{holder['pid']} saves a checkpoint") as refused:
        RunLock.take(str(tmp_path))
    assert "\n" not in str(refused.value)
    first.release()
    assert not (tmp_path / RunLock.NAME).exists()
    # another process holds it (util-linux's flock, no Python started), then is killed: the file stays, unlocked
    (tmp_path / RunLock.NAME).write_text('{"pid": 1, "host": "h", "started": "then"}\n')
    def wait_until(locked: bool, tries: int) -> None:  # bounded: the assertions below say what went wrong
        for _ in range(tries):
            if (subprocess.run(["flock", "-n", str(tmp_path / RunLock.NAME), "true"]).returncode != 0) == locked:
                return
            subprocess.run(["sleep", "0.1"])

    other = subprocess.Popen(["flock", "-o", str(tmp_path / RunLock.NAME), "sleep", "60"],  # -o: sleep holds none
                             start_new_session=True)
    try:
        wait_until(locked=True, tries=50)  # until the other process has its lock
        with pytest.raises(ConfigError, match="in use by a live run"):
            RunLock.take(str(tmp_path))
    finally:
        os.killpg(other.pid, signal.SIGKILL)  # flock and its sleep
        other.wait()
    # the kernel drops the lock when the last process holding the file is gone; flock's child (killed between its
    # fork and its close, under load) can outlive flock's own wait by a moment, so wait for that (bounded)
    wait_until(locked=False, tries=100)
    assert (tmp_path / RunLock.NAME).exists()
    RunLock.take(str(tmp_path)).release()


def test_resume_never_overwrites_and_a_run_is_never_written_inside_a_checkpoint(tmp_path):
    """Issue 45 §2: a bare --resume into a directory that holds a run but no complete checkpoint (only a .tmp) is
    refused, as is --resume CKPT of another run into a directory that holds one; overwrite_output_dir replaces it
    knowingly; a directory that holds no run starts fresh. Each refusal leaves the directory as it was (the lock
    taken for the decision is gone again)."""
    from curvzo_ds.config.schema import TrainConfig
    from curvzo_ds.errors import ConfigError
    from curvzo_ds.train.outputs import prepare_output_dir

    run = tmp_path / "run"
    (run / "checkpoint-8.tmp").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        (run / name).write_text("{}\n")
    before = sorted(p.name for p in run.iterdir())
    cfg = TrainConfig(output_dir=str(run))
    refusals = {
        (True, None): "holds a run (checkpoint-8.tmp, config.json, metrics.jsonl) but no complete checkpoint "
                      "(checkpoint-8.tmp: partial or damaged)",
        ("/elsewhere/checkpoint-3", "/elsewhere/checkpoint-3"): "already holds another run",
        (None, None): "already holds a run",
    }
    for (resume, checkpoint), words in refusals.items():
        with pytest.raises(ConfigError, match=None) as refused:
            prepare_output_dir(cfg, resume, checkpoint, OneRank())
        assert words in str(refused.value), str(refused.value)
        assert sorted(p.name for p in run.iterdir()) == before
    ckpt_dir = run / "checkpoint-8"
    ckpt_dir.mkdir()
    (ckpt_dir / "manifest.json").write_text("{}")
    (ckpt_dir / "rank-00000-of-00001.safetensors").write_text("")
    inside = TrainConfig(output_dir=str(ckpt_dir / "again"))
    with pytest.raises(ConfigError, match="is inside the checkpoint"):
        prepare_output_dir(inside, None, None, OneRank())
    prepare_output_dir(cfg, True, str(ckpt_dir), OneRank()).release()  # its own checkpoint: continued
    lock = prepare_output_dir(TrainConfig(output_dir=str(run), overwrite_output_dir=True), True, None, OneRank())
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == []  # replaced knowingly
    prepare_output_dir(TrainConfig(output_dir=str(tmp_path / "fresh")), True, None, OneRank()).release()


def test_a_run_without_dev_or_test_examples_says_so_unless_asked(caplog):
    """Issue 45 §3: an empty dev.jsonl turned dev evaluation off (summary.json's best_dev null) without a word. The
    run now says it once on rank 0; num_dev=0 (asked for) stays quiet, and another rank says nothing."""
    import logging
    import types

    from curvzo_ds.train.run import warn_missing_splits

    def job(num_dev, rank=0, splits=("test",)):
        return types.SimpleNamespace(cfg=types.SimpleNamespace(num_dev=num_dev, num_eval=16), rank=rank,
                                     eval_data={s: [] for s in splits})

    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        warn_missing_splits(job(16))
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and said[0].startswith("no dev examples (the task's dev split or dev.jsonl is empty)")
        assert "best_dev is null" in said[0]
        caplog.clear()
        warn_missing_splits(job(0))
        warn_missing_splits(job(16, rank=1))
        warn_missing_splits(job(16, splits=("dev", "test")))
        assert caplog.records == []
