"""A user's DeepSpeed config is honoured, mapped onto TrainConfig, or refused with the key named."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from curvzo_ds.config.ds_config import load_ds_config, resolve_ds_config
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "ds_configs"
SHIPPED = ROOT / "ds_configs"
WORLD = 2  # the table is resolved as one rank of a 2-rank job
HIDDEN = 64  # HF's "auto": reduce 64*64, prefetch int(0.9*64*64), persistence 10*64

# file -> expected outcome: `refused` (a substring of the one-line error that names the key), or
# `warns` (the key each warning starts with), `cfg` (the TrainConfig fields that change) and
# `zero` (entries the output's zero_optimization must hold).
CASES = {
    "hf_zero3_auto.json": dict(
        warns=["zero_optimization.offload_optimizer", "optimizer", "scheduler"],
        cfg={"offload_param": "cpu"},
        zero={"stage": 3, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
              "stage3_param_persistence_threshold": 640, "sub_group_size": 10**9,
              "stage3_max_live_parameters": 10**9, "offload_param": {"device": "cpu", "pin_memory": True}}),
    "zero3_offload_param.json": dict(
        warns=[], cfg={"global_batch_size": 32, "offload_param": "cpu"},
        zero={"stage3_param_persistence_threshold": 10000, "offload_param": {"device": "cpu", "pin_memory": False}}),
    "zero3_offload_optimizer.json": dict(
        warns=["zero_optimization.offload_optimizer"],
        cfg={"micro_batch_size": 2, "global_batch_size": 2 * 8 * WORLD, "dtype": "bfloat16"},
        zero={"reduce_bucket_size": 500_000_000}),
    "zero2.json": dict(refused="zero_optimization.stage=2"),
    "zero1.json": dict(refused="zero_optimization.stage=1"),
    "bf16_zero3.json": dict(
        warns=["gradient_accumulation_steps"],
        cfg={"global_batch_size": 32, "micro_batch_size": 8, "dtype": "bfloat16"},
        zero={"stage3_param_persistence_threshold": 40960}),
    "fp16_loss_scaling.json": dict(warns=["fp16.loss_scale"], cfg={"dtype": "float16"}, zero={"stage": 3}),
    "zeropp_hpz.json": dict(refused="zero_hpz_partition_size=8"),
    "zeropp_quantized_weights.json": dict(refused="zero_quantized_weights"),
    "zeropp_quantized_gradients.json": dict(warns=["zero_optimization.zero_quantized_gradients"], cfg={},
                                            zero={"stage": 3}),
    "pipeline.json": dict(refused="pipeline.stages=2"),
    "optimizer_scheduler.json": dict(warns=["optimizer", "scheduler", "gradient_clipping"], cfg={},
                                     zero={"stage3_param_persistence_threshold": 0}),
    "activation_checkpointing.json": dict(
        warns=["activation_checkpointing"], cfg={"micro_batch_size": 1, "global_batch_size": 16 * WORLD},
        zero={"stage3_prefetch_bucket_size": 3686}),
    "nvme_offload.json": dict(refused="offload_param.device=nvme"),
    "stage0.json": dict(warns=[], cfg={"micro_batch_size": 2, "dtype": "bfloat16", "zero_stage": 0},
                        zero={"stage": 0}),
    "tensor_parallel.json": dict(refused="tensor_parallel.autotp_size=2"),
    "sequence_parallel.json": dict(refused="sequence_parallel_size=4"),
    "monitors_and_unknown.json": dict(warns=["tensorboard", "wandb", "my_launcher_note"], cfg={},
                                      zero={"stage": 3}),
    "zero_key_typo.json": dict(refused="zero_optimization.stage3_prefetch_bucket"),
    "bf16_and_fp16.json": dict(refused="bf16.enabled and fp16.enabled"),
    "shipped/zero3.json": dict(warns=[], cfg={}, zero={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}),
    "shipped/zero3_offload.json": dict(warns=[], cfg={"offload_param": "cpu"},
                                       zero={"offload_param": {"device": "cpu", "pin_memory": False}}),
}


def fixture_path(name: str) -> Path:
    return SHIPPED / name.split("/", 1)[1] if name.startswith("shipped/") else FIXTURES / name


def test_every_fixture_is_in_the_table():
    on_disk = {p.name for p in FIXTURES.glob("*.json")} | {f"shipped/{p.name}" for p in SHIPPED.glob("*.json")}
    assert on_disk == set(CASES)


def warning_key(warning: str) -> str:
    """A warning starts with the key it is about: `key: ...`, `key=value: ...` or `key.a/b: ...`."""
    return warning.split(":")[0].split("=")[0].split("/")[0]


def changed_fields(before: TrainConfig, after: TrainConfig) -> dict:
    old, new = dataclasses.asdict(before), dataclasses.asdict(after)
    return {k: v for k, v in new.items() if old[k] != v}


def resolve(user, cfg: TrainConfig, world: int, hidden):
    """(DeepSpeed config, the run's config after mapping, warnings), as `curvzo-ds train` resolves them."""
    ours = {k: getattr(cfg, k) for k in ("global_batch_size", "micro_batch_size", "dtype", "zero_stage",
                                         "offload_param")}
    out, mapped, warnings = resolve_ds_config(user, world, hidden, **ours)
    return out, dataclasses.replace(cfg, **mapped), warnings


@pytest.mark.parametrize("name", sorted(CASES))
def test_table(name):
    expected = CASES[name]
    user = load_ds_config(str(fixture_path(name)))
    original = copy.deepcopy(user)
    if "refused" in expected:
        with pytest.raises(ConfigError) as err:
            resolve(user, TrainConfig(zero_stage=3), WORLD, HIDDEN)
        message = str(err.value)
        assert expected["refused"] in message and "\n" not in message
        assert user == original  # the caller's dict is not edited
        return
    out, cfg, warnings = resolve(user, TrainConfig(zero_stage=3), WORLD, HIDDEN)
    assert user == original  # the caller's dict is not edited
    assert sorted(warning_key(w) for w in warnings) == sorted(expected["warns"])
    assert all("\n" not in w for w in warnings)
    assert changed_fields(TrainConfig(zero_stage=3), cfg) == expected["cfg"]
    assert out["train_micro_batch_size_per_gpu"] == cfg.micro_batch_size
    assert out["gradient_accumulation_steps"] == 1
    assert out["train_batch_size"] == cfg.micro_batch_size * WORLD
    for key, value in expected["zero"].items():
        assert out["zero_optimization"][key] == value, key
    assert "optimizer" not in out and "scheduler" not in out
    assert "auto" not in json.dumps(out)
    assert ("bf16" in out) == (cfg.dtype == "bfloat16") and ("fp16" in out) == (cfg.dtype == "float16")


def test_hidden_size_unknown_leaves_deepspeed_defaults():
    user = load_ds_config(str(FIXTURES / "hf_zero3_auto.json"))
    out, _, _ = resolve(user, TrainConfig(zero_stage=3), 1, None)
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert key not in out["zero_optimization"]


def test_no_user_config_follows_cfg():
    cfg = TrainConfig(micro_batch_size=3, dtype="bfloat16", offload_param="cpu", zero_stage=3)
    out, after, warnings = resolve(None, cfg, 4, 64)
    assert after == cfg
    assert warnings == []
    assert out == {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "train_batch_size": 12,
                   "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}


def test_global_batch_not_divisible_by_world_is_accepted():
    # DeepSpeed itself refuses train_batch_size 16 at 3 ranks; the engine batches on its own.
    out, cfg, _ = resolve({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, TrainConfig(zero_stage=3), 3,
                          None)
    assert cfg.global_batch_size == 16 and out["train_batch_size"] == 12


@pytest.mark.parametrize("user, key", [
    ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, "zero_optimization.sub_group_size"),
    ({"bf16": {"enabled": False}}, "bf16.enabled=false"),
    ({"train_batch_size": 0}, "train_batch_size=0"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu=2.5"),
    ({"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}}, "offload_param=cpu"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}},
     "stage3_param_persistence_threshold=-1"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage='3'"),
])
def test_bad_values_name_the_key(user, key):
    with pytest.raises(ConfigError) as err:
        resolve(user, TrainConfig(dtype="bfloat16"), 1, 64)
    assert key in str(err.value)


# docs/config.md: every key a DeepSpeed config maps (ds_policy.MAPPED_FIELDS), set explicitly to another value, is
# refused naming both values and both places. (DeepSpeed dict, the explicit key and value, the words of the error.)
CONFLICTS = [
    ({"train_batch_size": 32}, "global_batch_size", 8,
     "global_batch_size=8 (--set) conflicts with train_batch_size=32"),
    ({"gradient_accumulation_steps": 4}, "global_batch_size", 8,
     "global_batch_size=8 (--set) conflicts with gradient_accumulation_steps=4 (x micro_batch_size 4 x 2 ranks = 32)"),
    ({"train_micro_batch_size_per_gpu": 2}, "micro_batch_size", 4,
     "micro_batch_size=4 (--set) conflicts with train_micro_batch_size_per_gpu=2"),
    ({"bf16": {"enabled": True}}, "dtype", "float32", "dtype=float32 (--set) conflicts with bf16.enabled=true"),
    ({"fp16": {"enabled": True}}, "dtype", "bfloat16", "dtype=bfloat16 (--set) conflicts with fp16.enabled=true"),
    ({"zero_optimization": {"stage": 0}}, "zero_stage", 3,
     "zero_stage=3 (--set) conflicts with zero_optimization.stage=0"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param", "none",
     "offload_param=none (--set) conflicts with zero_optimization.offload_param.device=cpu"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}, "offload_param", "cpu",
     "offload_param=cpu (--set) conflicts with zero_optimization.offload_param.device=none"),
]


def test_every_mapped_key_has_a_conflict_case():
    from curvzo_ds.config.ds_policy import MAPPED_FIELDS

    assert {key for _, key, _, _ in CONFLICTS} == set(MAPPED_FIELDS)


@pytest.mark.parametrize("user,key,value,words", CONFLICTS, ids=[f"{c[1]}-{i}" for i, c in enumerate(CONFLICTS)])
def test_an_explicit_key_that_the_deepspeed_config_contradicts_is_refused(user, key, value, words):
    def resolve_given(value, source=None, where="the deepspeed config"):
        return resolve_ds_config(user, WORLD, HIDDEN, explicit={key: source} if source else {}, where=where,
                                 **{key: value})

    with pytest.raises(ConfigError) as err:
        resolve_given(value, "--set", "--deepspeed ds.json")
    assert str(err.value).startswith(words + " (--deepspeed ds.json)") and "\n" not in str(err.value)
    # The same key from a YAML file names the file; set there to the DeepSpeed value, it is no conflict; set only in
    # the DeepSpeed config, the DeepSpeed value is taken.
    with pytest.raises(ConfigError, match=r"\(--config run\.yaml\) conflicts"):
        resolve_given(value, "--config run.yaml")
    taken = resolve_given(value)[1][key]
    assert taken != value
    assert resolve_given(taken, "--set")[1][key] == taken


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_ds_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 16,\n  "zero_optimization": {"stage": 3,}\n}\n')
    with pytest.raises(ConfigError, match="line 3"):
        load_ds_config(str(bad))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_ds_config(str(listed))


def test_deepspeed_initialize_accepts_every_served_config(one_rank_group):
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    served = [name for name, expected in CASES.items() if "refused" not in expected]
    for name in served:
        out, cfg, _ = resolve(load_ds_config(str(fixture_path(name))), TrainConfig(zero_stage=3), 1, 16)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        if cfg.dtype == "float16" and not get_accelerator().is_fp16_supported():
            # DeepSpeed's CPU accelerator serves fp16 only where oneDNN has fp16 kernels (AVX512-FP16
            # or AMX); elsewhere it refuses the config itself, with this message.
            with pytest.raises(ValueError, match="fp16 is not supported on your device"):
                deepspeed.initialize(model=model, config=out)
            continue
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=out)
        assert not isinstance(optimizer, torch.optim.Optimizer), name  # no Adam state
        assert engine.zero_optimization_stage() == cfg.zero_stage, name
        dtype = getattr(torch, cfg.dtype)
        with torch.no_grad():
            y = engine(torch.randn(2, 16, dtype=dtype))
        assert y.shape == (2, 4) and y.dtype == dtype, name


def test_shipped_accelerate_config_loads():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(SHIPPED / "accelerate_zero3.yaml"))
    assert str(config.distributed_type).endswith("DEEPSPEED")
    assert config.deepspeed_config["zero_stage"] == 3 and config.deepspeed_config["zero3_init_flag"] is True


@pytest.mark.parametrize("stage,zero,words", [
    (1, {}, "Use zero_optimization.stage 3"),
    (2, {}, "Use zero_optimization.stage 3"),
    (3, {"zero_hpz_partition_size": 8}, "Remove zero_hpz_partition_size"),
    (3, {"zero_quantized_weights": True}, "Set zero_quantized_weights to false"),
])
def test_a_users_own_engine_is_refused_when_shard_local_edits_cannot_serve_it(stage, zero, words):
    """Users who build their DeepSpeed engine themselves skip the config mapping: the engine check refuses too."""
    from types import SimpleNamespace

    from curvzo_ds.shard.ds_compat import check_engine_supported

    stub = SimpleNamespace(zero_optimization_stage=lambda: stage,  # as DeepSpeedEngine (tests/test_ds_contract.py)
                           _config=SimpleNamespace(zero_config=SimpleNamespace(**zero)))
    with pytest.raises(ValueError, match=words):
        check_engine_supported(stub)
    check_engine_supported(SimpleNamespace(zero_optimization_stage=lambda: 3,
                                           _config=SimpleNamespace(zero_config=SimpleNamespace())))  # plain stage 3


# The variables `accelerate launch` exports from an Accelerate config's deepspeed_config (accelerate/utils/launch.py).
ACCELERATE_ENV = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                  "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                  "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                  "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                  "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                  "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"}


@pytest.mark.parametrize("name", ["accelerate_zero3.yaml", "accelerate_gpu.yaml"])
def test_shipped_accelerate_configs_give_the_clis_global_batch(name, monkeypatch):
    """Issue 38 §2 / 39 §3: a shipped Accelerate config, launched with its own num_processes, maps onto the global
    batch and micro-batch of `curvzo-ds train`'s defaults (16 and 4), as torchrun gives them: it sets no
    gradient_accumulation_steps. The GPU config sets no zero_stage either: the run's layout is then `auto`."""
    from accelerate.commands.config.config_args import load_config_from_file

    from curvzo_ds.train.build import accelerate_ds_config

    config = load_config_from_file(str(SHIPPED / name))
    assert "gradient_accumulation_steps" not in config.deepspeed_config
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", str(config.mixed_precision))
    for key, var in ACCELERATE_ENV.items():
        if key in config.deepspeed_config:
            monkeypatch.setenv(var, str(config.deepspeed_config[key]).lower())
        else:
            monkeypatch.delenv(var, raising=False)
    user = accelerate_ds_config()
    defaults = TrainConfig(zero_stage=3)
    _, mapped, _ = resolve_ds_config(user, config.num_processes, HIDDEN, global_batch_size=defaults.global_batch_size,
                                     micro_batch_size=defaults.micro_batch_size, dtype=defaults.dtype,
                                     zero_stage=3, offload_param=defaults.offload_param)
    assert (mapped["global_batch_size"], mapped["micro_batch_size"]) == (16, 4), (name, user)
    assert user["zero_optimization"].get("stage") == (3 if name == "accelerate_zero3.yaml" else None)
    if name == "accelerate_gpu.yaml":
        assert config.use_cpu is False and mapped["dtype"] == defaults.dtype  # the run's dtype key decides
