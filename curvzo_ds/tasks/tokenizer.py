"""The one tokenizer loader, `load_tokenizer`: the bundled tiny tokenizers (made by tools/make_assets.py), or any
tokenizer by directory or hub id, as the config's `model` section names it; and `probe_hub`, the check before a
name is resolved (shared with models.py, which loads the models).

"llama": SentencePiece-style BPE with byte fallback; adds <s> (BOS) before the text, no EOS; <unk> is also the pad
token. "opt": GPT-2 byte-level BPE; like OPT it prepends </s> as BOS; <pad> pads. Their BOS handling differs, which
the label-span code must survive. Neither has a chat template (docs/tasks.md says how a chat task gets one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from curvzo_ds.errors import ConfigError
from curvzo_ds.hub import offline_unless_reachable

ASSETS = Path(__file__).resolve().parent.parent / "assets"
KINDS = ("llama", "opt")
DEMO_MODELS = {"demo": "llama", "demo-opt": "opt"}  # the built-in demo models' names, each with its tokenizer's kind


def tokenizer_dir(kind: str = "llama") -> Path:
    """Directory of the bundled tokenizer of `kind` ("llama" or "opt"), for AutoTokenizer."""
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind {kind!r} is not one of {', '.join(KINDS)}")
    return ASSETS / f"tokenizer-{kind}"


def load_tokenizer(source: Any = "llama", trust_remote_code: bool = False):
    """The tokenizer that `source` names, with a pad token (its EOS, else its UNK, where it has none):
    - a bundled one: "llama" or "opt", or a demo model's name ("demo", "demo-opt");
    - the config's `model` section (config.sections): its `tokenizer`, else its `model`, with its
      `trust_remote_code` (the run's tokenizer: train, eval, export);
    - a directory (one that `save_pretrained` wrote) or a hub id.
    A name that can only be a path and is no directory, or a tokenizer that ships code of its own without
    trust_remote_code, is a ConfigError in one line."""
    from transformers import AutoTokenizer

    if isinstance(source, str):
        name, key = source, "tokenizer"
        kind = source if source in KINDS else DEMO_MODELS.get(source)
    else:
        name, key = source.tokenizer or source.model, "tokenizer" if source.tokenizer else "model"
        kind, trust_remote_code = DEMO_MODELS.get(name), source.trust_remote_code
    if kind is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(kind)))
    else:
        probe_hub(name, key)
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        except ValueError as e:
            raise refused(key, name, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    # transformers warns "Token indices sequence length is longer than the specified maximum ... will result in
    # indexing errors" for a long text; the encoders cut every example to max_length after tokenizing, so the
    # warning is not true here (marked as already given).
    tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def probe_hub(name: str, key: str = "model") -> None:
    """Before a hub id is resolved: one probe, so that an unreachable hub fails at once (hub.py). A name that can
    only be a path (absolute, ./ ../ ~, or more than one /) and is no directory is refused here: the hub would
    answer it with a page of tracebacks about repo ids."""
    if os.path.isdir(name):
        return
    if os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1:
        raise ConfigError(f"{key}={name!r}: no such directory; give a local directory (one from save_pretrained) "
                          "or a hub id such as facebook/opt-125m")
    offline_unless_reachable()


def refused(key: str, value: str, e: ValueError) -> ConfigError:
    """transformers' refusal to load `value` (often several lines), as one line naming the key."""
    if "trust_remote_code" in str(e):
        return ConfigError(f"{key}={value!r} ships its own Python code, which runs only with trust_remote_code=true: "
                           "set it if you trust that code")
    return ConfigError(f"{key}={value!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
