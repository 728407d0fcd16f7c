"""Soak run (issue 20 §6): 2 ranks under torchrun, the demo model, 5000 steps; every 500 steps the RSS of each rank
and the steps/s of the last 500 steps. A leak shows as RSS that grows from window to window, a slowdown as
steps/s that falls.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/soak.py [--steps 5000] [--every 500] [--out FILE.json]
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def workers(launcher: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in out)


def last_step(metrics: pathlib.Path) -> tuple[int, float]:
    """(step, seconds since start) of the newest train line."""
    step, seconds = 0, 0.0
    if metrics.exists():
        for line in metrics.read_text().splitlines()[-20:]:
            row = json.loads(line)
            if "loss" in row and "split" not in row:
                step, seconds = row["step"], row.get("seconds", seconds)
    return step, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="curvzo-soak-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29777",
           "-m", "curvzo_ds.cli", "train", "--set", f"max_steps={args.steps}", "--set", "eval_steps=0",
           "--set", "save_steps=1000", "--set", "logging_steps=10", "--set", "disable_tqdm=true",
           "--set", "report_to=none", "--set", f"output_dir={out_dir}"]
    log = open(out_dir.parent / f"{out_dir.name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    rows, mark, prev = [], args.every, (0, 0.0)
    print(f"{'step':>6} {'steps/s':>8} {'RSS rank 0 MiB':>15} {'RSS rank 1 MiB':>15}", flush=True)
    while proc.poll() is None:
        time.sleep(1.0)
        step, seconds = last_step(out_dir / "metrics.jsonl")
        if step >= mark:
            pids = workers(proc.pid)
            rss = [round(rss_mib(p), 1) for p in pids]
            rate = (step - prev[0]) / max(1e-9, seconds - prev[1])
            rows.append({"step": step, "seconds": seconds, "steps_per_second": rate, "rss_mib": rss})
            print(f"{step:>6} {rate:8.2f} " + " ".join(f"{r:15.1f}" for r in rss), flush=True)
            prev, mark = (step, seconds), mark + args.every
    if proc.returncode != 0:
        raise SystemExit(f"the soak run failed (exit {proc.returncode}); see {log.name}")
    summary = json.loads((out_dir / "summary.json").read_text())
    result = {"command": " ".join(cmd), "steps": args.steps, "rows": rows, "peak_rss_bytes": summary["peak_rss_bytes"]}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
