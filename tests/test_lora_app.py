"""LoRA through the command line: 1 and 2 ranks agree, the adapter exports and merges.

The run trains only the peft adapters (q_proj, v_proj by default). The exported adapter,
loaded onto the base model with peft, and the merged model must compute the same logits
(up to fp32 rounding of W + B A), and differ from the base model (B starts at zero, so a
difference shows the adapters trained and were exported).
"""

import json
import shutil
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

    from curvzo_ds.config.presets import resolve_presets
    from curvzo_ds.config.schema import TrainConfig
    from curvzo_ds.config.sections import section
    from curvzo_ds.models import build_model

    out, _ = lora_run
    export = tmp_path / "merged"
    assert main(["export", str(out / "checkpoint-8"), "--out", str(export), "--merge-lora"]) == 0
    adapter = export / "adapter"  # --merge-lora: the merged model in --out, the adapter beside it
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(export)).eval()

    base_cfg = resolve_presets(TrainConfig())
    base, _ = build_model(section(base_cfg, "model"), base_cfg.seed, {})  # the demo base model, same seed as the run
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
import json, os, sys
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
for how, path, cwd, base in json.loads(sys.argv[1]):
    os.chdir(cwd)
    if how == "full":
        model = AutoModelForCausalLM.from_pretrained(path)
    elif how == "adapter":
        model = AutoPeftModelForCausalLM.from_pretrained(path)
    else:  # the line export prints for loading from any directory: PeftModel onto the base named by `base`
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)
    model = model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("A fun film. It was", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    print("new tokens", out.shape[1] - ids.shape[1], "logits", model(ids).logits.sum().item(), flush=True)
"""


def load_and_generate(*loads: tuple) -> list[str]:
    """Each (how, path, cwd[, base]) loaded with from_pretrained, in that working directory, then generate(): all
    in one new process with HF_HUB_OFFLINE=1 (one interpreter for the batch: before issue 35, one each)."""
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    jobs = [[how, str(path), str(cwd), str(base[0]) if base else None] for how, path, cwd, *base in loads]
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, json.dumps(jobs)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("new tokens")]
    assert proc.returncode == 0 and len(lines) == len(jobs), (jobs, proc.stderr[-2000:])
    assert all(line.startswith("new tokens 4 ") for line in lines), lines
    return [line.split("logits")[1].strip() for line in lines]


def test_every_export_loads_offline_in_a_fresh_process_and_generates(straight, lora_run, tmp_path, capsys):
    """Full, LoRA adapter (its base model named in adapter_config.json) and merged LoRA, each loaded with
    from_pretrained by a new process with HF_HUB_OFFLINE=1 (no retries against the hub), then generate(). The
    demo's adapter names its base "base", relative to itself (issue 28 §5): AutoPeftModelForCausalLM loads it in
    the adapter's directory, and the printed PeftModel line loads it from any directory, also after the export
    was moved (a second process, started after the move)."""
    exports = {"full": (straight[0] / "checkpoint-12", []), "adapter": (lora_run[0] / "checkpoint-8", []),
               "merged": (lora_run[0] / "checkpoint-8", ["--merge-lora"])}
    loads = []  # (how, path, cwd[, base]), loaded together below
    for kind, (ckpt, extra) in exports.items():
        out = tmp_path / kind
        assert main(["export", str(ckpt), "--out", str(out), *extra]) == 0
        printed = capsys.readouterr().out
        if kind in ("full", "merged"):
            assert f"from_pretrained({str(out)!r})" in printed
            loads.append(("full", out, tmp_path))
        if kind == "full":
            continue
        adapter = out / "adapter" if kind == "merged" else out
        recipe = f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(out / 'base')!r}), " \
                 f"{str(adapter)!r})"
        assert recipe in printed, printed
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == ("../base" if kind == "merged" else "base")
        loads += [("adapter", ".", adapter), ("anywhere", adapter, tmp_path, out / "base")]  # in its directory, any
    logits = load_and_generate(*loads)
    adapter_logits = logits[1]
    assert logits[2] == adapter_logits and logits[4] == logits[5]  # each adapter, from its directory or any
    moved = tmp_path / "elsewhere" / "copied-export"
    shutil.copytree(tmp_path / "adapter", moved)
    shutil.rmtree(tmp_path / "adapter")
    assert load_and_generate(("adapter", ".", moved), ("anywhere", moved, tmp_path, moved / "base")) == \
        [adapter_logits] * 2


def test_merge_lora_on_a_full_checkpoint_and_out_onto_a_file_are_one_line_errors(straight, tmp_path, capsys):
    ckpt = str(straight[0] / "checkpoint-12")
    assert main(["export", ckpt, "--out", str(tmp_path / "x"), "--merge-lora"]) == 2
    assert "full fine-tuning checkpoint" in capsys.readouterr().err
    (tmp_path / "file").write_text("keep me")
    assert main(["export", ckpt, "--out", str(tmp_path / "file")]) == 2
    assert "existing file" in capsys.readouterr().err and (tmp_path / "file").read_text() == "keep me"


def test_the_adapter_names_a_hub_id_as_given_and_a_local_directory_relative_to_itself(tmp_path, monkeypatch):
    """What export writes as base_model_name_or_path for the two non-demo kinds of model (the demo's is tested
    above, by loading): a hub id as given; a local directory by its path from the adapter (issue 28 §5), so that
    moving the export and the model together keeps it loadable."""
    from curvzo_ds.commands.export import _base_model
    from curvzo_ds.config.schema import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    assert _base_model("models/my-model", TrainConfig(model="models/my-model", lora=True), "stage", "exports/a",
                       "exports/a") == ("../../models/my-model", None, "models/my-model")
    assert _base_model("facebook/opt-125m", TrainConfig(model="facebook/opt-125m", lora=True), "stage", "out",
                       "out/adapter") == ("facebook/opt-125m", None, None)


def test_an_export_over_another_needs_overwrite_and_then_replaces_it_whole(straight, lora_run, tmp_path, capsys):
    """Issue 28 §4: a LoRA export onto a full one is refused (nothing changes); with --overwrite the directory holds
    exactly what a fresh LoRA export holds, byte for byte, and none of the full export's files."""
    full, lora = str(straight[0] / "checkpoint-12"), str(lora_run[0] / "checkpoint-8")
    out, fresh = tmp_path / "export", tmp_path / "fresh"
    assert main(["export", full, "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["export", lora, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert main(["export", lora, "--out", str(out), "--overwrite"]) == 0
    assert main(["export", lora, "--out", str(fresh)]) == 0

    def tree(root):
        return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}

    assert tree(out) == tree(fresh) and "model.safetensors" not in tree(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "fresh"]  # no staging directory left behind
