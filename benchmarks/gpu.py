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
- kernel launches per pass, where the engine counts them.
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
        for offload in (False, True) if args.offload else (False,):
            try:
                measure(name, offload, args.batch, args.seq_len, args.steps, report)
            except Exception:
                report.emit(failure("model", model=name, offload_param="cpu" if offload else "none"))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
