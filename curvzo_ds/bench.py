"""`curvzo-ds bench` (step time of the engine) and `curvzo-ds plan` (per-rank memory, no weights).

Figures are printed, never asserted: speed and memory targets live in benchmarks, not tests.
"""

from __future__ import annotations

import gc
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from . import data as D
from .data.stream import MicroBatches
from .engine import ZOEngine
from .run import Run
from .sysinfo import peak_rss_bytes, rss_bytes
from .tasks import demo_model_config, get_task, load_splits
from .tasks.demo import load_tokenizer


def bench(cfg, steps: int) -> None:
    """Time `steps` engine steps of the configured run (one rank or under a launcher)."""
    cfg.disable_tqdm = True
    run = Run(cfg)
    gc.collect()
    rss_setup, peak_setup = rss_bytes(trim=True), peak_rss_bytes()
    times = []
    for t in range(steps):
        batch = run.micro_batches(t)
        start = time.perf_counter()
        run.engine.step(batch)
        times.append(time.perf_counter() - start)
    owned = sum(e.owned[1] - e.owned[0] for e in run.engine.entries)
    owned_bytes = sum((e.owned[1] - e.owned[0]) * e.param.element_size() for e in run.engine.entries)
    master_bytes = sum(e.master.numel() * 4 for e in run.engine.entries if e.master is not None)
    gc.collect()
    per_rank = run.engine.comm.all_gather_object((owned_bytes, master_bytes, rss_setup, peak_setup,
                                                  rss_bytes(trim=True), peak_rss_bytes()))
    if run.rank == 0:
        warm = sorted(times[1:] or times)
        print(f"model {cfg.model} method {cfg.method} world {run.world} blocks {run.engine.num_blocks} "
              f"params {run.engine.num_params}")
        print(f"step seconds: median {warm[len(warm) // 2]:.4f} min {warm[0]:.4f} max {warm[-1]:.4f} "
              f"(first {times[0]:.4f})")
        print(f"rank 0 owns {owned} elements ({owned / run.engine.num_params:.3f} of the model); "
              f"peak RSS {peak_rss_bytes() / 2**20:.1f} MiB")
        mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "n/a"
        for r, (ob, mb, setup, peak_setup, now, peak) in enumerate(per_rank):
            print(f"rank {r}: owned trainable slices {mib(ob)}, fp32 master {mib(mb)}; RSS after set-up "
                  f"{mib(setup)} (peak while loading {mib(peak_setup)}), after the steps {mib(now)}, peak {mib(peak)}")


def plan(model: str, world_size: int, dtype: str, fp32_master: bool) -> None:
    """Per-rank bytes for the weights and CurvZO's extra state, from the model config alone."""
    if model in ("demo", "demo-opt"):
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


def drift(steps: int, dtype: str = "bfloat16", seed: int = 0) -> list[dict]:
    """Weight drift of low-precision ZO steps, with and without the fp32 master copy (prints a table).

    One process, the demo model and task. lr = 0: only the +eps, -2eps, +eps cycle moves the weights,
    so everything that moves is drift. lr > 0: the distance to an fp32 run of the same seed, as a
    fraction of how far the fp32 run moved.
    """
    tok, task = load_tokenizer("llama"), get_task("demo")
    encoded = [D.encode(task, tok, ex, 128, True) for ex in load_splits(task, seed, 512, 8, 8)["train"]]
    batches = [MicroBatches([D.collate(encoded[(16 * t + i) % len(encoded):][:4], tok.pad_token_id)
                             for i in (0, 4, 8, 12)]) for t in range(steps)]
    torch.manual_seed(seed)
    init = AutoModelForCausalLM.from_config(demo_model_config("llama")).state_dict()

    def run(dt, lr, eps, master):
        model = AutoModelForCausalLM.from_config(demo_model_config("llama"))
        model.load_state_dict(init)
        model.to(getattr(torch, dt))
        engine = ZOEngine(model, D.classification_loss, method="mezo", learning_rate=lr, zo_eps=eps, seed=seed,
                          fp32_master_weights=master)
        losses = [engine.step(b).loss for b in batches]
        return torch.cat([p.detach().double().flatten() for p in model.parameters()]), losses

    w0 = torch.cat([p.double().flatten() for p in init.values()])
    w0_low = w0.to(getattr(torch, dtype)).double()
    rows = []
    for lr, eps in ((0.0, 1e-3), (3e-4, 1e-2)):
        ref, _ = run("float32", lr, eps, False) if lr else (w0, None)
        for master in (False, True):
            w, losses = run(dtype, lr, eps, master)
            row = {"dtype": dtype, "lr": lr, "eps": eps, "fp32_master": master, "steps": steps,
                   "changed_fraction": (w != w0_low).double().mean().item(),
                   "max_abs_change": (w - w0_low).abs().max().item(), "final_loss": losses[-1]}
            if lr:
                row["dist_to_fp32_over_fp32_move"] = ((w - ref).norm() / (ref - w0).norm()).item()
            rows.append(row)
    print(f"{'dtype':9} {'lr':>7} {'eps':>6} {'master':>6} {'changed':>8} {'max|dw|':>9} {'vs fp32':>8} "
          f"{'loss':>7}  ({steps} MeZO steps, demo model)")
    for r in rows:
        vs = f"{r['dist_to_fp32_over_fp32_move']:8.3f}" if "dist_to_fp32_over_fp32_move" in r else f"{'-':>8}"
        print(f"{r['dtype']:9} {r['lr']:7.0e} {r['eps']:6.0e} {str(r['fp32_master']):>6} "
              f"{r['changed_fraction']:8.4f} {r['max_abs_change']:9.2e} {vs} {r['final_loss']:7.4f}")
    return rows
