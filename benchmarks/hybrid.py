"""Hybrid sharding and directions per step (issue 21 §1): examples/s and directions/s against the world size and
the shard group size, with the bytes all-reduced and all-gathered per step, on the demo model (CPU, gloo).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/hybrid.py [--steps 20] [--out FILE.json]

Each layout is one `curvzo-ds train` under torchrun; the time per step is taken from metrics.jsonl between step 4
and the last step (after ZeRO-3's trace). All-reduced bytes are the engine's one int64 vector per step
(q x (G + 3 x micro-batches) + 1 values); gathered bytes are ZeRO-3's all-gathers per rank and step: each forward
gathers the (K-1)/K of the model this rank does not own, and a group runs 2 q/R forwards per step.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 2, 2), (2, 1, 2), (4, 2, 2), (4, 2, 4), (4, 4, 4)]  # (world, K, q)
BATCH, MICRO = 16, 4


def run(world: int, group: int, q: int, steps: int, port: int) -> dict:
    out = pathlib.Path(tempfile.mkdtemp(prefix="curvzo-hybrid-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port),
           "-m", "curvzo_ds.cli", "train", "--set", f"max_steps={steps}", "--set", "eval_steps=0", "--set",
           "save_steps=0", "--set", "logging_steps=1", "--set", "disable_tqdm=true", "--set", "report_to=none",
           "--set", f"global_batch_size={BATCH}", "--set", f"micro_batch_size={MICRO}", "--set",
           f"shard_group_size={group}", "--set", f"num_directions={q}", "--set", f"output_dir={out}"]
    subprocess.run(cmd, cwd=str(ROOT), check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["seconds"] for r in rows if "loss" in r and "split" not in r}
    per_step = (train[steps] - train[4]) / (steps - 4)
    summary = json.loads((out / "summary.json").read_text())
    params, blocks = summary["num_params"], summary["num_blocks"]
    slots = BATCH // MICRO
    replicas = world // group
    return {"world": world, "shard_group_size": group, "replica_groups": replicas, "num_directions": q,
            "seconds_per_step": per_step, "examples_per_second": BATCH / per_step,
            "directions_per_second": q / per_step,
            "all_reduced_bytes_per_step": 8 * (q * (blocks + 3 * slots) + 1),
            "gathered_bytes_per_rank_step": 4 * params * (group - 1) / group * 2 * q / replicas,
            "digest": summary["params_digest"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    print(f"{'W':>2} {'K':>2} {'R':>2} {'q':>2} {'s/step':>7} {'ex/s':>6} {'dir/s':>6} {'reduced B':>9} "
          f"{'gathered MiB':>12}  digest", flush=True)
    for i, (world, group, q) in enumerate(LAYOUTS):
        r = run(world, group, q, args.steps, 29850 + i)
        results.append(r)
        print(f"{world:>2} {group:>2} {r['replica_groups']:>2} {q:>2} {r['seconds_per_step']:7.3f} "
              f"{r['examples_per_second']:6.1f} {r['directions_per_second']:6.2f} {r['all_reduced_bytes_per_step']:9d} "
              f"{r['gathered_bytes_per_rank_step'] / 2**20:12.2f}  {r['digest'][:19]}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
