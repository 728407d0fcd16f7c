"""Where a job's weights live (docs/scaling.md), decided in one place: `choose_layout` takes a run's config and its
DeepSpeed config (as read once) and returns the `Layout` that the topology and the engine then trust. The layouts
that `zero_stage: auto` chooses between are each planned with the memory model of `curvzo-ds plan`
(layout/memory.py): stage 0 when the whole model fits one device, else ZeRO-3 in the smallest shard group that fits.
The rule that the replica groups share the directions (`check_directions`) is stated here only."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from curvzo_ds.algo.differences import forwards_per_step
from curvzo_ds.config.ds_config import resolve_ds_config
from curvzo_ds.config.ds_policy import MAPPED_FIELDS
from curvzo_ds.config.fields import sources_of
from curvzo_ds.config.quantization import NEEDS_STAGE_0, is_quantized, quantization_lacks
from curvzo_ds.errors import ConfigError
from curvzo_ds.layout.memory import WIDTH, GiB, Plan, plan_memory
from curvzo_ds.shard.comm import Comm

log = logging.getLogger("curvzo_ds")

MARGIN = 0.10  # the share of a device's memory that `auto` leaves free (allocator fragmentation, CUDA context)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a job's weights live (docs/scaling.md): stage 0, every rank a whole copy with the micro-batches dealt
    over all ranks (`shard_group_size` 1, `replicas` W); or ZeRO-3 in shard groups of K ranks, each group a whole
    copy that evaluates its own directions (`replicas` W / K). `per_rank`: the planned bytes per rank (0: unknown);
    `gathered`: parameter bytes each rank all-gathers per step (`gathered_per_step`; 0 at stage 0)."""

    zero_stage: int
    shard_group_size: int
    replicas: int
    reason: str
    per_rank: int = 0
    gathered: int = 0
    group: int | None = None  # the ranks of one group for `Topology.create` and the run's shard_group_size key
    #                           (None: the whole job); at stage 0, the group the user gave, if any (choose_layout)

    def record(self) -> dict:
        """summary.json's `layout`."""
        return {"zero_stage": self.zero_stage, "shard_group_size": self.shard_group_size,
                "replicas": self.replicas, "reason": self.reason}

    def describe(self) -> str:
        if self.zero_stage == 0:
            return f"zero_stage=0 replicas={self.replicas} (each rank a whole copy, micro-batches split over ranks)"
        return (f"zero_stage=3 shard_group_size={self.shard_group_size} replicas={self.replicas}"
                + (f" (directions: num_directions a multiple of {self.replicas})" if self.replicas > 1 else ""))


def group_candidates(world_size: int, local_world_size: int | None = None) -> list[int]:
    """The shard group sizes `auto` tries, in order: divisors of the world size that divide the ranks of one node
    (the all-gathers stay inside a node), smallest first, then the other divisors, smallest first."""
    local = local_world_size or world_size
    divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
    return [k for k in divisors if local % k == 0] + [k for k in divisors if local % k]


def plan_layouts(world_size: int, memory: int, local_world_size: int | None = None, num_directions: int = 1,
                 difference: str = "central", **kwargs) -> tuple[Layout, list[Layout]]:
    """(the layout `zero_stage: auto` takes, every layout that fits, cheapest first), from `plan_memory` at
    `memory` bytes per rank less MARGIN. The rule: stage 0 when the whole model, its activations at the run's
    micro-batch, the ZO state and the row table fit one device (`plan_memory` at shard group 1); else ZeRO-3 in
    the smallest shard group K (a divisor of the world size; inside a node first) whose plan fits and whose W / K
    replica groups divide num_directions (each group evaluates its own directions); else, when nothing fits,
    ZeRO-3 over the whole job (`curvzo-ds plan` says by how much it does not fit). A quantised base (`quantization`
    in kwargs) is planned at stage 0 only, fitting or not. A ZeRO-3 layout's all-gather traffic counts the forwards
    of `difference`'s estimator (`gathered_per_step`)."""
    budget = int(memory * (1 - MARGIN))
    kwargs["num_directions"] = num_directions
    whole = plan_memory(world_size=world_size, shard_group_size=1, gpu_memory=memory, **kwargs)
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    fits = []
    if whole.total <= budget:
        fits.append(Layout(0, 1, world_size, f"the whole model fits one device: {gib(whole.total)} planned of "
                           f"{gib(memory)} less a {MARGIN:.0%} margin", whole.total, 0))
    quantization = kwargs.get("quantization", "none")
    if is_quantized(quantization):  # a bitsandbytes base is whole on every rank: stage 0 only
        verdict = (f"fits one device: {gib(whole.total)} planned of" if fits else
                   f"({gib(whole.total)} planned) does not fit one device of")
        return Layout(0, 1, world_size, f"quantization={quantization} takes stage 0, and the whole model {verdict} "
                      f"{gib(memory)} less a {MARGIN:.0%} margin", whole.total, 0), fits
    for k in group_candidates(world_size, local_world_size):
        if k == 1:
            continue  # a shard group of one is stage 0's memory with ZeRO-3's hooks
        p = plan_memory(world_size=world_size, shard_group_size=k, gpu_memory=memory, **kwargs)
        if p.total <= budget:
            per_step = gathered_per_step(p, difference, max(num_directions // (world_size // k), 1))
            why = ("" if whole.total <= budget else f"the whole model ({gib(whole.total)} planned) does not fit one "
                   f"device of {gib(memory)} less a {MARGIN:.0%} margin; ")
            fits.append(Layout(3, k, world_size // k, f"{why}the smallest shard group that fits is {k} ranks, "
                               f"{gib(p.total)} per rank", p.total, per_step))
    usable = [lay for lay in fits if lay.zero_stage == 0 or directions_fit(num_directions, lay.replicas)]
    if usable:
        chosen = usable[0]
        if chosen is not fits[0]:  # a smaller group fits, but its replica groups would need more directions
            chosen = dataclasses.replace(chosen, reason=(
                f"{chosen.reason.split('the smallest shard group')[0]}shard groups of {fits[0].shard_group_size} "
                f"ranks fit, but their {fits[0].replicas} replica groups each need their own directions "
                f"(num_directions={num_directions}): a shard group of {chosen.shard_group_size} ranks, "
                f"{gib(chosen.per_rank)} per rank"))
        return chosen, fits
    full = plan_memory(world_size=world_size, shard_group_size=world_size, gpu_memory=memory, **kwargs)
    return Layout(3, world_size, 1, f"nothing fits {gib(memory)} per rank less a {MARGIN:.0%} margin (ZeRO-3 over "
                  f"all {world_size} ranks needs {gib(full.total)}): ZeRO-3 over the whole job", full.total,
                  gathered_per_step(full, difference, num_directions)), fits


def gathered_per_step(plan: Plan, difference: str, directions_per_group: int) -> int:
    """Parameter bytes one rank all-gathers per step under ZeRO-3: every parameter once per forward, and the
    forwards of `directions_per_group` directions with the `difference` estimator (DIFFERENCE_SPECS: two per
    direction for central, one for rloo)."""
    return plan.params * WIDTH[plan.dtype] * forwards_per_step(difference, directions_per_group)


def directions_fit(num_directions: int, replicas: int) -> bool:
    """The one statement of the rule: ZeRO-3 replica groups each evaluate their own directions (direction d on group
    d mod R), so num_directions must be a multiple of the R groups, or some group would idle or do more forwards."""
    return num_directions % replicas == 0


def check_directions(world_size: int, group: int | None, num_directions: int) -> None:
    """Refuse in one line a topology (groups of `group` ranks; None: the whole job) whose replica groups cannot
    share `num_directions` evenly."""
    groups = world_size // group if group else 1
    if not directions_fit(num_directions, groups):
        raise ConfigError(f"num_directions={num_directions} must be a multiple of the number of replica groups "
                          f"({groups} = world size {world_size} / shard_group_size {group}), so that every group "
                          "evaluates the same number of directions")


def choose_layout(cfg, user_ds: dict | None, job: Comm | None = None) -> Layout:
    """The run's layout, from its resolved config `cfg` (presets filled) and its DeepSpeed config: `zero_stage` and
    `shard_group_size` decided where they are "auto". The DeepSpeed config's stage, dtype and offload are read
    through the config's own mapping (config.ds_config.resolve_ds_config, which also refuses a conflict with an
    explicit key), never beside it. The stage is the first of `stage_rules` that decides it; `auto` (docs/scaling.md;
    `plan_layouts` states the rule) plans with the memory model of `curvzo-ds plan` at the run's micro-batch,
    max_length, num_directions and difference, fed the smallest device memory of the job's ranks: a GPU's free
    memory, or on CPU the host's memory divided by the ranks on the node. The choice and its reason are logged in
    one line; the directions rule is checked (`check_directions`). A quantised run takes stage 0, unplanned:
    ZeRO-3 or a parameter offload with it is refused in one line. Collective (every rank calls it)."""
    job = job or Comm(None)
    world = job.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    where = f"--deepspeed {cfg.deepspeed}" if cfg.deepspeed else "the Accelerate config"
    _, mapped, _ = resolve_ds_config(user_ds, world, None, explicit=sources_of(cfg), where=where,
                                     **{k: getattr(cfg, k) for k in MAPPED_FIELDS})
    stage, reason = next(((st, why) for decides, st, why in stage_rules(cfg, mapped, where) if decides),
                         ("auto", None))
    quantization = getattr(cfg, "quantization", "none")
    if quantization_lacks(quantization, lora=True, zero3=stage == 3, offload=mapped["offload_param"] == "cpu"):
        given = reason if stage == 3 else f"zero_optimization.offload_param.device=cpu in {where}"
        raise ConfigError(f"quantization={quantization} needs zero_stage=0 ({NEEDS_STAGE_0}), not {given}: set "
                          f"zero_optimization.stage to 0 and remove offload_param in {where}, or set "
                          "quantization=none")
    group, q = cfg.shard_group_size, cfg.num_directions
    if stage == 3 and group == "auto" and q == 1:  # one replica group: the whole job, no plan
        layout = Layout(3, world, 1, f"{reason}; shard_group_size auto: num_directions=1 needs one replica group, "
                                     f"the whole job ({world} rank{'s' * (world != 1)})")
    elif stage == "auto" or (stage == 3 and group == "auto"):
        layout = _planned_layout(cfg, user_ds, job, mapped, stage, reason, local)
    else:
        layout = _given_layout(stage, group, world, reason)
    if layout.zero_stage == 0:
        layout = dataclasses.replace(layout, group=None if group in ("auto", None) else group)
    else:
        layout = dataclasses.replace(layout, group=None if layout.shard_group_size == world else
                                     layout.shard_group_size)
    check_directions(world, layout.group, q)
    if job.rank == 0:
        log.info("layout: %s: %s", layout.describe(), layout.reason)
    return layout


def stage_rules(cfg, mapped: dict, where: str) -> list[tuple[bool, int | str, str]]:
    """The rules that decide the stage before any plan, in order, as (applies, stage, reason): the first that
    applies wins; none: `auto`. An explicit stage (--set, the YAML, then the DeepSpeed file's or the Accelerate
    config's zero_optimization.stage) is kept; a quantised base takes stage 0; a parameter offload or an explicit
    shard_group_size takes ZeRO-3."""
    stage, group = mapped["zero_stage"], cfg.shard_group_size
    quantization = getattr(cfg, "quantization", "none")
    return [
        (cfg.zero_stage != "auto", stage, f"zero_stage={stage} ({sources_of(cfg).get('zero_stage', 'set')})"),
        (stage != "auto", stage, f"zero_optimization.stage={stage} in {where}"),
        (is_quantized(quantization), 0, f"quantization={quantization} (a bitsandbytes base is whole on every rank)"),
        (mapped["offload_param"] == "cpu", 3, "offload_param=cpu (parameter offload is ZeRO-3's)"),
        (group != "auto", 3, f"shard_group_size={group} ({sources_of(cfg).get('shard_group_size', 'set')})"),
    ]


def _planned_layout(cfg, user_ds: dict | None, job: Comm, mapped: dict, stage: int | str, reason: str | None,
                    local: int) -> Layout:
    """`zero_stage: auto`, or stage 3 with `shard_group_size: auto` (and several directions): the plan's choice
    (`plan_layouts`) at the smallest device memory of the job's ranks. Collective."""
    world, q = job.world_size, cfg.num_directions
    memory, kind = device_memory(job)  # collective: outside the try, so that every rank reaches it
    try:
        chosen, _ = plan_layouts(world, memory, local, q, difference=getattr(cfg, "difference", "central"),
                                 model=cfg.model, dtype=mapped["dtype"], offload=mapped["offload_param"],
                                 deepspeed=user_ds, batch=cfg.micro_batch_size, seq_len=cfg.max_length, device=kind,
                                 trust_remote_code=bool(getattr(cfg, "trust_remote_code", False)))
    except Exception as e:  # noqa: BLE001  a model the planner cannot read: ZeRO-3 over the job, on every rank
        chosen = Layout(3, world, 1, f"the memory model could not plan model {cfg.model} ({first_line(e)}): "
                                     "ZeRO-3 over the whole job")
    if stage == "auto":
        return chosen
    if chosen.zero_stage == 3:
        return dataclasses.replace(chosen, reason=f"{reason}; shard_group_size auto: {chosen.reason}")
    # the whole model fits, but the stage is 3: the smallest group whose replica groups divide the directions
    group = next((k for k in group_candidates(world, local) if k > 1 and directions_fit(q, world // k)), world)
    why = (f"the smallest group of more than one rank whose {world // group} replica groups divide "
           f"num_directions={q}" if group < world else f"the whole job ({world} ranks)")
    return Layout(3, group, world // group, f"{reason}; shard_group_size auto: {why}")


def _given_layout(stage: int, group: int | str | None, world: int, reason: str) -> Layout:
    """An explicit stage with an explicit (or no) shard group: stage 0 in groups of `group` ranks (the whole job by
    default), or ZeRO-3 in shard groups of `group`, which must divide the world size."""
    k = world if group in ("auto", None) else group
    if stage == 0:
        return Layout(0, 1 if k == world else k, world if k == world else world // k, reason)
    if k < 1 or k > world or world % k:
        raise ConfigError(f"shard_group_size={k} must divide the world size {world}: set it to the ranks of "
                          "one node, or leave it unset (the world size)")
    return Layout(3, k, world // k, reason)


def device_memory(job: Comm) -> tuple[int, str]:
    """(bytes of device memory per rank, the smallest over the job; "gpu" or "cpu"): a CUDA device's free memory,
    or on CPU the host's physical memory divided by the ranks on this node."""
    from deepspeed.accelerator import get_accelerator

    if torch.cuda.is_available() and get_accelerator().device_name() == "cuda":
        mine, kind = torch.cuda.mem_get_info()[0], "gpu"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", job.world_size))
        mine, kind = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1), "cpu"
    return min(job.all_gather_object(int(mine))), kind


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


__all__ = ["MARGIN", "Layout", "check_directions", "choose_layout", "device_memory", "directions_fit",
           "gathered_per_step", "group_candidates", "plan_layouts", "stage_rules"]
