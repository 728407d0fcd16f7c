"""The timings of `curvzo-ds bench`'s suite, reusable on their own (benchmarks/, benchmarks/RESULTS.md): step time
against two forwards with its sections, a MeZO-style reference step, a pass against the floor arm (a plain
torch.add_ over the same tensors), peak memory against inference, Python overhead per block, noise speed, and one
rank's figures under ZeRO-3.

`python -m curvzo_ds.commands.bench_timing timing|ranks OUT ...` is the worker the suite starts, one fresh process
per part (commands/bench.py's `run_suite`).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from curvzo_ds.algo.differences import forwards_per_step
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.data.stream import MicroBatches
from curvzo_ds.engine import StepTimer, ZOEngine
from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.noise.gaussian import NoiseSource
from curvzo_ds.shard.distributed import init_distributed
from curvzo_ds.sysinfo import rss_bytes

# A Llama of about 28M parameters (27.7M): hidden 512, 6 layers, vocab 8192.
SUITE_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                   tie_word_embeddings=False)
# `curvzo-ds bench --tiny` (the test suite's size): the same code paths on a Llama of about 0.1M parameters.
TINY_MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
MODELS = {"suite": SUITE_MODEL, "tiny": TINY_MODEL}
NOISE_SIZES = {"suite": (1 << 24, 1 << 26), "tiny": (1 << 20, 1 << 22)}  # noise_speed's and noise_threads' numel
# The methods timed: MeZO (every block), CurvZO at a fixed budget of 0.3 G, adaptive CurvZO (burnt in first), and
# MeZO's directions with the leave-one-out difference, q = 4 and q = 8 (q one-sided forwards a step).
METHODS = {
    "mezo": dict(method="mezo"),
    "curvzo_fixed_0.3": dict(method="fixed", budget=0.3, score_init=1.0, score_warmup_steps=0),
    "curvzo_adaptive": dict(method="curvzo", score_warmup_steps=1),
    "rloo-4": dict(method="mezo", difference="rloo", num_directions=4),
    "rloo-8": dict(method="mezo", difference="rloo", num_directions=8),
}
PERTURBATIONS = ("gaussian", "rademacher")  # `curvzo-ds bench --perturbation`: the z every method draws


def arm_forwards(cfg: dict) -> int:
    """Forwards of one step of an arm's config (algo.differences.forwards_per_step, the one count)."""
    return forwards_per_step(cfg.get("difference", "central"), cfg.get("num_directions", 1))
ZO_COMMON = dict(learning_rate=1e-7, zo_eps=1e-3, seed=0)
SECTIONS = ("forwards", "perturb_stats", "perturb", "update", "reduce")


def with_other(step: float, sections: dict) -> dict:
    """The reported sections plus "other", the rest of the step, so that they add up to the step exactly (the
    score statistics are a difference of two timed passes clamped at 0, so "other" is taken after the clamp)."""
    return {**sections, "other": step - sum(sections.values())}


def suite_model(device="cpu", dtype=torch.float32, size: str = "suite"):
    """The benchmark's Llama (`MODELS[size]`), seeded."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODELS[size])).to(device=device, dtype=dtype).eval()


def token_loss(model, input_ids: torch.Tensor):
    """Next-token cross-entropy over every position: (sum, count), the loss contract."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                            input_ids[:, 1:].reshape(-1), reduction="sum")
    return nll, input_ids[:, 1:].numel()


def mezo_reference_step(model, input_ids, seed: int, eps: float, lr: float) -> float:
    """One step the way MeZO's public trainer takes it (princeton-nlp/MeZO, large_models/trainer.py): four
    noise passes (+eps, -2 eps, +eps, update), each `torch.manual_seed(seed)` then `torch.normal` per
    parameter, and a new tensor per parameter per pass (`param.data = param.data + ...`)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def perturb(scaling: float) -> None:
        torch.manual_seed(seed)
        for p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device, dtype=p.data.dtype)
            p.data = p.data + scaling * z * eps

    with torch.no_grad():
        perturb(1)
        loss1 = token_loss(model, input_ids)[0].item()
        perturb(-2)
        loss2 = token_loss(model, input_ids)[0].item()
        perturb(1)
        projected_grad = (loss1 - loss2) / (2 * eps)
        torch.manual_seed(seed)
        for p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device, dtype=p.data.dtype)
            p.data = p.data - lr * (projected_grad * z)
    return projected_grad


class PeakMemory:
    """The peak memory of a phase: GPU allocator peak on CUDA, else this process's peak RSS (VmHWM), reset
    between phases through /proc/self/clear_refs (after returning freed heap to the system)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        rss_bytes(trim=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


@torch.no_grad()
def two_forwards(model, ids) -> None:
    token_loss(model, ids)
    token_loss(model, ids)


def _timed(sync, fn, *args):
    """(seconds, result) of fn(*args), the device synchronised before and after."""
    if sync:
        sync()
    start = time.perf_counter()
    result = fn(*args)
    if sync:
        sync()
    return time.perf_counter() - start, result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


PASS_SECTIONS = ("perturb_stats", "perturb", "update")  # the StepTimer sections that are passes over the weights


@torch.no_grad()
def floor_pass(params: list[torch.Tensor], sign: float = 1.0) -> None:
    """The floor arm (issue 58): the bytes of one in-place pass, read and written by a plain `torch.add_` over the
    same tensors (each element read once and written once, as a pass's in-place rows do)."""
    for p in params:
        p.add_(sign * 1e-7)


def time_methods(seq_lens: list[int], rounds: int, batch: int, device: str, perturbation: str = "gaussian",
                 size: str = "suite") -> dict:
    """One process, the plain module: per sequence length, forwards alone and every method's step with its
    sections, the MeZO-style reference, the floor arm (floor_pass), and peak memory against inference. Rounds
    interleave all of them. Every method draws z of `perturbation`; with +-1 z a Gaussian MeZO arm runs beside them
    (`mezo_gaussian`: the step the time outside the forwards is also compared with)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    memory = PeakMemory(device)
    model = suite_model(device, size=size)
    methods = {name: {**cfg, "perturbation": perturbation} for name, cfg in METHODS.items()}
    if perturbation != "gaussian":
        methods["mezo_gaussian"] = dict(method="mezo", perturbation="gaussian")
    engines = {name: ZOEngine(model, token_loss, ZOConfig(**ZO_COMMON, **cfg)) for name, cfg in methods.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for seq in seq_lens:
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, MODELS[size]["vocab_size"], (batch, seq), generator=gen).to(device)
        rows: dict[str, list] = {"two_forwards": [], "reference": [], "floor": [], **{m: [] for m in methods}}
        sections = {m: [] for m in methods}
        budgets = {m: [] for m in methods}
        passes = {}

        for r in range(rounds + 1):  # round 0 warms up (kernel build, allocator, adaptive scores) and is dropped
            t_fwd, _ = _timed(sync, two_forwards, model, ids)
            t_floor, _ = _timed(sync, floor_pass, params, (-1.0) ** r)
            if r:
                rows["floor"].append(t_floor)
            for name, engine in engines.items():
                engine.timer = StepTimer(sync)
                t_step, result = _timed(sync, engine.step, ids)
                if r:
                    rows[name].append(t_step)
                    sections[name].append(dict(engine.timer.totals))
                    budgets[name].append(result.budget / engine.num_blocks)
                    passes[name] = engine.perturber.step_passes
            t_ref, _ = _timed(sync, mezo_reference_step, model, ids, r, 1e-3, 1e-7)
            if r:
                rows["two_forwards"].append(t_fwd)
                rows["reference"].append(t_ref)
        # Peak memory: inference (two forwards) against one step of each method, same process, reset between.
        memory.reset()
        two_forwards(model, ids)
        inference_peak = memory.peak()
        peaks = {}
        for name, engine in engines.items():
            memory.reset()
            engine.step(ids)
            peaks[name] = memory.peak()
        memory.reset()
        mezo_reference_step(model, ids, seed=0, eps=1e-3, lr=1e-7)
        reference_peak = memory.peak()

        two = rows["two_forwards"]
        floor = _median(rows["floor"])
        entry = {"perturbation": perturbation, "forward_seconds": _median(two) / 2,
                 "two_forwards_seconds": _median(two), "floor_pass_seconds": floor,
                 "reference_step_seconds": _median(rows["reference"]),
                 "reference_ratio_to_two_forwards": _median([a / b for a, b in zip(rows["reference"], two)]),
                 "inference_peak_bytes": inference_peak, "reference_peak_bytes": reference_peak,
                 "reference_over_inference_peak_memory": reference_peak / inference_peak, "methods": {}}
        # The time outside the forwards, per forward, as a ratio to MeZO's (issue 46): what a method's passes over
        # the weights, reduction and bookkeeping cost per forward it buys.
        other = {name: _median([step - sec.get("forwards", 0.0) for step, sec in zip(rows[name], sections[name])])
                 / arm_forwards(methods[name]) for name in methods}
        for name in methods:
            split = {k: _median([s.get(k, 0.0) for s in sections[name]]) for k in SECTIONS}
            # A pass's time: the pass sections of a step over its passes (issue 58), against the floor arm's.
            pass_seconds = _median([sum(s.get(k, 0.0) for k in PASS_SECTIONS) for s in sections[name]]) / max(
                1, passes.get(name) or 1)
            entry["methods"][name] = {
                "perturbation": methods[name]["perturbation"],
                "passes_per_step": passes.get(name),
                "other_seconds_per_forward": other[name],
                "other_per_forward_over_mezo": other[name] / other["mezo"],
                "pass_seconds": pass_seconds,
                "pass_over_floor": pass_seconds / floor,
                "step_seconds": _median(rows[name]),
                "forwards_per_step": arm_forwards(methods[name]),
                "seconds_per_forward": _median(rows[name]) / arm_forwards(methods[name]),
                "ratio_to_two_forwards": _median([a / b for a, b in zip(rows[name], two)]),
                "seconds": with_other(_median(rows[name]), {
                    "forwards": split["forwards"], "noise_and_update": split["perturb"] * 2 + split["update"],
                    "score_statistics": max(0.0, split["perturb_stats"] - split["perturb"]),
                    "communication": split["reduce"]}),
                "budget_fraction": _median(budgets[name]),
                "zo_over_inference_peak_memory": peaks[name] / inference_peak,
                "peak_bytes": peaks[name],
            }
            if "mezo_gaussian" in other:
                entry["methods"][name]["other_per_forward_over_gaussian_mezo"] = other[name] / other["mezo_gaussian"]
            if name == "mezo":
                entry["methods"][name]["our_mezo_over_reference"] = _median(
                    [a / b for a, b in zip(rows[name], rows["reference"])])
        out[str(seq)] = entry
    return out


def python_overhead(blocks: int = 723, numel: int = 64, steps: int = 30) -> dict:
    """Per-step Python work with G tiny tensors (Llama-2-70B has 723), so that the math is negligible."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(numel)) for _ in range(blocks)])
    loss = lambda m, batch: (m[0].sum(), 1)  # noqa: E731 - one tiny op: the forwards cost nothing
    out = {"blocks": blocks, "numel_per_block": numel}
    for name, cfg in (("mezo", dict(method="mezo")), ("curvzo_fixed_0.3", METHODS["curvzo_fixed_0.3"])):
        engine = ZOEngine(model, loss, ZOConfig(**ZO_COMMON, **cfg))
        times, selected = [], []
        for _ in range(steps + 2):
            start = time.perf_counter()
            r = engine.step(None)
            times.append(time.perf_counter() - start)
            selected.append(r.n_selected)
        step = _median(times[2:])
        out[name] = {"step_seconds": step, "selected_blocks": _median(selected[2:]),
                     "microseconds_per_selected_block": 1e6 * step / max(1.0, _median(selected[2:]))}
    return out


def fused_pass(source: NoiseSource, buf: torch.Tensor) -> None:
    """buf <- buf + 1e-3 z in place, as the Perturber's in-place rows do: the C kernel on CPU, Triton on CUDA."""
    from curvzo_ds.noise import cpu as cpu_kernel
    from curvzo_ds.noise.rows import MODES

    if buf.device.type == "cuda":
        from curvzo_ds.noise import gpu

        gpu.run(*source.key(1, "w"), 0, buf, MODES[buf.dtype], 1.0, 1e-3, False)
    else:
        cpu_kernel.run(*source.key(1, "w"), 0, buf, MODES[buf.dtype], 1.0, 1e-3, False)


def noise_speed(numel: int = 1 << 24, rounds: int = 5, device: str = "cpu") -> dict:
    """Normals per second on one core (one thread), in the same process: torch.randn, the generator's slice (into
    a new tensor, as torch.randn, and into a reused buffer), its fused in-place update (the engine's path), and the
    torch-eager reference of the same definition."""
    from curvzo_ds.noise import cpu as cpu_kernel
    from curvzo_ds.noise import reference

    source, buf = NoiseSource(0), torch.zeros(numel, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(0)
    fns = {
        "torch_randn": lambda: torch.randn(numel, generator=gen, device=device),
        "slice": lambda: source.slice(1, "w", numel, 0, numel, device=device),
        "slice_into_buffer": lambda: source.slice(1, "w", numel, 0, numel, out=buf),
        "fused_axpy": lambda: fused_pass(source, buf),
        "torch_reference": lambda: reference.normals(*source.key(1, "w"), 0, min(numel, 1 << 22), device=device),
    }
    backend = ("triton" if device == "cuda" else "c" if cpu_kernel.available() else "torch-eager")
    out = {"numel": numel, "threads": torch.get_num_threads(), "backend": backend}
    for name, fn in fns.items():
        n = min(numel, 1 << 22) if name == "torch_reference" else numel
        out[f"{name}_normals_per_second"] = n / _median([_timed(sync, fn)[0] for _ in range(rounds)])
    out["slice_over_torch_randn"] = out["slice_normals_per_second"] / out["torch_randn_normals_per_second"]
    out["slice_into_buffer_over_torch_randn"] = (out["slice_into_buffer_normals_per_second"]
                                                 / out["torch_randn_normals_per_second"])
    out["fused_axpy_over_torch_randn"] = out["fused_axpy_normals_per_second"] / out["torch_randn_normals_per_second"]
    return out


def noise_threads(numel: int = 1 << 26, tensors: int = 16, rounds: int = 3, threads: list[int] | None = None) -> dict:
    """Offloaded parameters (bf16 on the CPU): seconds of one perturb pass of the Perturber over `tensors` tensors of
    `numel` elements in all, at 1, 2 and all cores (the C kernel's calls release the GIL: threads over rows)."""
    from curvzo_ds.shard.params import collect_entries, make_blocks
    from curvzo_ds.shard.perturb import Perturber

    all_cores = os.cpu_count() or 1
    threads = sorted({t for t in (threads or [1, 2, all_cores]) if t <= all_cores})
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel // tensors, generator=gen).to(torch.bfloat16))
                                    for _ in range(tensors)])
    entries = collect_entries(model, replicated_rank=0, fp32_master=False)
    perturber = Perturber(entries, make_blocks(entries, "tensor", 0), NoiseSource(0), torch.device("cpu"))
    perturber.begin(0, torch.ones(tensors, dtype=torch.bool))
    out = {"numel": numel, "tensors": tensors, "dtype": "bfloat16", "cores": all_cores, "seconds": {}}
    for t in threads:
        perturber.threads = t
        perturber.perturb(0.0, 1e-3)  # warm-up (the thread pool, page faults)
        times = [_timed(None, perturber.perturb, 1e-3, -1e-3)[0] for _ in range(rounds)]
        out["seconds"][str(t)] = _median(times)
    one = out["seconds"][str(threads[0])]
    out["speedup"] = {k: one / v for k, v in out["seconds"].items()}
    out["normals_per_second"] = {k: numel / v for k, v in out["seconds"].items()}
    return out


def rank_figures(seq: int, steps: int, batch: int, micro: int, perturbation: str = "gaussian",
                 size: str = "suite") -> dict:
    """One rank of a ZeRO-3 job (run under torchrun): owned bytes, step time, bytes all-reduced per step, and
    peak memory of ZO steps against inference-only forwards under the same config."""
    import deepspeed

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = suite_model("cpu", size=size)
    ds_engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": micro, "train_batch_size": micro * world, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}})
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, MODELS[size]["vocab_size"], (batch, seq), generator=gen).to(ds_engine.device)
    batches = MicroBatches([ids[i:i + micro] for i in range(0, batch, micro)])
    sync = torch.cuda.synchronize if device == "cuda" else None
    memory = PeakMemory(device)
    result = {"world_size": world, "methods": {}}
    engines = {name: ZOEngine(ds_engine, token_loss, ZOConfig(**ZO_COMMON, **METHODS[name], perturbation=perturbation))
               for name in ("mezo", "curvzo_fixed_0.3")}
    first = next(iter(engines.values()))
    result["owned_bytes"] = sum((e.owned[1] - e.owned[0]) * e.param.element_size() for e in first.entries)
    first.loss(batches)  # the first forward records the order of gathers
    memory.reset()
    for _ in range(2 * steps):  # as many forwards as the timed steps run: a like-for-like peak
        first.loss(batches)
    result["inference_peak_bytes"] = memory.peak()
    for name, engine in engines.items():
        engine.step(batches)  # warm-up
        memory.reset()
        before = dict(engine.comm.stats)
        times = []
        for _ in range(steps):
            if sync:
                sync()
            start = time.perf_counter()
            engine.step(batches)
            if sync:
                sync()
            times.append(time.perf_counter() - start)
        elements = engine.comm.stats["all_reduce_elements"] - before.get("all_reduce_elements", 0)
        result["methods"][name] = {"step_seconds": _median(times), "peak_bytes": memory.peak(),
                                   "all_reduced_bytes_per_step": 8 * elements / steps}
    everyone = engines["mezo"].comm.all_gather_object(result)
    return {"world_size": world, "ranks": everyone}


def machine() -> dict:
    info = {"torch": torch.__version__, "threads_per_rank": 1, "device": "cpu", "cpu": platform.processor()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    info["cores"] = os.cpu_count()
    return info


def _worker(argv: list[str]) -> None:
    """`python -m curvzo_ds.commands.bench_timing timing|ranks OUT A B C PERTURBATION SIZE` (bench.run_suite starts
    it)."""
    kind, out, size = argv[0], argv[1], argv[-1]
    if kind == "timing":
        torch.set_num_threads(1)
        seq_lens, rounds, batch = [int(x) for x in argv[2].split(",")], int(argv[3]), int(argv[4])
        perturbation = argv[5]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        speed_numel, threads_numel = NOISE_SIZES[size]
        result = {"seq_lens": time_methods(seq_lens, rounds, batch, device, perturbation, size),
                  "python_overhead": python_overhead(),
                  "noise": noise_speed(speed_numel, rounds=rounds, device=device),
                  "noise_threads": noise_threads(threads_numel, rounds=rounds),
                  "parameters": sum(p.numel() for p in suite_model("meta", size=size).parameters())}
        write_json_atomic(out, result)
    elif kind == "ranks":
        result = rank_figures(int(argv[2]), int(argv[3]), int(argv[4]), micro=4, perturbation=argv[5], size=size)
        if dist.get_rank() == 0:
            write_json_atomic(out, result)
        dist.barrier()
        dist.destroy_process_group()  # join the communication threads before the interpreter's teardown
    else:
        raise SystemExit(f"unknown bench worker {kind!r}")


if __name__ == "__main__":
    _worker(sys.argv[1:])
