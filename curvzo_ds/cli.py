"""`curvzo-ds`: train | eval | export | plot | bench | plan | diagnose (docs/contracts.md).

`train` and `eval` run inside the current process: alone it is a one-rank job, under
deepspeed / torchrun / accelerate launch / mpirun / srun it is one rank of the job.
A bad configuration prints one line naming the key or file and the fix, and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import re
import sys

from curvzo_ds.config.schema import (
    EVAL_FROM_CHECKPOINT,
    TrainConfig,
    build,
    coerce,
    differences,
    field_names,
    key_docs,
    set_sources,
)
from curvzo_ds.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED, ConfigError, RunEnded
from curvzo_ds.startup import extensions_dir


def _keys_help() -> str:
    docs = key_docs()
    lines = ["configuration keys (--set KEY=VALUE or a YAML file; default in brackets):"]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"  {f.name:<26} [{default}] {docs.get(f.name, '')}".rstrip())
    lines.append("None means: taken from a preset (demo model, full or LoRA; see docs/config.md).")
    return "\n".join(lines)


def read_values(config_file: str | None, sets: list[str], deepspeed: str | None) -> dict:
    """The keys given by --config, --set and --deepspeed, coerced to their types (not yet validated together)."""
    import yaml

    values: dict = {}
    if config_file:
        if os.path.isdir(config_file):
            raise ConfigError(f"--config {config_file}: is a directory; name the YAML file inside it")
        if not os.path.isfile(config_file):
            raise ConfigError(f"--config {config_file}: no such file")
        loaded = read_yaml(config_file)
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {config_file}: must be a mapping of key: value")
        values.update(loaded)
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE, for example --set learning_rate=1e-6")
        key, raw = item.split("=", 1)
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            values[key.strip()] = raw
    if deepspeed:
        values["deepspeed"] = deepspeed
    for key in ("model", "tokenizer", "task", "data_dir", "deepspeed"):
        path = values.get(key)
        must_exist = key == "deepspeed" or (key == "data_dir" and path not in (None, "hub", "samples"))
        if must_exist and path is not None and not os.path.exists(str(path)):
            raise ConfigError(f"{key}={path}: no such file or directory")
    return {k: coerce(TrainConfig, k, v) for k, v in values.items()}


def read_yaml(path: str):
    """A YAML file's contents; a duplicate key or a syntax error is a one-line ConfigError naming its line."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, str) and key in first:
                    raise ConfigError(f"--config {path} line {line}: duplicate key {key!r} (first at line "
                                      f"{first[key]}): keep one")
                first.setdefault(key, line)
            return super().construct_mapping(node, deep)

    try:
        with open(path) as f:
            return yaml.load(f, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}{where}: not valid YAML ({reason})") from None


def key_sources(config_file: str | None, sets: list[str], values: dict) -> dict[str, str]:
    """Where each explicitly given key came from: "--set" (a later --set wins over the file) or "--config FILE"."""
    given = {item.split("=", 1)[0].strip() for item in sets if "=" in item}
    return {k: "--set" if k in given else f"--config {config_file}" for k in values if k != "deepspeed"}


def load_config(config_file: str | None, sets: list[str], deepspeed: str | None) -> TrainConfig:
    values = read_values(config_file, sets, deepspeed)
    cfg = build(TrainConfig, values)
    set_sources(cfg, key_sources(config_file, sets, values))
    cfg.validate()
    return cfg


def eval_config(values: dict, resume) -> tuple[TrainConfig, str]:
    """`eval --resume [CKPT]`: the checkpoint's run config, with the given keys that do not change what is
    evaluated (batch size, num_eval, output path, ...). eval.json goes into the checkpoint unless output_dir is set."""
    from curvzo_ds.checkpoint.manager import CheckpointManager

    path = resume
    if resume is True:
        out = values.get("output_dir", TrainConfig.output_dir)
        path = CheckpointManager(out).resume_path(True)
        if path is None:
            raise ConfigError(f"--resume: no complete checkpoint in output_dir={out}; pass --resume CHECKPOINT")
    run_config = os.path.join(str(path), "run_config.json")
    if not os.path.isfile(run_config):
        raise ConfigError(f"--resume {path}: no run_config.json there; pass a checkpoint-<step> directory that "
                          "curvzo-ds train wrote")
    with open(run_config) as f:
        saved = json.load(f)
    changed = differences(saved, values, EVAL_FROM_CHECKPOINT)
    if changed:
        raise ConfigError(f"eval --resume evaluates the checkpoint's run, so {'; '.join(changed)} cannot be changed: "
                          "drop those --set (batch size, num_eval and output_dir may change)")
    known = set(field_names())
    merged = {k: v for k, v in saved.items() if k in known}
    merged.update(values)
    if "output_dir" not in values:
        merged["output_dir"] = str(path)  # eval.json next to what it evaluates
    cfg = build(TrainConfig, merged)
    cfg.validate()
    return cfg, str(path)


# One function per subcommand registers its parser and its handler (accelerate's commands/ shape); `main` only
# parses, dispatches and turns the errors a user can fix into one line.


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML file of key: value")
    p.add_argument("--deepspeed", help="your DeepSpeed config (JSON); each key honoured, mapped or refused")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from CHECKPOINT, or from the newest complete one in output_dir")


def train_command(sub) -> None:
    p = sub.add_parser("train", help="train a model (one rank of a launcher's job, or alone)", epilog=_keys_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _run_options(p)
    p.set_defaults(handler=_train)


def _train(args) -> None:
    cfg = load_config(args.config, args.set, args.deepspeed)
    from curvzo_ds.train.run import run_train

    run_train(cfg, args.resume)


def eval_command(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (--resume) on dev and test; without --resume, the untrained "
                                    "model (printed only, and refused where output_dir holds a run)",
                       epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _run_options(p)
    p.set_defaults(handler=_eval)


def _eval(args) -> None:
    values = read_values(args.config, args.set, args.deepspeed)
    cfg, resume = eval_config(values, args.resume) if args.resume else (load_config(
        args.config, args.set, args.deepspeed), None)
    set_sources(cfg, key_sources(args.config, args.set, values))
    # Only the JSON result goes to stdout, so that `curvzo-ds eval | jq` works. DeepSpeed is imported inside too:
    # without DS_ACCELERATOR it prints "Setting accelerator to CPU" as it loads, and its logger keeps the stdout
    # it finds then.
    with stdout_to_stderr() as stdout:
        from curvzo_ds.train.run import run_eval

        results = run_eval(cfg, resume)
        if results is not None:
            with contextlib.suppress(BrokenPipeError):  # a reader that stopped early (`| head -c 1`): end quietly
                stdout.write(json.dumps(results, indent=1) + "\n")
                stdout.flush()


def export_command(sub) -> None:
    p = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint")
    p.add_argument("checkpoint", help="a checkpoint directory (output_dir/checkpoint-N)")
    p.add_argument("--out", required=True, help="the directory to write (from_pretrained loads it)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA runs: write the merged model to --out itself and the adapter to --out/adapter")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out (the new export is renamed into place when complete)")
    p.set_defaults(handler=_export)


def _export(args) -> None:
    from curvzo_ds.commands.export import export_checkpoint

    for line in export_checkpoint(args.checkpoint, args.out, args.merge_lora, args.overwrite):
        print(line)


def plot_command(sub) -> None:
    p = sub.add_parser("plot", help="draw loss and evaluation curves of runs to a PNG")
    p.add_argument("run_dirs", nargs="+", help="one or more run directories (output_dir), compared by colour")
    p.add_argument("--out", help="the PNG to write (default: metrics.png in the first run directory)")
    p.set_defaults(handler=_plot)


def _plot(args) -> None:
    from curvzo_ds.commands.plot import plot_runs

    print(plot_runs(args.run_dirs, args.out))


def bench_command(sub) -> None:
    p = sub.add_parser("bench", help="the benchmark suite: step time against two forwards, noise, memory, ranks",
                       description="Without options: the suite (a 28M Llama, batch 16 x 64/256/1024 tokens, MeZO, "
                                   "CurvZO at 0.3 G and adaptive CurvZO, a MeZO-style reference step, peak memory "
                                   "against inference, and ZeRO-3 at 1, 2 and 3 ranks). It prints a table.")
    p.add_argument("--out", help="also write the figures to this JSON file")
    p.add_argument("--seq-lens", default="64,256,1024", help="tokens per sequence, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (forwards and steps interleaved)")
    p.add_argument("--world-sizes", default="1,2,3", help="ZeRO-3 world sizes for the per-rank table")
    p.add_argument("--run", action="store_true", help="instead: time `--steps` steps of the run configured by --set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --run: a config key")
    p.add_argument("--steps", type=int, default=20, help="with --run or --drift: steps to take")
    p.add_argument("--drift", choices=["bfloat16", "float16"],
                   help="instead: weight drift of DTYPE steps with and without fp32_master_weights")
    p.set_defaults(handler=_bench)


def _bench(args) -> None:
    from curvzo_ds.commands.bench import drift, run_bench, run_suite

    if args.drift:
        drift(args.steps, args.drift)
    elif args.run:
        run_bench(load_config(None, args.set, None), args.steps)
    else:
        run_suite(args.out, _ints(args.seq_lens, "--seq-lens"), args.rounds, _ints(args.world_sizes, "--world-sizes"))


def plan_command(sub) -> None:
    p = sub.add_parser("plan", help="per-rank memory of a model under ZeRO-3 with CurvZO, from its config",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Per-rank memory of CurvZO under ZeRO-3 from the model's config on the meta device "
                                   "(no weights), next to first-order AdamW; the last line says fits or does not "
                                   "fit. Formulas: docs/plan.md.")
    p.add_argument("--model", default="demo", help="a model directory, a built-in name (opt-2.7b, llama2-7b, ...), "
                                                   "demo, or a hub id whose config is in the local cache (plan "
                                                   "downloads nothing)")
    p.add_argument("--world-size", type=int, required=True, help="ranks W")
    p.add_argument("--shard-group-size", type=int, help="ranks K that share one ZeRO-3 partition (default W)")
    p.add_argument("--dtype", default="auto", help="bf16, fp16 or fp32 (or bfloat16, float16, float32); auto: the "
                                                   "model config's torch_dtype, else bf16")
    p.add_argument("--offload", default="none", choices=["none", "cpu"], help="offload_param")
    p.add_argument("--batch", type=int, default=4, help="sequences per forward on one rank")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per rank to fit in (80GiB, 80GB, 40G)")
    p.add_argument("--fp32-master-weights", nargs="?", const="true", default="auto", help="auto, true or false")
    p.add_argument("--deepspeed", help="a DeepSpeed config (JSON) for the bucket, live and persistence sizes")
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"],
                   help="cpu: plan a CPU run, where --gpu-memory means the process's memory")
    p.add_argument("--label-positions", type=int, default=1, help="logit positions per sequence (the loss's)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model directory's own Python code to read its config (off by default)")
    p.set_defaults(handler=_plan)


def _plan(args) -> None:
    from curvzo_ds.commands.plan import plan

    plan(model=args.model, world_size=args.world_size, shard_group_size=args.shard_group_size, dtype=args.dtype,
         offload=args.offload, batch=args.batch, seq_len=args.seq_len, gpu_memory=args.gpu_memory,
         fp32_master=args.fp32_master_weights, deepspeed=args.deepspeed, device=args.device,
         label_positions=args.label_positions, trust_remote_code=args.trust_remote_code)


def diagnose_command(sub) -> None:
    p = sub.add_parser("diagnose", help="do the scores track curvature? CurvZO steps next to the backprop gradient",
                       description="One process, plain model (no DeepSpeed): for each estimator, --steps CurvZO steps "
                                   "of the configured run; every --probe-every steps, the backprop gradient on the "
                                   "same batch. Prints the correlations of pi and S with the block energies and "
                                   "writes diagnose.json and one PNG per estimator to --out (docs/algorithm.md).")
    p.add_argument("--config", help="a YAML file of key: value")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key")
    p.add_argument("--estimators", default="normalized,unbiased_element",
                   help="score_estimator values, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="steps per estimator")
    p.add_argument("--probe-every", type=int, default=10, help="steps between two backprop probes")
    p.add_argument("--out", required=True, help="directory for diagnose.json and the PNGs")
    p.set_defaults(handler=_diagnose)


def _diagnose(args) -> None:
    from curvzo_ds.commands.diagnose import diagnose

    cfg = load_config(args.config, args.set, None)
    for line in diagnose(cfg, [x.strip() for x in args.estimators.split(",") if x.strip()], args.steps,
                         args.probe_every, args.out):
        print(line)


COMMANDS = (train_command, eval_command, export_command, plot_command, bench_command, plan_command, diagnose_command)
# A directory or run that is not what the command needs is the user's to fix: one line (exit 2), not a traceback.
VALUE_ERRORS_ARE_THE_USERS = ("export", "plot")


def build_parser() -> argparse.ArgumentParser:
    """The `curvzo-ds` parser: one subcommand per front end, every option with its help text."""
    parser = argparse.ArgumentParser(prog="curvzo-ds", description="CurvZO zeroth-order fine-tuning on ZeRO-3.")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # The deepspeed launcher inserts --local_rank=N (before the subcommand); LOCAL_RANK has it too.
    argv = [a for a in argv if not re.match(r"--local[-_]rank=\d+$", a)]
    args = parser.parse_args(argv)
    extensions_dir()  # a JIT build cache per Python environment, unless TORCH_EXTENSIONS_DIR is set (startup.py)
    try:
        args.handler(args)
    except (ConfigError, FileNotFoundError) as e:
        _say(f"curvzo-ds {args.command}: error: {e}")
        return EXIT_BAD_INPUT
    except RunEnded as e:  # the run stopped for a stated reason: one line (the log above has the context)
        _say(f"curvzo-ds {args.command}: {'' if e.exit_code == EXIT_PREEMPTED else 'error: '}{e}")
        return e.exit_code
    except ValueError as e:
        if args.command not in VALUE_ERRORS_ARE_THE_USERS:
            raise
        _say(f"curvzo-ds {args.command}: error: {e}")
        return EXIT_BAD_INPUT
    return EXIT_OK


def _say(line: str) -> None:
    """One write per line, so that the lines of ranks sharing a terminal or log file never run together (a message
    from a library that spans lines is joined into one)."""
    sys.stderr.write(" ".join(part.strip() for part in line.splitlines()) + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def stdout_to_stderr():
    """Send everything written to stdout (Python's and file descriptor 1: libraries, compilers) to stderr for the
    body; yields a stream on the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
    finally:
        sys.stdout.flush()
        with contextlib.suppress(BrokenPipeError):  # the reader is gone: what was left unwritten is dropped
            real.close()
        os.dup2(saved, 1)
        os.close(saved)


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{option} {text}: use comma-separated integers, for example 64,256") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text}: use integers >= 1")
    return values


def mark_preempted() -> None:
    """For launch/preempt.bash: a file in CURVZO_DS_EXIT_DIR says that this rank stopped on a signal after the
    checkpoint that every rank saved (the launchers themselves exit 1 then; the scripts in launch/ exit 3)."""
    directory = os.environ.get("CURVZO_DS_EXIT_DIR")
    if directory and os.path.isdir(directory):
        with contextlib.suppress(OSError):
            open(os.path.join(directory, f"preempted-{os.getpid()}"), "w").close()


def destroy_process_group() -> None:
    """Leave the job's process group when a command returns, as torchtitan's trainer does: without it NCCL warns at
    each exit, and the interpreter's teardown can abort in gloo's threads ("terminate called without an active
    exception", pytorch/pytorch#190489). Only a command that made a group has torch.distributed imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def entry() -> None:
    """The console script and `python -m curvzo_ds.cli`: a crash in native code (a segfault or an abort in a
    communication library) prints every thread's Python stack to stderr, so a cluster job's log shows where."""
    faulthandler.enable()
    code = main()
    destroy_process_group()  # not after an exception: other ranks may still be in a collective (torchtitan#1342)
    if code == EXIT_PREEMPTED:  # every rank is here at once (run_train's barrier): leave without the interpreter's
        mark_preempted()        # teardown, which can take seconds, so that srun --kill-on-bad-exit ends no rank
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
