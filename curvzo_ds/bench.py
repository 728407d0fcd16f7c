"""`curvzo-ds bench` (step time of the engine) and `curvzo-ds plan` (per-rank memory, no weights).

Figures are printed, never asserted: speed and memory targets live in benchmarks, not tests.
"""

from __future__ import annotations

import time

import torch


def bench(cfg, steps: int) -> None:
    """Time `steps` engine steps of the configured run (one rank or under a launcher)."""
    from .logs import peak_rss_bytes
    from .train import Run

    cfg.disable_tqdm = True
    run = Run(cfg)
    times = []
    for t in range(steps):
        batch = run.micro_batches(t)
        start = time.perf_counter()
        run.engine.step(batch)
        times.append(time.perf_counter() - start)
    owned = sum(e.owned[1] - e.owned[0] for e in run.engine.entries)
    if run.rank == 0:
        warm = sorted(times[1:] or times)
        print(f"model {cfg.model} method {cfg.method} world {run.world} blocks {run.engine.num_blocks} "
              f"params {run.engine.num_params}")
        print(f"step seconds: median {warm[len(warm) // 2]:.4f} min {warm[0]:.4f} max {warm[-1]:.4f} "
              f"(first {times[0]:.4f})")
        print(f"rank 0 owns {owned} elements ({owned / run.engine.num_params:.3f} of the model); "
              f"peak RSS {peak_rss_bytes() / 2**20:.1f} MiB")


def plan(model: str, world_size: int, dtype: str, fp32_master: bool) -> None:
    """Per-rank bytes for the weights and CurvZO's extra state, from the model config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model in ("demo", "demo-opt"):
        from .tasks import demo_model_config

        conf = demo_model_config("opt" if model == "demo-opt" else "llama")
    else:
        conf = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(conf)
    tensors = [p for p in m.parameters()]
    numel = sum(p.numel() for p in tensors)
    width = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    shard = sum(-(-p.numel() // world_size) for p in tensors)
    largest = max(p.numel() for p in tensors)
    print(f"{model}: {numel / 1e9:.3f} B parameters in {len(tensors)} tensors (blocks), world size {world_size}")
    print(f"  weights per rank (ZeRO-3 shard)      {shard * width / 2**30:8.2f} GiB")
    if fp32_master:
        print(f"  fp32 master copy of the shard        {shard * 4 / 2**30:8.2f} GiB")
    print(f"  largest gathered tensor (transient)  {largest * width / 2**30:8.2f} GiB")
    print(f"  noise buffer per tensor piece        {min(largest, 1 << 22) * 4 / 2**20:8.2f} MiB")
    print(f"  CurvZO state (scores, replicated)    {len(tensors) * 16 / 2**10:8.2f} KiB")
    print("  gradients, optimizer state           0 (zeroth order)")
