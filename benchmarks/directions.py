"""Issue 46's figures: what a step of q directions costs beyond its forwards, and the memory it holds; issue 58's:
the same with +-1 directions, and every pass against the floor arm.

    OMP_NUM_THREADS=1 python benchmarks/directions.py time --rounds 7 --out benchmarks/directions-cpu.json
    OMP_NUM_THREADS=1 python benchmarks/directions.py time --perturbations gaussian,rademacher --out ...
    OMP_NUM_THREADS=1 python benchmarks/directions.py memory --out benchmarks/directions-memory-cpu.json

`time`: one process, one thread, a plain module (the default layout at one rank), the `curvzo-ds bench` suite's
28M-parameter Llama at 4 x 32 tokens; MeZO, RLOO q = 4 and RLOO q = 8 interleaved round by round (round 0 warms up
and is dropped), each step and its sections timed by the engine's own StepTimer's sections in the thread's CPU time
(`time.thread_time`: torch and the noise kernel run at one thread in this thread, so other processes on a busy
machine do not count). Per arm: the median step, its forwards, the time
outside the forwards per forward and its ratio to MeZO's (`other_per_forward_over_mezo`), the whole step per forward
over MeZO's, and the passes over the weights per step (the Perturber's count, where the code has one).
`--perturbations gaussian,rademacher` (issue 58): the arms once per perturbation (+-1 arms named `<arm>-rademacher`),
every ratio over the Gaussian MeZO arm `mezo` (which always runs); the floor arm (a plain `torch.add_` of a scalar over
the same tensors: each element read and written once, the bytes of an in-place pass) is timed in the same rounds, and
each arm reports `pass_seconds` (its pass sections over its passes) and `pass_over_floor`.
`memory`: a 110M-parameter fp32 Llama (hidden 768, 12 layers, vocab 32000), one fresh process per arm (q = 1 MeZO,
q = 8 RLOO), three steps each; the peak RSS (ru_maxrss) of each process, and the q = 8 step's excess over the
q = 1 step's as a fraction of the trainable weights' bytes.

The script imports whichever curvzo_ds is first on sys.path, so `PYTHONPATH=/path/to/other/checkout` measures
another version of the code with the same script (benchmarks/RESULTS.md gives both, before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

ARMS = {"mezo": dict(method="mezo"), "rloo-4": dict(method="mezo", difference="rloo", num_directions=4),
        "rloo-8": dict(method="mezo", difference="rloo", num_directions=8)}
BIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
           num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=False)


def forwards(cfg: dict) -> int:
    """Forwards of one step of an arm (the package's one count, DIFFERENCE_SPECS)."""
    from curvzo_ds.algo.differences import forwards_per_step

    return forwards_per_step(cfg.get("difference", "central"), cfg.get("num_directions", 1))


def git_commit() -> str:
    import curvzo_ds

    root = curvzo_ds.__file__.rsplit("/curvzo_ds/", 1)[0]
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "curvzo_ds"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def time_arms(rounds: int, batch: int, seq: int, perturbations: tuple[str, ...] = ("gaussian",)) -> dict:
    from curvzo_ds import ZOConfig, ZOEngine
    from curvzo_ds.commands.bench_timing import SUITE_MODEL, suite_model, token_loss
    from curvzo_ds.engine import StepTimer

    class ThreadTimer(StepTimer):
        """The engine's sections, timed in this thread's CPU time: one thread does all the work (torch and the
        noise kernel at one thread), so a busy machine's waits do not count."""

        @contextlib.contextmanager
        def section(self, name: str):
            start = time.thread_time()
            try:
                yield
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.thread_time() - start

    torch.set_num_threads(1)
    model = suite_model()
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, SUITE_MODEL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    arms = {}
    for perturbation in perturbations:
        for name, cfg in ARMS.items():
            extra = {} if perturbation == "gaussian" else {"perturbation": perturbation}  # runs the code before the key
            arms[name if perturbation == "gaussian" else f"{name}-{perturbation}"] = {**cfg, **extra}
    arms.setdefault("mezo", ARMS["mezo"])  # the reference of every ratio
    engines = {name: ZOEngine(model, token_loss, ZOConfig(learning_rate=1e-7, zo_eps=1e-3, seed=0, **cfg))
               for name, cfg in arms.items()}
    steps = {name: [] for name in arms}
    other = {name: [] for name in arms}
    in_passes = {name: [] for name in arms}
    floor = []
    passes = {}
    for r in range(rounds + 1):
        start = time.thread_time()
        with torch.no_grad():
            for p in params:  # the floor arm: one read and one write of every element
                p.add_((-1.0) ** r * 1e-7)
        if r:
            floor.append(time.thread_time() - start)
        for name, engine in engines.items():
            engine.timer = ThreadTimer()
            start = time.thread_time()
            engine.step(ids)
            elapsed = time.thread_time() - start
            if r:
                steps[name].append(elapsed)
                other[name].append(elapsed - engine.timer.totals.get("forwards", 0.0))
                in_passes[name].append(sum(engine.timer.totals.get(k, 0.0) for k in ("perturb_stats", "perturb",
                                                                                    "update")))
                passes[name] = getattr(engine.perturber, "step_passes", None)
    out = {"floor": {"pass_seconds": statistics.median(floor)}}
    med = statistics.median
    for name, cfg in arms.items():
        f = forwards(cfg)
        out[name] = {"forwards_per_step": f, "step_seconds": med(steps[name]),
                     "other_seconds_per_forward": med(other[name]) / f, "passes_per_step": passes[name]}
        if passes[name]:
            out[name]["pass_seconds"] = med(in_passes[name]) / passes[name]
            out[name]["pass_over_floor"] = out[name]["pass_seconds"] / out["floor"]["pass_seconds"]
    for name in arms:
        out[name]["other_per_forward_over_mezo"] = (out[name]["other_seconds_per_forward"]
                                                    / out["mezo"]["other_seconds_per_forward"])
        out[name]["step_per_forward_over_mezo"] = ((out[name]["step_seconds"] / out[name]["forwards_per_step"])
                                                   / (out["mezo"]["step_seconds"] / 2))
    return out


def memory_child(arm: str) -> None:
    """One process: three steps of `arm` on the 110M Llama; prints its peak RSS and the weights' bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from curvzo_ds import ZOConfig, ZOEngine
    from curvzo_ds.commands.bench_timing import token_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BIG)).eval()
    ids = torch.randint(0, BIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    engine = ZOEngine(model, token_loss, ZOConfig(learning_rate=1e-7, zo_eps=1e-3, seed=0, **ARMS[arm]))
    for _ in range(3):
        engine.step(ids)
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "weights_bytes": weights}))


def memory_arms() -> dict:
    out = {}
    for arm in ("mezo", "rloo-8"):
        proc = subprocess.run([sys.executable, __file__, "memory-child", arm], capture_output=True, text=True,
                              check=True)
        out[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
    excess = out["rloo-8"]["peak_rss_bytes"] - out["mezo"]["peak_rss_bytes"]
    return {**out, "q8_excess_bytes": excess, "q8_excess_over_weights": excess / out["mezo"]["weights_bytes"],
            "q8_peak_over_q1": out["rloo-8"]["peak_rss_bytes"] / out["mezo"]["peak_rss_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["time", "memory", "memory-child"])
    parser.add_argument("arm", nargs="?")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--perturbations", default="gaussian",
                        help="time: comma-separated, gaussian and/or rademacher (issue 58)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.what == "memory-child":
        memory_child(args.arm)
        return
    result = (time_arms(args.rounds, args.batch, args.seq, tuple(args.perturbations.split(",")))
              if args.what == "time" else memory_arms())
    report = {"what": args.what, "commit": git_commit(), "machine": platform.processor() or platform.machine(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rounds": args.rounds,
              "shape": [args.batch, args.seq], "load_average": list(os.getloadavg()), "result": result}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
