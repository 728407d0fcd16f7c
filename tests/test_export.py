"""`curvzo-ds export` of checkpoints from every front end (docs/integrations.md, docs/outputs.md).

Every checkpoint carries the same model record and files (checkpoint.write.write_model_files), whoever wrote it:
- end to end, as a user runs it: a LoRA model trained by `ZOTrainer` (one process) and by `from_accelerator`
  (2 ranks under DeepSpeed ZeRO-3, accelerate launch), then `curvzo-ds export CKPT --out DIR` in its own process;
  the adapter loads with peft onto its base model with exactly the trained values (the digest of the loaded
  adapter state dict equals the params_digest of the training run), and its lora_B, zero at the start, moved;
- in one process, what export refuses in one line: a full model with frozen parameters, a model without a
  Hugging Face config, several adapters, tensors that are not peft's adapter keys, a merge without a base, a
  checkpoint without a model record.
"""

import hashlib
import json
import os
import shutil
import sys

import pytest
import torch

from curvzo_ds.checkpoint import manager as ckpt
from curvzo_ds.checkpoint.write import write_model_files
from curvzo_ds.cli import main
from curvzo_ds.engine import ZOEngine
from curvzo_ds.shard.digest import hash_tensor
from tests.helpers import ENV, ROOT, free_port, run_checked

WORKER = str(ROOT / "tests" / "multirank" / "integ_worker.py")
ACCELERATE_CFG = str(ROOT / "ds_configs" / "accelerate_zero3.yaml")


def tiny_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM

    from curvzo_ds.tasks import demo_model_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(demo_model_config("llama"))


def lora(model, **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, **extra))


def digest(tensors: dict) -> str:
    """params_digest's rule (docs/contracts.md) over full tensors in memory."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        hash_tensor(h, name, tensors[name])
    return "sha256:" + h.hexdigest()


def lm_output(m, ids):
    return m(input_ids=ids).logits.float().square().mean(), 1


def checkpoint_of(model, directory, steps: int = 2, loss=lm_output) -> str:
    """A one-process checkpoint of `model` after `steps` ZO steps on a fixed batch of token ids."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    engine = ZOEngine(model, loss, method="mezo", learning_rate=1e-2, zo_eps=1e-2, max_steps=steps)
    for _ in range(steps):
        engine.step(ids)
    return ckpt.save_checkpoint(engine, str(directory))


def export_error(checkpoint: str, out, capsys, *extra: str) -> str:
    capsys.readouterr()  # what came before: from_pretrained's progress bars
    assert main(["export", checkpoint, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("curvzo-ds export: error: "), err
    return err


# ------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """The base model a user has on disk (a tiny Llama), which both front ends load with from_pretrained."""
    path = tmp_path_factory.mktemp("base") / "tiny-llama"
    tiny_llama().save_pretrained(path)
    return str(path)


def export_cli(checkpoint: str, out) -> str:
    """`curvzo-ds export CKPT --out DIR` in a new process, as a user types it; returns what it printed."""
    proc = run_checked([sys.executable, "-m", "curvzo_ds.cli", "export", checkpoint, "--out", str(out)], ENV)
    return proc.stdout


def check_adapter_export(result: dict, base_dir: str, out) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    printed = export_cli(result["checkpoint"], out)
    relative = os.path.relpath(base_dir, out)  # a local base is named relative to the adapter (issue 28)
    assert f"base model {relative!r}" in printed and f"from_pretrained({base_dir!r}), {str(out)!r})" in printed
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == relative
    # Onto its base model with peft: exactly the trained adapters.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out))
    state = get_peft_model_state_dict(model)
    assert sorted(state) == sorted(result["names"]) and len(state) == 8  # 2 layers x q, v x A, B
    assert digest(state) == result["digest"]
    assert all(state[k].abs().max() > 0 for k in state if "lora_B" in k)  # B starts at 0: these trained
    # The adapter names its base, so peft finds it alone from the adapter's directory.
    here = os.getcwd()
    os.chdir(out)
    try:
        assert digest(get_peft_model_state_dict(AutoPeftModelForCausalLM.from_pretrained("."))) == result["digest"]
    finally:
        os.chdir(here)


@pytest.mark.slow
def test_a_zotrainer_lora_checkpoint_exports_an_adapter_with_the_trained_values(base_dir, tmp_path):
    out = tmp_path / "r.json"
    run_checked([sys.executable, WORKER, "lora_trainer", base_dir, str(out)])
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["checkpoint"].endswith("checkpoint-4")
    check_adapter_export(result, base_dir, tmp_path / "exported")


@pytest.mark.multirank
def test_a_from_accelerator_lora_checkpoint_at_two_ranks_exports_an_adapter_with_the_trained_values(base_dir,
                                                                                                    tmp_path):
    out, port = tmp_path / "r.json", free_port()
    run_checked([shutil.which("accelerate"), "launch", "--config_file", ACCELERATE_CFG, "--num_processes", "2",
                 "--main_process_port", str(port), WORKER, "lora_loop", base_dir, str(out)],
                {**ENV, "MASTER_PORT": str(port)})
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["ds_engine"] == "DeepSpeedEngine"
    assert result["checkpoint"].endswith("pytorch_model")  # accelerator.save_state through the hooked engine
    check_adapter_export(result, base_dir, tmp_path / "exported")


# ------------------------------------------------------------------------------------------- in one process


def test_the_model_record_names_the_adapters_base_and_the_frozen_parameters(tmp_path, monkeypatch):
    """write_model_files: a local base directory by its absolute path (from_pretrained(adapter) must find it from
    any working directory), a hub id as given, none when the model had no name; a full model's frozen tensors."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    for source, recorded in (("my-model", str(tmp_path / "my-model")), ("org/hub-model", "org/hub-model"),
                             ("", None)):
        model = tiny_llama()
        model.name_or_path = model.config._name_or_path = source  # as from_pretrained(source) sets them
        target = tmp_path / f"files-{len(source)}"
        target.mkdir()
        record = write_model_files(str(target), lora(model))
        assert record["kind"] == "peft" and record["adapters"] == ["default"] and record["peft_type"] == "LORA"
        assert record["base_model"] == recorded
        assert (target / "adapter_config.json").exists() and (target / "config.json").exists()
        assert len(record["adapter_keys"]) == 8 and all(".lora_" in k for k in record["adapter_keys"])
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)
    record = write_model_files(str(tmp_path), model)
    assert record == {"kind": "full", "hf_config": True, "frozen": ["lm_head.weight", "model.norm.weight"]}


def test_a_full_checkpoint_exports_and_one_with_frozen_parameters_is_refused(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    good = checkpoint_of(model, tmp_path / "full")
    assert main(["export", good, "--out", str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert digest(dict(loaded.named_parameters())) == digest(dict(model.named_parameters()))
    partly = tiny_llama()
    partly.model.norm.weight.requires_grad_(False)
    err = export_error(checkpoint_of(partly, tmp_path / "partly"), tmp_path / "x", capsys)
    assert "1 of the model's were frozen (e.g. model.norm.weight)" in err and not (tmp_path / "x").exists()


def test_export_overwrite_replaces_an_earlier_export_and_never_a_run_live_or_finished(tmp_path, capsys):
    """Issue 59 §2: `export --overwrite` into a live run's directory deleted its checkpoints, metrics, logs and lock;
    into a finished run's, the run. Both are refused in one line naming what is there, nothing changed; into an
    earlier export, the new export replaces it whole. A live run is one whose lock (train/outputs.RunLock) is held:
    an flock on another open file conflicts within this process too."""
    from curvzo_ds.train.outputs import RunLock

    def tree(root):
        return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}

    good = checkpoint_of(tiny_llama(), tmp_path / "source")
    for name in ("live", "finished"):
        run = tmp_path / name
        (run / "checkpoint-8").mkdir(parents=True)
        (run / "checkpoint-8" / "manifest.json").write_text("{}")
        (run / "config.json").write_text(json.dumps({"output_dir": str(run), "method": "mezo"}))
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n')
    lock = RunLock.take(str(tmp_path / "live"))
    try:
        before = tree(tmp_path / "live")
        err = export_error(good, tmp_path / "live", capsys, "--overwrite")
        assert f"--out {tmp_path / 'live'} is in use by a live run (pid {os.getpid()} on " in err, err
        assert tree(tmp_path / "live") == before
    finally:
        lock.release()
    before = tree(tmp_path / "finished")
    err = export_error(good, tmp_path / "finished", capsys, "--overwrite")
    assert "holds a run (checkpoint-8, config.json, metrics.jsonl): an export never replaces a run's files" in err
    assert tree(tmp_path / "finished") == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert "holds files that no export writes (todo.txt)" in export_error(good, tmp_path / "notes", capsys,
                                                                          "--overwrite")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    # an earlier export: refused without --overwrite, replaced with it (and an export into a new directory inside a
    # run is no harm: it adds a directory)
    out = tmp_path / "export"
    assert main(["export", good, "--out", str(out)]) == 0
    (out / "model.safetensors").write_bytes(b"stale")
    assert "is not empty: it holds an earlier export" in export_error(good, out, capsys)
    assert main(["export", good, "--out", str(out), "--overwrite"]) == 0
    assert main(["export", good, "--out", str(tmp_path / "finished" / "export")]) == 0
    assert tree(out) == tree(tmp_path / "finished" / "export")
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".old", RunLock.NAME))]


def test_export_refuses_in_one_line_what_it_cannot_write_faithfully(tmp_path, capsys):
    plain = checkpoint_of(torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 4)), tmp_path / "plain",
                          loss=lambda m, ids: (m(ids).square().mean(), 1))
    assert "has no config.json" in export_error(plain, tmp_path / "x", capsys)

    two = lora(tiny_llama())
    from peft import LoraConfig

    two.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    err = export_error(checkpoint_of(two, tmp_path / "two"), tmp_path / "x", capsys)
    assert "['default', 'other']" in err

    saved = lora(tiny_llama(), modules_to_save=["lm_head"])  # trained beside the adapters, under its own names
    err = export_error(checkpoint_of(saved, tmp_path / "saved"), tmp_path / "x", capsys)
    assert "not the keys of peft's adapter state dict" in err

    nameless = checkpoint_of(lora(tiny_llama()), tmp_path / "nameless")  # built from a config: no name_or_path
    assert "does not name its base model" in export_error(nameless, tmp_path / "x", capsys, "--merge-lora")
    assert main(["export", nameless, "--out", str(tmp_path / "adapter")]) == 0  # the adapter itself is faithful
    assert "PeftModel.from_pretrained(your_base_model" in capsys.readouterr().out

    manifest = json.loads((tmp_path / "nameless" / "checkpoint-2" / "manifest.json").read_text())
    del manifest["model"]  # as an older curvzo_ds wrote it
    (tmp_path / "nameless" / "checkpoint-2" / "manifest.json").write_text(json.dumps(manifest))
    assert "no model record" in export_error(nameless, tmp_path / "x", capsys)
    assert not (tmp_path / "x").exists()


def test_export_refuses_a_damaged_checkpoint_and_an_out_that_is_the_checkpoints(tmp_path, capsys):
    """Issue 45 §3: an export of a checkpoint without config.json reported success and could not be loaded; an --out
    inside the checkpoint wrote into it (with --overwrite, an --out that holds it would have replaced it); a rank
    file linked to a file outside the checkpoint was followed; an --out under a file was a traceback. Each is one
    line and exit 2 now, and the checkpoint is unchanged."""
    good = checkpoint_of(tiny_llama(), tmp_path / "run")
    manifest = json.loads(open(os.path.join(good, "manifest.json")).read())
    before = {name: open(os.path.join(good, name), "rb").read() for name in os.listdir(good)}

    older = str(tmp_path / "older" / "checkpoint-2")  # written before `other_files`: config.json is checked by name
    shutil.copytree(good, older)
    with open(os.path.join(older, "manifest.json"), "w") as f:
        json.dump({k: v for k, v in manifest.items() if k != "other_files"}, f)
    os.remove(os.path.join(older, "config.json"))
    assert "config.json is missing: the checkpoint is partial" in export_error(older, tmp_path / "x", capsys)
    newer = str(tmp_path / "newer" / "checkpoint-2")
    shutil.copytree(good, newer)
    os.remove(os.path.join(newer, "config.json"))
    assert "config.json is missing: the checkpoint is partial" in export_error(newer, tmp_path / "x", capsys)

    (tmp_path / "run.log").write_text("a file")
    for out, extra, words in ((os.path.join(good, "hf"), (), "is inside the checkpoint"),
                              (str(tmp_path / "run"), ("--overwrite",), "is a directory that holds"),
                              (good, ("--overwrite",), "is inside the checkpoint"),
                              (str(tmp_path / "run.log" / "x"), (), "cannot be written (Not a directory)")):
        assert words in export_error(good, out, capsys, *extra), out
    linked = str(tmp_path / "linked" / "checkpoint-2")
    shutil.copytree(good, linked)
    rank = os.path.join(linked, sorted(manifest["files"])[0])
    os.rename(rank, str(tmp_path / "outside.safetensors"))
    os.symlink(str(tmp_path / "outside.safetensors"), rank)
    assert "is a link (to " in export_error(linked, tmp_path / "x", capsys)
    damaged = str(tmp_path / "damaged" / "checkpoint-2")
    shutil.copytree(good, damaged)
    with open(os.path.join(damaged, "manifest.json"), "w") as f:
        json.dump({**manifest, "model": {"kind": "full"}}, f)
    assert "its model record" in export_error(damaged, tmp_path / "x", capsys)
    assert not (tmp_path / "x").exists()
    assert {name: open(os.path.join(good, name), "rb").read() for name in os.listdir(good)} == before
