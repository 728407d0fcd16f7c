"""`curvzo-ds plot`: the figure of a real run (every panel has data), comparisons, runs that lack a panel's data,
one-line errors; and the pi side file (curvzo_ds/train/pilog.py): round trip, resume truncation, a torn last row."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys

import numpy as np
import pytest
import torch

from curvzo_ds.cli import main
from curvzo_ds.commands.plot import _moving_average, figure, plot_runs, short_name, widest_blocks
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import ConfigError
from curvzo_ds.train.pilog import PI_FILE, PI_HEADER, PiWriter, has_pi, read_pi
from tests.helpers import ENV, ROOT, run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRAIN = ["--set", "method=curvzo", "--set", "max_steps=30", "--set", "eval_steps=10", "--set", "num_train=64",
         "--set", "num_dev=16", "--set", "num_eval=16", "--set", "global_batch_size=8", "--set", "micro_batch_size=4",
         "--set", "report_to=none", "--set", "disable_tqdm=true"]


def engine_pi(out, steps=30, layers=25, every=2):
    """A real ZOEngine's pi, written as the training loop writes it: G = 2 * layers blocks (> 40 by default)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    x, y = torch.randn(32, 4), torch.randn(32, 4)
    loss = lambda m, batch: (((m(x) - y) ** 2).sum(), len(x))
    engine = ZOEngine(model, loss, ZOConfig(method="curvzo", learning_rate=1e-3, zo_eps=1e-3, max_steps=steps,
                                            score_warmup_steps=4))
    with PiWriter(str(out), [b.name for b in engine.blocks]) as writer:
        writer.truncate_after(engine.step_count)
        while engine.step_count < steps:
            pi = engine.sampler.probabilities(engine.step_count).pi  # what the next step draws from
            engine.step(None)
            if engine.step_count % every == 0:
                writer.write(engine.step_count, pi)
    return engine


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """`curvzo-ds train` of the demo: 30 steps, dev every 10, one process."""
    out = tmp_path_factory.mktemp("plot") / "curvzo-demo"
    proc = run_cli([sys.executable, "-m", "curvzo_ds.cli", "train", *TRAIN, "--set", f"output_dir={out}"],
                          env=ENV, capture_output=True, text=True, timeout=400, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert has_pi(str(out)), "the training run wrote no pi side file (pi.json, pi.bin)"
    return out


def panels_with_data(fig) -> list[str]:
    """The titles of the curve panels that have a line with points, and of the heat map if it has cells."""
    axes = fig.axes
    titles = [ax.get_title() for ax in axes[:6] if any(len(line.get_xdata()) for line in ax.lines)]
    if len(axes) > 6 and axes[6].collections and axes[6].collections[0].get_array().size:
        titles.append(axes[6].get_title())
    return titles


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == PNG_SIGNATURE and header[12:16] == b"IHDR"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_plot_of_a_real_run(real_run, tmp_path):
    import matplotlib.pyplot as plt

    fig = figure([str(real_run)])
    try:
        assert len(panels_with_data(fig)) == 7, [ax.get_title() for ax in fig.axes]
        assert fig._suptitle.get_text() == "model demo · task demo · method curvzo"
        metric_ax = fig.axes[2]
        summary = json.loads((real_run / "summary.json").read_text())
        labels = [t.get_text() for t in metric_ax.get_legend().get_texts()]
        assert any(f"best dev @ {summary['best_dev']['step']}" in t and f"{summary['test']['accuracy']:.4g}" in t
                   for t in labels), labels
    finally:
        plt.close(fig)
    out = plot_runs([str(real_run)], str(tmp_path / "figs" / "run.png"))
    assert out == str(tmp_path / "figs" / "run.png")
    width, height = png_size(out)
    assert width > 1000 and height > 800


def test_heatmap_keeps_the_40_widest_blocks(real_run, tmp_path):
    import matplotlib.pyplot as plt

    run = tmp_path / "wide"
    run.mkdir()
    for name in ("metrics.jsonl", "config.json", "summary.json"):
        shutil.copy(real_run / name, run / name)
    engine_pi(run, layers=30)  # G = 60
    fig = figure([str(run)])
    try:
        heat = fig.axes[6]
        assert len(heat.get_yticklabels()) == 40
        assert "40 of G = 60" in heat.get_title()
        assert heat.collections[0].get_array().shape == (40, 15)  # blocks x rows (every 2nd of 30 steps)
    finally:
        plt.close(fig)


def make_run(path, method, steps=200, seed=0, dev=True, test=True, adaptive=True):
    """A synthetic run directory: metrics.jsonl, config.json, summary.json (no pi file)."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    best = None
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in range(1, steps + 1):
            loss = 0.7 * math.exp(-step / (150 + 50 * seed)) + 0.05 * rng.random()
            row = {"step": step, "loss": None if step == 7 else loss, "budget": 3.0 if adaptive else 12.0,
                   "n_selected": rng.randint(1, 6) if adaptive else 12, "param_fraction": 0.3 if adaptive else 1.0}
            if adaptive:
                row.update(d_eff=6.0 + step / 100, score_entropy=0.8)
            f.write(json.dumps(row) + "\n")
            if dev and step % 50 == 0:
                f.write(json.dumps({"step": step, "split": "dev", "loss": loss, "accuracy": 0.5 + step / 1000}) + "\n")
                best = {"step": step, "loss": loss, "accuracy": 0.5 + step / 1000}
        if test:
            f.write(json.dumps({"step": steps, "split": "test", "final": True, "loss": 0.3, "accuracy": 0.66}) + "\n")
    (path / "config.json").write_text(json.dumps({"model": "demo", "task": "demo", "method": method}))
    (path / "summary.json").write_text(json.dumps({"method": method, "steps": steps, "num_blocks": 12,
                                                   "best_dev": best, "test": {"accuracy": 0.66} if test else None}))
    return str(path)


def test_runs_compared_by_colour(real_run, tmp_path):
    import matplotlib.pyplot as plt

    mezo = make_run(tmp_path / "mezo-s0", "mezo", steps=30, seed=1, adaptive=False)
    bare = make_run(tmp_path / "no-eval", "curvzo", steps=30, dev=False, test=False)
    fig = figure([str(real_run), mezo, bare])
    try:
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == ["curvzo-demo (curvzo, lr 0.0003, seed 42, 1 rank)",
                                                              "mezo-s0 (mezo)", "no-eval (curvzo)"]
        assert fig._suptitle.get_text() == "model demo · task demo · method curvzo, mezo"
        assert len(panels_with_data(fig)) == 7
        assert "the first run with a pi file" in fig.axes[6].get_title()
        colours = {line.get_color() for line in fig.axes[0].lines}
        assert colours == {"C0", "C1", "C2"}
    finally:
        plt.close(fig)


def test_a_run_without_adaptive_fields_dev_test_or_pi(tmp_path):
    """MeZO without evaluations: the panels without data say so; nothing crashes."""
    import matplotlib.pyplot as plt

    run = make_run(tmp_path / "mezo", "mezo", steps=5, dev=False, test=False, adaptive=False)
    (tmp_path / "mezo" / "summary.json").unlink()
    fig = figure([run])
    try:
        titles = panels_with_data(fig)
        assert len(titles) == 3, titles  # training loss, budget, param fraction
        assert len(fig.axes) == 6  # no empty heat-map panel: a note at the bottom says why
        said = [" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts]  # wrapped lines
        assert any("d_eff and H are logged by adaptive CurvZO" in t for t in said), said
        assert any("no dev evaluations" in t for t in said)
        assert any(PI_FILE in t.get_text() and "MeZO writes none" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)
    assert png_size(plot_runs([run]))[0] > 0  # default: <run>/metrics.png
    assert (tmp_path / "mezo" / "metrics.png").exists()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_best_dev_notes_stay_inside_the_panel(tmp_path, count):
    """Issue 28 §13: with the best dev at the last step, the runs' best-dev notes (one box, a line per run) lie
    inside the dev panel, the stars are drawn unclipped on its edge, and a MeZO-only figure has no heat-map panel."""
    import matplotlib.pyplot as plt

    runs = [make_run(tmp_path / f"run{i}", "mezo", steps=200, seed=i, adaptive=False) for i in range(count)]
    fig = figure(runs)
    try:
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        ax = fig.axes[2]
        box, panel = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1, (box, panel)
        notes = [t.get_text() for t in ax.get_legend().get_texts()]
        assert notes == ["best dev @ 200 (accuracy 0.7): test accuracy 0.66"] * count, notes
        stars = [line for line in ax.lines if line.get_marker() == "*"]
        assert len(stars) == count and all(star.get_xdata()[0] == 200 and not star.get_clip_on() for star in stars)
        assert len(fig.axes) == 6  # MeZO only: no pi file, no heat map
        assert "fewer blocks hold more parameters" in fig.axes[4].get_title()
    finally:
        plt.close(fig)


def test_a_run_is_labelled_with_its_method_lora_lr_seed_and_world_size(tmp_path):
    from curvzo_ds.commands.plot_data import run_label

    config = {"method": "curvzo", "lora": True, "lora_r": 8, "learning_rate": 5e-5, "seed": 3}
    assert run_label("a", config, {"world_size": 2}) == "a (curvzo, LoRA r=8, lr 5e-05, seed 3, 2 ranks)"
    assert run_label("b", {"method": "mezo", "learning_rate": 3e-4, "seed": 0}, {"world_size": 1}) == \
        "b (mezo, lr 0.0003, seed 0, 1 rank)"
    assert run_label("c", {}, {}) == "c"


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty holds no metrics.jsonl"):
        plot_runs([str(tmp_path / "empty")], str(tmp_path / "x.png"))
    with pytest.raises(ConfigError, match="missing: no such directory"):
        plot_runs([str(tmp_path / "missing")], str(tmp_path / "x.png"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="blank.*no metrics lines"):
        plot_runs([str(tmp_path / "blank")], str(tmp_path / "x.png"))
    with pytest.raises(ConfigError, match="at least one run"):
        plot_runs([], str(tmp_path / "x.png"))
    run = make_run(tmp_path / "run", "curvzo", steps=5)
    with pytest.raises(ConfigError, match=r"x\.txt.*\.png"):
        plot_runs([run], str(tmp_path / "x.txt"))
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.txt").exists()
    for args in ([str(tmp_path / "empty")], [str(tmp_path / "missing")], [run, "--out", str(tmp_path / "x.txt")]):
        assert main(["plot", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("curvzo-ds plot: error: ") and err.count("\n") == 1, err


def test_widest_blocks_and_short_names():
    pi = np.array([[0.1, 0.5, 0.2, 0.3], [0.9, 0.5, 0.25, 0.6]])
    assert widest_blocks(pi, 2).tolist() == [0, 3]  # ranges 0.8, 0, 0.05, 0.3; kept in block order
    assert widest_blocks(pi, 4).tolist() == [0, 1, 2, 3]
    assert short_name("model.layers.3.self_attn.q_proj.weight") == "L3.attn.q_proj"
    assert short_name("base_model.model.model.layers.10.mlp.down_proj.lora_A.default.weight", 20).startswith("…")
    assert len(short_name("x" * 100)) == 36


def test_moving_average():
    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert _moving_average([2.0, 4.0], 1) == [2.0, 4.0]


# --- the pi side file ---

def write_rows(out, steps, names=("a", "b", "c"), dtype="float16"):
    with PiWriter(str(out), list(names), dtype=dtype) as writer:
        for step in steps:
            writer.write(step, torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64) * step / 10)


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-3), ("float32", 1e-7)])
def test_pi_round_trip(tmp_path, dtype, tol):
    write_rows(tmp_path, [2, 4, 6], dtype=dtype)
    steps, names, pi = read_pi(str(tmp_path))
    assert steps.tolist() == [2, 4, 6] and names == ["a", "b", "c"]
    expected = np.array([[0.1, 0.5, 1.0]]) * np.array([[0.2], [0.4], [0.6]])
    assert pi.shape == (3, 3) and np.allclose(pi, expected, rtol=tol, atol=0)
    header = json.loads((tmp_path / PI_HEADER).read_text())
    assert header["num_blocks"] == 3 and header["dtype"] == dtype
    assert (tmp_path / PI_FILE).stat().st_size == 3 * (8 + 3 * np.dtype(dtype).itemsize)


def test_pi_truncate_after_matches_a_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    write_rows(straight, range(1, 7))
    write_rows(resumed, range(1, 6))  # died after step 5; resumed from checkpoint-3
    writer = PiWriter(str(resumed), ["a", "b", "c"])
    assert writer.truncate_after(3) == 2
    assert read_pi(str(resumed))[0].tolist() == [1, 2, 3]
    for step in range(4, 7):
        writer.write(step, torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64) * step / 10)
    writer.close()
    assert (resumed / PI_FILE).read_bytes() == (straight / PI_FILE).read_bytes()
    assert PiWriter(str(resumed), ["a", "b", "c"]).truncate_after(0) == 6  # a fresh run in the same directory
    assert read_pi(str(resumed))[0].tolist() == []


def test_pi_torn_last_row_is_dropped(tmp_path):
    write_rows(tmp_path, [1, 2, 3])
    with open(tmp_path / PI_FILE, "ab") as f:
        f.write(b"\x04\x00\x00\x00\x00")  # a crash in the middle of row 4
    steps, _, pi = read_pi(str(tmp_path))
    assert steps.tolist() == [1, 2, 3] and pi.shape == (3, 3)
    assert PiWriter(str(tmp_path), ["a", "b", "c"]).truncate_after(3) == 1
    assert (tmp_path / PI_FILE).stat().st_size == 3 * 14
    with open(tmp_path / PI_FILE, "ab") as f:
        f.write(b"\x04\x00")
    write_rows(tmp_path, [4])  # no truncate_after: the writer still cuts the torn row before appending
    assert read_pi(str(tmp_path))[0].tolist() == [1, 2, 3, 4]


def test_pi_of_another_run_is_replaced_and_a_disabled_writer_writes_nothing(tmp_path):
    write_rows(tmp_path / "run", [1, 2])
    writer = PiWriter(str(tmp_path / "run"), ["x", "y"])
    assert writer.truncate_after(5) == 2  # other blocks: the old rows cannot continue
    writer.write(6, np.array([0.5, 0.25]))
    writer.close()
    steps, names, pi = read_pi(str(tmp_path / "run"))
    assert steps.tolist() == [6] and names == ["x", "y"] and pi.tolist() == [[0.5, 0.25]]
    with pytest.raises(ValueError, match="2 blocks"):
        PiWriter(str(tmp_path / "run"), ["x", "y"]).write(7, np.ones(3))
    off = PiWriter(str(tmp_path / "off"), ["a"], enabled=False)
    off.write(1, np.ones(1))
    assert off.truncate_after(0) == 0
    assert not (tmp_path / "off").exists()


def test_the_legend_names_difference_and_q_and_the_axes_start_at_0_with_room_for_the_stars(tmp_path):
    """Issue 44: an RLOO-8 run read as "mezo" in the legend; the best-dev stars on the last step were cut by the
    panel's right edge; the heat map's step axis started at -10 (the shared axis' margin)."""
    import matplotlib.pyplot as plt

    from curvzo_ds.commands.plot_data import run_label

    assert run_label("r", {"method": "mezo", "difference": "rloo", "num_directions": 8}, {}) == "r (mezo rloo q=8)"
    assert run_label("c", {"method": "mezo", "difference": "central", "num_directions": 4}, {}) == "c (mezo q=4)"
    assert run_label("m", {"method": "mezo", "difference": "central", "num_directions": 1}, {}) == "m (mezo)"
    run = make_run(tmp_path / "cz", "curvzo", steps=500)
    engine_pi(tmp_path / "cz", steps=500, every=10)
    fig = figure([run])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_xlim()[0] == 0 for ax in fig.axes[:7]), [ax.get_xlim() for ax in fig.axes[:7]]
        ax = fig.axes[2]
        (star,) = [line for line in ax.lines if line.get_marker() == "*"]
        box, panel = star.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1, (box, panel)  # the whole star inside the panel
    finally:
        plt.close(fig)


def test_an_out_that_cannot_be_written_and_damaged_lines_are_said(tmp_path, capsys):
    """Issue 45 §3: `plot --out` where it cannot write was a traceback; a line of metrics.jsonl that is not JSON (or a
    damaged summary.json) was left out without a word. The first is one line and exit 2, the second a warning."""
    run = make_run(tmp_path / "run", "curvzo", steps=20)
    (tmp_path / "a-file").write_text("x")
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    (ckpt / "rank-00000-of-00001.safetensors").write_text("")
    for out, words in ((tmp_path / "a-file" / "x.png", "a-file is a file"),
                       (ckpt / "x.png", "is inside the checkpoint")):
        assert main(["plot", run, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("curvzo-ds plot: error: ") and err.count("\n") == 1 and words in err, err
    with open(tmp_path / "run" / "metrics.jsonl", "r+") as f:
        lines = f.readlines()
        lines[4] = '{"step": 5, "loss"\n'
        f.seek(0)
        f.writelines(lines + ['{"step": 21, "lo'])
        f.truncate()
    (tmp_path / "run" / "summary.json").write_text("{not json")
    assert main(["plot", run, "--out", str(tmp_path / "fig.png")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any("metrics.jsonl: lines 5, " in line and "not a JSON object and left out" in line for line in err), err
    assert any("summary.json cannot be read" in line for line in err), err
    assert all(line.startswith("curvzo-ds plot: warning: ") for line in err), err
