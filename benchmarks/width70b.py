"""Llama-2-70B widths on CPU (issue 21): one decoder layer at Llama-2-70B's widths (hidden 8192, intermediate
28672, 64 heads, 8 KV heads, vocab 32000) with its embedding and head, 1.38 B parameters (5.5 GB in fp32), under
ZeRO-3 on CPU (gloo), one torchrun launch per world size.

    python benchmarks/width70b.py --world-sizes 1,2 --out w70.json        # the figures in benchmarks/RESULTS.md
    python benchmarks/width70b.py --tiny --world-sizes 1,2 --out t.json   # the same code at tiny widths (CI)

Per world size: the bytes each rank owns (against 1/W of the model); the peak memory of the timed steps above
the runtime baseline (libraries imported, process group up) against the plan's steady peak (`curvzo-ds plan
--device cpu`); the step time split (the engine's StepTimer sections, as `curvzo-ds bench` reports them); the
params_digest after the steps. Then whether the digests agree across world sizes, and the per-step Python
overhead with 723 blocks (Llama-2-70B's tensor count; `curvzo_ds.commands.bench_timing.python_overhead`).
"""

import argparse
import gc
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.commands.bench_timing import (  # noqa: E402
    METHODS,
    SECTIONS,
    ZO_COMMON,
    PeakMemory,
    python_overhead,
    token_loss,
    with_other,
)
from curvzo_ds.data.stream import MicroBatches  # noqa: E402
from curvzo_ds.engine import StepTimer  # noqa: E402

WIDTHS = {
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2, vocab_size=512),
}
# stage3_max_live_parameters 3e8 (DeepSpeed's default is 1e9): at 1e9 the plan puts a rank at 11 GB here, two of
# them past this machine's 24 GiB.
ZERO = {"stage": 3, "stage3_max_live_parameters": 3e8}


def llama_config(width: str):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, **WIDTHS[width])


def worker(width: str, batch: int, seq: int, steps: int, out: str) -> None:
    """One rank: build under zero.Init, one warm-up step, `steps` timed steps, the digest; rank 0 writes `out`."""
    import deepspeed
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from curvzo_ds.layout.memory import plan_memory
    from curvzo_ds.shard.digest import params_digest
    from curvzo_ds.shard.distributed import init_distributed
    from curvzo_ds.sysinfo import peak_rss_bytes, rss_bytes

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:  # the planner reads a model directory and a DeepSpeed config; it
        llama_config(width).save_pretrained(tmp)  # runs first: a live HfDeepSpeedConfig would reach its meta model
        ds_path = os.path.join(tmp, "ds.json")
        pathlib.Path(ds_path).write_text(json.dumps({"zero_optimization": ZERO}))
        plan = plan_memory(tmp, world, dtype="fp32", batch=1, seq_len=seq, label_positions=seq,
                           deepspeed=ds_path, device="cpu")
    gc.collect()
    baseline = rss_bytes(trim=True)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "gradient_accumulation_steps": 1,
                 "zero_optimization": ZERO}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - zero.Init while the model is built: no rank holds it whole
    torch.manual_seed(0)
    start = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.float32):
        model = LlamaForCausalLM._from_config(llama_config(width), torch_dtype=torch.float32)
    ds_engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine = ZOEngine(ds_engine, token_loss, ZOConfig(**ZO_COMMON, **METHODS["curvzo_adaptive"]))
    build_seconds = time.perf_counter() - start
    ids = torch.randint(0, WIDTHS[width]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    batches = MicroBatches([ids[i:i + 1] for i in range(batch)])  # the global batch, one sequence per forward

    engine.step(batches)  # warm-up: ZeRO-3 records its trace, the noise kernel loads
    memory = PeakMemory("cpu")
    memory.reset()
    times, sections = [], []
    for _ in range(steps):
        engine.timer = StepTimer()
        start = time.perf_counter()
        engine.step(batches)
        times.append(time.perf_counter() - start)
        sections.append(engine.timer.totals)
    step_peak = memory.peak() - baseline
    split = {k: statistics.median(s.get(k, 0.0) for s in sections) for k in SECTIONS}
    step = statistics.median(times)
    figures = {"rank": rank, "owned_bytes": sum((e.owned[1] - e.owned[0]) * e.param.element_size()
                                                for e in engine.entries),
               "step_peak_bytes": step_peak, "process_peak_bytes": peak_rss_bytes() - baseline}
    ranks = engine.comm.all_gather_object(figures)
    digest = params_digest(engine.entries, engine.comm)
    if rank == 0:
        result = {"world_size": world, "width": width, "parameters": engine.num_params,
                  "blocks": engine.num_blocks, "batch": batch, "seq_len": seq, "steps": steps,
                  "build_seconds": build_seconds, "step_seconds": step,
                  "seconds": with_other(step, {
                      "forwards": split["forwards"], "noise_and_update": 2 * split["perturb"] + split["update"],
                      "score_statistics": max(0.0, split["perturb_stats"] - split["perturb"]),
                      "communication": split["reduce"]}),
                  "planned_step_peak_bytes": plan.steady, "planned_gathered_bytes": plan.gathered,
                  "planned_shard_bytes": plan.shard, "ranks": ranks, "params_digest": digest}
        pathlib.Path(out).write_text(json.dumps(result, indent=1))
    engine.comm.barrier()
    torch.distributed.destroy_process_group()  # join the communication threads before the interpreter's teardown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args, out: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), os.path.abspath(__file__), "--worker", out, "--width", args.width, "--batch",
           str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(pathlib.Path(out).read_text())


def summarise(runs: list[dict], overhead: dict) -> dict:
    """The checks of issue 21 over the runs, and a printed table."""
    one = runs[0]
    total_owned = sum(r["owned_bytes"] for r in one["ranks"])
    report = {"runs": runs, "python_overhead": overhead,
              "digests_equal": len({r["params_digest"] for r in runs}) == 1}
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"Llama-2-70B widths ({one['width']}): {one['parameters'] / 1e9:.3f} B parameters, {one['blocks']} "
          f"blocks, global batch {one['batch']} x {one['seq_len']} tokens, fp32, {one['steps']} timed steps")
    print(f"{'W':>2} {'owned MiB/rank':>15} {'x W / all':>9} {'step peak MiB':>14} {'planned':>8} {'ratio':>6} "
          f"{'step s':>7} {'fwd':>6} {'noise+upd':>9} {'stats':>6} {'comm':>6} {'other':>6}")
    for r in runs:
        w = r["world_size"]
        owned = [x["owned_bytes"] for x in r["ranks"]]
        peak = max(x["step_peak_bytes"] for x in r["ranks"])
        r["owned_fraction_times_w"] = [o * w / total_owned for o in owned]
        r["planned_over_measured"] = r["planned_step_peak_bytes"] / peak
        s = r["seconds"]
        print(f"{w:>2} {'/'.join(mib(o) for o in owned):>15} {max(r['owned_fraction_times_w']):9.4f} "
              f"{'/'.join(mib(x['step_peak_bytes']) for x in r['ranks']):>14} {mib(r['planned_step_peak_bytes']):>8} "
              f"{r['planned_over_measured']:6.3f} {r['step_seconds']:7.2f} {s['forwards']:6.2f} "
              f"{s['noise_and_update']:9.2f} {s['score_statistics']:6.2f} {s['communication']:6.2f} "
              f"{s['other']:6.2f}")
    print(f"params_digest equal across world sizes: {report['digests_equal']} ({runs[0]['params_digest'][:23]})")
    m, f = overhead["mezo"], overhead["curvzo_fixed_0.3"]
    print(f"Python overhead at G = {overhead['blocks']} tiny blocks: MeZO {1e3 * m['step_seconds']:.1f} ms/step, "
          f"CurvZO at 0.3 G {1e3 * f['step_seconds']:.1f} ms/step")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--tiny", action="store_true", help="tiny widths, same code (the CI path)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (global), one per forward")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="timed steps, after one warm-up step")
    ap.add_argument("--out")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--width", default="70b", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.width, args.batch, args.seq_len, args.steps, args.worker)
        # The result is written and every rank has met; the interpreter's teardown once aborted here in gloo's
        # threads under load (2026-11-28).
        from curvzo_ds.startup import exit_now

        exit_now(0)
    args.width = "tiny" if args.tiny else "70b"
    with tempfile.TemporaryDirectory() as tmp:
        runs = [launch(int(w), args, os.path.join(tmp, f"w{w}.json")) for w in args.world_sizes.split(",")]
    torch.set_num_threads(1)
    report = summarise(runs, python_overhead(723, steps=10 if args.tiny else 30))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
