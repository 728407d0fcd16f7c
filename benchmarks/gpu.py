"""GPU benchmark: Llama-2-7B and -13B built from their configs (random init, bf16, no download) under ZeRO-3 at world
size 1 (and, with --offload, with `offload_param: cpu`).

    python benchmarks/gpu.py --out gpu.jsonl                   # on a GPU machine (tools/gpu_run.sh runs it)
    DS_ACCELERATOR=cpu python benchmarks/gpu.py --tiny --out x.jsonl   # the same code on a tiny config, on CPU (CI)

Every result is one JSON line, printed and appended to --out (flushed and fsynced) as soon as it exists, so a
command killed at its time limit keeps everything measured before: first the environment, then the noise parity
of the device kernel against the CPU kernel and the torch reference (each case on its own line, edge key words and
starts included), then one line per model and placement with
- peak GPU memory of ZO training against an inference-only forward pass under the same ZeRO-3 config;
- the time of noise and update against two forwards (targets on an H100 at 16 x 256 tokens: <= 10% MeZO,
  <= 5% CurvZO at 0.3 G);
- steps per second, and the step split (forwards, noise and update, score statistics, communication);
- kernel launches per pass, where the engine counts them;
- with --layouts, in interleaved rounds in the same process: two plain forwards, MeZO's algorithm as its trainer
  writes it (`mezo_reference`) and our MeZO step under each layout (stage 0, the default where the model fits, and
  ZeRO-3), with `step_over_mezo_reference` and `step_over_two_forwards` per layout (issue 39's targets on an H100
  at 16 x 256 tokens: <= 0.70 and <= 1.2 for the default layout).
A failure is a result too: its line carries `error` (the first line of the exception) and where it came from.
Figures go in benchmarks/RESULTS.md with the command and the machine.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curvzo_ds import ZOConfig, ZOEngine
from curvzo_ds.commands.bench_timing import noise_threads, token_loss  # noqa: E402
from curvzo_ds.engine import StepTimer  # noqa: E402
from curvzo_ds.noise import cpu as cpu_kernel  # noqa: E402
from curvzo_ds.noise import reference  # noqa: E402
from curvzo_ds.shard.distributed import init_distributed  # noqa: E402

CONFIGS = {  # the published configs of meta-llama/Llama-2-{7,13}b-hf
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=512),
}

# (k0, k1, start, n): the key words 0, 1 and 2^32 - 1 (Triton specialises an int argument equal to 1), starts at
# 2^31, 2^32 and 2^33 + a tail (int32 index arithmetic), the 2^32-group counter carry, and a start above 2^40.
PARITY_CASES = [(0, 0, 0, 1 << 20), (1, 2, 3, 100_001), (2, 1, 5, 4099), (0xFFFFFFFF, 0xFFFFFFFF, 7, 65_537),
                (1, 1, 1 << 31, 5003), (12345, 1, 1 << 32, 5003), (0, 0xFFFFFFFF, (1 << 33) - 8, 5003),
                (77, 88, 4 * (1 << 32) - 6, 5003), (99, 100, (1 << 40) + 1, 70_001)]


class Report:
    """JSON lines to stdout and to `path`, each flushed and fsynced as soon as it is written."""

    def __init__(self, path: str | None):
        self.path = path

    def emit(self, record: dict) -> None:
        line = json.dumps(record, default=str)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())


def failure(kind: str, **fields) -> dict:
    """A result line for an exception being handled: its first line, and the innermost frame of our code."""
    etype, value, tb = sys.exc_info()
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "curvzo_ds" in f.filename or "benchmarks" in f.filename] or frames
    where = f"{ours[-1].filename}:{ours[-1].lineno} ({ours[-1].name})" if ours else "?"
    first = (str(value).strip().splitlines() or [""])[0]
    return {"kind": kind, **fields, "error": f"{etype.__name__}: {first}", "where": where,
            "traceback_tail": "".join(traceback.format_exception(etype, value, tb))[-2000:]}


def environment() -> dict:
    from importlib import metadata

    names = ("torch", "triton", "deepspeed", "transformers", "accelerate", "peft", "pydantic")
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info = {"kind": "environment", "python": platform.python_version(), "versions": versions,
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR"), "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda, capability=list(props.major_minor)
                    if hasattr(props, "major_minor") else [props.major, props.minor],
                    multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
        info["avx512f"] = " avx512f " in flags + " "
    except OSError:
        pass
    return info


def noise_parity(device: str, report: Report) -> None:
    """The device kernel (Triton on CUDA) against the CPU kernel and the torch reference, one line per case:
    z itself (mode 0), then a bf16 axpy with its fixed-point sum of z^2."""
    from curvzo_ds.noise import gpu

    for k0, k1, start, n in PARITY_CASES:
        case = {"kind": "noise_parity", "k0": k0, "k1": k1, "start": start, "n": n}
        try:
            ref = reference.normals(k0, k1, start, n, "cpu")
            cpu = torch.empty(n, dtype=torch.float32)
            cpu_kernel.run(k0, k1, start, cpu, 0, 0.0, 0.0, False) if cpu_kernel.available() else cpu.copy_(ref)
            dev = torch.empty(n, dtype=torch.float32, device=device)
            gpu.run(k0, k1, start, dev, 0, 0.0, 0.0)
            dev = dev.cpu()
            case["cpu_equals_reference"] = torch.equal(cpu.view(torch.int32), ref.view(torch.int32))
            case["device_equals_reference"] = torch.equal(dev.view(torch.int32), ref.view(torch.int32))
            case["device_mismatches"] = int((dev.view(torch.int32) != ref.view(torch.int32)).sum())
            case["max_abs_difference"] = float((dev - ref).abs().max()) if n else 0.0
            x_dev = torch.linspace(-2, 2, n, device=device).to(torch.bfloat16)
            x_cpu = x_dev.cpu().clone()
            s_dev = gpu.run(k0, k1, start, x_dev, 2, 0.999, 1e-3)
            s_cpu = cpu_kernel.run(k0, k1, start, x_cpu, 2, 0.999, 1e-3, True) if cpu_kernel.available() else None
            s_dev = int(s_dev) if s_dev is not None else None
            case["bf16_axpy_equal"] = torch.equal(x_dev.cpu().view(torch.int16), x_cpu.view(torch.int16))
            case["sum_z2_equal"] = s_dev == int(reference.fixed_point_sum_of_squares(ref)) and (
                s_cpu is None or s_cpu == s_dev)
            case["identical"] = bool(case["device_equals_reference"] and case["cpu_equals_reference"]
                                     and case["bf16_axpy_equal"] and case["sum_z2_equal"])
            report.emit(case)
        except Exception:
            report.emit(failure(**case))


def build_stage0(name: str, micro: int):
    """The model whole on the device under DeepSpeed stage 0 (what `zero_stage: auto` takes when it fits one
    device), built from the same seed as `build`: its `.module` is the plain Hugging Face model."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    ds_config = {"train_micro_batch_size_per_gpu": micro, "train_batch_size": micro, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 0}, **({"bf16": {"enabled": True}} if cuda else {})}
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIGS[name]), torch_dtype=dtype)
    model.to("cuda" if cuda else "cpu")
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    return engine


def layout_arms(name: str, batch: int) -> dict:
    """(arm name -> (callable taking the input ids, what it holds)): the plain forward, MeZO's algorithm
    (`mezo_reference`: its trainer loop written plainly, four passes of torch.manual_seed + torch.normal per
    parameter) and our MeZO step under each layout at world size 1: stage 0 (the default, `auto`) and ZeRO-3."""
    from curvzo_ds.commands.bench_timing import mezo_reference_step

    stage0 = build_stage0(name, batch)
    zero3, keep = build(name, False, batch)
    plain = stage0.module
    zo = lambda engine: ZOEngine(engine, token_loss, ZOConfig(learning_rate=1e-7, zo_eps=1e-3, method="mezo"))  # noqa: E731
    ours = {"stage0": zo(stage0), "zero3": zo(zero3)}
    seeds = iter(range(1, 1 << 30))

    def two_forwards(ids):
        with torch.no_grad():
            token_loss(plain, ids)
            token_loss(plain, ids)

    return {"two_plain_forwards": two_forwards,
            "mezo_reference": lambda ids: mezo_reference_step(plain, ids, next(seeds), 1e-3, 1e-7),
            "step_stage0": lambda ids: ours["stage0"].step(ids),
            "step_zero3": lambda ids: ours["zero3"].step(ids)}, (stage0, zero3, keep, ours)


def measure_layouts(name: str, batch: int, seq: int, rounds: int, report: Report) -> dict:
    """The arms of `layout_arms` in one process, in interleaved rounds (each round runs every arm once, in turn), after
    one untimed warm-up call each. One line per round as it ends (kind `layout_round`), then one line with each
    arm's median and, per layout, `step_over_mezo_reference` and `step_over_two_forwards` (kind `layouts`);
    `default_layout` names the layout `zero_stage: auto` takes here (stage0: the model fits one device)."""
    cuda = torch.cuda.is_available()
    arms, holders = layout_arms(name, batch)
    ids = torch.randint(0, CONFIGS[name]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to("cuda" if cuda else "cpu")
    row = {"model": name, "batch": batch, "seq_len": seq, "rounds": rounds}
    for arm in arms.values():
        arm(ids)  # warm-up: kernel compilation, ZeRO-3's first-forward trace
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm, call in arms.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            call(ids)
            if cuda:
                torch.cuda.synchronize()
            times[arm].append(time.perf_counter() - start)
        report.emit({**row, "kind": "layout_round", "round": r, **{arm: t[-1] for arm, t in times.items()}})
    median = {arm: statistics.median(t) for arm, t in times.items()}
    result = {**row, "kind": "layouts", "seconds": median, "default_layout": "stage0"}
    for layout in ("stage0", "zero3"):
        step = median[f"step_{layout}"]
        result[layout] = {"step_seconds": step, "step_over_mezo_reference": step / median["mezo_reference"],
                          "step_over_two_forwards": step / median["two_plain_forwards"]}
    result["step_over_mezo_reference"] = result["stage0"]["step_over_mezo_reference"]  # the default layout's
    result["mezo_reference_over_two_forwards"] = median["mezo_reference"] / median["two_plain_forwards"]
    report.emit(result)
    del arms, holders
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def build(name: str, offload: bool, micro: int):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    zero = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    ds_config = {"train_micro_batch_size_per_gpu": micro, "train_batch_size": micro, "gradient_accumulation_steps": 1,
                 "zero_optimization": zero, **({"bf16": {"enabled": True}} if cuda else {})}
    keep = HfDeepSpeedConfig(ds_config)  # zero.Init while the model is built: no rank holds it whole
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
        model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIGS[name]), torch_dtype=dtype)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    return engine, keep


METHODS = (("mezo", dict(method="mezo")),
           ("curvzo_fixed_0.3", dict(method="fixed", budget=0.3, score_init=1.0, score_warmup_steps=0)))


def measure(name: str, offload: bool, batch: int, seq: int, steps: int, report: Report) -> None:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else None
    ds_engine, keep = build(name, offload, batch)
    ids = torch.randint(0, CONFIGS[name]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ds_engine.device)
    row = {"kind": "model", "model": name, "offload_param": "cpu" if offload else "none", "batch": batch,
           "seq_len": seq, "parameters": sum(p.ds_numel for p in ds_engine.module.parameters())}

    def peak_reset():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    with torch.no_grad():
        token_loss(ds_engine, ids)  # the first forward records the order of ZeRO-3's gathers
        peak_reset()
        start = time.perf_counter()
        token_loss(ds_engine, ids)
        token_loss(ds_engine, ids)
        if sync:
            sync()
        row["two_forwards_seconds"] = time.perf_counter() - start
    row["inference_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    report.emit({**row, "kind": "model_inference"})
    methods = {}
    for method, cfg in METHODS:
        engine = None
        try:
            engine = ZOEngine(ds_engine, token_loss, ZOConfig(learning_rate=1e-7, zo_eps=1e-3, **cfg))
            engine.step(ids)  # warm-up (kernel compilation)
            peak_reset()
            times, sections = [], []
            for _ in range(steps):
                engine.timer = StepTimer(sync)
                start = time.perf_counter()
                engine.step(ids)
                if sync:
                    sync()
                times.append(time.perf_counter() - start)
                sections.append(engine.timer.totals)
            split = {k: statistics.median(s.get(k, 0.0) for s in sections) for k in
                     ("forwards", "perturb_stats", "perturb", "update", "reduce")}
            noise_update = 2 * split["perturb"] + split["update"]
            step = statistics.median(times)
            # untimed: one step without the timer's per-section synchronisations
            if sync:
                sync()
            engine.timer = None
            start = time.perf_counter()
            engine.step(ids)
            if sync:
                sync()
            result = {
                "step_seconds": step, "steps_per_second": 1 / step,
                "untimed_step_seconds": time.perf_counter() - start,
                "forwards_seconds": split["forwards"], "noise_and_update_seconds": noise_update,
                "score_statistics_seconds": max(0.0, split["perturb_stats"] - split["perturb"]),
                "communication_seconds": split["reduce"],
                "noise_and_update_over_two_forwards": noise_update / split["forwards"],
                "zo_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "launches_per_pass": list(engine.perturber.step_launches),
                "fp32_master_copies": any(e.master is not None for e in engine.entries),
            }
            if cuda:
                result["zo_over_inference_peak_memory"] = result["zo_peak_bytes"] / row["inference_peak_bytes"]
            methods[method] = result
            report.emit({**row, "kind": "model_method", "method": method, **result})
        except Exception:
            report.emit(failure("model_method", model=name, offload_param=row["offload_param"], method=method))
        finally:
            del engine
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    report.emit({**row, **methods})
    del ds_engine, keep
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama2-7b,llama2-13b")
    ap.add_argument("--tiny", action="store_true", help="the tiny config only (the CPU path CI runs)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--offload", action="store_true", help="also measure offload_param: cpu (slow: noise on the CPU)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--noise-threads", action="store_true",
                    help="also time offloaded (CPU) noise at 1, 2, 4, 8 and all cores (bench.noise_threads)")
    ap.add_argument("--layouts", action="store_true",
                    help="also time, in interleaved rounds in this process: two plain forwards, MeZO's algorithm "
                         "(mezo_reference) and our MeZO step under stage 0 (the default layout) and ZeRO-3")
    ap.add_argument("--layouts-only", action="store_true", help="--layouts without the per-method measurements")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of --layouts")
    ap.add_argument("--out", help="append the JSON lines here as they are measured")
    args = ap.parse_args()
    report = Report(args.out)
    report.emit(environment())
    init_distributed()
    torch.set_num_threads(torch.get_num_threads() if torch.cuda.is_available() else 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not args.skip_parity:
        noise_parity(device, report)
    if args.noise_threads:
        try:
            report.emit({"kind": "noise_threads", **noise_threads(1 << 27, 32, 3, [1, 2, 4, 8, os.cpu_count() or 1])})
        except Exception:
            report.emit(failure("noise_threads"))
    models = ["tiny"] if args.tiny else [m for m in args.models.split(",") if m]
    for name in models:
        if args.layouts or args.layouts_only:
            try:
                measure_layouts(name, args.batch, args.seq_len, args.rounds, report)
            except Exception:
                report.emit(failure("layouts", model=name))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
        for offload in (False, True) if args.offload and not args.layouts_only else (False,):
            if args.layouts_only:
                break
            try:
                measure(name, offload, args.batch, args.seq_len, args.steps, report)
            except Exception:
                report.emit(failure("model", model=name, offload_param="cpu" if offload else "none"))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
