"""ZOEngine: one CurvZO (or baseline) step on a plain module or a DeepSpeed engine.

The algorithm's decisions (pi, the budget, the mask, the update coefficients, the scores) are the
sampler's (sampling.py). The engine does the rest of a step (docs/algorithm.md, docs/deepspeed.md):
1. each rank adds +eps z to the part of each selected tensor it edits (its ZeRO-3 shard, or the
   whole tensor where a gathered replica must follow), computing the fixed-point sums of z^2 over
   the part it owns; forwards of its micro-batches; -2 eps z; forwards again;
2. one all-reduce of int64 values: the block sums and the per-micro-batch loss sums;
3. every rank computes the same Delta and applies the same update. The update also undoes the
   perturbation, so each selected element's noise is generated three times, not four.
No gradient, optimizer state or full parameter is created by the engine. The passes over the weights are
the Perturber's (perturb.py), the all-reduce's wire format is StepPacket's (comm.py), the bf16/fp16
visibility check is VisibilityMonitor's (visibility.py), and which ranks share what is the Topology's
(distributed.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from curvzo_ds.algo.sampling import CurvZOSampler, StepPlan
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.data.losses import loss_parts, mean_loss
from curvzo_ds.data.stream import MicroBatches, round_robin_slots
from curvzo_ds.errors import NonFiniteLossError, RanksDisagree
from curvzo_ds.noise.gaussian import FIXED_POINT_BITS, MAX_ABS_Z, NoiseSource
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.comm import Comm, StepPacket, bits_float64, float64_bits
from curvzo_ds.shard.distributed import Topology
from curvzo_ds.shard.mask import MaskedPerturber, StaticMask
from curvzo_ds.shard.params import ParamEntry, collect_entries, make_blocks
from curvzo_ds.shard.perturb import Perturber, StepPasses
from curvzo_ds.shard.visibility import VisibilityMonitor

log = logging.getLogger("curvzo_ds")


@dataclass
class StepResult:
    step: int  # 1 after the first update
    loss: float | None
    loss_plus: float | None
    loss_minus: float | None
    projected_grad: float | None
    budget: float
    n_selected: int
    param_fraction: float
    max_inv_pi: float
    learning_rate: float
    d_eff: float | None = None
    score_entropy: float | None = None
    visibility: float | None = None  # the least fraction of a drawn bf16/fp16 block's elements that +eps z moved
    visibility_block: str | None = None
    skipped: str | None = None
    stop: bool = False  # with step(batch, stop_requested=...): some rank asked to stop (not a metric)
    pi: torch.Tensor | None = None  # [G] the inclusion probabilities this update drew from (not a metric)

    def as_dict(self) -> dict[str, Any]:
        """The metrics.jsonl fields (docs/outputs.md)."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ("stop", "pi"))
        return {k: v for k, v in values if v is not None or k.startswith("loss") or k == "projected_grad"}


LossFn = Callable[[Any, Any], Any]


class StepTimer:
    """Wall time per section of `ZOEngine.step`, for benchmarks: `engine.timer = StepTimer()`.

    Sections: "perturb_stats" (+eps z, with the score statistics when the method has them), "perturb"
    (-2 eps z: the same work without statistics), "forwards", "reduce" (the all-reduce and its read-back),
    "update" (restore and update in one pass). `sync` (torch.cuda.synchronize on a GPU) runs at each edge.
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.totals: dict[str, float] = {}
        self.sync = sync

    @contextlib.contextmanager
    def section(self, name: str):
        if self.sync:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start


class ZOEngine:
    """Zeroth-order training of `model` (an nn.Module or a DeepSpeed engine) on `loss_fn`.

    `loss_fn(model, micro_batch)` returns `(loss_sum, count)` (docs/contracts.md); a mean loss is `(mean, 1)`.
    Only parameters with `requires_grad` are perturbed, so LoRA works as is.
    For an Accelerate loop, `curvzo_ds.from_accelerator` prepares the model and builds the engine.

    `topology` (distributed.Topology): which ranks share a ZeRO-3 partition; `group` is the short form for a
    shard group made by the caller (hybrid sharding); neither: the whole job is one partition.
    """

    def __init__(self, model, loss_fn: LossFn, config: ZOConfig | None = None, *, group=None,
                 topology: Topology | None = None, **overrides):
        cfg = copy.deepcopy(config) if config is not None else ZOConfig()
        names = {f.name for f in dataclasses.fields(cfg)}
        for key, value in overrides.items():
            if key not in names:
                raise ValueError(f"unknown ZOEngine option {key!r}")
            setattr(cfg, key, value)
        missing = [k for k in ("learning_rate", "zo_eps", "max_steps") if getattr(cfg, k) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} unset: a TrainConfig's presets are resolved by the CLI "
                             "(config.resolve_presets); set them or pass a ZOConfig")
        cfg.validate()
        self.cfg = cfg
        self.model = model
        self.module = ds_compat.module_of(model)
        if ds_compat.is_ds_engine(model):
            ds_compat.check_engine_supported(model)
        self.loss_fn = loss_fn
        # The step's all-reduce spans the job; ZeRO-3's partition and the micro-batches are the shard group's.
        self.topology = topology if topology is not None else Topology.of(group)
        self.topology.check_directions(cfg.num_directions)
        self.comm: Comm = self.topology.shard
        self.entries: list[ParamEntry] = collect_entries(self.module, replicated_rank=self.comm.rank,
                                                         fp32_master=cfg.fp32_master_weights)
        if not self.entries:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train. "
                             "Unfreeze some parameters or enable LoRA.")
        self.blocks = make_blocks(self.entries, cfg.block_granularity, cfg.block_chunk_size)
        self.sizes = torch.tensor([b.size for b in self.blocks], dtype=torch.float64)
        self.num_params = int(self.sizes.sum().item())
        too_big = [b.name for b in self.blocks if b.size * MAX_ABS_Z**2 * 2**FIXED_POINT_BITS >= 2**62]
        if too_big:
            raise ValueError(f"block {too_big[0]} has too many elements for the int64 score statistics; "
                             "set block_granularity=chunk")
        self.noise = NoiseSource(cfg.seed)
        # Where the step's statistics and losses are gathered: the collectives' device, or with one rank the
        # device of the weights (a single GPU needs no process group).
        first = self.entries[0]
        self.device = self.comm.device if self.comm.world_size > 1 else ds_compat.storage_device(first.param)
        self.sampler = CurvZOSampler(cfg, self.sizes, self.noise.mask_uniforms)
        self.perturber: StepPasses = Perturber(self.entries, self.blocks, self.noise, self.device)
        self.static_mask: StaticMask | None = None  # static_mask: set by fit_static_mask or a checkpoint
        self.visibility = VisibilityMonitor(self.entries, self.blocks, self.device, cfg.visibility_steps,
                                            cfg.visibility_warn, cfg.zo_eps)
        self.partitioned = any(e.partitioned for e in self.entries)
        self.timer: StepTimer | None = None
        self.last_mask: torch.Tensor | None = None
        self.step_count = 0
        self.skips_in_row = 0
        self.skipped_total = 0
        self._check_ranks_agree()
        log.info("ZOEngine: method %s, learning_rate %g (%s), zo_eps %g, weight_decay %g; %d blocks, %d trainable "
                 "parameters; noise %s", cfg.method, cfg.learning_rate, cfg.lr_scheduler_type, cfg.zo_eps,
                 cfg.weight_decay, self.num_blocks, self.num_params, self.noise.ident)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def fit_static_mask(self, batches) -> StaticMask:
        """static_mask (docs/algorithm.md, "A static mask"): pick the top `cfg.static_mask` fraction of elements by
        one backprop per batch of `batches` (the first `static_mask_batches` training batches), and perturb only
        those from now on. Collective; call it once before the first step (the CLI does)."""
        from curvzo_ds.shard import mask

        self.set_static_mask(mask.fit(self, batches, self.cfg.static_mask))
        log.info("static_mask: %d of %d trainable elements (%.4g%%) chosen by backprop on %d batches",
                 self.static_mask.selected, self.num_params, 100 * self.static_mask.selected / self.num_params,
                 len(batches))
        return self.static_mask

    def set_static_mask(self, mask: StaticMask) -> None:
        """Perturb and update only the elements of `mask` (a checkpoint's, or fit_static_mask's)."""
        if self.cfg.method != "mezo":
            raise ValueError(f"static_mask needs method=mezo (a fixed set of elements, perturbed at every step with no "
                             f"1/pi weights), not method={self.cfg.method}")
        if self.partitioned:  # a persistent tensor's region is all of it: gathered, as after a first forward
            ds_compat.gather_persistent([e.param for e in self.entries])
        self.static_mask = mask
        self.perturber = MaskedPerturber(mask, self.noise)

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, batch, stop_requested: bool | None = None) -> StepResult:
        """One update on `batch` (a MicroBatches of the global batch, or this rank's own batch).

        `stop_requested` (the CLI's pre-emption flag): summed over the ranks in the step's own all-reduce, so that
        every rank learns at the same step that one of them was asked to stop (`StepResult.stop`).
        """
        _check_batch(batch)
        cfg = self.cfg
        if cfg.static_mask and self.static_mask is None:
            raise ValueError(f"static_mask={cfg.static_mask} needs its mask: call engine.fit_static_mask(batches) "
                             "before the first step (curvzo-ds train does)")
        t = self.step_count
        lr = self.sampler.learning_rate(t)
        plan = self.sampler.plan(t)
        fraction = (self.static_mask.selected / self.num_params if self.static_mask is not None
                    else plan.param_fraction(self.sizes))
        base = dict(budget=plan.budget, n_selected=plan.n_selected, param_fraction=fraction,
                    max_inv_pi=plan.max_inv_pi, learning_rate=lr, d_eff=plan.d_eff, score_entropy=plan.entropy,
                    pi=plan.pi)
        self.last_mask = plan.mask
        if plan.n_selected == 0:
            # No block drawn: no forwards, no score update; the step is counted (docs/algorithm.md).
            self._end_step(plan, None, None)
            stop = self._agree(stop_requested) if stop_requested is not None else False
            return StepResult(t + 1, None, None, None, None, skipped="empty_mask", stop=stop, **base)
        replicas, replica = self.topology.replicas, self.topology.replica
        if replicas > 1 and not isinstance(batch, MicroBatches):
            raise ValueError("with replica groups, step() takes the global batch as MicroBatches (every group "
                             "evaluates the same data)")
        eps, q = cfg.zo_eps, cfg.num_directions
        # With q > 1 every direction starts from the same w: the edited values are kept and put back exactly,
        # in every copy (so persistent parameters are gathered first, as the first forward would do).
        if q > 1 and self.partitioned:
            ds_compat.gather_persistent([e.param for e in self.entries])
        perturber = self.perturber
        perturber.begin(t, plan.mask, q)
        saved = perturber.snapshot() if q > 1 else None
        was_training = self.module.training
        self.module.eval()  # dropout would give the two forwards different masks
        evals = []  # (direction, block sums of z^2, L+ slots, L- slots) of the directions this group evaluates
        # The visibility counts come from direction 0 (replica group 0); the other groups send zeros.
        # A static mask writes its elements from fp32 values: no block to watch.
        watch = self.visibility.watch(t, perturber if replica == 0 else None) if self.static_mask is None else None
        changed = None if replica == 0 else self.visibility.moved(watch)
        try:
            for d in range(replica, q, replicas):
                with self._section("perturb_stats"):
                    block_fixed = perturber.perturb(0.0, eps, stats=self.sampler.scored, direction=d)
                if d == 0:
                    changed = self.visibility.moved(watch)
                with self._section("forwards"):
                    plus = self._forwards(batch)
                with self._section("perturb"):
                    perturber.perturb(eps, -eps, direction=d)
                with self._section("forwards"):
                    minus = self._forwards(batch)
                if saved is not None:
                    perturber.restore(saved)
                evals.append((d, block_fixed, plus, minus))
        finally:
            self.module.train(was_training)
        with self._section("reduce"):
            losses, block_sq, changed, stop = self._reduce(evals, self._slot_count(batch), changed,
                                                            stop_requested)
        base["stop"] = stop
        if changed is not None:
            base.update(self.visibility.report(changed, plan.mask))
        deltas = [(lp - lm) / (2 * eps) for lp, lm in losses]
        loss_plus, loss_minus = (sum(x[i] for x in losses) / q for i in (0, 1))
        delta = sum(deltas) / q
        loss = 0.5 * (loss_plus + loss_minus)
        if not all(math.isfinite(x) for x in (loss_plus, loss_minus, delta, *deltas)):
            if saved is None:
                perturber.perturb(-eps, 0.0)
            self._end_step(plan, None, None)
            self.skips_in_row += 1
            self.skipped_total += 1
            log.warning("step %d: non-finite loss (L+=%s, L-=%s); weights restored, step skipped (%d in a row)",
                        t + 1, loss_plus, loss_minus, self.skips_in_row)
            if self.skips_in_row >= cfg.max_consecutive_skips:
                raise NonFiniteLossError(
                    f"{self.skips_in_row} consecutive steps had a non-finite loss (last at step {t + 1}); "
                    "lower learning_rate or zo_eps, or check the data and the model's dtype")
            return StepResult(t + 1, _finite_or_none(loss), _finite_or_none(loss_plus),
                              _finite_or_none(loss_minus), None, skipped="non_finite_loss", **base)
        self.skips_in_row = 0
        with self._section("update"):
            steps, keep = self.sampler.direction_updates(plan, deltas, lr, cfg.weight_decay)
            if q == 1:
                perturber.update(steps[0], keep, eps, cfg.weight_decay)
            else:
                perturber.update_directions(steps, keep, cfg.weight_decay)
        self._end_step(plan, deltas, block_sq)
        return StepResult(t + 1, loss, loss_plus, loss_minus, delta, **base)

    def _section(self, name: str):
        return self.timer.section(name) if self.timer is not None else contextlib.nullcontext()

    def _end_step(self, plan: StepPlan, delta: list[float] | None, block_sq: torch.Tensor | None) -> None:
        if delta is None:
            self.sampler.skip(plan)
        else:
            self.sampler.observe(plan, delta, block_sq)
        self.step_count = plan.step + 1

    @torch.no_grad()
    def loss(self, batch) -> float:
        """The loss of the current weights on `batch` (same reduction as a step, no perturbation)."""
        _check_batch(batch)
        was_training = self.module.training
        self.module.eval()
        try:
            local = self._forwards(batch)
        finally:
            self.module.train(was_training)
        total = self._slot_count(batch)
        vec = torch.zeros(2 * total, dtype=torch.int64, device=self.device)
        for slot, row in local:
            vec[2 * slot: 2 * slot + 2] = float64_bits(row)
        vals = bits_float64(self.comm.all_reduce_sum_int64(vec)).view(total, 2).tolist()
        return mean_loss((row[0], row[1]) for row in vals)

    # ----------------------------------------------------------------- forwards and reduction
    def _slot_count(self, batch) -> int:
        return len(batch.items) if isinstance(batch, MicroBatches) else self.comm.world_size

    def _forwards(self, batch) -> list[tuple[int, torch.Tensor]]:
        """This rank's (slot, [loss_sum, count] float64 on the reduction device), plus zero-weight forwards
        to match the other ranks. Nothing is read back to the host here."""
        w, r = self.comm.world_size, self.comm.rank
        if isinstance(batch, MicroBatches):
            items, out = batch.items, []
            for j in round_robin_slots(len(items), r, w):
                if j is not None:
                    out.append((j, self._call_loss(items[j])))
                elif self.partitioned:
                    self._call_loss(items[0])  # zero weight: keeps ZeRO-3's collective gathers in step
            return out
        return [(r, self._call_loss(batch))]

    def _call_loss(self, micro_batch) -> torch.Tensor:
        loss_sum, count = loss_parts(self.loss_fn(self.model, micro_batch))
        # A number becomes a device tensor by a fill (torch.full), never by a host-to-device copy that would wait.
        parts = [x.detach().to(self.device, torch.float64).reshape(()) if torch.is_tensor(x)
                 else torch.full((), float(x), dtype=torch.float64, device=self.device) for x in (loss_sum, count)]
        return torch.stack(parts)

    def _agree(self, flag: bool) -> bool:
        """True on every rank if `flag` is set on any (a step without forwards has no all-reduce to carry it)."""
        return bool(self.topology.job.all_reduce_sum_int64(torch.tensor([int(flag)], dtype=torch.int64)).item())

    def _reduce(self, evals, total: int, changed=None, stop_requested=None):
        """The step's one all-reduce over every rank (all replica groups), StepPacket's wire format: for each of the
        q directions its G block sums (none for MeZO); on visibility steps the G counts of moved bf16/fp16 elements;
        (L+, L-, count) of every direction and micro-batch slot; with `stop_requested`, the stop flag. Returns
        ([(L+, L-)] per direction, block sums of z^2 [G] or [q, G], moved counts or None, whether any rank asked to
        stop)."""
        q, g = self.cfg.num_directions, (self.num_blocks if self.sampler.scored else 0)
        packet = StepPacket(q, g, total, moved=self.num_blocks if changed is not None else 0,
                            stop=stop_requested is not None, device=self.device)
        for d, block_fixed, plus, minus in evals:
            if g:
                packet.put_sums(d, block_fixed)
            for (slot, lp), (_, lm) in zip(plus, minus):
                packet.put_losses(d, slot, lp, lm)
        if changed is not None:
            packet.put_moved(changed)
        if stop_requested is not None:
            packet.put_stop(stop_requested)
        packet.all_reduce(self.topology.job)
        block_sq = (packet.block_sums().to(torch.float64) / 2.0**FIXED_POINT_BITS if g
                    else torch.zeros(q * self.num_blocks, dtype=torch.float64))
        losses = [tuple(mean_loss((row[i], row[2]) for row in rows) for i in (0, 1)) for rows in packet.losses()]
        return losses, block_sq if q > 1 else block_sq[:self.num_blocks], packet.moved(), packet.stop()

    # ----------------------------------------------------------------- state
    def state_hash(self) -> str:
        """A hash of what every rank must agree on: the step, the scores, the warm-up sums, the last step's mask
        and the noise generator (the CLI compares it across ranks every `consistency_steps` steps)."""
        h = hashlib.sha256(f"{self.step_count} {self.noise.ident}".encode())
        for t in (self.sampler.scores, self.sampler.warmup_sum, self.last_mask):
            if t is not None:
                h.update(t.cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "seed": self.cfg.seed,
            **self.sampler.state_dict(),
            "skipped_total": self.skipped_total,
            "skips_in_row": self.skips_in_row,
            "noise": self.noise.describe(),
            "blocks": [b.name for b in self.blocks],
            "method": self.cfg.method,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError if a checkpoint's engine state cannot continue this engine (noise, blocks, seed)."""
        if state["noise"] != self.noise.describe():
            raise ValueError(f"checkpoint noise {state['noise']} differs from this engine's "
                             f"{self.noise.describe()}: it was written by another noise generator; resume it with the "
                             "curvzo_ds version that wrote it")
        if list(state["blocks"]) != [b.name for b in self.blocks]:
            raise ValueError("checkpoint blocks differ from this model's trainable parameters "
                             "(another model, LoRA setting or block_granularity?)")
        if state["seed"] != self.cfg.seed:
            raise ValueError(f"checkpoint seed {state['seed']} differs from seed={self.cfg.seed}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.step_count = int(state["step"])
        self.sampler.load_state_dict(state)
        self.skipped_total = int(state["skipped_total"])
        self.skips_in_row = int(state["skips_in_row"])

    def _check_ranks_agree(self) -> None:
        """Fail on every rank, at start-up, in one line, if ranks disagree on the configuration, the trainable blocks
        or the noise: the generator's identity and a digest of a reference vector drawn by this rank's own kernel
        (another kernel build or definition draws other bits, and the shards would get inconsistent noise)."""
        job = self.topology.job
        if job.world_size == 1:
            return
        mine = {"config": dataclasses.asdict(self.cfg), "blocks": [(b.name, b.size) for b in self.blocks],
                "noise": self.noise.describe(), "kernel": self.noise.reference_digest(self.device)}
        everyone = job.all_gather_object(mine)
        first = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs == first:
                continue
            diff = sorted(k for k in set(theirs["config"]) | set(first["config"])
                          if theirs["config"].get(k) != first["config"].get(k))
            if diff:
                what = ", ".join(f"{k}: {first['config'].get(k)!r} vs {theirs['config'].get(k)!r}" for k in diff)
            elif theirs["blocks"] != first["blocks"]:
                what = "the trainable parameters (another model, LoRA setting or block_granularity)"
            else:
                what = (f"the noise kernel (reference digest {first['kernel']} vs {theirs['kernel']}, generator "
                        f"{first['noise']['ident']} vs {theirs['noise']['ident']}: another build of curvzo_ds or of "
                        "its kernel)")
            raise RanksDisagree(f"rank {rank} disagrees with rank 0 on {what}. Every rank must start with the same "
                                "seed, configuration, model and curvzo_ds build, or the noise would not match.")


def _check_batch(batch) -> None:
    """A plain list is ambiguous (a list of micro-batches, or one batch that is a list): refuse it in one line."""
    if isinstance(batch, list):
        raise ValueError(f"step() got a plain list of {len(batch)} items: pass MicroBatches([...]) for micro-batches "
                         "(micro-batch j runs on rank j mod W; curvzo_ds.split_batch makes them), or a tuple or dict "
                         "for this rank's own batch")


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
