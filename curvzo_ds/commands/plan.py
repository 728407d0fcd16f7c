"""`curvzo-ds plan`: per-rank memory of CurvZO training, from the model's config alone (no weights), for the
layout the run would take.

The memory model is curvzo_ds/layout/memory.py (`plan_memory`, `Plan`) and the layout choice layout/choice.py;
docs/plan.md states each formula. This module is the command: its options, and the plan printed; its exit code is
1 when the plan does not fit.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from curvzo_ds.algo.differences import DIFFERENCE_SPECS, Difference
from curvzo_ds.errors import EXIT_FAILED, EXIT_OK, ConfigError

DIFFERENCES = [d.value for d in Difference]

if TYPE_CHECKING:
    from curvzo_ds.layout.choice import Layout
    from curvzo_ds.layout.memory import Plan


def register(sub) -> None:
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
    p.add_argument("--num-directions", type=int, default=1,
                   help="directions per step (num_directions): ZeRO-3 replica groups each need their own")
    p.add_argument("--difference", default="central", choices=DIFFERENCES,
                   help="the run's difference: its forwards per direction (central two, rloo one) set the "
                        "all-gather traffic per step")
    p.add_argument("--quantization", default="none",
                   help="none, 8bit or 4bit: plan a LoRA run on a base quantised by bitsandbytes (the run's "
                        "quantization; stage 0)")
    p.add_argument("--lora", action="store_true", help="plan a LoRA run (implied by --quantization 8bit or 4bit)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (lora_r)")
    p.add_argument("--lora-target-modules", default="q_proj,v_proj",
                   help="the linear layers LoRA adapts, comma-separated (lora_target_modules)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: min(W, 8)); auto's shard groups "
                                                     "stay inside a node first")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model directory's own Python code to read its config (off by default)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    """Print the plan; the exit code is 0 when it fits and 1 when it does not (docs/plan.md), so a script can branch."""
    if (args.lora or args.quantization != "none") and args.lora_r < 1:
        raise ConfigError(f"--lora-r {args.lora_r}: use an integer >= 1")
    result = plan(model=args.model, world_size=args.world_size, shard_group_size=args.shard_group_size,
                  dtype=args.dtype, offload=args.offload, batch=args.batch, seq_len=args.seq_len,
                  gpu_memory=args.gpu_memory, fp32_master=args.fp32_master_weights, deepspeed=args.deepspeed,
                  device=args.device, label_positions=args.label_positions, trust_remote_code=args.trust_remote_code,
                  num_directions=args.num_directions, difference=args.difference, gpus_per_node=args.gpus_per_node,
                  quantization=args.quantization,
                  lora_r=args.lora_r if args.lora or args.quantization != "none" else 0,
                  lora_target_modules=tuple(m.strip() for m in args.lora_target_modules.split(",") if m.strip()))
    return EXIT_OK if result.fits else EXIT_FAILED


def plan(num_directions: int = 1, gpus_per_node: int | None = None, difference: str = "central", **kwargs) -> Plan:
    """`curvzo-ds plan`: the layout the run takes (`zero_stage: auto`, layout/choice.py's `plan_layouts`, unless
    --shard-group-size names one), its per-rank table, the other layouts that fit (`layout_lines`, their all-gather
    traffic counted with `difference`'s forwards), then its verdict (the last line says `fits` or `does not fit`);
    return the plan of that layout."""
    from curvzo_ds.layout.choice import Layout, check_directions, plan_layouts
    from curvzo_ds.layout.memory import parse_memory, plan_memory  # transformers comes with it: imported here

    if num_directions < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise ConfigError(f"--num-directions {num_directions} / --gpus-per-node {gpus_per_node}: use integers >= 1")
    fewest = DIFFERENCE_SPECS[Difference(difference)].min_directions
    if num_directions < fewest:
        raise ConfigError(f"--difference {difference} needs --num-directions {fewest} or more (its baseline is the "
                          f"other directions' losses), not {num_directions}")
    kwargs["num_directions"] = num_directions
    world, memory = kwargs["world_size"], kwargs.get("gpu_memory", "80GiB")
    memory = parse_memory(memory) if isinstance(memory, str) else int(memory)
    if kwargs.get("shard_group_size") is None:  # the layout auto takes, planned; the others as alternatives
        rest = {k: v for k, v in kwargs.items() if k not in ("world_size", "shard_group_size", "gpu_memory",
                                                             "num_directions")}
        chosen, fits = plan_layouts(world, memory, gpus_per_node or min(world, 8), num_directions, difference,
                                    **rest)
        kwargs["shard_group_size"] = 1 if chosen.zero_stage == 0 else chosen.shard_group_size
    else:
        result = plan_memory(**kwargs)
        group = kwargs["shard_group_size"]
        try:  # the rule train applies (layout/choice.py), before any rank starts: the same words
            check_directions(world, group, num_directions)
        except ConfigError as e:
            raise ConfigError(f"refused: {e}: train refuses this layout; use --num-directions a multiple of "
                              f"{world // group}, or another --shard-group-size") from None
        chosen = Layout(3, group, world // group, f"shard_group_size={group} (--shard-group-size)", result.total)
        fits = []
    result = plan_memory(**kwargs)
    *body, verdict = result.format().split("\n")
    print("\n".join([*body, *layout_lines(chosen, fits), *offload_lines(result, kwargs), verdict]))
    return result


def offload_lines(result: Plan, kwargs: dict) -> list[str]:
    """A GPU plan that does not fit without offloading: one line that says whether `--offload cpu` (the run's
    `offload_param: cpu`) makes it fit, planned again with it; none when the plan fits, already offloads, or
    its DeepSpeed config decides the offload, or quantises its base (stage 0 only)."""
    from curvzo_ds.layout.memory import GiB, plan_memory

    if result.fits or result.device != "gpu" or result.offload != "none" or result.quantization != "none":
        return []
    offloaded = plan_memory(**{**kwargs, "offload": "cpu"})
    if offloaded.offload != "cpu":  # the DeepSpeed config's offload_param wins over --offload
        return []
    if offloaded.fits:
        return [f"offload: with --offload cpu it fits (train with --set offload_param=cpu): "
                f"{offloaded.total / GiB:.2f} GiB of {offloaded.memory / GiB:.1f} GiB per rank on the GPU, "
                f"{offloaded.host / GiB:.2f} GiB of host memory per rank beside it"]
    return [f"offload: --offload cpu does not make it fit either: {offloaded.total / GiB:.2f} GiB of "
            f"{offloaded.memory / GiB:.1f} GiB per rank on the GPU (largest batch at {offloaded.seq_len} tokens: "
            f"{offloaded.max_batch})"]


def layout_lines(chosen: Layout, fits: list[Layout]) -> list[str]:
    """`layout: ...` (the layout the table above describes: what `zero_stage: auto` takes at --batch and --seq-len in
    --gpu-memory, or the --shard-group-size given) and one line per other layout that fits: its per-rank memory,
    the parameter bytes it all-gathers per rank per step, and the replicas it offers for directions."""
    from curvzo_ds.layout.memory import GiB

    lines = [f"layout: {chosen.describe()}: {chosen.per_rank / GiB:.2f} GiB per rank; {chosen.reason}"]
    for alt in fits:
        if alt.zero_stage == chosen.zero_stage and alt.shard_group_size == chosen.shard_group_size:
            continue
        gathered = (f"{alt.gathered / GiB:.2f} GiB all-gathered per rank per step" if alt.zero_stage == 3 else
                    "no all-gathers")
        lines.append(f"  also fits: {alt.describe()}: {alt.per_rank / GiB:.2f} GiB per rank, {gathered}, "
                     f"{alt.replicas} replica{'s' * (alt.replicas != 1)} for directions")
    return lines
