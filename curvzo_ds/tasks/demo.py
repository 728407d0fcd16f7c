"""The built-in tiny tokenizers and model configs (made by tools/make_assets.py).

"llama": SentencePiece-style BPE with byte fallback; adds <s> (BOS) before the text, no
EOS; <unk> is also the pad token. "opt": GPT-2 byte-level BPE; like OPT it prepends
</s> as BOS; <pad> pads. Their BOS handling differs, which the label-span code must survive.
"""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
KINDS = ("llama", "opt")


def tokenizer_dir(kind: str = "llama") -> Path:
    """Directory of the bundled tokenizer of `kind` ("llama" or "opt"), for AutoTokenizer."""
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind {kind!r} is not one of {', '.join(KINDS)}")
    return ASSETS / f"tokenizer-{kind}"


def load_tokenizer(kind: str = "llama"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(kind)))


def demo_model_config(kind: str = "llama", vocab_size: int | None = None):
    """A tiny LlamaConfig / OPTConfig (hidden 64, 2 layers, 4 heads) matching the bundled tokenizer.

    OPT keeps its default dropout of 0.1, so code that must run the model in eval mode is tested.
    """
    from transformers import LlamaConfig, OPTConfig

    tokenizer = load_tokenizer(kind)
    ids = dict(vocab_size=vocab_size or len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    if kind == "llama":
        return LlamaConfig(intermediate_size=256, num_key_value_heads=4, tie_word_embeddings=False,
                           **shape, **ids)
    return OPTConfig(ffn_dim=256, word_embed_proj_dim=64, **shape, **ids)
