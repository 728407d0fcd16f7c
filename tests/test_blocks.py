"""Block granularity: tensor (the paper), layer, chunk. Every trainable element belongs to exactly one block."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from curvzo_ds.engine import ZOEngine
from curvzo_ds.tasks import demo_model_config


def lm(model, batch):
    return model(input_ids=batch).logits.float().square().mean(), 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(demo_model_config("llama"))


def coverage(engine) -> dict[str, list[tuple[int, int]]]:
    """Per tensor, the sorted (lo, hi) ranges the blocks give it."""
    out = {e.name: [] for e in engine.entries}
    for b in engine.blocks:
        for i, lo, hi in b.segments:
            out[engine.entries[i].name].append((lo, hi))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("granularity", ["tensor", "layer", "chunk"])
def test_blocks_partition_the_trainable_elements(model, granularity):
    engine = ZOEngine(model, lm, method="mezo", block_granularity=granularity, block_chunk_size=1000)
    for e in engine.entries:  # each tensor covered once, without gaps or overlaps
        ranges = coverage(engine)[e.name]
        assert ranges[0][0] == 0 and ranges[-1][1] == e.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(b.size for b in engine.blocks) == engine.num_params
    assert engine.num_blocks == len(engine.blocks)


def test_layer_blocks_group_each_decoder_layer_and_keep_other_tensors_alone(model):
    tensor = ZOEngine(model, lm, method="mezo")
    layer = ZOEngine(model, lm, method="mezo", block_granularity="layer")
    names = sorted(b.name for b in layer.blocks)
    n_layers = model.config.num_hidden_layers
    outside = [e.name for e in tensor.entries if ".layers." not in e.name]
    assert names == sorted([f"model.layers.{i}" for i in range(n_layers)] + outside)
    per_layer = {b.name: {layer.entries[i].name for i, _, _ in b.segments} for b in layer.blocks}
    for i in range(n_layers):
        assert per_layer[f"model.layers.{i}"] == {e.name for e in tensor.entries
                                                  if e.name.startswith(f"model.layers.{i}.")}


def test_chunk_blocks_are_fixed_size_pieces(model):
    engine = ZOEngine(model, lm, method="mezo", block_granularity="chunk", block_chunk_size=1000)
    for e in engine.entries:
        sizes = [hi - lo for lo, hi in coverage(engine)[e.name]]
        assert all(s == 1000 for s in sizes[:-1]) and 0 < sizes[-1] <= 1000
