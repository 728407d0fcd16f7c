"""`curvzo-ds eval`: evaluate a checkpoint (--resume) on dev and test, or the untrained model, and print the result
as JSON on stdout, alone (`curvzo-ds eval ... | jq`); everything else goes to stderr."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from curvzo_ds.commands.train import keys_help, run_options
from curvzo_ds.config.fields import set_sources
from curvzo_ds.config.load import (
    EVAL_FROM_CHECKPOINT,
    build,
    differences,
    key_sources,
    load_config,
    read_run_config,
    read_values,
)
from curvzo_ds.config.resolve import resolve
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (--resume) on dev and test; without --resume, the untrained "
                                    "model (printed only, and refused where output_dir holds a run)",
                       epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    run_options(p)
    p.set_defaults(handler=handle)


def handle(args) -> None:
    values = read_values(args.config, args.set, args.deepspeed)
    if args.resume:
        cfg, resume = eval_config(values, args.resume, key_sources(args.config, args.set, values))
    else:
        cfg, resume = load_config(args.config, args.set, args.deepspeed), None
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


def eval_config(values: dict, resume, sources: dict | None = None) -> tuple[TrainConfig, str]:
    """`eval --resume [CKPT]`: the checkpoint (resolved and verified once, here) and its run config, with the given
    keys that do not change what is evaluated (batch size, num_eval, output path, ...). eval.json goes into the
    checkpoint unless output_dir is set."""
    from curvzo_ds.checkpoint.manager import CheckpointManager

    out = values.get("output_dir", TrainConfig.output_dir)
    path = CheckpointManager(out).resume_path(resume)  # True: the newest that verifies; a path: it, verified
    if path is None:
        raise ConfigError(f"--resume: no complete checkpoint in output_dir={out}; pass --resume CHECKPOINT")
    saved = read_run_config(path)
    changed = differences(saved, values, EVAL_FROM_CHECKPOINT)
    if changed:
        raise ConfigError(f"eval --resume evaluates the checkpoint's run, so {'; '.join(changed)} cannot be changed: "
                          "drop those --set (batch size, num_eval and output_dir may change)")
    merged = {**saved, **values}
    if "output_dir" not in values:
        merged["output_dir"] = path  # eval.json next to what it evaluates
    return resolve(set_sources(build(TrainConfig, merged), sources or {})), path


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
