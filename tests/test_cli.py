"""The command line's documentation and `curvzo-ds eval`."""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from curvzo_ds.cli import build_parser, main
from curvzo_ds.config.presets import resolve_presets
from curvzo_ds.config.schema import TrainConfig, ZOConfig, key_fields
from tests.helpers import CLI, COMMON, ENV, ROOT, eval_cli, logged_eval, run_checked

KEYS = [f.name for f in key_fields(TrainConfig)]


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for f in key_fields(TrainConfig):
        assert f"  {f.name:<26} [{f.default}]" in out, f.name


def test_every_subcommand_describes_each_option(capsys):
    """Each subcommand's --help exits 0 and every argument and option in it has a help text."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"train", "eval", "export", "plot", "bench", "plan", "diagnose"} <= set(subcommands)
    for name, sub in subcommands.items():
        undescribed = [a.dest for a in sub._actions if a.dest != "help" and not a.help]
        assert not undescribed, f"curvzo-ds {name}: no help text for {undescribed}"
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"usage: curvzo-ds {name}")


def test_docs_config_lists_every_key():
    text = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in KEYS if f"| `{k}` |" not in text]
    assert not missing, f"docs/config.md lacks {missing}: regenerate its table"


def test_generated_doc_tables_are_current():
    """docs/config.md's key table and docs/deepspeed.md's refusal table are the code's (tools/make_docs.py)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_docs.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_cli_imports_neither_deepspeed_nor_transformers_and_deepspeed_skips_mlflow():
    """cli imports every command module to build its parser; a command imports DeepSpeed and transformers in its
    handler, so that --help stays quick and DeepSpeed's first log line never reaches `eval`'s stdout."""
    code = ("import sys, curvzo_ds.cli; print(sorted({'deepspeed', 'transformers'} & set(sys.modules)))\n"
            # DeepSpeed's first import leaves its autotuner's mlflow out (startup.defer_mlflow), not a user's
            "import importlib.util; importlib.util.find_spec('deepspeed')\n"  # as transformers asks first
            "import deepspeed, deepspeed.autotuning.autotuner as a; print(a.has_mlflow, 'mlflow' in sys.modules)\n"
            "import mlflow; print(mlflow.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["[]", "False", "False", "mlflow"], proc.stdout + proc.stderr



# Run in a child process: pytest's own process may hold the session's process group (conftest.one_rank_group, or
# the one DeepSpeedPlugin starts in tests/test_ds_config.py), which this test must neither meet nor destroy, so
# that the files pass in any order.
ENTRY_CHILD = """
import json, sys
import torch.distributed as dist
from curvzo_ds import cli
from curvzo_ds.shard import distributed

store = sys.argv[1]
seen = {}
for outcome in ("0", "2", "1", "unexpected"):
    def main(outcome=outcome):
        dist.init_process_group("gloo", init_method=f"file://{store}-{outcome}", rank=0, world_size=1)
        distributed.CREATED[0] = True  # as init_distributed marks a group a command made
        if outcome == "unexpected":
            raise RuntimeError("unexpected")
        return int(outcome)
    cli.main = main
    try:
        cli.entry()
    except SystemExit as e:
        seen[outcome] = [e.code, dist.is_initialized()]
    if dist.is_initialized():
        dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_entry_leaves_the_process_group_on_every_path(tmp_path):
    """A return from main (done, a bad input, a RunEnded) destroys the process group that the command made (one
    that main's caller made is the caller's: conftest.one_rank_group's survives in-process commands); an unexpected
    exception prints its traceback, aborts the group (no collective) and exits 1, as an uncaught exception does."""
    proc = subprocess.run([sys.executable, "-c", ENTRY_CHILD, str(tmp_path / "store")], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"0": [0, False], "2": [2, False], "1": [1, False], "unexpected": [1, False]}, proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "RuntimeError: unexpected" in proc.stderr

def eval_checkpoint(out: pathlib.Path, step: int) -> dict:
    """`curvzo-ds eval --resume out/checkpoint-<step>` with the run's settings; its eval.json."""
    ev_dir = pathlib.Path(f"{out}-eval-{step}")
    args = [a.replace(str(out), str(ev_dir)) for a in COMMON] + ["--set", f"output_dir={ev_dir}"]
    assert main(["eval", *args, "--resume", str(out / f"checkpoint-{step}")]) == 0
    return json.loads((ev_dir / "eval.json").read_text())


def test_eval_prints_the_json_alone_without_ds_accelerator_and_ends_quietly_on_a_closed_pipe(straight, tmp_path):
    """Issue 38 §1: the README's `curvzo-ds eval --resume CKPT | jq ...` on a CPU machine, where DS_ACCELERATOR is
    not set: DeepSpeed's "Setting accelerator to CPU" goes to stderr, not into the JSON, and a reader that stops
    early (`| head -c 1`) ends the command without a BrokenPipeError traceback. Real processes: DS_ACCELERATOR is
    read while DeepSpeed is imported."""
    env = {k: v for k, v in ENV.items() if k != "DS_ACCELERATOR"}
    ckpt = straight[0] / "checkpoint-12"
    proc = subprocess.run([sys.executable, "-m", "curvzo_ds.cli", "eval", "--resume", str(ckpt)], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 12, proc.stdout[:500]  # raises if anything else reached stdout
    piped = subprocess.run(["bash", "-c", 'set -o pipefail; "$0" -m curvzo_ds.cli eval --resume "$1" | head -c 1',
                            sys.executable, str(ckpt)], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                           timeout=400)
    assert piped.returncode == 0 and piped.stdout == "{", piped.stderr[-3000:]
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr[-3000:]


def test_eval_of_a_checkpoint_equals_the_training_eval(one_rank_group, straight):
    """`curvzo-ds eval --resume CKPT` recomputes the dev and test metrics logged at that step."""
    out, _ = straight
    result = eval_checkpoint(out, 12)
    logged = logged_eval(out, 12)
    assert result["step"] == 12 and set(logged) == {"dev", "test"}
    for split in ("dev", "test"):
        assert result[split]["accuracy"] == logged[split]["accuracy"]
        assert result[split]["loss"] == logged[split]["loss"]


def test_the_reported_test_metric_is_the_best_dev_checkpoints(one_rank_group, straight):
    """As MeZO: summary.json's test metric is the evaluation of the best-dev checkpoint, not of the last step."""
    out, summary = straight
    best = summary["best_dev"]["step"]
    assert best != summary["steps"] and summary["test"] != summary["final"]["test"]  # the two can be told apart
    result = eval_checkpoint(out, best)
    assert result["step"] == best
    assert result["test"] == summary["test"]
    assert result["dev"]["accuracy"] == summary["best_dev"]["accuracy"]


@pytest.mark.slow
def test_eval_takes_what_it_evaluates_from_the_checkpoint(tmp_path):
    """On a run of another task than the demo's, `eval --resume CKPT` alone evaluates that task (the numbers the
    run logged at that step), prints only JSON and writes eval.json next to the checkpoint."""
    out = tmp_path / "sst2"
    run_checked(CLI + ["--set", "task=sst2", "--set", "data_dir=samples", "--set", "max_steps=4",
                       "--set", "save_steps=4", "--set", "eval_steps=4", "--set", "global_batch_size=4",
                       "--set", "micro_batch_size=2", "--set", "report_to=none", "--set", f"output_dir={out}"])
    result = eval_cli(out / "checkpoint-4", tmp_path)
    logged = logged_eval(out, 4)
    assert result["step"] == 4 and result["dev"]["loss"] == logged["dev"]["loss"]
    assert result["test"]["accuracy"] == logged["test"]["accuracy"]


def test_presets_are_mezos_for_full_and_lora_runs_and_give_way_to_the_user():
    full = resolve_presets(TrainConfig(model="facebook/opt-13b"))
    lora = resolve_presets(TrainConfig(model="facebook/opt-13b", lora=True))
    demo = resolve_presets(TrainConfig())
    assert (full.learning_rate, full.zo_eps, full.max_steps) == (1e-6, 1e-3, 20000)
    assert (lora.learning_rate, lora.zo_eps, lora.lora_target_modules) == (5e-5, 1e-2, ["q_proj", "v_proj"])
    assert (demo.learning_rate, demo.zo_eps, demo.max_steps, demo.eval_steps) == (3e-4, 1e-2, 300, 100)
    assert resolve_presets(TrainConfig(lora=True)).learning_rate == 1e-2  # measured: docs/measurements.md
    # loss_std's learning_rate is eta, a step length in units of z: MeZO's 1e-6 there would move nothing
    std = dict(model="facebook/opt-13b", difference="rloo", num_directions=8, step_normalization="loss_std")
    assert resolve_presets(TrainConfig(**std)).learning_rate == 1e-3
    assert resolve_presets(TrainConfig(**std, learning_rate=2e-3)).learning_rate == 2e-3
    mine = resolve_presets(TrainConfig(model="facebook/opt-13b", learning_rate=1e-7, zo_eps=1e-4, max_steps=5))
    assert (mine.learning_rate, mine.zo_eps, mine.max_steps) == (1e-7, 1e-4, 5)
    given = TrainConfig()
    assert resolve_presets(given) is not given and given.learning_rate is None and given.max_steps is None
    # Issue 37 §5: at MeZO's rate CurvZO's step is corrected (max_weight); the demo's own rate is the paper's step's.
    assert (full.rate_correction, lora.rate_correction, demo.rate_correction) == ("max_weight", "max_weight", "none")
    assert ZOConfig().rate_correction == "max_weight"  # the library's default rate is MeZO's too
    paper = resolve_presets(TrainConfig(model="facebook/opt-13b", rate_correction="none"))
    assert paper.rate_correction == "none"
    from curvzo_ds.config.resolve import engine_config

    with pytest.raises(ValueError, match="^rate_correction unset"):  # an engine never takes an unfilled preset
        engine_config(TrainConfig(learning_rate=1e-6, zo_eps=1e-3, max_steps=5), {})


def test_the_fewest_forwards_preset_file_trains_rloo8_with_loss_std(tmp_path):
    """configs/fewest_forwards.yaml (issue 47: the setting the protocol measured best) is what README's "Which
    method" names, and a run from it takes the normalised RLOO step: each step's record has the 8 losses' spread."""
    from curvzo_ds.config.load import load_config

    preset = ROOT / "configs" / "fewest_forwards.yaml"
    cfg = load_config(str(preset), ["model=facebook/opt-13b"], None)
    assert (cfg.method, cfg.difference, cfg.num_directions, cfg.step_normalization, cfg.learning_rate) == (
        "mezo", "rloo", 8, "loss_std", 5.66e-3)
    # issue 57: the file states the horizon its constant eta was measured for, and its schedule
    assert (cfg.max_steps, cfg.lr_scheduler_type) == (50, "constant")
    args = [a for a in COMMON if a != "method=curvzo"][1:]  # the file's method, not the tests' default
    run_checked([*CLI, "--config", str(preset), *args, "--set", "max_steps=2", "--set", f"output_dir={tmp_path}"])
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss_std" in r]
    assert len(steps) == 2 and all(r["loss_std"] > 0 for r in steps)
    run = json.loads((tmp_path / "config.json").read_text())
    assert (run["difference"], run["num_directions"], run["step_normalization"]) == ("rloo", 8, "loss_std")


def test_the_keys_sources_survive_replace_and_stay_out_of_the_files_and_the_key_list():
    """Issue 36: where each key came from is a field (dataclasses.replace keeps it, as the DeepSpeed mapping
    needs), not a key: not in config.json / run_config.json (to_dict), --help, or what --set accepts."""

    from curvzo_ds.commands.train import keys_help
    from curvzo_ds.config.fields import field_names, set_sources, sources_of, to_dict
    from curvzo_ds.config.load import build
    from curvzo_ds.errors import ConfigError

    cfg = set_sources(TrainConfig(), {"learning_rate": "--set"})
    moved = resolve_presets(dataclasses.replace(cfg, micro_batch_size=2))
    assert sources_of(moved) == {"learning_rate": "--set"}
    assert "sources" not in to_dict(moved) and "sources" not in field_names()
    assert " sources " not in keys_help()
    with pytest.raises(ConfigError, match="unknown key 'sources'"):
        build(TrainConfig, {"sources": {}})


def test_the_jit_cache_is_per_python_environment_and_the_users_setting_wins(monkeypatch, tmp_path):
    """Issue 28 §11: two environments (sys.prefix) get two TORCH_EXTENSIONS_DIRs under the cache, so they never
    rebuild each other's DeepSpeed op; a TORCH_EXTENSIONS_DIR set by the user is kept."""
    from curvzo_ds import startup

    monkeypatch.setenv("CURVZO_DS_CACHE", str(tmp_path))
    dirs = []
    for prefix in ("/opt/venvs/a", "/opt/venvs/b", "/opt/venvs/a"):
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(sys, "prefix", prefix)
        dirs.append(startup.extensions_dir())
        assert os.environ["TORCH_EXTENSIONS_DIR"] == dirs[-1]
    assert dirs[0] == dirs[2] != dirs[1] and all(d.startswith(str(tmp_path / "torch_extensions")) for d in dirs)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/my/own")
    assert startup.extensions_dir() == "/my/own"


def test_a_checkpoint_from_before_rate_correction_counts_as_the_papers_step():
    """A run_config.json written before the key existed ran the paper's step: resuming it with the preset
    (max_weight outside the demo) names the change; with rate_correction=none it agrees."""
    from curvzo_ds.config.fields import to_dict
    from curvzo_ds.config.load import differences

    hub = to_dict(resolve_presets(TrainConfig(model="facebook/opt-13b")))
    saved = {k: v for k, v in hub.items() if k != "rate_correction"}
    assert differences(saved, hub, ["rate_correction"]) == ["rate_correction: 'none' -> 'max_weight'"]
    assert differences(saved, {**hub, "rate_correction": "none"}, ["rate_correction"]) == []


def test_no_option_is_taken_from_an_abbreviation(tmp_path, capsys):
    """Issue 45 §2: `curvzo-ds train --resum` was argparse's prefix match for --resume, and started a full default run.
    Every parser refuses prefixes, and an unknown option is one line naming the one it resembles."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert parser.allow_abbrev is False and all(sub.allow_abbrev is False for sub in subcommands.values())
    for name, sub in subcommands.items():
        required = [a for a in sub._actions if a.required and a.option_strings]
        for option in [o for a in sub._actions for o in a.option_strings if o.startswith("--") and len(o) > 4]:
            given = [x for a in required if option not in a.option_strings for x in (a.option_strings[0], "1")]
            positionals = ["x"] * len(sub._get_positional_actions())
            try:
                _, unknown = sub.parse_known_args([*given, *positionals, option[:-1], "1"])
            except SystemExit:  # a required option left out: its abbreviation would have been taken for it
                continue
            assert option[:-1] in unknown, (name, option)
    capsys.readouterr()  # argparse's usage lines of the left-out required options
    out = tmp_path / "runs"
    assert main(["train", "--resum", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["curvzo-ds train: error: unrecognized arguments: --resum (did you mean --resume? options are never "
                   "abbreviated)"], err
    assert not out.exists()


def test_a_bad_launcher_environment_is_one_line_before_any_process_group(tmp_path, capsys, monkeypatch):
    """Issue 45 §3: WORLD_SIZE=abc and MASTER_PORT=99999 were tracebacks, RANK=5 with WORLD_SIZE=2 waited for ranks
    that never come until ddp_timeout (1800 s): each is refused at start, naming the variable."""
    cases = [({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number >= 1"),
             ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number >= 1"),
             ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number >= 0"),
             ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a port (1-65535)"),
             ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 is not below WORLD_SIZE=2 (the ranks are 0..1)")]
    for env, words in cases:
        with monkeypatch.context() as m:
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
                m.delenv(key, raising=False)
            for key, value in env.items():
                m.setenv(key, value)
            assert main(["train", "--set", f"output_dir={tmp_path / 'run'}"]) == 2, env
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("curvzo-ds train: error: the launcher's environment: ") \
            and words in err[0], (env, err)
    assert not (tmp_path / "run").exists()


def test_an_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C before training, or a second SIGINT or SIGTERM 5 s after the first (train/signals.py): no traceback,
    one line, 130 as a shell reports a Ctrl-C, and no interpreter teardown (os._exit)."""
    from curvzo_ds import cli

    def interrupted():
        raise KeyboardInterrupt

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(cli, "main", interrupted)
    monkeypatch.setattr(cli.os, "_exit", leave)
    monkeypatch.setattr(cli.faulthandler, "enable", lambda: None)  # pytest's captured stderr has no file descriptor
    with pytest.raises(SystemExit) as exit_info:
        cli.entry()
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert err.startswith("curvzo-ds: interrupted: stopped at once") and err.count("\n") == 1, err


def test_one_reader_of_run_config_json_refuses_a_damaged_one_in_one_line(one_rank_group, tmp_path, capsys):
    """Issue 44/45: resume, `eval --resume` and export read a checkpoint's run_config.json through one function
    (config.load.read_run_config): keys coerced, unknown keys left out, and a file that is not JSON, not an object,
    or holds a value of the wrong type is one line; `eval --resume` of it is exit 2 before anything is built."""
    import torch

    from curvzo_ds.checkpoint import manager as ckpt
    from curvzo_ds.config.load import read_run_config, saved_config
    from curvzo_ds.engine import ZOEngine
    from curvzo_ds.errors import ConfigError

    def checkpoint(name: str, text: str) -> str:
        engine = ZOEngine(torch.nn.Linear(2, 1), lambda m, b: (m(b).sum(), 1), method="mezo")

        def run_config(directory):
            with open(os.path.join(directory, "run_config.json"), "w") as f:
                f.write(text)

        return ckpt.save_checkpoint(engine, str(tmp_path / name), write_extra=run_config)

    good = checkpoint("good", json.dumps({"learning_rate": 1, "seed": 3.0, "from_a_later_version": 1}))
    assert read_run_config(good) == {"learning_rate": 1.0, "seed": 3}
    assert saved_config(good).seed == 3
    for name, text, words in (("not-json", "{not json", "run_config.json is not valid JSON"),
                              ("a-list", "[1]", "run_config.json holds no JSON object"),
                              ("bad-type", json.dumps({"seed": "three"}), "run_config.json: seed='three'")):
        path = checkpoint(name, text)
        with pytest.raises(ConfigError, match=None) as refused:
            read_run_config(path)
        assert words in str(refused.value), str(refused.value)
        assert main(["eval", "--resume", path]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("curvzo-ds eval: error: ") and words in err[0], err
    assert read_run_config(str(tmp_path), required=False) is None
    with pytest.raises(ConfigError, match="no run_config.json there"):
        read_run_config(str(tmp_path))
