"""Issue 59 §3: what surprised a new user, each fixed at its root and tested here by its own function, in one
process (no run is trained: the refusals and rules are unit-tested; docs/reliability.md, tests/test_bad_inputs.py
has the CLI's one-line refusals)."""

import os
import re

import pytest

from curvzo_ds.config.load import checked_path, differences, load_config
from curvzo_ds.errors import ConfigError


def test_several_config_files_merge_in_order_and_each_key_names_its_file(tmp_path):
    """A second --config silently dropped the first (the preset plus another file trained plain MeZO): the files
    merge in order, a later one winning, --set over all; each key's source names the file it came from, and the
    files are kept in order for the run's log line."""
    preset, mine = tmp_path / "preset.yaml", tmp_path / "mine.yaml"
    preset.write_text("method: curvzo\nnum_directions: 4\nseed: 1\n")
    mine.write_text("seed: 2\nmax_steps: 7\n")
    cfg = load_config([str(preset), str(mine)], ["max_steps=9"], None)
    assert (cfg.method, cfg.num_directions, cfg.seed, cfg.max_steps) == ("curvzo", 4, 2, 9)
    assert cfg.sources == {"method": f"--config {preset}", "num_directions": f"--config {preset}",
                           "seed": f"--config {mine}", "max_steps": "--set"}
    assert cfg.config_files == (str(preset), str(mine))
    assert load_config(str(preset), [], None).config_files == (str(preset),)  # one file, as before
    from curvzo_ds.cli import build_parser

    args = build_parser().parse_args(["train", "--config", "a.yaml", "--config", "b.yaml"])
    assert args.config == ["a.yaml", "b.yaml"]


def test_path_keys_are_recorded_absolute_and_checked_for_their_kind(tmp_path, monkeypatch):
    """A relative task= tied a run to the directory it started in, and the absolute path of the same task was refused
    on resume as "cannot be changed". Paths that exist are recorded absolute; a saved relative path and the new
    absolute one of the same directory are the same; a built-in name or a hub id stays as it is; a file where a
    directory is needed (or the reverse) is one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks" / "mine").mkdir(parents=True)
    (tmp_path / "ds.json").write_text("{}")
    assert checked_path("task", "tasks/mine") == str(tmp_path / "tasks" / "mine")
    assert checked_path("deepspeed", "ds.json") == str(tmp_path / "ds.json")
    for key, value in (("task", "sst2"), ("model", "demo"), ("data_dir", "samples"), ("model", "facebook/opt-125m")):
        assert checked_path(key, value) == value
    assert differences({"task": "tasks/mine"}, {"task": str(tmp_path / "tasks" / "mine")}, ["task"]) == []
    assert differences({"task": "tasks/mine"}, {"task": "sst2"}, ["task"]) == ["task: 'tasks/mine' -> 'sst2'"]
    for key, value, words in (("task", "ds.json", "task=ds.json is a file, not a directory: give a task directory"),
                              ("model", "ds.json", "model=ds.json is a file, not a directory"),
                              ("tokenizer", "ds.json", "tokenizer=ds.json is a file"),
                              ("data_dir", "ds.json", "data_dir=ds.json is a file"),
                              ("deepspeed", "tasks", "deepspeed=tasks is a directory: name the DeepSpeed JSON file"),
                              ("deepspeed", "none.json", "deepspeed=none.json: no such file or directory")):
        with pytest.raises(ConfigError, match="^" + words.replace("(", r"\(")):
            checked_path(key, value)
    cfg = load_config(None, ["task=tasks/mine"], None)
    assert cfg.task == os.path.join(tmp_path, "tasks", "mine")  # what config.json and run_config.json record


def test_best_dev_breaks_a_metric_tie_by_the_dev_loss(tmp_path):
    """On generation tasks F1 often ties, and the first evaluation stayed "best" while the dev loss kept falling: a
    tie now goes to the lower dev loss (a higher one, or none, keeps the earlier best)."""
    from curvzo_ds.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(str(tmp_path), metric="f1")
    assert manager.track(100, {"f1": 0.2, "loss": 3.0})
    assert manager.track(200, {"f1": 0.2, "loss": 2.5})  # the tie, with a lower loss
    assert not manager.track(300, {"f1": 0.2, "loss": 2.7})
    assert not manager.track(400, {"f1": 0.2})
    assert not manager.track(500, {"f1": 0.1, "loss": 0.1})  # the metric first
    assert manager.track(600, {"f1": 0.3, "loss": 9.0})
    assert manager.best["step"] == 600
    lower = CheckpointManager(str(tmp_path), metric="loss", greater_is_better=False)
    assert lower.track(1, {"loss": 1.0}) and not lower.track(2, {"loss": 1.0})


def test_plan_and_train_check_refuse_the_layout_the_ranks_refuse():
    """`plan --num-directions 3 --shard-group-size 2` said "fits" for a layout that train refused inside the ranks
    (a 47-line torchrun failure): plan says "refused" with the ranks' reason, and `train --check --world-size N` (the
    launch/ scripts pass N) refuses it before any rank starts."""
    from curvzo_ds.commands.plan import plan
    from curvzo_ds.commands.train import check_world_layout

    with pytest.raises(ConfigError, match=r"^refused: num_directions=3 must be a multiple of the number of replica "
                                          r"groups \(2 = world size 4 / shard_group_size 2\)"):
        plan(model="demo", world_size=4, shard_group_size=2, num_directions=3)
    cfg = load_config(None, ["shard_group_size=2", "num_directions=3"], None)
    with pytest.raises(ConfigError, match=r"^num_directions=3 must be a multiple of the number of replica groups"):
        check_world_layout(cfg, 4)
    check_world_layout(cfg, 2)  # one replica group: any q
    with pytest.raises(ConfigError, match="^shard_group_size=2 must divide the world size 3"):
        check_world_layout(cfg, 3)
    check_world_layout(load_config(None, ["num_directions=3"], None), 4)  # auto: a layout that fits is chosen


def test_the_first_signal_is_acknowledged_at_once_in_one_line(capfd, monkeypatch):
    """The first SIGTERM or Ctrl-C during a long step said nothing until the step ended (minutes on a large model):
    the handler writes one line at once (rank 0 only: every rank of a launched job gets the signal)."""
    import signal

    from curvzo_ds.train.signals import StopRequest

    monkeypatch.delenv("RANK", raising=False)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # together with the first: the same request, no second line
    assert stop.requested and stop.signal_name == "SIGTERM"
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("curvzo-ds: SIGTERM received: the run stops at the end of the step "
                                                   "in progress, after saving a checkpoint"), err
    monkeypatch.setenv("RANK", "1")
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested and capfd.readouterr().err == ""


def test_a_manifest_whose_dtype_disagrees_with_its_tensors_is_refused(tmp_path, capsys):
    """A manifest recording a dtype its rank files do not hold gave a silently lossy export and was accepted by
    `eval --resume`: verify_checkpoint (which export, eval --resume and train --resume all run first) compares each
    slice's stored dtype with the manifest's, an fp32 master copy (`master`) allowed."""
    import json

    import torch

    from curvzo_ds.checkpoint import manager as ckpt
    from curvzo_ds.checkpoint.format import verify_checkpoint
    from curvzo_ds.cli import main
    from curvzo_ds.engine import ZOEngine

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = ZOEngine(model, lambda m, x: (m(x).square().sum(), 1), method="mezo", learning_rate=1e-2, zo_eps=1e-2)
    engine.step(torch.ones(2, 4))
    path = ckpt.save_checkpoint(engine, str(tmp_path / "run"))
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert all(info["master"] is False for info in manifest["tensors"].values())
    verify_checkpoint(path)
    for dtype, master, stored in (("bfloat16", False, "F32"), ("float16", False, "F32"), ("float16", True, None),
                                  ("float32", True, None)):
        edited = json.loads(json.dumps(manifest))
        edited["tensors"]["0.weight"].update(dtype=dtype, master=master)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(edited, f)
        if stored is None:  # F32 is what an fp32 master copy of a 16-bit (or 32-bit) tensor holds: consistent
            verify_checkpoint(path)
            continue
        with pytest.raises(ConfigError, match=f"holds 0.weight as {stored}, where the manifest records dtype {dtype}"):
            verify_checkpoint(path)
        bad = edited
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(bad, f)
    assert main(["export", path, "--out", str(tmp_path / "x")]) == 2 and "manifest and the tensors disagree" in \
        capsys.readouterr().err
    older = json.loads(json.dumps(manifest))  # a checkpoint from before `master`: F32 under a 16-bit dtype passes
    for info in older["tensors"].values():
        info.pop("master")
    older["tensors"]["0.weight"]["dtype"] = "bfloat16"
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(older, f)
    verify_checkpoint(path)


def test_the_environment_variables_the_project_reads_are_checked_where_they_are_read(monkeypatch, tmp_path):
    """Bad values of the variables curvzo_ds reads gave tracebacks (DeepSpeed's own import for DS_ACCELERATOR), were
    ignored (CURVZO_DS_NOISE_KERNEL) or hung (an unresolvable MASTER_ADDR under torchrun): each is one line naming the
    variable. (The launchers' RANK, WORLD_SIZE, MASTER_PORT, NPROC, ... are the bad-input table's and
    test_reliability's.)"""
    from curvzo_ds import environment
    from curvzo_ds.shard.distributed import check_launcher_env

    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("MASTER_PORT", raising=False)  # another test's launch may have set it in this process
    for name, value, words in (
            ("CURVZO_DS_NOISE_KERNEL", "fast", "CURVZO_DS_NOISE_KERNEL='fast' is not one of auto, torch, triton"),
            ("DS_ACCELERATOR", "gpu", "DS_ACCELERATOR='gpu' is not one of DeepSpeed's accelerators (cuda, cpu"),
            ("CURVZO_DS_CACHE", str(tmp_path / "file"), "CURVZO_DS_CACHE=" + str(tmp_path / "file") + " is a file"),
            ("MASTER_ADDR", "no-such-host.invalid", "MASTER_ADDR=no-such-host.invalid (MASTER_PORT=29500) cannot be "
                                                    "resolved")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match="^the environment: " + re.escape(words)):
            environment.noise_kernel()
            environment.check_accelerator()
            environment.cache_dir()
            check_launcher_env(os.environ)
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    check_launcher_env(os.environ)
    assert environment.noise_kernel() == "auto" and environment.cache_dir().endswith("curvzo_ds")


def test_a_rank_waits_a_bounded_time_for_rank_0_and_names_where_it_looked(capsys):
    """Issue 59: a MASTER_ADDR that resolves but where no rank 0 listens left the other ranks silent until ddp_timeout
    (30 minutes). A rank other than 0 says that it waits, then stops in one line naming MASTER_ADDR and MASTER_PORT;
    it goes on as soon as the port answers, and rank 0 (or a one-rank job) does not wait."""
    import socket

    from curvzo_ds.environment import wait_for_rank0

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
        with pytest.raises(ConfigError, match=r"^the environment: rank 1 could not reach rank 0 at MASTER_ADDR="
                                              rf"127\.0\.0\.1 MASTER_PORT={port} in 2 s \(Connection refused\)"):
            wait_for_rank0(env, 2, every=0.5)  # bound, not listening: refused
        assert "rank 1 waits for rank 0 at 127.0.0.1" in capsys.readouterr().err
        wait_for_rank0({**env, "RANK": "0"}, 0.1)
        wait_for_rank0({**env, "WORLD_SIZE": "1"}, 0.1)
        srv.listen()
        wait_for_rank0(env, 2)


def test_train_help_names_the_built_in_tasks():
    """`train --help` said "built-in task name or a task directory" and named none."""
    from curvzo_ds.commands.train import keys_help
    from curvzo_ds.tasks import TASK_NAMES

    line = next(line for line in keys_help().splitlines() if line.strip().startswith("task "))
    assert all(name in line for name in TASK_NAMES) and "sst2, rte" in line, line


def test_an_absurd_horizon_is_warned_about_with_the_time_it_implies(caplog):
    """max_steps=1e8 was accepted without a word: after its first steps a run says how long the rest would take,
    when that is more than a week (once, rank 0 only)."""
    import logging

    from curvzo_ds.train.loop import HorizonWatch

    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        watch = HorizonWatch(100_000_000, rank=0)
        for step, now in enumerate([10.0, 10.5, 11.0, 11.5, 12.0], start=1):
            watch.observe(step, now)
        HorizonWatch(100_000_000, rank=1).observe(1, 0.0)
        short = HorizonWatch(300, rank=0)
        for step, now in enumerate([10.0, 10.5, 11.0, 11.5], start=1):
            short.observe(step, now)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "max_steps=100000000: at 0.5 s per step (this run's steps so far) the 99999996 steps left take about 579 days"
    ), warnings
