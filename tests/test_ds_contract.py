"""The DeepSpeed internals curvzo_ds reads, checked against the installed DeepSpeed on a real ZeRO-3 engine.

Every private DeepSpeed attribute the package reads is read in curvzo_ds/shard/ds_compat.py (and the settings named in
ds_policy.REFUSALS). A DeepSpeed release that renames or retypes one fails here, naming the attribute and the
DeepSpeed version, rather than in a training run. One process, world size 1, DS_ACCELERATOR=cpu.
"""

import math
import os
import re
from collections.abc import Callable

import deepspeed
import pytest
import torch

from curvzo_ds.config.ds_policy import REFUSALS, refusal
from curvzo_ds.shard import ds_compat
from tests.helpers import ROOT
from tests.toys import TinyNet

# Refused in a user's config only: DeepSpeed 0.19.8 has no such setting any more (MiCS was removed), so no engine
# can carry it.
CONFIG_ONLY = {"zero_optimization.mics_shard_size"}
VERSION = deepspeed.__version__

# What ds_compat.py reads from a ZeRO-3 parameter, and the type it relies on.
PARAM_ATTRIBUTES = {
    "ds_tensor": torch.Tensor,  # this rank's 1-D shard
    "ds_numel": int,
    "ds_shape": tuple,  # a torch.Size
    "ds_process_group": torch.distributed.ProcessGroup,
    "ds_persist": bool,
    "ds_status": None,  # a ZeroParamStatus (checked below)
    "ds_id": int,  # zero_init_partitioned: present only on a parameter zero.Init partitioned
    "all_gather": Callable,  # gather_persistent: p.all_gather(param_list=[...])
    "partition": Callable,  # forget_backward: p.partition(param_list=[...], has_been_updated=False)
    "ds_active_sub_modules": set,  # forget_backward: the modules that still hold a gathered parameter
}
# What forget_backward calls on the ZeRO-3 parameter coordinator (after static_mask's probe).
COORDINATOR_ATTRIBUTES = ("release_backward_leftovers", "is_invalid_trace", "_invalidate_trace",
                          "_PartitionedParameterCoordinator__params_to_release")
DS_PARAM_METHODS = ("all_gather", "partition", "all_gather_coalesced")  # what zero.Init adds to a parameter
ENGINE_ATTRIBUTES = ("_config",)  # engine._config.zero_config: the engine's DeepSpeedZeroConfig


def fail(what: str, problem: str) -> None:
    pytest.fail(f"DeepSpeed {VERSION}: {what} {problem}; curvzo_ds/shard/ds_compat.py reads it (docs/deepspeed.md): "
                "update ds_compat.py for this release, or install deepspeed within curvzo_ds/versions.py's range")


def get(what: str, obj, attr: str):
    """getattr(obj, attr), or a failure naming `what` and the DeepSpeed version."""
    try:
        return getattr(obj, attr)
    except AttributeError as e:
        fail(what, f"is gone (AttributeError: {e})")


def expect(what: str, value, kind) -> None:
    if not isinstance(value, kind):
        fail(what, f"is a {type(value).__module__}.{type(value).__qualname__}, not a {kind.__name__}")


@pytest.fixture(scope="module")
def engine(one_rank_group):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20}}
    built, *_ = deepspeed.initialize(model=TinyNet(), config=config)
    return built


def test_the_tables_name_every_private_attribute_ds_compat_reads():
    source = (ROOT / "curvzo_ds" / "shard" / "ds_compat.py").read_text()
    read = set(re.findall(r"[.\"'](ds_(?!policy\b)[a-z_]+)\b", source))
    read |= {m for m in re.findall(r"\.([a-z_]+)\(", source) if m in DS_PARAM_METHODS}
    assert read <= set(PARAM_ATTRIBUTES), f"add {sorted(read - set(PARAM_ATTRIBUTES))} to PARAM_ATTRIBUTES"
    read = set(re.findall(r"engine\.(_[a-z_]+)", source))
    assert read <= set(ENGINE_ATTRIBUTES), f"add {sorted(read - set(ENGINE_ATTRIBUTES))} to ENGINE_ATTRIBUTES"


def test_no_other_module_reads_a_deepspeed_parameter_attribute():
    """The tables above cover what ds_compat.py reads; that is all the package reads: no other module reads a ds_*
    attribute (p.ds_tensor, hasattr(p, "ds_id"), getattr(p, "ds_numel", ...)), so a DeepSpeed release that renames
    one fails here and not in a run."""
    import ast

    found = []
    for path in sorted((ROOT / "curvzo_ds").rglob("*.py")):
        if path.name == "ds_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr", "setattr"):
                names += [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if name.startswith("ds_") and name != "ds_compat"]
    assert not found, f"read these through curvzo_ds/shard/ds_compat.py: {found}"


def test_module_level_names():
    import importlib

    names = ["deepspeed.DeepSpeedEngine", "deepspeed.initialize", "deepspeed.init_distributed",
             "deepspeed.zero.GatheredParameters", "deepspeed.zero.Init",
             "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE",
             "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload",
             "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
             "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs",
             "deepspeed.accelerator.get_accelerator"]
    for dotted in names:
        parts = dotted.split(".")
        obj = deepspeed
        for i, part in enumerate(parts[1:], 2):
            if not hasattr(obj, part):  # a submodule not imported yet
                try:
                    importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    pass
            obj = get(dotted, obj, part)


@pytest.mark.parametrize("attr", sorted(PARAM_ATTRIBUTES))
def test_a_partitioned_parameter_has(engine, attr):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for name, p in engine.module.named_parameters():
        value = get(f"a ZeRO-3 parameter's {attr} ({name})", p, attr)
        expect(f"{attr} ({name})", value, PARAM_ATTRIBUTES[attr] or ZeroParamStatus)


def test_the_shard_layout_ds_compat_assumes(engine):
    params = dict(engine.module.named_parameters())
    partitioned = [n for n, p in params.items() if not p.ds_persist]
    assert partitioned and len(partitioned) < len(params), "the fixture needs persistent and partitioned tensors"
    for name, p in params.items():
        world = torch.distributed.get_world_size(group=p.ds_process_group)
        if p.ds_tensor.dim() != 1 or p.ds_tensor.numel() != math.ceil(p.ds_numel / world):
            fail(f"ds_tensor ({name})", f"has shape {tuple(p.ds_tensor.shape)}, not ceil(ds_numel / W) = "
                                        f"{math.ceil(p.ds_numel / world)} elements in 1-D")
        assert tuple(p.ds_shape) == ds_compat.full_shape(p) and p.ds_numel == math.prod(p.ds_shape), name
        assert ds_compat.owned_range(p) == (0, p.ds_numel), name  # world size 1 owns everything
    p = params[partitioned[0]]
    if p.data.numel() != 0 or ds_compat.is_available(p):
        fail(f"p.data ({partitioned[0]})", f"holds {p.data.numel()} elements outside a forward, not 0")
    with ds_compat.gathered([p]):
        if not ds_compat.is_available(p):
            fail("ds_status inside GatheredParameters", f"is {p.ds_status}, not ZeroParamStatus.AVAILABLE")
        full = p.data.clone()
    assert torch.equal(full.view(-1), ds_compat.shard_view(p, p.ds_numel))


def test_the_engine_attributes(engine):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert ds_compat.is_ds_engine(engine)
    expect("engine.zero_optimization_stage()", get("engine.zero_optimization_stage", engine,
                                                    "zero_optimization_stage")(), int)
    zero = get("engine._config.zero_config", get("engine._config", engine, "_config"), "zero_config")
    expect("engine._config.zero_config", zero, DeepSpeedZeroConfig)
    expect("engine.pipeline_parallelism", get("engine.pipeline_parallelism", engine, "pipeline_parallelism"), bool)
    expect("engine.module", engine.module, torch.nn.Module)
    assert ds_compat.module_of(engine) is engine.module
    if ds_compat.optimizer_of(engine) is not None:
        fail("engine.optimizer", f"is a {type(engine.optimizer).__qualname__} on ZeRO-3 without an optimizer, "
                                 "not a DeepSpeedZeRoOffload")
    settings = ds_compat.engine_settings(engine)
    read = {f"zero_optimization.{key}" for key in settings["zero_optimization"]}
    wanted = {r.key for r in REFUSALS if r.key.startswith("zero_optimization.") and ".offload_param" not in r.key
              and r.key not in CONFIG_ONLY}
    assert read >= wanted, f"DeepSpeed {VERSION}: engine_settings could not read {sorted(wanted - read)}"
    assert refusal(settings) is None


def test_the_parameter_coordinator_forget_backward_uses(engine):
    coordinator = get("engine.optimizer.get_param_coordinator", engine.optimizer, "get_param_coordinator")()
    for attr in COORDINATOR_ATTRIBUTES:
        expect(f"the parameter coordinator's {attr}", get(f"the parameter coordinator's {attr}", coordinator, attr),
               Callable)
    ds_compat.forget_backward(engine, list(engine.module.parameters()))  # finds the cached release sets, or raises
    assert coordinator.is_invalid_trace()


def test_every_refused_zero_setting_is_read_from_the_zero_config():
    """engine_settings walks each REFUSALS key through DeepSpeedZeroConfig's attributes; a renamed one would read
    as None and the refusal would silently never fire."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(stage=3, zero_hpz_partition_size=2, zero_quantized_weights=True,
                               zero_quantized_nontrainable_weights=True,
                               offload_param={"device": "nvme", "nvme_path": os.devnull})
    assert not {k.split(".")[1] for k in CONFIG_ONLY} & set(DeepSpeedZeroConfig.model_fields), \
        f"DeepSpeed {VERSION} has {CONFIG_ONLY} again: read it from the engine too"
    for r in REFUSALS:
        parts = r.key.split(".")
        if parts[0] != "zero_optimization" or parts[1:] == ["stage"] or r.key in CONFIG_ONLY:
            continue
        value = zero
        for part in parts[1:]:
            value = get(f"DeepSpeedZeroConfig.{'.'.join(parts[1:])}", value, part)
        assert r.refuses(getattr(value, "value", value)), f"DeepSpeed {VERSION}: {r.key} read as {value!r}"
