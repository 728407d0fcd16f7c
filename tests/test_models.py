"""Models from a local directory, the way users bring a hub model: tiny OPT and Llama saved locally.

Each directory holds exactly the weights of the built-in demo model (same config, same seed),
saved with `save_pretrained`, plus the tiny tokenizer. Loading it with `model=DIR` goes through
`from_pretrained` inside zero.Init (a live HfDeepSpeedConfig), which partitions the weights as
they load. A run from the directory must then equal the demo run bit for bit, at 1 and 2 ranks:
a loader that dropped or re-initialised a tensor would change the digest.
"""

import pytest
import torch

from tests.helpers import train

# The demo's presets, set for the directory too (a local directory is a hub model: MeZO's rate, rate_correction
# max_weight).
SAME = ["--set", "learning_rate=3e-4", "--set", "zo_eps=1e-2", "--set", "max_steps=6", "--set", "eval_steps=3",
        "--set", "save_steps=6", "--set", "rate_correction=none"]


def save_demo_model(kind: str, out) -> str:
    from transformers import AutoModelForCausalLM

    from curvzo_ds.tasks import demo_model_config
    from curvzo_ds.tasks.demo import load_tokenizer

    torch.manual_seed(42)  # TrainConfig's default seed, as the demo model is built
    model = AutoModelForCausalLM.from_config(demo_model_config(kind))
    model.save_pretrained(str(out))
    load_tokenizer(kind).save_pretrained(str(out))
    return str(out)


@pytest.mark.multirank
@pytest.mark.parametrize("kind,demo", [("llama", "demo"), ("opt", "demo-opt")])
def test_local_model_directory_equals_the_demo_model(tmp_path, kind, demo):
    path = save_demo_model(kind, tmp_path / f"tiny-{kind}")
    ref = train("python", 1, tmp_path / "demo", "--set", f"model={demo}", *SAME)
    one = train("python", 1, tmp_path / "dir-1", "--set", f"model={path}", *SAME)
    two = train("torchrun", 2, tmp_path / "dir-2", "--set", f"model={path}", *SAME)
    assert ref["params_digest"] == one["params_digest"] == two["params_digest"]
    assert ref["test"] == one["test"] == two["test"]
    assert two["world_size"] == 2
