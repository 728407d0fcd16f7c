"""LoRA through the command line: 1 and 2 ranks agree, the adapter exports and merges.

The run trains only the peft adapters (q_proj, v_proj by default). The exported adapter,
loaded onto the base model with peft, and the merged model must compute the same logits
(up to fp32 rounding of W + B A), and differ from the base model (B starts at zero, so a
difference shows the adapters trained and were exported).
"""

import json

import pytest
import torch

from curvzo_ds.cli import main
from tests.helpers import train

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
    export = tmp_path / "adapter"
    assert main(["export", str(out / "checkpoint-8"), "--out", str(export), "--merge-lora"]) == 0
    assert (export / "adapter_model.safetensors").exists() and (export / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged")).eval()

    base, _ = build_model(resolve_presets(TrainConfig()), {})  # the demo base model, same seed as the run
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base.eval()(ids).logits
        adapted = PeftModel.from_pretrained(base, str(export)).eval()
        adapter_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    # fp32: merging W + (alpha/r) B A rounds each weight once; logits of O(1) agree to ~1e-5.
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-4, atol=1e-4)
    assert (adapter_logits - base_logits).abs().max() > 1e-4
