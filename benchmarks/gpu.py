"""GPU benchmark: Llama-2-7B and -13B built from their configs (random init, bf16, no download), ZeRO-3 at world
size 1, then with `offload_param: cpu`.

    python benchmarks/gpu.py --out gpu.json                    # on a GPU machine (H100: the issue's targets)
    DS_ACCELERATOR=cpu python benchmarks/gpu.py --tiny --out x.json   # the same code on a tiny config, on CPU (CI)

For each model and placement it reports:
- peak GPU memory of ZO training against an inference-only forward pass under the same ZeRO-3 config;
- the time of noise and update against two forwards (target on an H100 at 16 x 256 tokens: <= 5%);
- steps per second, and the step split (forwards, noise and update, score statistics, communication);
- that the CUDA noise kernel gives the same bits as the CPU kernel (the generator's promise), and the largest
  difference if it does not.
Figures go in benchmarks/RESULTS.md with the command and the machine.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curvzo_ds import ZOConfig, ZOEngine  # noqa: E402
from curvzo_ds.bench import token_loss  # noqa: E402
from curvzo_ds.distributed import init_distributed  # noqa: E402
from curvzo_ds.engine import StepTimer  # noqa: E402
from curvzo_ds.noise import NoiseSource  # noqa: E402

CONFIGS = {  # the published configs of meta-llama/Llama-2-{7,13}b-hf
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=512),
}


def noise_parity(device: str) -> dict:
    """The device kernel against the CPU kernel on ranges that cross every edge case (start mod 4, blocks,
    the 2^32-group counter carry, a start above 2^40)."""
    src = NoiseSource(seed=1234)
    worst, identical = 0.0, True
    cases = (("a", 0, 1 << 20), ("b", 3, 100_001), ("c", 4 * (1 << 32) - 6, 5003), ("d", (1 << 40) + 1, 70_001))
    for name, start, n in cases:
        cpu = src.slice(0, name, start + n, start, n, device="cpu")
        dev = src.slice(0, name, start + n, start, n, device=device).cpu()
        identical &= torch.equal(cpu.view(torch.int32), dev.view(torch.int32))
        worst = max(worst, (cpu - dev).abs().max().item())
    out = torch.zeros(4099, dtype=torch.bfloat16, device=device)
    ref = torch.zeros(4099, dtype=torch.bfloat16)
    s_dev = src.axpy_(out, 0, "e", 5, 0.999, 1e-3, want_sq=True)
    s_cpu = src.axpy_(ref, 0, "e", 5, 0.999, 1e-3, want_sq=True)
    identical &= torch.equal(out.cpu(), ref) and int(s_dev) == int(s_cpu)
    return {"identical": bool(identical), "max_abs_difference": worst}


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


def measure(name: str, offload: bool, batch: int, seq: int, steps: int) -> dict:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else None
    ds_engine, keep = build(name, offload, batch)
    ids = torch.randint(0, CONFIGS[name]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ds_engine.device)
    row = {"model": name, "offload_param": "cpu" if offload else "none", "batch": batch, "seq_len": seq,
           "parameters": sum(p.ds_numel for p in ds_engine.module.parameters())}

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
    for method, cfg in (("mezo", dict(method="mezo")),
                        ("curvzo_fixed_0.3", dict(method="fixed", budget=0.3, score_init=1.0, score_warmup_steps=0))):
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
        row[method] = {
            "step_seconds": step, "steps_per_second": 1 / step,
            "forwards_seconds": split["forwards"], "noise_and_update_seconds": noise_update,
            "score_statistics_seconds": max(0.0, split["perturb_stats"] - split["perturb"]),
            "communication_seconds": split["reduce"],
            "noise_and_update_over_two_forwards": noise_update / split["forwards"],
            "zo_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        }
        if cuda:
            row[method]["zo_over_inference_peak_memory"] = row[method]["zo_peak_bytes"] / row["inference_peak_bytes"]
    del ds_engine, keep
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama2-7b,llama2-13b")
    ap.add_argument("--tiny", action="store_true", help="the tiny config only (the CPU path CI runs)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    init_distributed()
    torch.set_num_threads(torch.get_num_threads() if torch.cuda.is_available() else 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = ["tiny"] if args.tiny else args.models.split(",")
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "noise_parity": noise_parity(device) if device == "cuda" else None,
              "runs": []}
    for name in models:
        for offload in (False, True):
            row = measure(name, offload, args.batch, args.seq_len, args.steps)
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"device": report["device"], "noise_parity": report["noise_parity"]}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
