"""`curvzo-ds plot`: training loss and eval metrics against step, one line per run, in one PNG."""

from __future__ import annotations

import json
import os

from .logs import METRICS_FILE, read_metrics

EVAL_METRICS = ("accuracy", "f1", "exact_match")


def plot_runs(run_dirs: list[str], out: str | None = None) -> str:
    """Draw the runs' `metrics.jsonl` into a PNG at `out` (default `<first run>/metrics.png`); return its path.

    Left: training loss against step, faint, with its moving average over about 1/20 of the run
    on top. Right: each eval metric of the dev (solid) and test (dashed) splits. A run is labelled
    by its summary.json `method` and its directory name.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = [_load_run(d) for d in run_dirs]
    out = out or os.path.join(run_dirs[0], "metrics.png")

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    eval_lines = 0
    for index, (label, train, evals) in enumerate(runs):
        color = f"C{index % 10}"
        steps, losses = _series(train, "loss")
        if steps:
            ax_loss.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
            ax_loss.plot(steps, _moving_average(losses, max(1, len(losses) // 20)), color=color, label=label)
        for split, style in (("dev", "-"), ("test", "--")):
            rows = [r for r in evals if r.get("split") == split]
            for metric, marker in zip(EVAL_METRICS, "os^"):
                steps, values = _series(rows, metric)
                if steps:
                    ax_eval.plot(steps, values, style, color=color, marker=marker, markersize=3,
                                 label=f"{label} {split} {metric}")
                    eval_lines += 1
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_loss.grid(alpha=0.3)
    if ax_loss.lines:
        ax_loss.legend(fontsize=8)
    ax_eval.set(title="eval", xlabel="step", ylabel="metric")
    ax_eval.grid(alpha=0.3)
    if eval_lines:
        ax_eval.legend(fontsize=8)
    else:
        ax_eval.text(0.5, 0.5, "no eval lines", ha="center", va="center", transform=ax_eval.transAxes)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _load_run(run_dir: str) -> tuple[str, list[dict], list[dict]]:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist: pass a run's output_dir (it holds {METRICS_FILE})")
    rows = [r for r in read_metrics(path) if isinstance(r.get("step"), int | float)]
    if not rows:
        raise ValueError(f"{path} holds no metrics lines with a step")
    label = os.path.basename(os.path.normpath(run_dir))
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            method = json.load(f).get("method")
    except (OSError, ValueError, AttributeError):
        method = None
    if method:
        label = f"{method} ({label})"
    train = [r for r in rows if "split" not in r]
    evals = [r for r in rows if "split" in r]
    return label, train, evals


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows whose `key` is a number (null, that is non-finite, is left out)."""
    pairs = [(r["step"], r[key]) for r in rows
             if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    averages, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averages.append(total / min(i + 1, window))
    return averages


__all__ = ["plot_runs"]
