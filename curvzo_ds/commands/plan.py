"""`curvzo-ds plan`: per-rank memory of CurvZO training under ZeRO-3, from the model's config alone (no weights).

The memory model is curvzo_ds/shard/memory.py (`plan_memory`, `Plan`); docs/plan.md states each formula. This
module is the command: its options, and the plan printed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from curvzo_ds.shard.memory import Plan


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
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model directory's own Python code to read its config (off by default)")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    plan(model=args.model, world_size=args.world_size, shard_group_size=args.shard_group_size, dtype=args.dtype,
         offload=args.offload, batch=args.batch, seq_len=args.seq_len, gpu_memory=args.gpu_memory,
         fp32_master=args.fp32_master_weights, deepspeed=args.deepspeed, device=args.device,
         label_positions=args.label_positions, trust_remote_code=args.trust_remote_code)


def plan(**kwargs) -> Plan:
    """`curvzo-ds plan`: print the plan (its last line says `fits` or `does not fit`) and return it."""
    from curvzo_ds.shard.memory import plan_memory  # transformers comes with it: imported when a plan is made

    result = plan_memory(**kwargs)
    print(result.format())
    return result
