"""Writing a checkpoint (format.py defines the format and reads it): `write_checkpoint`, the collective that writes
each rank's file and rank 0's manifest under `<final>.tmp`; `write_model_files`, what an export needs beside the
weights; and `publish_dir`, the flush and rename that publishes a staged directory (export uses it too).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from curvzo_ds.checkpoint.format import FORMAT, MASK_PREFIX, file_sha256
from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import CheckpointWriteError
from curvzo_ds.jsonio import honour_umask
from curvzo_ds.shard.params import canonical_name


def fsync(path: str) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: str, final: str) -> None:
    """Flush the complete directory `tmp` (its entries and itself) to the disk and rename it to `final`. An existing
    `final` is moved to `tmp.old` first and removed only after the new one is in place: a crash at any point leaves
    one complete directory at `final` or beside it, never a mix of the two."""
    for name in os.listdir(tmp):
        fsync(os.path.join(tmp, name))
    fsync(tmp)
    old = tmp + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def _jsonable_state(state: dict) -> dict:
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in state.items()}


def write_checkpoint(engine: ZOEngine, final: str, trainer_state: dict | None = None,
                     write_extra: Callable[[str], None] | None = None, tokenizer=None) -> str:
    """Collective: the checkpoint at exactly `final` (written as `final.tmp`, published when complete).

    Rank 0 adds the model files (write_model_files, with `tokenizer` when given) and then runs `write_extra(dir)`
    for the caller's own files, before the rename. With replica groups (hybrid sharding) every group holds the
    same shards: group 0 writes them, and the others learn from it whether that worked."""
    topology = engine.topology
    if topology.replicas == 1:
        return _write_group(engine, final, trainer_state, write_extra, tokenizer)
    error = None
    if topology.replica == 0:
        try:
            _write_group(engine, final, trainer_state, write_extra, tokenizer)
        except CheckpointWriteError as e:
            error = str(e)
    error = topology.job.broadcast_object(error)
    if error:
        raise CheckpointWriteError(error)
    return final


def write_model_files(directory: str, module, tokenizer=None) -> dict:
    """What an export needs beside the weights, written the same way for every front end (rank 0): the model's
    config.json (the base model's, under peft), a peft adapter's adapter_config.json, and the tokenizer when there
    is one. Returns the manifest's "model" record, which export reads to refuse what it cannot write faithfully:
    - full fine-tuning: {"kind": "full", "hf_config": whether config.json was written, "frozen": the canonical
      names of parameters that were not trained (a full export from the checkpoint would lack them)};
    - peft: {"kind": "peft", "peft_type", "adapters" (names), "base_model" (the adapter config's
      base_model_name_or_path, absolute when it is a local directory; None when unknown), "adapter_keys" (the keys
      of peft's adapter state dict, which the checkpoint's tensors must be)}.
    """
    peft = getattr(module, "peft_config", None)
    base = module.get_base_model() if peft is not None else module
    hf_config = getattr(base, "config", None)
    if hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(os.path.join(directory, "config.json"))
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    if peft is None:
        seen, frozen = set(), []
        for name, p in module.named_parameters():
            if id(p) not in seen and not p.requires_grad:
                frozen.append(canonical_name(name, False))
            seen.add(id(p))
        return {"kind": "full", "hf_config": hasattr(hf_config, "to_json_file"), "frozen": sorted(frozen)}
    from peft import get_peft_model_state_dict

    adapters = sorted(peft)
    record = {"kind": "peft", "adapters": adapters, "peft_type": None, "base_model": None, "adapter_keys": []}
    if len(adapters) == 1:
        adapter = peft[adapters[0]]
        adapter.save_pretrained(directory)
        source = adapter.base_model_name_or_path
        record.update(peft_type=str(getattr(adapter.peft_type, "value", adapter.peft_type)),
                      base_model=(os.path.abspath(source) if source and os.path.isdir(source) else source) or None,
                      # the keys only; save_embedding_layers=False: no look-up of the base model's config (the hub)
                      adapter_keys=sorted(get_peft_model_state_dict(module, adapter_name=adapters[0],
                                                                    save_embedding_layers=False)))
    return record


def _rank_tensors(engine: ZOEngine) -> tuple[dict, dict]:
    """(this rank's tensors to save, {name: its global [lo, hi)}): the owned slice of each trainable tensor, and the
    owned selected elements of a static mask (global indices)."""
    tensors, slices = {}, {}
    for e in engine.entries:
        lo, hi = e.owned
        if hi > lo:
            values = e.region_values()[lo - e.region[0]: hi - e.region[0]]
            tensors[e.name] = values.contiguous() if e.master is not None else values.to(e.param.dtype).contiguous()
            slices[e.name] = [lo, hi]
    if engine.static_mask is not None:
        for i, e in enumerate(engine.entries):
            owned = engine.static_mask.owned(i)
            if len(owned):
                tensors[MASK_PREFIX + e.name] = owned.contiguous()
    return tensors, slices


def _write_group(engine: ZOEngine, final: str, trainer_state: dict | None,
                 write_extra: Callable[[str], None] | None, tokenizer=None) -> str:
    comm = engine.comm
    tmp = final + ".tmp"
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    fname = f"rank-{comm.rank:05d}-of-{comm.world_size:05d}.safetensors"
    mine = error = None
    try:  # a failure on one rank is shared, so that no rank waits for it in a collective
        tensors, slices = _rank_tensors(engine)
        path = os.path.join(tmp, fname)
        save_file(tensors, path)
        honour_umask(path)
        fsync(path)
        mine = (fname, file_sha256(path), slices)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = f"rank {comm.rank}: {e.__class__.__name__}: {e}"
    everyone = comm.all_gather_object((mine, error))
    _raise_any(final, [err for _, err in everyone])
    if comm.rank == 0:
        try:
            parts = [m for m, _ in everyone]
            manifest = {
                "format": FORMAT,
                "step": engine.step_count,
                "world_size": comm.world_size,
                "files": {f: sha for f, sha, _ in parts},
                "slices": {f: s for f, _, s in parts},
                # `master`: the rank files hold the fp32 master copy of this tensor, not its own dtype (verified)
                "tensors": {e.name: {"shape": list(e.shape), "dtype": str(e.param.dtype).removeprefix("torch."),
                                     "numel": e.numel, "master": e.master is not None} for e in engine.entries},
                "engine": _jsonable_state(engine.state_dict()),
                "trainer": trainer_state or {},
                "model": write_model_files(tmp, engine.module, tokenizer),
            }
            if engine.static_mask is not None:
                manifest["static_mask"] = {"fraction": engine.static_mask.fraction,
                                           "selected": engine.static_mask.selected}
            if write_extra is not None:
                write_extra(tmp)
            # every other file (the model's config, the tokenizer, write_extra's) checksummed too: verify_checkpoint
            manifest["other_files"] = {name: file_sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))
                                       if name not in manifest["files"] and os.path.isfile(os.path.join(tmp, name))}
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
            publish_dir(tmp, final)  # write_extra's files too: all on disk before the rename publishes them
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"rank 0: {e.__class__.__name__}: {e}"
    _raise_any(final, [comm.broadcast_object(error if comm.rank == 0 else None)])
    return final


def _raise_any(final: str, errors: list) -> None:
    errors = [e for e in errors if e]
    if errors:
        raise CheckpointWriteError(f"checkpoint {final} was not written ({'; '.join(errors)}); the previous "
                                   f"checkpoints are intact, and {final}.tmp holds the partial files")
