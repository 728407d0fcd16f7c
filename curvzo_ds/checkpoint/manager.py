"""Checkpoints without an optimizer: each rank saves what it owns; reload at any world size.

`checkpoint-<step>/` holds one safetensors file per rank with the rank's owned slice of every
trainable tensor (1-D, with its global [lo, hi) in the manifest), `manifest.json` (format, step,
world size, the SHA-256 of every file, the tensors' shapes and dtypes, the engine's ZO state: step,
seed, scores, noise definition; the model record; the trainer's state: the state of each stateful
component) and what an export needs beside the weights. A checkpoint is written under
`checkpoint-<step>.tmp` and renamed when complete, so a crash never leaves a directory that looks
complete. `engine.save_checkpoint` of DeepSpeed is not used: it needs an optimizer (docs/deepspeed.md).

`write_model_files` is the one writer of what an export needs (the model's config.json, a peft
adapter's adapter_config.json, the tokenizer, and the manifest's "model" record), for every front end:
every checkpoint goes through it. `CheckpointManager` is the run lifecycle around checkpoints (save
when due, rotation that keeps the best, resume paths, the best evaluation, stateful components),
shared by the CLI, `from_accelerator` and `ZOTrainer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from curvzo_ds.engine import ZOEngine
from curvzo_ds.errors import CheckpointWriteError, ConfigError
from curvzo_ds.jsonio import honour_umask, replace_atomic
from curvzo_ds.shard.mask import StaticMask
from curvzo_ds.shard.params import canonical_name, intersect

log = logging.getLogger("curvzo_ds")
FORMAT = "curvzo_ds-checkpoint-v1"
MASK_PREFIX = "static_mask:"  # rank files: the owned selected elements of a static_mask run, per tensor
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _jsonable_state(state: dict) -> dict:
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in state.items()}


def save_checkpoint(engine: ZOEngine, output_dir: str, trainer_state: dict | None = None,
                    write_extra: Callable[[str], None] | None = None, tokenizer=None) -> str:
    """Collective: every rank writes its owned slices to `output_dir/checkpoint-<step>`; returns that path.

    Rank 0 adds the model files (write_model_files, with `tokenizer` when given) and then runs
    `write_extra(dir)` for the caller's own files, before the rename.
    """
    return write_checkpoint(engine, os.path.join(output_dir, f"checkpoint-{engine.step_count}"), trainer_state,
                            write_extra, tokenizer)


def write_checkpoint(engine: ZOEngine, final: str, trainer_state: dict | None = None,
                     write_extra: Callable[[str], None] | None = None, tokenizer=None) -> str:
    """Collective: the checkpoint at exactly `final` (written as `final.tmp`, renamed when complete).

    With replica groups (hybrid sharding) every group holds the same shards: group 0 writes them, and the
    others learn from it whether that worked."""
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


def _write_group(engine: ZOEngine, final: str, trainer_state: dict | None,
                 write_extra: Callable[[str], None] | None, tokenizer=None) -> str:
    comm = engine.comm
    step = engine.step_count
    tmp = final + ".tmp"
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    fname = f"rank-{comm.rank:05d}-of-{comm.world_size:05d}.safetensors"
    mine = error = None
    try:  # a failure on one rank is shared, so that no rank waits for it in a collective
        tensors, slices = {}, {}
        for e in engine.entries:
            lo, hi = e.owned
            if hi > lo:
                values = e.region_values()[lo - e.region[0]: hi - e.region[0]]
                tensors[e.name] = values.contiguous() if e.master is not None else values.to(e.param.dtype).contiguous()
                slices[e.name] = [lo, hi]
        if engine.static_mask is not None:  # the selected elements this rank owns, as global indices
            for i, e in enumerate(engine.entries):
                owned = engine.static_mask.owned(i)
                if len(owned):
                    tensors[MASK_PREFIX + e.name] = owned.contiguous()
        path = os.path.join(tmp, fname)
        save_file(tensors, path)
        honour_umask(path)
        _fsync(path)
        mine = (fname, _sha256(path), slices)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = f"rank {comm.rank}: {e.__class__.__name__}: {e}"
    everyone = comm.all_gather_object((mine, error))
    _raise_any(final, [err for _, err in everyone])
    if comm.rank == 0:
        try:
            parts = [m for m, _ in everyone]
            manifest = {
                "format": FORMAT,
                "step": step,
                "world_size": comm.world_size,
                "files": {f: sha for f, sha, _ in parts},
                "slices": {f: s for f, _, s in parts},
                "tensors": {e.name: {"shape": list(e.shape), "dtype": str(e.param.dtype).removeprefix("torch."),
                                     "numel": e.numel} for e in engine.entries},
                "engine": _jsonable_state(engine.state_dict()),
                "trainer": trainer_state or {},
                "model": write_model_files(tmp, engine.module, tokenizer),
            }
            if engine.static_mask is not None:
                manifest["static_mask"] = {"fraction": engine.static_mask.fraction,
                                           "selected": engine.static_mask.selected}
            if write_extra is not None:
                write_extra(tmp)
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
            for name in os.listdir(tmp):  # write_extra's files too: all on disk before the rename publishes them
                _fsync(os.path.join(tmp, name))
            _fsync(tmp)
            _publish(tmp, final)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"rank 0: {e.__class__.__name__}: {e}"
    _raise_any(final, [comm.broadcast_object(error if comm.rank == 0 else None)])
    return final


def _fsync(path: str) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, final: str) -> None:
    """Rename the complete `tmp` to `final`. An existing `final` (the same step saved again) is moved aside first
    and removed only after the new one is in place: a crash at any point leaves one complete checkpoint."""
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def _raise_any(final: str, errors: list) -> None:
    errors = [e for e in errors if e]
    if errors:
        raise CheckpointWriteError(f"checkpoint {final} was not written ({'; '.join(errors)}); the previous "
                                   f"checkpoints are intact, and {final}.tmp holds the partial files")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints (a manifest, no .tmp suffix), oldest first."""
    out = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            m = _NAME.match(name)
            path = os.path.join(output_dir, name)
            if m and os.path.isfile(os.path.join(path, "manifest.json")):
                out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint that verifies (verify_checkpoint); each newer one that does not is named in
    a warning and skipped."""
    for _, path in reversed(list_checkpoints(output_dir)):
        try:
            verify_checkpoint(path)
            return path
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


_RANK_FILE = re.compile(r"^rank-\d{5}-of-\d{5}\.safetensors$")


def verify_checkpoint(path: str) -> dict:
    """The manifest of checkpoint `path`, after checking that it is one: a readable manifest of this format, rank
    files that are plain safetensors names inside the directory (never a pickle, never a path out of it), all
    present, with the recorded SHA-256. Raises ValueError naming the first problem. Loading runs no code."""
    manifest = read_manifest(path)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or set(files) != set(manifest.get("slices", {})):
        raise ValueError(f"{path}/manifest.json lists no rank files, or its files and slices disagree")
    for name, sha in files.items():
        if not _RANK_FILE.match(str(name)):
            raise ValueError(f"{path}/manifest.json names {name!r}: only rank-NNNNN-of-NNNNN.safetensors files in "
                             "the checkpoint directory are loaded (no pickles, no paths)")
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise ValueError(f"{fpath} is missing: the checkpoint is partial")
        if _sha256(fpath) != sha:
            raise ValueError(f"checksum mismatch for {fpath}: the checkpoint is corrupt")
    return manifest


def rotate_checkpoints(output_dir: str, keep: int | None, protect: str | None = None) -> None:
    """Keep the newest `keep` checkpoints, and never delete `protect` (the best-dev one)."""
    if not keep:
        return
    found = list_checkpoints(output_dir)
    doomed = found[:-keep] if len(found) > keep else []
    for _, path in doomed:
        if protect and os.path.abspath(path) == os.path.abspath(protect):
            continue
        shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    """One run's checkpoints, shared by the CLI, `from_accelerator` and `ZOTrainer` (torchtitan's shape).

    - `save(engine)`: collective; writes `output_dir/checkpoint-<step>` (or `path`): the weights, the engine's ZO
      state, the model files (write_model_files, with `tokenizer`), the front end's own files (`write_extra(dir)`,
      rank 0) and the trainer state: the manager's own `state_dict()` (the best evaluation) and that of each
      component in `states` (objects with `state_dict()` / `load_state_dict()`), under their names. Then rank 0
      rotates to `save_total_limit`, never deleting the best checkpoint, and every rank meets at a barrier;
    - `maybe_save(engine, last)`: `save` when `save_steps` divides the step or at the last step, once per step;
    - `track(step, metrics)`: the best evaluation so far by `metric` (higher is better unless
      `greater_is_better=False`); the best is protected from rotation once it is saved;
    - `load(engine, path)`: the weights, the ZO state, and the state of the manager and of every component;
    - `resume_path(resume)`: `True` is the newest complete checkpoint, a path is checked to exist.
    Collectives run on the engine's job (`engine.topology.job`).
    """

    def __init__(self, output_dir: str, *, save_steps: int = 0, save_total_limit: int | None = None,
                 metric: str | None = None, greater_is_better: bool = True, tokenizer=None,
                 states: dict | None = None, write_extra: Callable[[str], None] | None = None):
        self.output_dir = output_dir
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.tokenizer = tokenizer
        self.states = dict(states or {})
        self.write_extra = write_extra
        self.best: dict | None = None  # {"step", "metrics", "checkpoint": the saved one, protected from rotation}
        self.saved_step: int | None = None  # the step of the last save of this run

    def path_for(self, step: int) -> str:
        return os.path.join(self.output_dir, f"checkpoint-{step}")

    def is_better(self, metrics: dict) -> bool:
        value = metrics.get(self.metric) if self.metric else None
        if value is None:
            return False
        if self.best is None:
            return True
        best = self.best["metrics"].get(self.metric)
        if best is None:
            return True
        return value > best if self.greater_is_better else value < best

    def track(self, step: int, metrics: dict) -> bool:
        """Record an evaluation at `step`; True when it is the best so far. Its checkpoint is protected from
        rotation once `save` writes the checkpoint of that step (until then the previous best one stays)."""
        if not self.is_better(metrics):
            return False
        self.best = {"step": step, "metrics": dict(metrics), "checkpoint": self.best and self.best["checkpoint"]}
        return True

    def save(self, engine, path: str | None = None, mark_latest: bool = False,
             extra_state: dict | None = None) -> str:
        """Collective: write the checkpoint of the engine's current step, rotate, and meet at a barrier.

        `mark_latest`: also name it in `output_dir/latest` (DeepSpeed's convention, read by `tagged_latest`);
        `extra_state`: more trainer state for this checkpoint only (DeepSpeed's client_state)."""
        step = engine.step_count
        path = path or self.path_for(step)
        if self.best is not None and self.best["step"] == step:
            self.best["checkpoint"] = path
        trainer = {"checkpoints": self.state_dict(), **{name: s.state_dict() for name, s in self.states.items()},
                   **(extra_state or {})}
        path = write_checkpoint(engine, path, trainer, self.write_extra, self.tokenizer)
        job = engine.topology.job
        if job.rank == 0:
            rotate_checkpoints(self.output_dir, self.save_total_limit,
                               protect=self.best["checkpoint"] if self.best else None)
            if mark_latest:
                replace_atomic(os.path.join(self.output_dir, "latest"), os.path.basename(path))
        job.barrier()
        self.saved_step = step
        log.info("saved %s%s", path, " (the best evaluation so far)" if self.best and self.best["step"] == step
                 and self.metric else "")
        return path

    def maybe_save(self, engine, last: bool = False) -> str | None:
        """Save when `save_steps` divides the step or at the `last` step, unless this step is saved already;
        returns the path written, or None."""
        step = engine.step_count
        due = last or (self.save_steps and step % self.save_steps == 0)
        return self.save(engine) if due and self.saved_step != step else None

    def load(self, engine, path: str) -> dict:
        """Collective: the checkpoint's weights and ZO state into `engine`, and its trainer state into the manager
        and each component; returns the trainer state."""
        trainer = load_checkpoint(engine, path)
        # A checkpoint from before issue 27 holds the same states in one flat mapping ("best_dev", "seconds").
        self.load_state_dict(trainer.get("checkpoints", trainer))
        for name, component in self.states.items():
            component.load_state_dict(trainer.get(name, trainer))
        return trainer

    def tagged_latest(self) -> str:
        """The checkpoint `output_dir/latest` names (DeepSpeed's `load_checkpoint(dir)` with no tag)."""
        latest = os.path.join(self.output_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{self.output_dir} has no 'latest' file: pass tag=<checkpoint name>")
        with open(latest) as f:
            return os.path.join(self.output_dir, f.read().strip())

    def resume_path(self, resume) -> str | None:
        """The checkpoint a `--resume` means: None (no resume), the newest one that verifies (newer broken ones are
        named in a warning), or the given path, which must verify (else a one-line ConfigError)."""
        if not resume:
            return None
        if resume is True:
            return latest_checkpoint(self.output_dir)
        if not os.path.isdir(str(resume)):
            raise ConfigError(f"--resume {resume}: no such checkpoint directory")
        try:
            verify_checkpoint(str(resume))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--resume {resume}: {e}") from None
        return str(resume)

    def state_dict(self) -> dict:
        return {"best_dev": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state.get("best_dev")


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        raise ValueError(f"{path} is not a complete checkpoint (no manifest.json); "
                         "pass a checkpoint-<step> directory or use --resume with no path")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{mpath} does not hold a manifest object: the checkpoint is corrupt")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{mpath}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def read_range(path: str, manifest: dict, name: str, lo: int, hi: int, verified: set | None = None) -> torch.Tensor:
    """Elements [lo, hi) of tensor `name`, assembled from every rank file that holds a part of them."""
    out = None
    filled = 0
    for fname, slices in manifest["slices"].items():
        if name not in slices:
            continue
        s_lo, s_hi = slices[name]
        a, b = intersect((lo, hi), (s_lo, s_hi))
        if b <= a:
            continue
        fpath = os.path.join(path, fname)
        if verified is not None and fname not in verified:
            if _sha256(fpath) != manifest["files"][fname]:
                raise ValueError(f"checksum mismatch for {fpath}: the checkpoint is corrupt")
            verified.add(fname)
        with safe_open(fpath, framework="pt") as f:
            part = f.get_slice(name)[a - s_lo: b - s_lo]
        if out is None:
            out = torch.empty(hi - lo, dtype=part.dtype)
        out[a - lo: b - lo] = part
        filled += b - a
    if filled != hi - lo:
        raise ValueError(f"checkpoint {path} misses elements of {name} in [{lo}, {hi})")
    return out if out is not None else torch.empty(0)


def load_checkpoint(engine: ZOEngine, path: str) -> dict:
    """Load weights and ZO state into `engine` (any world size). Returns the trainer state."""
    manifest = read_manifest(path)
    tensors = manifest["tensors"]
    names = sorted(e.name for e in engine.entries)
    if sorted(tensors) != names:
        missing = sorted(set(names) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(names))[:3]
        raise ValueError(f"checkpoint {path} does not match this model's trainable parameters "
                         f"(missing {missing}, unexpected {extra}): same model, LoRA and block settings?")
    verified: set = set()
    with torch.no_grad():
        for e in engine.entries:
            if list(e.shape) != tensors[e.name]["shape"]:
                raise ValueError(f"{e.name}: checkpoint shape {tensors[e.name]['shape']} != model {list(e.shape)}")
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
    """{tensor name: its selected elements' global indices, sorted}, from every rank file."""
    parts: dict[str, list[torch.Tensor]] = {}
    for fname in manifest["files"]:
        fpath = os.path.join(path, fname)
        if fname not in verified:
            if _sha256(fpath) != manifest["files"][fname]:
                raise ValueError(f"checksum mismatch for {fpath}: the checkpoint is corrupt")
            verified.add(fname)
        with safe_open(fpath, framework="pt") as f:
            for key in f.keys():
                if key.startswith(MASK_PREFIX):
                    parts.setdefault(key[len(MASK_PREFIX):], []).append(f.get_tensor(key))
    full = {name: torch.sort(torch.cat(p)).values for name, p in parts.items()}
    if sum(len(v) for v in full.values()) != manifest["static_mask"]["selected"]:
        raise ValueError(f"checkpoint {path}: its static mask misses elements: the checkpoint is corrupt")
    return full


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Full tensors in their stored dtype, one process (for export)."""
    manifest = read_manifest(path)
    verified: set = set()
    out = {}
    for name, info in sorted(manifest["tensors"].items()):
        flat = read_range(path, manifest, name, 0, info["numel"], verified)
        out[name] = flat.to(getattr(torch, info["dtype"])).view(info["shape"])
    return out
