"""`curvzo-ds plot RUN... --out F.png`: one PNG of a set of runs, one colour per run.

Panels: training loss (raw and smoothed); dev loss; the task metric on dev, with the best-dev step marked and
the test score at that step (summary.json) in a box inside the axes, one line per run; the budget B and the blocks
drawn; B as the fraction of parameters; d_eff / G and H; and, when a run has one, a heat map of pi per block over
steps (pi.bin, curvzo_ds/train/pilog.py) of the first such run, every panel's step axis from 0. The title names the
model, task and method; each run's legend label its method with its difference and q (`mezo rloo q=8`), LoRA rank,
learning rate, seed and world size. What plot leaves out (a line that is not JSON, a damaged file) it says on stderr.
The runs are read by commands/plot_data.py (`load_run`).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np

from curvzo_ds.checkpoint.format import checkpoint_containing
from curvzo_ds.commands.plot_data import RunData, is_number, load_run
from curvzo_ds.errors import ConfigError
from curvzo_ds.train.pilog import PI_FILE

HEATMAP_BLOCKS = 40


def plot_runs(run_dirs: list[str], out: str | None = None) -> str:
    """Draw the runs into a PNG at `out` (default `<first run>/metrics.png`); return its path."""
    if not run_dirs:
        raise ConfigError("curvzo-ds plot needs at least one run directory (a train run's output_dir)")
    runs = [load_run(d) for d in run_dirs]  # first: a run that is not one is refused before --out is made
    out = out or os.path.join(run_dirs[0], "metrics.png")
    if not out.lower().endswith(".png"):
        raise ConfigError(f"--out {out}: plot writes a PNG; give a file name ending in .png")
    inside = checkpoint_containing(os.path.dirname(os.path.abspath(out)))
    if inside:
        raise ConfigError(f"--out {out} is inside the checkpoint {inside}: choose a path outside it")
    above = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ConfigError(f"--out {out} cannot be written: {above} is a file; choose another path")
    try:  # before the drawing: an --out that cannot be written is one line, not a traceback after it
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        if not os.access(os.path.dirname(os.path.abspath(out)), os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror or e}): choose another path") from None
    fig = figure(runs)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=100, bbox_inches="tight")
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror or e}): choose another path") from None
    finally:
        plt.close(fig)
    return out


def figure(run_dirs: list[str]):
    """The matplotlib Figure of the runs: axes 0-5 the curves; 6 the heat map (then its colour bar) when a run has
    a pi file. Without one (MeZO writes none) there is no heat-map row, and a note at the bottom says why.
    `run_dirs`: directories, or runs that load_run has read."""
    runs = [d if isinstance(d, RunData) else load_run(d) for d in run_dirs]
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("curvzo-ds plot needs matplotlib: pip install 'curvzo_ds[plot]'") from None

    with_pi = any(run.pi is not None and len(run.pi[0]) for run in runs)
    legend_rows = -(-len(runs) // 2)
    head = 0.95 + 0.3 * legend_rows  # inches above the panels: the title, the legend (two runs a row), panel titles
    height = (13 if with_pi else 8.6) + head
    fig = plt.figure(figsize=(17, height))
    rows = 3 if with_pi else 2
    grid = fig.add_gridspec(rows, 3, height_ratios=[1, 1, 1.5][:rows], hspace=0.42, wspace=0.22,
                            top=1 - head / height, bottom=0.05 if with_pi else 0.09)
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[i // 3, i % 3], sharex=axes[0]) for i in range(1, 6)]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    panels = (_train_loss, _dev_loss, _dev_metric, _budget, _fraction, _d_eff)
    for ax, panel in zip(axes, panels):
        ax.margins(x=0.02, y=0.12)
        empty = panel(ax, runs, colors)  # what to say when the runs have no data for it
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not ax.lines:
            _no_data(ax, empty)
    if with_pi:
        _heatmap(fig, fig.add_subplot(grid[2, :], sharex=axes[0]), runs)
    else:
        fig.text(0.5, 0.01, f"no pi heat map: none of these runs has a pi file ({PI_FILE}); MeZO writes none, its "
                 "pi is all 1", ha="center", va="bottom", color="0.4", fontsize=11)
    # The steps from 0 (no empty strip before the first, under the heat map too), and room on the right for the
    # best-dev stars, which the last step often holds: every panel shares this x axis.
    last = max([step for run in runs for rows in (run.train, run.dev, run.test) for step in _series(rows, "step")[0]]
               + [_edges(run.pi[0])[-1] for run in runs if run.pi is not None and len(run.pi[0])] + [1])
    axes[0].set_xlim(0, last * 1.04)
    fig.suptitle(_title(runs), fontsize=14, y=1 - 0.12 / height)
    handles = [plt.Line2D([], [], color=c, linewidth=2.5) for c in colors]
    fig.legend(handles, [r.label for r in runs], loc="upper center", ncol=min(len(runs), 2), frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.45 / height), fontsize=11)
    return fig


def _train_loss(ax, runs, colors) -> str:
    for run, color in zip(runs, colors):
        steps, losses = _series(run.train, "loss")
        if steps:
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
            window = max(1, min(len(losses) // 2, max(5, len(losses) // 20)))
            ax.plot(steps, _moving_average(losses, window), color=color, linewidth=1.8)
    ax.set(title="training loss (faint: raw; bold: moving average)", ylabel="loss")
    return "no data: no training loss logged"


def _dev_loss(ax, runs, colors) -> str:
    for run, color in zip(runs, colors):
        steps, losses = _series(run.dev, "loss")
        if steps:
            ax.plot(steps, losses, "-o", color=color, markersize=3.5)
            best = _best(run)
            if best:
                ax.axvline(best[0], color=color, linestyle=":", linewidth=1)
    ax.set(title="dev loss (dotted: best-dev step)", ylabel="loss")
    return "no data: no dev evaluations (num_dev, eval_steps)"


def _dev_metric(ax, runs, colors) -> str:
    import matplotlib.pyplot as plt

    metrics, notes = [], []
    for run, color in zip(runs, colors):
        metric = run.metric
        steps, values = _series(run.dev, metric) if metric else ([], [])
        if not steps:
            continue
        metrics.append(metric)
        ax.plot(steps, values, "-o", color=color, markersize=3.5)
        best = _best(run)
        if best is None:
            continue
        step, value, test = best
        ax.axvline(step, color=color, linestyle=":", linewidth=1)
        if value is not None:  # not clipped: the best step is often the last, on the axes' edge
            ax.plot([step], [value], "*", color=color, markersize=15, markeredgecolor="black", zorder=5,
                    clip_on=False)
        shown = f" ({metric} {value:.3g})" if value is not None else ""
        notes.append((color, f"best dev @ {step}{shown}: " +
                      (f"test {metric} {test:.4g}" if test is not None else "no test score")))
    if notes:  # one line per run in a box inside the axes, where the curves leave room (matplotlib's "best")
        handles = [plt.Line2D([], [], color=c, marker="*", markersize=11, markeredgecolor="black", linestyle="")
                   for c, _ in notes]
        ax.legend(handles, [text for _, text in notes], loc="best", fontsize=8.5, framealpha=0.9,
                  handletextpad=0.3, borderaxespad=0.4)
    name = "/".join(dict.fromkeys(metrics)) or "metric"
    ax.set(title=f"dev {name} (star: best dev, with the test score there)", ylabel=name)
    return "no data: no dev evaluations (num_dev, eval_steps)"


def _budget(ax, runs, colors) -> str:
    for run, color in zip(runs, colors):
        steps, budget = _series(run.train, "budget")
        if steps:
            ax.plot(steps, budget, color=color, linewidth=1.8)
        steps, drawn = _series(run.train, "n_selected")
        if steps:
            ax.plot(steps, drawn, color=color, linewidth=0.7, alpha=0.45)
    sizes = {run.num_blocks for run in runs}
    of = f" of G = {sizes.pop()}" if len(sizes) == 1 and None not in sizes else ""
    ax.set(title=f"budget B (bold) and blocks drawn (faint){of}", ylabel="blocks")
    return "no data: no budget logged"


def _fraction(ax, runs, colors) -> str:
    for run, color in zip(runs, colors):
        steps, fraction = _series(run.train, "param_fraction")
        if steps:
            ax.plot(steps, fraction, color=color, linewidth=1.8)
    ax.set_title("B as the fraction of parameters perturbed (expected)\nblocks differ in size: when pi moves to "
                 "large blocks,\nfewer blocks hold more parameters", fontsize=10.5)
    ax.set_ylabel("fraction of parameters")
    return "no data: no param_fraction logged"


def _d_eff(ax, runs, colors) -> str:
    for run, color in zip(runs, colors):
        steps, d_eff = _series(run.train, "d_eff")
        if steps and run.num_blocks:
            ax.plot(steps, np.divide(d_eff, run.num_blocks), color=color, linewidth=1.8)
        steps, entropy = _series(run.train, "score_entropy")
        if steps:
            ax.plot(steps, entropy, "--", color=color, linewidth=1.4)
    ax.set(title="d_eff / G (solid) and normalised entropy H (dashed)", ylabel="fraction")
    return "no data: d_eff and H are logged by adaptive CurvZO (method=curvzo) only"


def _heatmap(fig, ax, runs) -> None:
    index = next(i for i, run in enumerate(runs) if run.pi is not None and len(run.pi[0]))
    run = runs[index]
    steps, names, pi = run.pi
    cols = widest_blocks(pi, HEATMAP_BLOCKS)
    which = f"the {len(cols)} of G = {len(names)} blocks whose pi varies most" if len(cols) < len(names) \
        else f"all G = {len(names)} blocks"
    first = " (the first run with a pi file)" if len(runs) > 1 else ""
    edges = _edges(steps)
    mesh = ax.pcolormesh(edges, np.arange(len(cols) + 1), pi[:, cols].T, cmap="viridis", shading="flat")
    ax.set_yticks(np.arange(len(cols)) + 0.5, [short_name(names[c]) for c in cols],
                  fontsize=max(5, min(9, 300 // max(1, len(cols)))))
    ax.invert_yaxis()
    ax.set(title=f"pi per block over steps: {run.label}{first}, {which}", xlabel="step (the pi each step drew from)")
    fig.colorbar(mesh, ax=ax, label="pi", pad=0.01, fraction=0.03)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, textwrap.fill(text, 44), ha="center", va="center", transform=ax.transAxes, color="0.4",
            fontsize=11)
    ax.tick_params(labelleft=False, left=False)


def widest_blocks(pi: np.ndarray, k: int) -> np.ndarray:
    """The columns of the k blocks with the widest range of pi over the rows, in block order (all when G <= k)."""
    if pi.shape[1] <= k:
        return np.arange(pi.shape[1])
    spread = pi.max(axis=0) - pi.min(axis=0)
    return np.sort(np.argsort(-spread, kind="stable")[:k])


def short_name(name: str, width: int = 36) -> str:
    """A block name for a tick label: without the usual prefixes and `.weight`, `layers.N` as `LN`."""
    for prefix in ("base_model.model.", "model.", "transformer.", "decoder."):
        name = name.removeprefix(prefix)
    name = name.removesuffix(".weight").replace("layers.", "L").replace("self_attn.", "attn.")
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _title(runs: list[RunData]) -> str:
    parts = []
    for key in ("model", "task", "method"):
        values = list(dict.fromkeys(str(run.get(key)) for run in runs if run.get(key)))
        if values:
            parts.append(f"{key} {', '.join(values)}")
    return " · ".join(parts) or ", ".join(run.label for run in runs)


def _best(run: RunData) -> tuple[int, float | None, float | None] | None:
    """(step, dev metric, test metric) of the best dev evaluation: summary.json's, else the dev lines' best."""
    metric = run.metric
    best = run.summary.get("best_dev")
    if isinstance(best, dict) and is_number(best.get("step")):
        test = run.summary.get("test")
        value = best.get(metric) if metric else None
        return int(best["step"]), value if is_number(value) else None, \
            (test.get(metric) if isinstance(test, dict) and is_number(test.get(metric)) else None)
    steps, values = _series(run.dev, metric) if metric else ([], [])
    if not steps:
        return None
    i = int(np.argmax(values))
    test = next((r.get(metric) for r in run.test if r["step"] == steps[i] and is_number(r.get(metric))), None)
    return int(steps[i]), values[i], test


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around each step: halfway to the neighbours (half a step out at the ends)."""
    s = np.asarray(steps, dtype=float)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows whose `key` is a number (null, that is non-finite, is left out)."""
    pairs = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
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


# The command: its parser and its handler (cli.py builds the parser from every command's `register`).


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw loss and evaluation curves of runs to a PNG")
    p.add_argument("run_dirs", nargs="+", help="one or more run directories (output_dir), compared by colour")
    p.add_argument("--out", help="the PNG to write (default: metrics.png in the first run directory)")
    p.set_defaults(handler=handle)


def handle(args) -> None:
    print(plot_runs(args.run_dirs, args.out))


__all__ = ["figure", "handle", "plot_runs", "register", "short_name", "widest_blocks"]
