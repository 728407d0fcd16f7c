"""`curvzo-ds bench`: the benchmark suite, the timing of a configured run, and the bf16/fp16 drift table.

Figures are printed (and written as JSON), never asserted: speed and memory targets live here and in
benchmarks/RESULTS.md, not in tests. The suite's timings are commands/bench_timing.py.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from curvzo_ds.config.load import load_config
from curvzo_ds.errors import ConfigError
from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.sysinfo import peak_rss_bytes, rss_bytes

WORKER = "curvzo_ds.commands.bench_timing"  # the suite's parts, each run in a fresh process (`python -m WORKER`)


def register(sub) -> None:
    p = sub.add_parser("bench", help="the benchmark suite: step time against two forwards, noise, memory, ranks",
                       description="Without options: the suite (a 28M Llama, batch 16 x 64/256/1024 tokens, MeZO, "
                                   "CurvZO at 0.3 G and adaptive CurvZO, a MeZO-style reference step, peak memory "
                                   "against inference, and ZeRO-3 at 1, 2 and 3 ranks). It prints a table.")
    p.add_argument("--out", help="also write the figures to this JSON file")
    p.add_argument("--seq-lens", default="64,256,1024", help="tokens per sequence, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (forwards and steps interleaved)")
    p.add_argument("--world-sizes", default="1,2,3", help="ZeRO-3 world sizes for the per-rank table")
    p.add_argument("--tiny", action="store_true",
                   help="the suite on a Llama of about 0.1M parameters and smaller noise buffers (every code path and "
                        "figure; the tests' size)")
    p.add_argument("--perturbation", choices=["gaussian", "rademacher"], default="gaussian",
                   help="the z every method of the suite draws (with rademacher a Gaussian MeZO arm runs beside, for "
                        "other_per_forward_over_gaussian_mezo); every method reports pass_over_floor, its pass against "
                        "a torch.add_ over every trainable weight (a method that perturbs a fraction of the blocks "
                        "passes over that fraction: its figure is lower by it)")
    p.add_argument("--run", action="store_true", help="instead: time `--steps` steps of the run configured by --set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --run: a config key")
    p.add_argument("--steps", type=int, default=20, help="with --run or --drift: steps to take")
    p.add_argument("--drift", choices=["bfloat16", "float16"],
                   help="instead: weight drift of DTYPE steps with and without fp32_master_weights")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    if args.drift:
        drift(args.steps, args.drift)
    elif args.run:
        run_bench(load_config(None, args.set, None), args.steps)
    else:
        run_suite(args.out, _ints(args.seq_lens, "--seq-lens"), args.rounds, _ints(args.world_sizes, "--world-sizes"),
                  perturbation=args.perturbation, size="tiny" if args.tiny else "suite")


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{option} {text}: use comma-separated integers, for example 64,256") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text}: use integers >= 1")
    return values


def run_bench(cfg, steps: int) -> None:
    """Time `steps` engine steps of the configured run (one rank or under a launcher)."""
    from curvzo_ds.train.build import build  # DeepSpeed is imported with it: only when a run starts

    cfg = dataclasses.replace(cfg, disable_tqdm=True)
    run = build(cfg)
    gc.collect()
    rss_setup, peak_setup = rss_bytes(trim=True), peak_rss_bytes()
    times = []
    for t in range(steps):
        batch = run.batch(t)
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
        print(f"model {cfg.model} method {cfg.method} world {run.topology.job.world_size} "
              f"blocks {run.engine.num_blocks} params {run.engine.num_params}")
        print(f"step seconds: median {warm[len(warm) // 2]:.4f} min {warm[0]:.4f} max {warm[-1]:.4f} "
              f"(first {times[0]:.4f})")
        print(f"rank 0 owns {owned} elements ({owned / run.engine.num_params:.3f} of the model); "
              f"peak RSS {peak_rss_bytes() / 2**20:.1f} MiB")
        mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "n/a"
        for r, (ob, mb, setup, peak_setup, now, peak) in enumerate(per_rank):
            print(f"rank {r}: owned trainable slices {mib(ob)}, fp32 master {mib(mb)}; RSS after set-up "
                  f"{mib(setup)} (peak while loading {mib(peak_setup)}), after the steps {mib(now)}, peak {mib(peak)}")


def drift(steps: int, dtype: str = "bfloat16", seed: int = 0) -> list[dict]:
    """Weight drift of low-precision ZO steps, with and without the fp32 master copy (prints a table).

    One process, the demo model and task. lr = 0: only the +eps, -2eps, +eps cycle moves the weights,
    so everything that moves is drift. lr > 0: the distance to an fp32 run of the same seed, as a
    fraction of how far the fp32 run moved.
    """
    from transformers import AutoModelForCausalLM

    from curvzo_ds import data as D
    from curvzo_ds.data.stream import MicroBatches
    from curvzo_ds.engine import ZOEngine
    from curvzo_ds.tasks import demo_model_config, get_task, load_splits
    from curvzo_ds.tasks.demo import load_tokenizer

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


def run_suite(out: str | None, seq_lens: list[int], rounds: int, world_sizes: list[int], batch: int = 16,
              rank_seq: int = 64, rank_steps: int = 3, perturbation: str = "gaussian", size: str = "suite") -> dict:
    """The whole suite, each part in a fresh process (one thread per rank): prints a table, writes `out`. `size`:
    the model, bench_timing.MODELS' "suite" (28M) or "tiny"; `perturbation`: the z every method draws."""
    from curvzo_ds.commands.bench_timing import MODELS, machine

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    report = {"machine": machine(), "model": {**MODELS[size], "parameters": None}, "batch": batch,
              "rounds": rounds, "perturbation": perturbation, "seq_lens": {}, "python_overhead": None,
              "world_sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "timing.json")
        subprocess.run([sys.executable, "-m", WORKER, "timing", part, ",".join(map(str, seq_lens)),
                        str(rounds), str(batch), perturbation, size], env=env, check=True)
        timing = json.loads(open(part).read())
        report["seq_lens"], report["python_overhead"] = timing["seq_lens"], timing["python_overhead"]
        report["noise"], report["noise_threads"] = timing["noise"], timing["noise_threads"]
        report["model"]["parameters"] = timing["parameters"]
        for world in world_sizes:
            part = os.path.join(tmp, f"ranks-{world}.json")
            port = str(20000 + os.getpid() % 20000 + world)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                            "--master_port", port, "-m", WORKER, "ranks", part, str(rank_seq),
                            str(rank_steps), str(batch), perturbation, size], env={**env, "DS_ACCELERATOR": env.get(
                                "DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")}, check=True)
            report["world_sizes"][str(world)] = json.loads(open(part).read())
    print(format_report(report))
    if out:
        write_json_atomic(out, report)
    return report


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [f"curvzo-ds bench: Llama {report['model']['parameters'] / 1e6:.1f}M, batch {report['batch']}, "
             f"{report['rounds']} rounds, {m['device']} ({m['cpu']}), 1 thread per rank, perturbation "
             f"{report.get('perturbation', 'gaussian')}",
             f"{'tokens':>6} {'method':<18} {'step s':>8} {'/2 fwd':>7} {'s/fwd':>6} {'fwd':>6} {'noise+upd':>9} "
             f"{'stats':>6} {'comm':>6} {'other':>6} {'B/G':>5} {'mem/inf':>7} {'oth/mezo':>8} {'pass/fl':>7}"]
    for seq, e in report["seq_lens"].items():
        for name, r in e["methods"].items():
            s = r["seconds"]
            lines.append(f"{seq:>6} {name:<18} {r['step_seconds']:8.3f} {r['ratio_to_two_forwards']:7.3f} "
                         f"{r['seconds_per_forward']:6.3f} {s['forwards']:6.3f} {s['noise_and_update']:9.3f} "
                         f"{s['score_statistics']:6.3f} "
                         f"{s['communication']:6.3f} {s['other']:6.3f} {r['budget_fraction']:5.2f} "
                         f"{r['zo_over_inference_peak_memory']:7.3f} {r['other_per_forward_over_mezo']:8.3f} "
                         f"{r['pass_over_floor']:7.3f}")
        lines.append(f"{seq:>6} {'floor (torch.add_)':<18} one pass {e['floor_pass_seconds']:.4f} s")
        lines.append(f"{seq:>6} {'mezo_reference':<18} {e['reference_step_seconds']:8.3f} "
                     f"{e['reference_ratio_to_two_forwards']:7.3f}   our MeZO / reference "
                     f"{e['methods']['mezo']['our_mezo_over_reference']:.3f}")
    po = report["python_overhead"]
    mezo, fixed = po["mezo"], po["curvzo_fixed_0.3"]
    lines.append(f"Python overhead at G = {po['blocks']} tiny blocks: MeZO {1e3 * mezo['step_seconds']:.1f} ms/step "
                 f"({mezo['microseconds_per_selected_block']:.0f} us per selected block), CurvZO at 0.3 G "
                 f"{1e3 * fixed['step_seconds']:.1f} ms/step")
    nz = report.get("noise")
    if nz:
        lines.append(f"noise ({nz['backend']}, {nz['threads']} thread): torch.randn "
                     f"{nz['torch_randn_normals_per_second'] / 1e6:.0f} M normals/s, slice "
                     f"{nz['slice_normals_per_second'] / 1e6:.0f} M/s ({nz['slice_over_torch_randn']:.2f}x; into a "
                     f"buffer {nz['slice_into_buffer_over_torch_randn']:.2f}x), fused "
                     f"update {nz['fused_axpy_normals_per_second'] / 1e6:.0f} M/s "
                     f"({nz['fused_axpy_over_torch_randn']:.2f}x), torch-eager reference "
                     f"{nz['torch_reference_normals_per_second'] / 1e6:.0f} M/s")
    nt = report.get("noise_threads")
    if nt:
        timings = ", ".join(f"{t} thread{'s' if t != '1' else ''} {sec * 1e3:.0f} ms ({nt['speedup'][t]:.2f}x)"
                            for t, sec in nt["seconds"].items())
        lines.append(f"offloaded noise ({nt['numel'] / 1e6:.0f} M bf16 elements on the CPU, one perturb pass): "
                     f"{timings}")
    for world, w in report["world_sizes"].items():
        for rank, r in enumerate(w["ranks"]):
            mezo, fixed = r["methods"]["mezo"], r["methods"]["curvzo_fixed_0.3"]
            lines.append(f"world {world} rank {rank}: owned {r['owned_bytes'] / 2**20:.1f} MiB, step MeZO "
                         f"{mezo['step_seconds']:.3f} s / CurvZO 0.3 G {fixed['step_seconds']:.3f} s, all-reduced "
                         f"{mezo['all_reduced_bytes_per_step']:.0f} / {fixed['all_reduced_bytes_per_step']:.0f} B "
                         f"per step, peak ZO / inference {fixed['peak_bytes'] / r['inference_peak_bytes']:.3f}")
    return "\n".join(lines)
