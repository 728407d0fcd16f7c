"""Tasks (MeZO's prompts), their data splits, and the bundled demo tokenizers and model configs."""

from curvzo_ds.tasks.demo import demo_model_config, load_tokenizer, tokenizer_dir
from curvzo_ds.tasks.splits import load_splits, read_jsonl, split
from curvzo_ds.tasks.task import (
    BUILTIN,
    CLASSIFICATION,
    GENERATION,
    TASK_NAMES,
    Task,
)
from curvzo_ds.tasks.task_dir import get_task, load_task_dir

__all__ = [
    "BUILTIN", "CLASSIFICATION", "GENERATION", "TASK_NAMES", "Task", "get_task", "load_task_dir",
    "load_splits", "split", "read_jsonl", "tokenizer_dir", "load_tokenizer", "demo_model_config",
]
