"""The command line's documentation and `curvzo-ds eval`."""

import dataclasses
import json
import pathlib

import pytest

from curvzo_ds.cli import main
from curvzo_ds.config import TrainConfig
from tests.test_app import COMMON, ROOT

KEYS = [f.name for f in dataclasses.fields(TrainConfig)]


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"  {f.name:<26} [{f.default}]" in out, f.name


def test_docs_config_lists_every_key():
    text = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in KEYS if f"| `{k}` |" not in text]
    assert not missing, f"docs/config.md lacks {missing}: regenerate its table"


def test_eval_of_a_checkpoint_equals_the_training_eval(straight):
    """`curvzo-ds eval --resume CKPT` recomputes the dev and test metrics logged at that step."""
    out, _ = straight
    ev_dir = pathlib.Path(str(out) + "-eval")
    args = [a.replace(str(out), str(ev_dir)) for a in COMMON] + ["--set", f"output_dir={ev_dir}"]
    assert main(["eval", *args, "--resume", str(out / "checkpoint-12")]) == 0
    result = json.loads((ev_dir / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {r["split"]: r for r in rows if r.get("split") and r["step"] == 12}
    assert result["step"] == 12 and set(logged) == {"dev", "test"}
    for split in ("dev", "test"):
        assert result[split]["accuracy"] == logged[split]["accuracy"]
        assert result[split]["loss"] == logged[split]["loss"]
