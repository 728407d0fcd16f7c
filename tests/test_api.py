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
