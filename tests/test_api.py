"""The public entry point: every documented name imports from the top level, in a fresh interpreter."""

import subprocess
import sys

from tests.helpers import ENV, ROOT

PUBLIC = ["ZOEngine", "ZOConfig", "MicroBatches", "split_batch", "StepResult", "save_checkpoint", "load_checkpoint",
          "CheckpointManager", "ZOTrainer", "from_accelerator", "__version__"]


def fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_every_public_name_imports_from_the_top_level():
    out = fresh(f"from curvzo_ds import {', '.join(PUBLIC)}; import curvzo_ds; print(sorted(curvzo_ds.__all__))")
    assert set(PUBLIC) <= set(eval(out))
    assert fresh("from curvzo_ds import ZOTrainer; import transformers; print(issubclass(ZOTrainer, "
                 "transformers.Trainer))") == "True"


def test_importing_the_package_stays_light():
    """`import curvzo_ds` loads neither transformers, accelerate, peft nor deepspeed (ZOTrainer is lazy)."""
    out = fresh("import sys, curvzo_ds; print([m for m in ('transformers', 'accelerate', 'peft', 'deepspeed') "
                "if m in sys.modules])")
    assert out == "[]"


def test_version_matches_the_package_metadata():
    from importlib import metadata

    import curvzo_ds

    assert curvzo_ds.__version__ == metadata.version("curvzo_ds")


# --- the API's edges (issue 28 §9): each misuse is one line that names the fix, before any weight moves ---

def tiny_engine(loss, **cfg):
    import torch

    from curvzo_ds import ZOConfig, ZOEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return ZOEngine(model, loss, ZOConfig(**{"learning_rate": 1e-3, "zo_eps": 1e-3, **cfg})), model


def test_a_plain_list_to_step_is_refused_naming_microbatches():
    import pytest
    import torch

    x = torch.randn(8, 4)
    engine, model = tiny_engine(lambda m, b: (m(b).square().sum(), len(b)))
    before = model.weight.detach().clone()
    for call in (engine.step, engine.loss):
        with pytest.raises(ValueError) as err:
            call([x[:4], x[4:]])
        assert "MicroBatches([...])" in str(err.value) and "\n" not in str(err.value)
    assert torch.equal(model.weight, before) and engine.step_count == 0
    from curvzo_ds import MicroBatches

    assert engine.step(MicroBatches([x[:4], x[4:]])).step == 1  # the named fix works


def test_a_bare_scalar_from_loss_fn_is_refused_naming_the_contract():
    import pytest
    import torch

    x = torch.randn(8, 4)
    engine, _ = tiny_engine(lambda m, b: m(b).square().sum())
    with pytest.raises(ValueError, match=r"returned a tensor of shape \[\]: it must return \(loss_sum, count\)"):
        engine.step(x)
    assert engine.step_count == 0
    engine, _ = tiny_engine(lambda m, b: float(m(b).square().sum()))
    with pytest.raises(ValueError, match="loss_fn returned a float"):
        engine.loss(x)


def test_a_linear_schedule_without_max_steps_is_refused():
    import pytest

    from curvzo_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="lr_scheduler_type=linear needs max_steps > 0"):
        tiny_engine(lambda m, b: (m(b).sum(), 1), lr_scheduler_type="linear")
    engine, _ = tiny_engine(lambda m, b: (m(b).sum(), 1), lr_scheduler_type="linear", max_steps=10)
    assert engine.rate.at(5) == 0.5e-3  # decays to 0 at max_steps


def test_the_readme_states_zoconfigs_default_learning_rate():
    """ZOConfig() trains with MeZO's full-parameter rate, which looks dead on small models: the README says so where
    it shows the API."""
    from curvzo_ds import ZOConfig

    readme = (ROOT / "README.md").read_text()
    python = readme[readme.index("- **Python:**"):readme.index("- **Your own Accelerate loop")]
    import re

    stated = re.search(r"`ZOConfig\(\)` defaults to [^`]*`learning_rate=([0-9.e+-]+)`", python)
    assert stated and float(stated.group(1)) == ZOConfig().learning_rate, python
    assert "loss_fn(model, micro_batch) -> (loss_sum, count)" in python
