"""report_to (docs/outputs.md, "Trackers"): accelerate's trackers get metrics.jsonl's numbers under the same names;
a name that is unknown or not installed is refused in one line."""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest

from curvzo_ds.config.report_to import resolve_report_to
from curvzo_ds.errors import ConfigError
from curvzo_ds.train.logs import MetricsWriter
from curvzo_ds.train.trackers import scalars, tracker_kwargs
from tests.helpers import ENV, ROOT, cli


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What a tracker should hold: every number of metrics.jsonl, as (step, value) per `<split>/<field>`."""
    want: dict[str, list[tuple[int, float]]] = {}
    last = 0
    for row in rows:
        step = max(row["step"], last) if row.get("best_dev") else row["step"]  # the best-dev test line: at the last
        last = max(last, step)  # step logged (trackers.py)
        for name, value in scalars(row).items():
            want.setdefault(name, []).append((step, float(value)))
    return want


def test_report_to_values():
    assert resolve_report_to("none") == [] and resolve_report_to([]) == []
    assert resolve_report_to("auto") == ["tensorboard"]  # tensorboard is a test dependency
    assert resolve_report_to("TensorBoard, tensorboard") == ["tensorboard"]
    assert resolve_report_to(["tensorboard"]) == ["tensorboard"]
    assert "tensorboard" in resolve_report_to("all")
    with pytest.raises(ConfigError, match="'nosuch' is not a tracker; use .*wandb.*, auto, all or none"):
        resolve_report_to("tensorboard,nosuch")
    with pytest.raises(ConfigError, match="none stands alone"):
        resolve_report_to("tensorboard,none")
    with pytest.raises(ConfigError, match="must be a tracker name"):
        resolve_report_to(3)


def test_a_tracker_without_its_package_is_refused_with_the_fix(monkeypatch, capsys, tmp_path):
    import accelerate.tracking

    from curvzo_ds.cli import main

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])
    with pytest.raises(ConfigError, match=r"^report_to='wandb': wandb is not installed: pip install wandb, or remove "
                                          r"wandb from report_to$"):
        resolve_report_to("wandb")
    assert resolve_report_to("auto") == []  # auto: tensorboard only where it is installed
    assert main(["train", "--set", "report_to=tensorboard,mlflow", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tensorboard, or remove tensorboard from report_to" in err[0], err
    assert not (tmp_path / "run").exists()


def test_every_accelerate_tracker_takes_the_arguments_given(tmp_path):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    for name, cls in LOGGER_TYPE_TO_CLASS.items():
        inspect.signature(cls).bind(**tracker_kwargs(name, str(tmp_path), str(tmp_path / "tensorboard"), None))


def test_a_disabled_writer_starts_no_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with MetricsWriter(str(tmp_path / "run"), enabled=False, trackers=["wandb"]) as writer:
        writer.write({"step": 1, "loss": 1.0})
        assert writer.trackers.names == []
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A short CLI run of the demo that reports to TensorBoard, W&B (offline) and MLflow (a local file store)."""
    pytest.importorskip("wandb", reason="W&B tracker test: pip install wandb (in the test extra)")
    pytest.importorskip("mlflow", reason="MLflow tracker test: pip install mlflow-skinny (in the test extra)")
    tmp = tmp_path_factory.mktemp("tracked")
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wandb"), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}", "MLFLOW_EXPERIMENT_NAME": "trackers-test",
           "MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 refuses a file store unless told
    (tmp / "wandb").mkdir()
    out = tmp / "run"
    r = cli("train", "--set", "max_steps=4", "--set", "eval_steps=2", "--set", "num_train=32", "--set", "num_dev=8",
            "--set", "num_eval=8", "--set", "global_batch_size=4", "--set", "micro_batch_size=4",
            "--set", "save_steps=0", "--set", "disable_tqdm=true", "--set", "report_to=tensorboard,wandb,mlflow",
            "--set", f"output_dir={out}", env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return tmp, out, rows


def test_mlflow_holds_the_metrics_of_metrics_jsonl(tracked_run, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow tracker test: pip install mlflow-skinny (in the test extra)")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    tmp, out, rows = tracked_run
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "trackers-test"]
    (run,) = client.search_runs([experiment.experiment_id])
    want = expected(rows)
    assert {"train/loss", "train/projected_grad", "dev/loss", "dev/accuracy"} <= set(want)
    assert set(run.data.metrics) == set(want)
    for name, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert [s for s, _ in got] == [s for s, _ in sorted(points)], name
        assert [v for _, v in got] == pytest.approx([v for _, v in sorted(points)], rel=1e-12), name
    assert run.data.params["report_to"] == "tensorboard,wandb,mlflow"  # the run config, as hyperparameters
    assert run.data.tags.get("mlflow.runName") == str(out)


def test_wandb_offline_holds_the_metrics_of_metrics_jsonl(tracked_run):
    pytest.importorskip("wandb", reason="W&B tracker test: pip install wandb (in the test extra)")
    tmp, out, rows = tracked_run
    runs = list((tmp / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    got = wandb_history(next(runs[0].glob("*.wandb")))
    want = expected(rows)
    for name, points in want.items():
        assert [s for s, _ in sorted(got.get(name, []))] == [s for s, _ in sorted(points)], name
        assert [v for _, v in sorted(got[name])] == pytest.approx([v for _, v in sorted(points)], rel=1e-12), name
    assert not set(got) - set(want)


def wandb_records(path):
    """The protobuf records of a .wandb file: W&B's 7-byte file header, then a LevelDB log (32 KiB blocks of
    records, each with a 7-byte header: crc32c, little-endian uint16 length, type FULL=1, FIRST=2, MIDDLE=3,
    LAST=4). wandb 0.31 ships no Python reader of its own."""
    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            yield pieces


def wandb_history(path) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) pairs of each metric in an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2

    history: dict[str, list[tuple[int, float]]] = {}
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop("_step", record.history.step.num)
        for key, value in items.items():
            if not key.startswith("_") and isinstance(value, int | float):
                history.setdefault(key, []).append((step, float(value)))
    return history


def test_tensorboard_of_the_same_run_is_where_it_was(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, rows = tracked_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    want = expected(rows)
    assert set(events.Tags()["scalars"]) == set(want)
    for name, points in want.items():  # TensorBoard stores float32
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in points], name
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-30), name


def test_report_to_from_the_command_line_a_file_and_an_old_run_config(tmp_path):
    from curvzo_ds.config.fields import to_dict
    from curvzo_ds.config.load import load_config

    assert load_config(None, ["report_to=tensorboard,wandb"], None).report_to == "tensorboard,wandb"
    assert load_config(None, ["report_to=[tensorboard, mlflow]"], None).report_to == ["tensorboard", "mlflow"]
    (tmp_path / "c.yaml").write_text("report_to:\n  - tensorboard\n  - wandb\n")
    cfg = load_config(str(tmp_path / "c.yaml"), [], None)
    assert resolve_report_to(cfg.report_to) == ["tensorboard", "wandb"]
    # run_config.json keeps the value as given; one written before lists were accepted holds a plain name
    again = json.loads(json.dumps(to_dict(cfg)))
    assert load_config(None, [f"report_to={again['report_to']}"], None).report_to == ["tensorboard", "wandb"]
    assert load_config(None, ["report_to=tensorboard"], None).report_to == "tensorboard"
    with pytest.raises(ConfigError, match="'nosuch' is not a tracker"):
        load_config(None, ["report_to=nosuch"], None)
