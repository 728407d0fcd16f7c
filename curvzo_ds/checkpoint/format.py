"""The checkpoint format: what each rank writes, and how it is read and verified (write.py writes it).

`checkpoint-<step>/` holds one safetensors file per rank with the rank's owned slice of every trainable tensor
(1-D, with its global [lo, hi) in the manifest), `manifest.json` (format, step, world size, the SHA-256 of every
rank file and, as `other_files`, of every other file, the tensors' shapes and dtypes, the engine's ZO state, the
model record, the trainer's state) and what an export needs beside the weights (write.write_model_files). A reader
takes only the directory's own files (`own_file`: no paths, no links) and checks the manifest whole
(`check_manifest`) and every checksum (`verify_checkpoint`) before it reads a tensor; a damaged checkpoint is a
one-line ConfigError. A checkpoint is written under `<final>.tmp` and published by `write.publish_dir`, which export
uses too. `engine.save_checkpoint` of DeepSpeed is not used: it needs an optimizer (docs/deepspeed.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch
from safetensors import safe_open

from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.mask import StaticMask
from curvzo_ds.shard.params import intersect

FORMAT = "curvzo_ds-checkpoint-v1"
MASK_PREFIX = "static_mask:"  # rank files: the owned selected elements of a static_mask run, per tensor
_RANK_FILE = re.compile(r"^rank-\d{5}-of-\d{5}\.safetensors$")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def own_file(path: str, name: str) -> str:
    """`path/name`, a file of the checkpoint directory itself: a name with no directory part, and no link (which
    could lead out of the directory). Raises ConfigError (a ValueError) naming the problem."""
    fpath = os.path.join(path, name)
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise ConfigError(f"{path}/manifest.json names {name!r}: only files in the checkpoint directory itself are "
                          "read (no paths)")
    if os.path.islink(fpath):
        raise ConfigError(f"{fpath} is a link (to {os.readlink(fpath)}): only files inside the checkpoint directory "
                          "are read; copy the file in place of the link")
    if not os.path.isfile(fpath):
        raise ConfigError(f"{fpath} is missing: the checkpoint is partial")
    return fpath


def checked_file(path: str, name: str, sha: str, verified: set | None = None) -> str:
    """The path of rank file `name` of checkpoint `path`, after checking that `name` is a rank file name (no pickle,
    no path out of the directory), that the file is there (not a link: own_file) and that its SHA-256 is `sha`; a
    name already in `verified` is not hashed again, and a checked one is added to it. Raises ConfigError (a
    ValueError) naming the problem."""
    if not _RANK_FILE.match(str(name)):
        raise ConfigError(f"{path}/manifest.json names {name!r}: only rank-NNNNN-of-NNNNN.safetensors files in "
                          "the checkpoint directory are loaded (no pickles, no paths)")
    if verified is not None and name in verified:
        return os.path.join(path, name)
    fpath = own_file(path, name)
    if file_sha256(fpath) != sha:
        raise ConfigError(f"checksum mismatch for {fpath}: the checkpoint is corrupt")
    if verified is not None:
        verified.add(name)
    return fpath


def checkpoint_containing(path: str) -> str | None:
    """The checkpoint directory (a manifest.json and rank files) that `path` is or lies inside, or None: a command's
    output there would change the checkpoint."""
    here = os.path.realpath(path)
    while True:
        if os.path.isfile(os.path.join(here, "manifest.json")) and any(_RANK_FILE.match(n) for n in os.listdir(here)):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, read (not checked against its files: verify_checkpoint). Raises ConfigError
    (a ValueError) naming the problem."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.lexists(mpath):
        raise ConfigError(f"{path} is not a complete checkpoint (no manifest.json); "
                          "pass a checkpoint-<step> directory or use --resume with no path")
    own_file(path, "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{mpath} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{mpath} does not hold a manifest object: the checkpoint is corrupt")
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{mpath}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def check_manifest(path: str, manifest: dict) -> None:
    """That the manifest describes a whole checkpoint: a step, every tensor with a shape, a dtype and its element
    count, rank files with checksums, and slices (of tensors it lists, inside their bounds) that cover every element
    of every tensor. Raises ConfigError naming the first problem: a hand-edited or damaged manifest is refused here,
    before any rank reads a tensor."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path}/manifest.json: {what}: the checkpoint is corrupt; resume from another checkpoint")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not count(manifest.get("step")):
        raise bad(f"step {manifest.get('step')!r} is not a step number")
    files, slices, tensors = manifest.get("files"), manifest.get("slices"), manifest.get("tensors")
    if not isinstance(files, dict) or not files or not isinstance(slices, dict) or set(files) != set(slices):
        raise bad("it lists no rank files, or its files and slices disagree")
    if not all(isinstance(sha, str) for sha in files.values()):
        raise bad("a rank file has no checksum")
    if not isinstance(tensors, dict) or not tensors:
        raise bad("it lists no tensors")
    if not isinstance(manifest.get("engine"), dict):
        raise bad("it holds no engine state")
    for name, info in tensors.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(count(n) for n in shape):
            raise bad(f"tensor {name} has no shape")
        if not isinstance(getattr(torch, str(info.get("dtype")), None), torch.dtype):
            raise bad(f"tensor {name} has no dtype ({info.get('dtype')!r})")
        if not isinstance(info.get("master", False), bool):
            raise bad(f"tensor {name}: master {info.get('master')!r} is not true or false")
        if info.get("numel") != math.prod(shape):
            raise bad(f"tensor {name}: numel {info.get('numel')!r} is not the product of its shape {shape}")
    covered: dict[str, list] = {name: [] for name in tensors}
    for fname, parts in slices.items():
        if not isinstance(parts, dict):
            raise bad(f"{fname} has no slices")
        for name, bounds in parts.items():
            if name not in tensors:
                raise bad(f"{fname} holds a slice of {name}, which it lists in no tensors entry")
            if (not isinstance(bounds, list) or len(bounds) != 2 or not all(count(b) for b in bounds)
                    or not bounds[0] < bounds[1] <= tensors[name]["numel"]):
                raise bad(f"{fname}: slice {bounds!r} of {name} is outside its {tensors[name]['numel']} elements")
            covered[name].append(bounds)
    for name, parts in covered.items():
        end = 0
        for lo, hi in sorted(parts):
            if lo > end:
                break
            end = max(end, hi)
        if end < tensors[name]["numel"]:
            raise bad(f"no rank file holds elements {end}.. of {name} (it has {tensors[name]['numel']})")
    other = manifest.get("other_files", {})
    if not isinstance(other, dict) or not all(isinstance(v, str) for v in other.values()):
        raise bad("its other_files are not checksums")


def verify_checkpoint(path: str, verified: set | None = None) -> dict:
    """The manifest of checkpoint `path`, after checking that it is one: a readable manifest of this format that
    describes a whole checkpoint (check_manifest), every rank file it lists checked (checked_file) and holding the
    slices it claims, and every other file it lists (the model's config, the tokenizer, run_config.json) there with
    its checksum. Raises ConfigError (a ValueError) naming the first problem. Loading runs no code. The rank files
    checked go into `verified` when given, so that a read that follows does not hash them again."""
    manifest = read_manifest(path)
    check_manifest(path, manifest)
    verified = set() if verified is None else verified
    for name, sha in manifest["files"].items():
        fpath = checked_file(path, name, sha, verified)
        try:
            with safe_open(fpath, framework="pt") as f:
                held = {key: f.get_slice(key).get_shape() for key in f.keys()}
                stored = {key: f.get_slice(key).get_dtype() for key in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors' own error types; the file verified, the header is bad
            raise ConfigError(f"{fpath} is not a safetensors file ({e}): the checkpoint is corrupt") from None
        for tensor, (lo, hi) in manifest["slices"][name].items():
            if held.get(tensor) != [hi - lo]:
                raise ConfigError(f"{fpath} holds {held.get(tensor)!r} for {tensor}, where the manifest says "
                                  f"[{hi - lo}] elements: the checkpoint is corrupt")
            check_stored_dtype(fpath, tensor, manifest["tensors"][tensor], stored[tensor])
    for name, sha in manifest.get("other_files", {}).items():
        if file_sha256(own_file(path, name)) != sha:
            raise ConfigError(f"checksum mismatch for {os.path.join(path, name)}: the checkpoint is corrupt")
    return manifest


# safetensors' names of the dtypes a checkpoint holds
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def check_stored_dtype(fpath: str, tensor: str, info: dict, stored: str) -> None:
    """That the rank file `fpath` holds `tensor` in the dtype its manifest entry records: the tensor's own dtype, or
    F32 where the entry says `master` (an fp32 master copy of a 16-bit tensor). A checkpoint written before `master`
    was recorded may hold F32 for any 16-bit tensor. Otherwise a load would convert it and an export lose precision
    without a word: a one-line ConfigError."""
    dtype, master = info["dtype"], info.get("master")
    want = "F32" if master else SAFETENSORS_DTYPES.get(dtype, dtype)
    older = master is None and stored == "F32" and dtype in ("bfloat16", "float16")
    if stored != want and not older:
        copy = " (an fp32 master copy)" if master else ""
        raise ConfigError(f"{fpath} holds {tensor} as {stored}, where the manifest records dtype {dtype}{copy}: the "
                          "manifest and the tensors disagree, so a load or an export would convert the values "
                          "silently; the checkpoint is corrupt")


def check_model(path: str, manifest: dict, entries) -> None:
    """That checkpoint `path` holds exactly these trainable tensors (the engine's `entries`), each with its shape:
    a checkpoint of another model, LoRA or block setting is a one-line ConfigError."""
    tensors = manifest["tensors"]
    names = sorted(e.name for e in entries)
    if sorted(tensors) != names:
        missing = sorted(set(names) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(names))[:3]
        raise ConfigError(f"checkpoint {path} does not match this model's trainable parameters "
                          f"(missing {missing}, unexpected {extra}): same model, LoRA and block settings?")
    for e in entries:
        if list(e.shape) != tensors[e.name]["shape"]:
            raise ConfigError(f"checkpoint {path}: {e.name} has the shape {tensors[e.name]['shape']} there and "
                              f"{list(e.shape)} in this model: same model, LoRA and block settings?")


def read_range(path: str, manifest: dict, name: str, lo: int, hi: int, verified: set) -> torch.Tensor:
    """Elements [lo, hi) of tensor `name`, assembled from every rank file that holds a part of them; each file is
    checked (checked_file) before its first read."""
    out = None
    filled = 0
    for fname, slices in manifest["slices"].items():
        if name not in slices:
            continue
        s_lo, s_hi = slices[name]
        a, b = intersect((lo, hi), (s_lo, s_hi))
        if b <= a:
            continue
        with safe_open(checked_file(path, fname, manifest["files"][fname], verified), framework="pt") as f:
            part = f.get_slice(name)[a - s_lo: b - s_lo]
        if out is None:
            out = torch.empty(hi - lo, dtype=part.dtype)
        out[a - lo: b - lo] = part
        filled += b - a
    if filled != hi - lo:
        raise ConfigError(f"checkpoint {path} misses elements of {name} in [{lo}, {hi}): the checkpoint is corrupt")
    return out if out is not None else torch.empty(0)


def load_checkpoint(engine: ZOEngine, path: str) -> dict:
    """Load weights and ZO state into `engine` (any world size). Returns the trainer state. A damaged checkpoint,
    or one of another model, is a one-line ConfigError (a ValueError) before any weight is written."""
    manifest = read_manifest(path)
    check_manifest(path, manifest)
    check_model(path, manifest, engine.entries)
    verified: set = set()
    with torch.no_grad():
        for e in engine.entries:
            lo, hi = e.region
            if hi <= lo:
                continue
            values = read_range(path, manifest, e.name, lo, hi, verified)
            if e.master is not None:
                e.master.copy_(values.float())
                e.write(0, e.master)
            else:
                e.write(0, values)
    if manifest.get("static_mask"):
        engine.set_static_mask(StaticMask.from_full(engine.entries, read_static_mask(path, manifest, verified),
                                                    manifest["static_mask"]["fraction"]))
    engine.load_state_dict(manifest["engine"])
    engine.topology.job.barrier()
    return manifest.get("trainer", {})


def read_static_mask(path: str, manifest: dict, verified: set) -> dict[str, torch.Tensor]:
    """{tensor name: its selected elements' global indices, sorted}, from every rank file (each checked once)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for fname, sha in manifest["files"].items():
        with safe_open(checked_file(path, fname, sha, verified), framework="pt") as f:
            for key in f.keys():
                if key.startswith(MASK_PREFIX):
                    parts.setdefault(key[len(MASK_PREFIX):], []).append(f.get_tensor(key))
    full = {name: torch.sort(torch.cat(p)).values for name, p in parts.items()}
    if sum(len(v) for v in full.values()) != manifest["static_mask"]["selected"]:
        raise ConfigError(f"checkpoint {path}: its static mask misses elements: the checkpoint is corrupt")
    return full


def consolidated_state_dict(path: str, verified: set | None = None) -> dict[str, torch.Tensor]:
    """Full tensors in their stored dtype, one process (for export), from a checkpoint that verifies (each rank file
    hashed once: those in `verified`, checked by the caller's verify_checkpoint, not again)."""
    verified = set() if verified is None else verified
    manifest = verify_checkpoint(path, verified)
    out = {}
    for name, info in sorted(manifest["tensors"].items()):
        flat = read_range(path, manifest, name, 0, info["numel"], verified)
        out[name] = flat.to(getattr(torch, info["dtype"])).view(info["shape"])
    return out
