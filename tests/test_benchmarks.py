"""The benchmark scripts run: their CPU paths on tiny settings (the figures are in benchmarks/RESULTS.md)."""

import json
import sys

import pytest

from tests.helpers import ENV, ROOT, run_checked


@pytest.mark.slow
def test_gpu_benchmark_script_runs_its_cpu_path(tmp_path):
    """benchmarks/gpu.py on a tiny config: one JSON line per result as it is measured (the environment, each model
    and method, each placement with --offload), every figure a GPU run reports, and a failure recorded as a line
    with its first error, not lost."""
    out = tmp_path / "gpu.jsonl"
    run_checked([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--batch", "2", "--seq-len", "16",
                 "--steps", "1", "--offload", "--out", str(out)], {k: v for k, v in ENV.items() if k != "MASTER_PORT"},
                timeout=300)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "environment" and lines[0]["versions"]["torch"]
    models = [r for r in lines if r["kind"] == "model"]
    assert [r["offload_param"] for r in models] == ["none", "cpu"]
    methods = [r for r in lines if r["kind"] == "model_method"]
    assert [(r["offload_param"], r["method"]) for r in methods] == [
        (place, m) for place in ("none", "cpu") for m in ("mezo", "curvzo_fixed_0.3")]
    for r in methods:
        assert r["forwards_seconds"] > 0 and r["noise_and_update_seconds"] > 0
        assert r["noise_and_update_over_two_forwards"] == r["noise_and_update_seconds"] / r["forwards_seconds"]
        # One C call per pass (+eps, -2 eps, update), and a second in the update: DeepSpeed's CPU engine holds the
        # tiny Llama in bf16, so its 1-D tensors have fp32 master copies, updated, then written to the stored copies.
        assert r["launches_per_pass"] == [1, 1, 2]
    bad = tmp_path / "bad.jsonl"
    run_checked([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--models", "no-such-model", "--out", str(bad)],
                {k: v for k, v in ENV.items() if k != "MASTER_PORT"}, timeout=300)
    failed = [json.loads(line) for line in bad.read_text().splitlines()][-1]
    assert failed["kind"] == "model" and failed["model"] == "no-such-model"
    assert failed["error"] == "KeyError: 'no-such-model'" and "gpu.py" in failed["where"]


@pytest.mark.multirank
def test_width70b_script_runs_at_tiny_widths(tmp_path):
    """benchmarks/width70b.py at tiny widths, 1 and 2 ranks: each rank owns 1/W of the model, the digests
    after the steps agree, and every reported figure is there."""
    out = tmp_path / "w.json"
    run_checked([sys.executable, str(ROOT / "benchmarks" / "width70b.py"), "--tiny", "--world-sizes", "1,2",
                 "--steps", "1", "--out", str(out)], {k: v for k, v in ENV.items() if k != "MASTER_PORT"}, timeout=300)
    report = json.loads(out.read_text())
    assert report["digests_equal"] and [r["world_size"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        assert all(abs(f - 1) <= 0.02 for f in run["owned_fraction_times_w"])
        assert run["planned_step_peak_bytes"] > 0 and all(r["step_peak_bytes"] > 0 for r in run["ranks"])
        assert run["step_seconds"] > 0 and run["seconds"]["forwards"] > 0
    assert report["python_overhead"]["blocks"] == 723


@pytest.mark.slow
def test_bench_suite_writes_every_contract_field(tmp_path):
    """`curvzo-ds bench --out`: per sequence length and method ratio_to_two_forwards, our_mezo_over_reference,
    zo_over_inference_peak_memory (docs/contracts.md), and the per-rank table."""
    out = tmp_path / "bench.json"
    run_checked([sys.executable, "-m", "curvzo_ds.cli", "bench", "--seq-lens", "8", "--rounds", "1",
                 "--world-sizes", "1,2", "--out", str(out)], timeout=600)
    report = json.loads(out.read_text())
    entry = report["seq_lens"]["8"]
    assert entry["methods"]["mezo"]["our_mezo_over_reference"] > 0
    for method in ("mezo", "curvzo_fixed_0.3", "curvzo_adaptive"):
        m = entry["methods"][method]
        assert m["ratio_to_two_forwards"] > 1 and m["zo_over_inference_peak_memory"] > 0
    assert abs(entry["methods"]["curvzo_fixed_0.3"]["budget_fraction"] - 0.3) < 1e-9
    ranks = report["world_sizes"]["2"]["ranks"]
    assert len(ranks) == 2 and abs(ranks[0]["owned_bytes"] / report["world_sizes"]["1"]["ranks"][0]["owned_bytes"]
                                   - 0.5) < 0.02
    assert ranks[0]["methods"]["mezo"]["all_reduced_bytes_per_step"] == 8 * 3 * 4  # 4 micro-batches, no scores
    noise = report["noise"]  # the generator against torch.randn, on one thread in the same process
    assert noise["threads"] == 1 and noise["backend"] == "c"
    for name in ("torch_randn", "slice", "slice_into_buffer", "fused_axpy", "torch_reference"):
        assert noise[f"{name}_normals_per_second"] > 0
