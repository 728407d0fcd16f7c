"""The built-in tiny model configs, matching the bundled tokenizers (tools/make_assets.py; the tokenizers and the
one loader: tasks/tokenizer.py, whose names are also importable from here)."""

from curvzo_ds.tasks.tokenizer import KINDS, load_tokenizer, tokenizer_dir

__all__ = ["KINDS", "demo_model_config", "load_tokenizer", "tokenizer_dir"]


def demo_model_config(kind: str = "llama", vocab_size: int | None = None):
    """A tiny LlamaConfig / OPTConfig (hidden 64, 2 layers, 4 heads) matching the bundled tokenizer.

    OPT keeps its default dropout of 0.1, so code that must run the model in eval mode is tested.
    """
    from transformers import LlamaConfig, OPTConfig

    tokenizer = load_tokenizer(tokenizer_dir(kind).name.removeprefix("tokenizer-"))  # a kind, or ValueError
    ids = dict(vocab_size=vocab_size or len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    if kind == "llama":
        return LlamaConfig(intermediate_size=256, num_key_value_heads=4, tie_word_embeddings=False,
                           **shape, **ids)
    return OPTConfig(ffn_dim=256, word_embed_proj_dim=64, **shape, **ids)
