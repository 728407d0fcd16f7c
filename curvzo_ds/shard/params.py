"""The trainable parameters as this rank sees them, and their grouping into blocks.

Each trainable tensor is a `ParamEntry`: its canonical name (what `save_pretrained` writes,
docs/contracts.md), its full size, and two global flat ranges:
- `owned`: the elements this rank stores and is responsible for (its ZeRO-3 shard; all of it
  on rank 0 and none elsewhere for a replicated parameter). Score statistics and checkpoints
  count exactly these, so each element is counted once over the job.
- `region`: the elements this rank edits. The owned shard, or the whole tensor when a full
  replica must follow every edit (ZeRO-3 persistent parameters, replicated parameters).
Blocks (paper Sec. 3.5) are lists of segments (entry, lo, hi) of one or more tensors.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch

from curvzo_ds.config.schema import Granularity
from curvzo_ds.shard import ds_compat

_LAYER = re.compile(r"^(.*?\.(?:layers|h|layer|blocks|decoder\.layers)\.\d+)\.")


@dataclass
class ParamEntry:
    name: str
    param: torch.nn.Parameter
    numel: int
    shape: tuple[int, ...]
    owned: tuple[int, int]
    region: tuple[int, int]
    decay: bool
    partitioned: bool
    master: torch.Tensor | None = None  # fp32 copy of the region

    def targets(self) -> list[tuple[torch.Tensor, int]]:
        """(flat view, offset of its first element within the region) for every copy to edit."""
        lo, hi = self.region
        if not self.partitioned:
            return [(self.param.data.view(-1), 0)]
        own_lo, own_hi = self.owned
        shard = ds_compat.shard_view(self.param, own_hi - own_lo)
        out = [(shard, own_lo - lo)]
        if (lo, hi) == (0, self.numel) and ds_compat.is_available(self.param):
            full = self.param.data.view(-1)
            # At world size 1 the gathered tensor can be the shard itself: edit it once.
            if full.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr():
                out.append((full, 0))
        return out

    def storage_key(self) -> tuple:
        """Where the copies of targets() live now (addresses, and whether a gathered replica is there): cheap, so
        that the Perturber can check every step that its table is still valid."""
        p = self.param
        if not self.partitioned:
            return (p.data_ptr(), p.numel())
        return (ds_compat.shard_address(p),
                self.region == (0, self.numel) and ds_compat.is_available(p) and p.data_ptr())

    def _pieces(self, a: int, n: int):
        """(target view, index range in the view, index range in a region piece [a, a+n))."""
        for view, off in self.targets():
            lo, hi = max(a, off), min(a + n, off + view.numel())
            if hi > lo:
                yield view, slice(lo - off, hi - off), slice(lo - a, hi - a)

    def write(self, a: int, values: torch.Tensor) -> None:
        """region[a: a + len(values)] <- values, in every copy."""
        for view, vs, zs in self._pieces(a, values.numel()):
            view[vs].copy_(values[zs])

    def region_values(self) -> torch.Tensor:
        """The current values of the region, fp32 (from the master copy when there is one; float64 tensors in
        float64, so that a checkpoint of them is exact)."""
        if self.master is not None:
            return self.master
        lo, hi = self.region
        dtype = torch.promote_types(self.param.dtype, torch.float32)
        out = torch.empty(hi - lo, dtype=dtype, device=ds_compat.storage_device(self.param))
        targets = self.targets()
        if max(off + view.numel() for view, off in targets) < hi - lo or min(off for _, off in targets) > 0:
            raise RuntimeError(f"{self.name}: only the shard is here; gather the parameter to read its region")
        for view, off in targets:
            out[off: off + view.numel()] = view.to(dtype)
        return out


@dataclass
class Block:
    name: str
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (entry index, lo, hi)

    @property
    def size(self) -> int:
        return sum(hi - lo for _, lo, hi in self.segments)


def canonical_name(name: str, peft: bool) -> str:
    """Strip wrapper prefixes so that noise keys and checkpoints never depend on the entry point."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    if peft:
        name = re.sub(r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)\.[^.]+", r".\1", name)
    return name


_LORA_A = re.compile(r"\.lora_(embedding_)?A(\.|$)")


def is_lora_a(name: str) -> bool:
    """Whether a canonical name (`canonical_name`) is a LoRA adapter's A factor (lora_A or lora_embedding_A)."""
    return _LORA_A.search(name) is not None


def collect_entries(module: torch.nn.Module, *, replicated_rank: int, fp32_master: bool | str) -> list[ParamEntry]:
    """Every trainable parameter of `module` (tied ones once), in sorted canonical-name order.

    fp32_master: True gives every bf16/fp16 tensor an fp32 copy of its region; "auto" only the 1-D ones (norm
    weights near 1.0 and biases, whose bf16 spacing is larger than eps z: without a copy they barely move).
    """
    is_peft = hasattr(module, "peft_config")
    entries = []
    seen = set()
    for raw_name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        name = canonical_name(raw_name, is_peft)
        numel = ds_compat.full_numel(p)
        shape = ds_compat.full_shape(p)
        if ds_compat.is_partitioned(p):
            owned = ds_compat.owned_range(p)
            region = (0, numel) if ds_compat.is_persistent(p) else owned
            partitioned = True
        else:
            owned = (0, numel) if replicated_rank == 0 else (0, 0)
            region = (0, numel)
            partitioned = False
        decay = len(shape) >= 2 and "norm" not in name.lower()
        entries.append(ParamEntry(name, p, numel, shape, owned, region, decay, partitioned))
    entries.sort(key=lambda e: e.name)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("two trainable parameters have the same canonical name; rename one")
    if fp32_master:
        low = [e for e in entries if e.param.dtype in (torch.bfloat16, torch.float16)  # fp32/64 edited exactly
               and (fp32_master is True or len(e.shape) == 1)]
        # A persistent tensor's region is all of it, but before the first forward only the shard is
        # here: gather those (a collective; the list is the same on every rank).
        gather = [e.param for e in low if e.partitioned and e.region == (0, e.numel)
                  and not ds_compat.is_available(e.param)]
        with ds_compat.gathered(gather) if gather else contextlib.nullcontext():
            for e in low:
                e.master = e.region_values().clone()
    return entries


def make_blocks(entries: list[ParamEntry], granularity: str, chunk: int) -> list[Block]:
    """Blocks by tensor (the paper's setting), by layer, or by fixed-size sub-tensor chunks."""
    blocks: list[Block] = []
    if granularity == Granularity.TENSOR:
        blocks = [Block(e.name, [(i, 0, e.numel)]) for i, e in enumerate(entries)]
    elif granularity == Granularity.CHUNK:
        for i, e in enumerate(entries):
            for c, lo in enumerate(range(0, e.numel, chunk)):
                blocks.append(Block(f"{e.name}#{c}", [(i, lo, min(lo + chunk, e.numel))]))
    elif granularity == Granularity.LAYER:
        by_layer: dict[str, Block] = {}
        for i, e in enumerate(entries):
            m = _LAYER.match(e.name)
            key = m.group(1) if m else e.name
            by_layer.setdefault(key, Block(key)).segments.append((i, 0, e.numel))
        blocks = sorted(by_layer.values(), key=lambda b: b.name)
    else:
        raise ValueError(f"block_granularity={granularity!r}: use tensor, layer or chunk")
    return blocks


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (lo, lo)
