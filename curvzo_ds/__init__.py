"""curvzo_ds: CurvZO zeroth-order fine-tuning of causal language models on DeepSpeed ZeRO-3.

    from curvzo_ds import ZOEngine, ZOConfig, MicroBatches
    engine = ZOEngine(model_or_deepspeed_engine, loss_fn, ZOConfig(learning_rate=1e-6, zo_eps=1e-3))
    result = engine.step(MicroBatches([micro_batch_0, micro_batch_1]))

`loss_fn(model, micro_batch) -> (loss_sum, count)`. Checkpoints: `save_checkpoint(engine, dir)` and
`load_checkpoint(engine, path)`, at any world size. An Accelerate loop: `from_accelerator(...)`;
a Hugging Face Trainer: `ZOTrainer` (imported on first use, so `import curvzo_ds` stays light).
"""

import contextlib

from curvzo_ds.checkpoint.manager import CheckpointManager, load_checkpoint, save_checkpoint
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.data.stream import MicroBatches, split_batch
from curvzo_ds.engine import StepResult, ZOEngine
from curvzo_ds.errors import ConfigError, NonFiniteLossError
from curvzo_ds.startup import defer_mlflow, extensions_dir, quiet_known_warnings
from curvzo_ds.versions import check_versions

__version__ = "0.1.0"

# DeepSpeed's CPU op is built once per Python environment in curvzo_ds's cache (startup.py): a user's own script
# (accelerate launch, ZOTrainer) that imports curvzo_ds shares the CLI's build instead of building it again.
with contextlib.suppress(ConfigError):  # a TORCH_EXTENSIONS_DIR that is a file: the CLI says so in one line
    extensions_dir()
quiet_known_warnings()
defer_mlflow()  # DeepSpeed's autotuner's mlflow import is 2 s of every start (startup.py)
check_versions()  # an unsupported torch, deepspeed, transformers, accelerate or peft is named here (versions.py)

__all__ = [
    "ZOEngine", "ZOConfig", "MicroBatches", "split_batch", "StepResult", "save_checkpoint", "load_checkpoint",
    "CheckpointManager", "ConfigError", "NonFiniteLossError", "ZOTrainer", "from_accelerator", "__version__",
]


def __getattr__(name: str):
    # Lazy: ZOTrainer pulls in transformers' Trainer, from_accelerator pulls in accelerate.
    if name == "ZOTrainer":
        from curvzo_ds.train.hf_trainer import ZOTrainer

        return ZOTrainer
    if name == "from_accelerator":
        from curvzo_ds.train.integrations import from_accelerator

        return from_accelerator
    raise AttributeError(f"module 'curvzo_ds' has no attribute {name!r}")
