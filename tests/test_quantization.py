"""A quantised base (issue 48 §4): `quantization: 4bit | 8bit` loads the base through bitsandbytes, frozen, and the
step perturbs the LoRA adapters only. Refused without lora=true and under ZeRO-3; a 4-bit LoRA run of the demo model
through the CLI trains, resumes exactly, evaluates and exports an adapter that peft loads onto the base it names; the
planner counts the base at the bytes bitsandbytes stores.
"""

import json
import logging
import shutil
import sys

import pytest
import torch

from curvzo_ds.cli import main
from curvzo_ds.config.resolve import resolve
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.config.sections import section
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.memory import GiB, plan_memory
from tests.helpers import COMMON, check_contract, cli, eval_cli, logged_eval, metrics_lines

# COMMON less its ZeRO-3 DeepSpeed file: a quantised run takes stage 0 (zero_stage auto)
STAGE0 = [a for i, a in enumerate(COMMON) if "--deepspeed" not in COMMON[max(i - 1, 0):i + 1]]
QUANT = ["--set", "lora=true", "--set", "quantization=4bit", "--set", "learning_rate=1e-2", "--set", "max_steps=6"]


def train(out, *extra: str, nproc: int = 1) -> dict:
    proc = cli("train", *STAGE0, *QUANT, "--set", f"output_dir={out}", *extra, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "run"
    summary = train(out)
    check_contract(out)  # once: the other runs here are the same run resumed or at 2 ranks
    return out, summary


def model_section(**keys):
    return section(resolve(TrainConfig(lora=True, **keys)), "model")


# --- refusals --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets, words", [
    (["quantization=4bit"], "quantization=4bit needs lora=true"),
    (["lora=true", "quantization=8bit", "zero_stage=3"], "needs zero_stage=0 (a bitsandbytes base is whole on every "
                                                         "rank; ZeRO-3 cannot partition or offload it), not "
                                                         "zero_stage=3: set zero_stage=auto"),
    (["lora=true", "quantization=4bit", "offload_param=cpu"], "not offload_param=cpu"),
    (["lora=true", "quantization=3bit"], "quantization='3bit' is invalid: it must be none, 8bit or 4bit"),
])
def test_refused_without_lora_and_under_zero3_in_one_line(sets, words, capsys):
    argv = ["train", "--check"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_deepspeed_file_at_stage_3_is_refused_and_auto_takes_stage_0(tmp_path):
    from curvzo_ds.layout.choice import choose_layout

    ds = tmp_path / "ds.json"
    cfg = resolve(TrainConfig(lora=True, quantization="4bit", deepspeed=str(ds)))
    with pytest.raises(ConfigError, match=rf"not zero_optimization.stage=3 in --deepspeed {ds}: set "
                                          r"zero_optimization.stage to 0 and remove offload_param"):
        choose_layout(cfg, {"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="not zero_optimization.offload_param.device=cpu"):
        choose_layout(cfg, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    layout = choose_layout(resolve(TrainConfig(lora=True, quantization="8bit")), None)
    assert layout.zero_stage == 0 and "quantization=8bit" in layout.reason
    # a model that would not fit one device still takes stage 0: the quantised base cannot be partitioned
    big = choose_layout(resolve(TrainConfig(model="llama2-70b", lora=True, quantization="4bit")), None)
    assert big.zero_stage == 0


def test_a_missing_bitsandbytes_is_one_line_naming_the_extra(monkeypatch):
    from curvzo_ds.models import quantization_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ConfigError, match=r"quantization=4bit needs bitsandbytes, which cannot be imported .*: "
                                          r"pip install 'curvzo_ds\[quant\]'"):
        quantization_config("4bit", torch.float32)
    assert quantization_config("none", torch.float32) is None  # no import when not asked for


# --- the model -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_the_base_is_quantised_and_frozen_and_only_the_adapters_train(bits):
    import bitsandbytes as bnb

    from curvzo_ds.models import build_model

    model, _ = build_model(model_section(quantization=bits), 42, {})
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    layer = {"4bit": bnb.nn.Linear4bit, "8bit": bnb.nn.Linear8bitLt}[bits]
    assert isinstance(q_proj.base_layer, layer) and not q_proj.base_layer.weight.requires_grad
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert model.peft_config["default"].base_model_name_or_path in ("", None)  # no temporary directory named
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a forward does not depend on what came before it (models.keep_stored_format)
        first = model.eval()(ids).logits
        model.train()(ids)
        model.state_dict()  # as a checkpoint's save reads it
        assert torch.equal(model.eval()(ids).logits, first) and torch.isfinite(first).all()


def test_the_planner_counts_what_bitsandbytes_stores():
    """The demo model's 4-bit base as built (packed nf4 bytes, each block's fp32 absmax, the rest fp32) is the
    planner's base figure, to the byte."""
    from curvzo_ds.models import build_model

    model, _ = build_model(model_section(quantization="4bit"), 42, {})
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    stored = sum(p.numel() * p.element_size() for p in base)
    stored += sum(p.quant_state.absmax.numel() * 4 for p in base if getattr(p, "quant_state", None) is not None)
    plan = plan_memory("demo", 1, dtype="fp32", quantization="4bit", lora_r=8)
    assert plan.shard == stored
    assert plan.adapters == 4 * sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


# --- a 4-bit LoRA run through the CLI --------------------------------------------------------------------------


def test_a_4bit_lora_run_trains_the_adapters_at_stage_0(quant_run):
    out, summary = quant_run
    assert summary["steps"] == 6 and summary["layout"]["zero_stage"] == 0
    assert "quantization=4bit" in summary["layout"]["reason"]
    names = json.loads((out / "checkpoint-6" / "manifest.json").read_text())["tensors"]
    assert names and all("lora_" in n for n in names), names
    rows = [r for r in metrics_lines(out) if "split" not in r]
    assert any(r.get("projected_grad") not in (None, 0) for r in rows)
    assert json.loads((out / "checkpoint-6" / "run_config.json").read_text())["quantization"] == "4bit"


def test_resume_is_exact(quant_run, tmp_path):
    """A run resumed from the uninterrupted run's checkpoint-3 ends with its weights (params_digest) and its lines."""
    out, summary = quant_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-3", resumed / "checkpoint-3")
    assert train(resumed, "--resume", str(resumed / "checkpoint-3"))["params_digest"] == summary["params_digest"]
    later = [r for r in metrics_lines(out) if r.get("step", 0) > 3]
    assert [r for r in metrics_lines(resumed) if r.get("step", 0) > 3] == later


@pytest.mark.multirank
def test_two_ranks_equal_one(quant_run, tmp_path):
    assert train(tmp_path / "run-2", nproc=2)["params_digest"] == quant_run[1]["params_digest"]


def test_eval_of_a_quantised_checkpoint_rebuilds_the_quantised_base(quant_run, tmp_path):
    out, _ = quant_run
    assert eval_cli(out / "checkpoint-6", tmp_path)["dev"]["loss"] == logged_eval(out, 6)["dev"]["loss"]


def test_the_export_loads_in_peft_onto_the_base_it_names_and_merge_warns(quant_run, tmp_path, caplog, capsys):
    """The adapter names its base ("base", the demo's full-precision weights, saved beside it). peft loads it onto
    that base quantised as the run did, which gives the trained model's logits; --merge-lora merges it into the
    full-precision base, with a warning that it was trained against the quantised one."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from curvzo_ds.models import build_model, keep_stored_format

    out, _ = quant_run
    export = tmp_path / "adapter"
    capsys.readouterr()
    assert main(["export", str(out / "checkpoint-6"), "--out", str(export)]) == 0
    # issue 59: its load hint loads the base quantised as below (it loaded it in full precision: test 0.555 for 0.57)
    hint = capsys.readouterr().out
    assert (f"AutoModelForCausalLM.from_pretrained({str(export / 'base')!r}, quantization_config=BitsAndBytesConfig("
            "load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.float32, "
            f"bnb_4bit_use_double_quant=False)), {str(export)!r})") in hint, hint
    adapter_config = json.loads((export / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "base"
    assert "quantization_config" not in json.loads((export / "base" / "config.json").read_text())
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(export / "base"), quantization_config=four_bit)
    keep_stored_format(base)  # as the run computed (no repacking for AVX512-bf16 CPUs)
    loaded = PeftModel.from_pretrained(base, str(export)).eval()

    trained, _ = build_model(model_section(quantization="4bit"), 42, {})  # the run's model, its adapters loaded
    set_peft_model_state_dict(trained, load_file(str(export / "adapter_model.safetensors")))
    untrained, _ = build_model(model_section(quantization="4bit"), 42, {})
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded(ids).logits
        torch.testing.assert_close(logits, trained.eval()(ids).logits, rtol=0, atol=0)
        assert (logits - untrained.eval()(ids).logits).abs().max() > 1e-4  # the adapters trained

    merged_dir = tmp_path / "merged"
    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        assert main(["export", str(out / "checkpoint-6"), "--out", str(merged_dir), "--merge-lora"]) == 0
    assert "the adapter was trained against the 4bit-quantised base" in caplog.text
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    assert getattr(merged.config, "quantization_config", None) is None
    full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(merged_dir / "base")),
                                     str(merged_dir / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, full(ids).logits, rtol=1e-4, atol=1e-4)


# --- plan ------------------------------------------------------------------------------------------------------


def test_plan_counts_a_quantised_llama2_base():
    """Llama-2-7B: the 32 x (4 x 4096^2 + 3 x 4096 x 11008) linear weights at 0.5 B + 4 B / 64 (4bit) or 1 B + 4 B
    per output row (8bit); embeddings, head and norms in bf16; adapters r (in + out) on q_proj and v_proj, fp32."""
    linear, rows = 32 * (4 * 4096**2 + 3 * 4096 * 11008), 32 * (4 * 4096 + 2 * 11008 + 4096)
    plans = {q: plan_memory("llama2-7b", 1, quantization=q, lora_r=8, batch=16) for q in ("4bit", "8bit")}
    rest = 2 * (plans["4bit"].params - linear)
    assert plans["4bit"].quantized_elements == linear
    assert plans["4bit"].shard == int(linear * (0.5 + 4 / 64)) + rest
    assert plans["8bit"].shard == linear + 4 * rows + rest
    assert plans["4bit"].adapters == 4 * 32 * 2 * 8 * (4096 + 4096)
    full = plan_memory("llama2-7b", 1, shard_group_size=1, lora_r=8, batch=16)
    assert plans["4bit"].total < plans["8bit"].total < full.total
    assert plans["4bit"].total < 5 * GiB  # SensZOQ's "under 8 GiB" for Llama-2-7B, with 16 x 512 tokens
    assert plan_memory("llama2-70b", 1, quantization="4bit", lora_r=8, gpu_memory="48GiB").fits


def test_plan_command_takes_stage_0_for_a_quantised_base(capsys):
    assert main(["plan", "--model", "llama2-13b", "--world-size", "8", "--quantization", "8bit"]) == 0
    printed = capsys.readouterr().out
    assert "quantised 8bit" in printed and "LoRA r=8, base 8bit;" in printed
    assert "layout: zero_stage=0 replicas=8" in printed and "also fits" not in printed
    assert main(["plan", "--world-size", "2", "--shard-group-size", "2", "--quantization", "4bit"]) == 2
    assert "--shard-group-size 1" in capsys.readouterr().err
