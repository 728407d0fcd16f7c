"""`curvzo-ds train`: train a model, as one rank of a launcher's job or alone (the run is curvzo_ds/train/run.py's,
its loop train/loop.py's). Its options and the key list of its --help are eval's too."""

from __future__ import annotations

import argparse
import dataclasses

from curvzo_ds.config.load import load_config
from curvzo_ds.config.schema import TrainConfig, key_docs, key_fields
from curvzo_ds.errors import ConfigError


def keys_help() -> str:
    """The epilog of `train --help` and `eval --help`: every configuration key with its default and doc."""
    docs = key_docs()
    lines = ["configuration keys (--set KEY=VALUE or a YAML file; default in brackets):"]
    for f in key_fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"  {f.name:<26} [{default}] {docs.get(f.name, '')}".rstrip())
    lines.append("None means: taken from a preset (demo model, full or LoRA; see docs/config.md).")
    return "\n".join(lines)


def run_options(p: argparse.ArgumentParser) -> None:
    """The options of a run's configuration, shared by train and eval."""
    p.add_argument("--config", action="append", metavar="FILE",
                   help="a YAML file of key: value; repeat it to merge several in order (a later file wins, --set "
                        "over all)")
    p.add_argument("--deepspeed", help="your DeepSpeed config (JSON); each key honoured, mapped or refused")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from CHECKPOINT, or from the newest complete one in output_dir")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (one rank of a launcher's job, or alone)", epilog=keys_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    run_options(p)
    p.add_argument("--check", action="store_true",
                   help="only read and validate the configuration, then exit: 0, or 2 with the one-line error (the "
                        "launch/ scripts run it once before they start the ranks)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="with --check: the ranks the launcher will start, so that a layout the ranks would refuse "
                        "(shard_group_size, num_directions) is refused here first")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    cfg = load_config(args.config, args.set, args.deepspeed)
    if args.world_size is not None and not args.check:
        raise ConfigError("--world-size goes with --check only (a launcher sets the world size of a run)")
    if args.check:
        preflight(cfg, args.world_size)
        return
    from curvzo_ds.train.run import run_train  # DeepSpeed is imported with it: only when a run starts

    run_train(cfg, args.resume)


def preflight(cfg, world_size: int | None = None) -> None:
    """`train --check`, beyond the config: what one process can refuse before any rank starts, so that a launcher
    never starts ranks that would all refuse it (and print its own traceback): the launcher's environment, an
    explicit shard_group_size that does not divide `world_size` or whose replica groups cannot share
    num_directions (the rule the ranks apply, layout/choice.py), float16 where DeepSpeed's accelerator has none, and
    the task, tokenizer and data with the checks each rank repeats (not the model's, which needs the model built,
    nor the batch's, which a DeepSpeed file can still set)."""
    import logging
    import os

    from curvzo_ds.environment import noise_kernel
    from curvzo_ds.shard.distributed import check_launcher_env
    from curvzo_ds.train.inputs import check_dtype, checked_data

    check_launcher_env(os.environ)  # MASTER_PORT, and a rank's variables where a launcher set them already
    noise_kernel()  # CURVZO_DS_NOISE_KERNEL, which the ranks read when they build the engine
    if world_size is not None:
        check_world_layout(cfg, world_size)
    check_dtype(cfg.dtype)
    quiet = logging.getLogger("curvzo_ds")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the ranks give the data's warnings; here only refusals
    try:
        checked_data(cfg)
    finally:
        quiet.setLevel(level)


def check_world_layout(cfg, world_size: int) -> None:
    """An explicit shard_group_size against the world size the launcher will start: it must divide it, and its
    replica groups must share num_directions evenly (`check_directions`, the ranks' own rule). `auto` and null
    always give a layout that passes."""
    from curvzo_ds.layout.choice import check_directions

    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: use an integer >= 1")
    group = cfg.shard_group_size
    if group in ("auto", None):
        return
    if world_size % group:
        raise ConfigError(f"shard_group_size={group} must divide the world size {world_size}: set it to the ranks of "
                          "one node, or leave it unset (auto)")
    check_directions(world_size, None if group == world_size else group, cfg.num_directions)
