"""The configuration's sections, its one resolution (presets, DeepSpeed, one validation, frozen) and its sources."""

import copy
import dataclasses
import json
import pathlib
import re

import pytest

from curvzo_ds.config.fields import field_names, set_sources, sources_of, to_dict
from curvzo_ds.config.presets import resolve_presets
from curvzo_ds.config.resolve import resolve, resolve_run, zo_part
from curvzo_ds.config.schema import TrainConfig, ZOConfig
from curvzo_ds.config.sections import SECTION_OF, SECTIONS, section
from curvzo_ds.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_key_is_in_exactly_one_section():
    listed = [k for keys in SECTIONS.values() for k in keys]
    twice = sorted({k for k in listed if listed.count(k) > 1})
    assert not twice, f"in two sections: {twice}"
    assert sorted(listed) == sorted(field_names(TrainConfig)), (
        f"in no section: {sorted(set(field_names(TrainConfig)) - set(listed))}; not a key: "
        f"{sorted(set(listed) - set(field_names(TrainConfig)))}")
    assert "sources" not in listed


def test_docs_config_groups_keys_by_section():
    text = (ROOT / "docs" / "config.md").read_text()
    text = text[text.index("## All keys"):]
    heading = None
    seen = {}
    for line in text.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        m = re.match(r"\| `(\w+)` \|", line)
        if m:
            seen[m.group(1)] = heading
    assert seen == SECTION_OF


def test_section_is_frozen_and_holds_its_keys():
    cfg = TrainConfig(save_steps=7, output_dir="runs/x")
    ckpt = section(cfg, "checkpoint")
    assert ckpt.save_steps == 7 and ckpt.output_dir == "runs/x"
    assert set(dataclasses.asdict(ckpt)) == set(SECTIONS["checkpoint"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        ckpt.save_steps = 1
    with pytest.raises(KeyError, match="no config section"):
        section(cfg, "nope")


def test_resolve_returns_a_new_frozen_config_and_leaves_its_input_alone():
    cfg = TrainConfig(model="facebook/opt-13b", lora_target_modules="q_proj, k_proj")
    before = copy.deepcopy(cfg)
    out = resolve(cfg)
    assert out is not cfg and cfg == before and not cfg.resolved
    assert out.resolved and out.learning_rate == 1e-6 and out.lora_target_modules == ["q_proj", "k_proj"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.learning_rate = 1.0
    # the flat run_config.json is the same keys as before: no internal field in it
    assert list(to_dict(out)) == field_names(TrainConfig)
    json.dumps(to_dict(out))
    # replace gives a mutable, unresolved copy (validated again by whoever uses it)
    again = dataclasses.replace(out, seed=1)
    assert not again.resolved
    again.seed = 2
    # deepcopy keeps it frozen
    assert copy.deepcopy(out).resolved


def test_resolve_presets_does_not_mutate():
    cfg = TrainConfig()
    out = resolve_presets(cfg)
    assert cfg.learning_rate is None and out.learning_rate == 3e-4 and out.save_steps == 100


def test_resolve_maps_the_deepspeed_config_and_validates_once():
    cfg = set_sources(TrainConfig(), {"seed": "--set"})
    early = resolve(cfg)  # the CLI's, before ranks start
    out, ds, notes = resolve_run(early, world_size=2, hidden_size=None, user_ds={"train_micro_batch_size_per_gpu": 2})
    assert out.resolved and out.micro_batch_size == 2 and ds["train_micro_batch_size_per_gpu"] == 2
    assert early.micro_batch_size == 4 and sources_of(out) == {"seed": "--set"}
    # an explicit key that the DeepSpeed config sets otherwise is refused by the mapping
    given = set_sources(TrainConfig(micro_batch_size=4), {"micro_batch_size": "--set"})
    with pytest.raises(ConfigError, match="conflicts with train_micro_batch_size_per_gpu=2"):
        resolve(given, world_size=1, user_ds={"train_micro_batch_size_per_gpu": 2})
    with pytest.raises(ConfigError, match="seed=-1 is invalid"):
        resolve(TrainConfig(seed=-1))


def test_sources_survive_replace_and_stay_out_of_to_dict_and_equality():
    cfg = set_sources(TrainConfig(), {"dtype": "--set"})
    assert sources_of(dataclasses.replace(cfg, seed=3)) == {"dtype": "--set"}
    assert "sources" not in to_dict(cfg)
    assert cfg == TrainConfig() and "sources" not in repr(cfg)


def test_a_raw_zoconfig_still_fails_validation_with_the_same_message():
    raw = ZOConfig(budget_min=0.9, budget_max=0.5)
    assert not raw.resolved
    with pytest.raises(ConfigError, match=r"^budget_min=0.9 is larger than budget_max=0.5: set budget_min <= "):
        raw.validate()
    with pytest.raises(ConfigError, match=r"^method='sgd' is invalid: it must be one of curvzo, "):
        ZOConfig(method="sgd").validate()


def test_zo_part_of_a_resolved_config_is_resolved():
    assert zo_part(resolve(TrainConfig())).resolved
    assert not zo_part(resolve_presets(TrainConfig())).resolved
