"""Issue 48 §4's figure: the peak RSS of a 4-bit LoRA run against a bf16 LoRA run of the same model, and each against
the planner's (`curvzo-ds plan --device cpu`).

    python benchmarks/quant_rss.py --out benchmarks/quant-rss-cpu.json

The model: a 134M-parameter Llama built from its config (hidden 768, 12 layers, vocab 32000, untied head) with a
fixed seed, saved as bf16 safetensors into a temporary directory with the bundled Llama tokenizer, and loaded by
`curvzo-ds train`'s own build from there, as a hub model is. Each arm is one fresh process: the runtime baseline
(torch, DeepSpeed, transformers, peft and bitsandbytes imported, the process group up), then `train.build.build`
(lora=true, dtype=bfloat16, stage 0, the demo task, micro-batches of 4) and three steps. The figures are the peak
RSS above the baseline while loading (VmHWM after the build) and while stepping (VmHWM reset after the build, read
after the steps), beside `plan_memory(..., device="cpu")` of what ran: its `load`, `steady` and `total`.

The arms run with MALLOC_MMAP_THRESHOLD_=1048576 (docs/plan.md, "CPU runs"): glibc's dynamic mmap threshold
otherwise keeps bitsandbytes' quantisation temporaries in the heap, and the 4-bit loading peak of this model varied
from 310 to 790 MiB between identical runs. `--default-malloc` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=False)
ARMS = ("none", "4bit", "8bit")
STEPS = 3


def save_model(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from curvzo_ds.tasks import load_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).save_pretrained(directory)
    load_tokenizer("llama").save_pretrained(directory)


def arm(model: str, quantization: str, out: str) -> None:
    """One process: baseline, build, STEPS steps; writes its figures to `out`."""
    import gc

    import bitsandbytes  # noqa: F401  in the baseline of every arm (peft imports it whenever it is installed)

    from curvzo_ds.config.load import load_config
    from curvzo_ds.layout.memory import trained_extent
    from curvzo_ds.shard.distributed import init_distributed
    from curvzo_ds.sysinfo import rss_bytes
    from curvzo_ds.train.build import build

    def high_water() -> int:  # VmHWM: the peak RSS since the start or the last reset
        with open("/proc/self/status") as f:
            return 1024 * int(next(line for line in f if line.startswith("VmHWM")).split()[1])

    init_distributed()
    gc.collect()
    baseline = rss_bytes(trim=True)
    with tempfile.TemporaryDirectory() as output_dir:
        sets = [f"model={model}", "lora=true", f"quantization={quantization}", "dtype=bfloat16", "zero_stage=0",
                f"max_steps={STEPS}", "global_batch_size=16", "micro_batch_size=4", "disable_tqdm=true",
                "report_to=none", f"output_dir={output_dir}"]
        run = build(load_config(None, sets, None))
        loaded = high_water()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the RSS now
        rows, seq, positions = trained_extent(run, STEPS)
    with open(out, "w") as f:
        json.dump(dict(quantization=quantization, baseline=baseline, loaded_peak=loaded, steps_peak=high_water(),
                       rows=rows, seq=seq, positions=positions, trained=run.engine.num_params), f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--default-malloc", action="store_true", help="without MALLOC_MMAP_THRESHOLD_")
    args = parser.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    from curvzo_ds.layout.memory import plan_memory

    results = []
    with tempfile.TemporaryDirectory() as directory:
        model = os.path.join(directory, "llama-134m")
        save_model(model)
        for quantization in args.arms.split(","):
            for _ in range(args.repeats):
                figures = os.path.join(directory, f"{quantization}.json")
                subprocess.run([sys.executable, __file__, "arm", model, quantization, figures], check=True, env=env)
                with open(figures) as f:
                    m = json.load(f)
                plan = plan_memory(model, 1, shard_group_size=1, dtype="bfloat16", batch=m["rows"], seq_len=m["seq"],
                                   label_positions=m["positions"], device="cpu", quantization=quantization, lora_r=8)
                mib = lambda b: round(b / 2**20, 1)  # noqa: E731
                load, steps = m["loaded_peak"] - m["baseline"], m["steps_peak"] - m["baseline"]
                results.append(dict(quantization=quantization, load_mib=mib(load), steps_mib=mib(steps),
                                    peak_mib=mib(max(load, steps)), planned_load_mib=mib(plan.load),
                                    planned_steady_mib=mib(plan.steady), planned_total_mib=mib(plan.total),
                                    base_mib=mib(plan.shard), rows=m["rows"], seq=m["seq"], trained=m["trained"]))
                print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.processor() or platform.machine(), python=platform.python_version(),
                       malloc_mmap_threshold=env.get("MALLOC_MMAP_THRESHOLD_"), model=MODEL, steps=STEPS,
                       arms=results), f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["arm"]:
        arm(*sys.argv[2:5])
    else:
        main()
