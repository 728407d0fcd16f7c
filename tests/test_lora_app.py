"""LoRA through the command line: 1 and 2 ranks agree, the adapter exports and merges.

The run trains only the peft adapters (q_proj, v_proj by default). The exported adapter,
loaded onto the base model with peft, and the merged model must compute the same logits
(up to fp32 rounding of W + B A), and differ from the base model (B starts at zero, so a
difference shows the adapters trained and were exported).
"""

import json
import subprocess
import sys

import pytest
import torch

from curvzo_ds.cli import main
from tests.helpers import ENV, eval_cli, logged_eval, train

LORA = ["--set", "lora=true", "--set", "learning_rate=1e-2", "--set", "max_steps=8"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run-1"
    return out, train("python", 1, out, *LORA)


def test_lora_trains_only_the_adapters(lora_run):
    out, summary = lora_run
    names = json.loads((out / "checkpoint-8" / "manifest.json").read_text())["tensors"]
    assert names and all("lora_" in n for n in names), names
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("projected_grad") not in (None, 0) for r in rows if "split" not in r)
    assert summary["world_size"] == 1 and summary["steps"] == 8


def test_eval_of_a_lora_checkpoint_needs_no_lora_setting(lora_run, tmp_path):
    """`eval --resume` of a LoRA checkpoint with no --set: LoRA and the rest come from the run's config."""
    out, _ = lora_run
    result = eval_cli(out / "checkpoint-8", tmp_path)
    assert result["step"] == 8 and result["dev"]["loss"] == logged_eval(out, 8)["dev"]["loss"]


@pytest.mark.multirank
def test_lora_two_ranks_equal_one(lora_run, tmp_path):
    summary = train("torchrun", 2, tmp_path / "run-2", *LORA)
    assert summary["params_digest"] == lora_run[1]["params_digest"]


def test_lora_export_and_merge(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from curvzo_ds.config import TrainConfig, resolve_presets
    from curvzo_ds.models import build_model

    out, _ = lora_run
    export = tmp_path / "merged"
    assert main(["export", str(out / "checkpoint-8"), "--out", str(export), "--merge-lora"]) == 0
    adapter = export / "adapter"  # --merge-lora: the merged model in --out, the adapter beside it
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(export)).eval()

    base, _ = build_model(resolve_presets(TrainConfig()), {})  # the demo base model, same seed as the run
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base.eval()(ids).logits
        adapted = PeftModel.from_pretrained(base, str(adapter)).eval()
        adapter_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    # fp32: merging W + (alpha/r) B A rounds each weight once; logits of O(1) agree to ~1e-5.
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-4, atol=1e-4)
    assert (adapter_logits - base_logits).abs().max() > 1e-4


LOAD_AND_GENERATE = """
import sys
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer
kind, path = sys.argv[1], sys.argv[2]
model = (AutoPeftModelForCausalLM if kind == "adapter" else AutoModelForCausalLM).from_pretrained(path).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
ids = tokenizer("A fun film. It was", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print("new tokens", out.shape[1] - ids.shape[1])
"""


def test_every_export_loads_offline_in_a_fresh_process_and_generates(straight, lora_run, tmp_path, capsys):
    """Full, LoRA adapter (its base model named in adapter_config.json) and merged LoRA, each loaded with
    from_pretrained by a new process with HF_HUB_OFFLINE=1 (no retries against the hub), then generate()."""
    exports = {"full": (straight[0] / "checkpoint-12", []), "adapter": (lora_run[0] / "checkpoint-8", []),
               "merged": (lora_run[0] / "checkpoint-8", ["--merge-lora"])}
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for kind, (ckpt, extra) in exports.items():
        out = tmp_path / kind
        assert main(["export", str(ckpt), "--out", str(out), *extra]) == 0
        printed = capsys.readouterr().out
        assert f"from_pretrained({str(out)!r})" in printed or f"from_pretrained({str(out / 'adapter')!r})" in printed
        targets = [("full", out)] if kind == "full" else [("adapter", out)] if kind == "adapter" else [
            ("full", out), ("adapter", out / "adapter")]
        for how, path in targets:
            proc = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, how, str(path)], env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0 and "new tokens 4" in proc.stdout, (kind, how, proc.stderr[-2000:])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "adapter" / "base").resolve())


def test_merge_lora_on_a_full_checkpoint_and_out_onto_a_file_are_one_line_errors(straight, tmp_path, capsys):
    ckpt = str(straight[0] / "checkpoint-12")
    assert main(["export", ckpt, "--out", str(tmp_path / "x"), "--merge-lora"]) == 2
    assert "full fine-tuning checkpoint" in capsys.readouterr().err
    (tmp_path / "file").write_text("keep me")
    assert main(["export", ckpt, "--out", str(tmp_path / "file")]) == 2
    assert "existing file" in capsys.readouterr().err and (tmp_path / "file").read_text() == "keep me"
