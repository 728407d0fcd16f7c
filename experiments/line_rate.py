"""What `learning_rate: auto`'s line rule measures on a model (docs/algorithm.md, "The rate of a normalised step"):
the greedy rate along the step's own direction before the first step (algo/rate.py's `line_rate`), per seed, for
loss_std RLOO-8 and for running_rms, and the rate the rule takes from it (x auto_rate_fraction), as the engine chose,
or the rule's refusal (its slope and curvature, in the row).

    nice -n 19 python -m experiments.line_rate --config small                  # experiments/pipeline.py's model
    nice -n 19 python -m experiments.line_rate --config smollm --tasks sentiment topic   # SmolLM2-135M
    nice -n 19 python -m experiments.line_rate --variant noisy --seeds 2 --probes 16 32 64  # more probes, 20% flipped

The runs are built as experiments/horizon.py builds them (its Setup and base configs); nothing is trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile

from experiments.core import Log, arm_config, variant_task
from experiments.horizon import ARMS, NOISY, Setup


def chosen_rate(setup: Setup, task: str, arm: str, seed: int, probes: int,
                variant: dict | None = None) -> tuple[float | None, float | None, str]:
    """(the greedy rate, the rate the rule chose, its reason) of `arm` on `task` (with `variant` applied by
    experiments/core.py's `variant_task`, as run_curve applies it) at `seed` over `probes` probes, as PlainRun's
    engine chose it at the default auto_rate_fraction; (None, None, the refusal) where the rule refused."""
    from curvzo_ds.errors import RateRefused
    from curvzo_ds.train.plain import PlainRun

    base = setup.base(setup.model, setup.task_dir(task), 1e-3, seed, 1)
    with tempfile.TemporaryDirectory(prefix="line-rate-task-") as tmp:
        task_dir = variant_task(base.task, variant, tmp)
        try:
            run = PlainRun(dataclasses.replace(arm_config(base, ARMS[arm]), task=task_dir, auto_rate_probes=probes))
        except RateRefused as e:
            return None, None, str(e)
    rate = run.engine.rate
    return rate.greedy, rate.base, rate.reason


def main(argv=None) -> None:
    from curvzo_ds.algo.rate import AUTO_RATE_PROBES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["small", "smollm", "ci"], default="small")
    parser.add_argument("--tasks", nargs="+", default=["sentiment"])
    parser.add_argument("--arms", nargs="+", default=["std-auto-plateau", "rms-auto-plateau"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--variant", choices=["clean", "noisy"], default="clean",
                        help="noisy: 20%% of the train labels flipped, as experiments/horizon.py's noisy cell")
    parser.add_argument("--probes", type=int, nargs="+", default=[AUTO_RATE_PROBES])
    parser.add_argument("--model", help="a model directory instead (the test's tiny Llama)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    logging.getLogger("curvzo_ds").setLevel(logging.WARNING)
    cache = os.path.expanduser("~/.cache/curvzo_ds/" + ("real_model" if args.config == "smollm" else "pipeline"))
    from deepspeed.accelerator import get_accelerator

    get_accelerator()  # its "Setting accelerator to CPU" goes to stdout: before the table, not inside it
    with tempfile.TemporaryDirectory(prefix="line-rate-") as tmp:
        setup = Setup(args.config, cache, args.model, tmp, Log(os.path.join(tmp, "log")))
        print("| task | variant | arm | seed | probes | greedy rate | the rule's rate | slope, curvature (means) |")
        print("|---|---|---|---|---|---|---|---|")
        variant = NOISY if args.variant == "noisy" else None
        for task in args.tasks:
            for arm in args.arms:
                for seed in args.seeds:
                    for probes in args.probes:
                        greedy, rule, reason = chosen_rate(setup, task, arm, seed, probes, variant)
                        if greedy is None:  # "...: along the step's direction on 16 probes the loss falls (...) ..."
                            cells = f"refused | | {reason.partition(' probes ')[2].split(', so')[0] or reason}"
                        else:
                            cells = f"{greedy:.4g} | {rule:.3g} | {reason.split('(mean ')[1].rstrip(')')}"
                        print(f"| {task} | {args.variant} | {arm} | {seed} | {probes} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
