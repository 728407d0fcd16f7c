"""ZOEngine: the wiring of a step (the package's docstring describes the step); the forwards and their all-reduce
are shard/forwards.py's, the passes over the weights the Perturber's, the decisions the sampler's, the saved state
engine/state.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from curvzo_ds.algo.differences import Estimate, FiniteDifference
from curvzo_ds.algo.estimators import Perturbation
from curvzo_ds.algo.rate import NUMBER_FIX, Rate, line_rate, line_tau
from curvzo_ds.algo.sampling import METHOD_SPECS, CurvZOSampler, Method, StepPlan
from curvzo_ds.config.resolve import engine_config
from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.config.sections import section
from curvzo_ds.data.stream import MicroBatches
from curvzo_ds.engine.result import LossFn, StepResult, StepTimer
from curvzo_ds.engine.state import EngineState
from curvzo_ds.errors import NonFiniteLossError, RateRefused
from curvzo_ds.noise.gaussian import FIXED_POINT_BITS, MAX_ABS_Z, NoiseSource
from curvzo_ds.shard import ds_compat
from curvzo_ds.shard.comm import Comm
from curvzo_ds.shard.distributed import Topology, check_ranks_agree
from curvzo_ds.shard.forwards import Reduced, check_batch, eval_mode, reduce_step, run_forwards, slot_count
from curvzo_ds.shard.mask import MaskedPerturber, StaticMask
from curvzo_ds.shard.mask import fit as fit_mask
from curvzo_ds.shard.params import ParamEntry, collect_entries, is_lora_a, make_blocks
from curvzo_ds.shard.perturb import Perturber, Point, StepPasses
from curvzo_ds.shard.visibility import VisibilityMonitor

log = logging.getLogger("curvzo_ds")
LORA_MIXED_FIX = ("its blocks mix a LoRA adapter's A and B factors (block_granularity=layer), so the line moves both, "
                  "and on a fresh adapter (B = 0) that line is concave: set block_granularity=tensor (the probe then "
                  "holds the A factors), or learning_rate to a number")


class ZOEngine(EngineState):
    """Zeroth-order training of `model` (an nn.Module or a DeepSpeed engine) on `loss_fn`.

    `loss_fn(model, micro_batch)` returns `(loss_sum, count)` (docs/contracts.md); a mean loss is `(mean, 1)`.
    Only parameters with `requires_grad` are perturbed, so LoRA works as is.
    For an Accelerate loop, `curvzo_ds.from_accelerator` prepares the model and builds the engine.

    `topology` (distributed.Topology): which ranks share a ZeRO-3 partition; `group` is the short form for a
    shard group made by the caller (hybrid sharding); neither: the whole job is one partition.
    `sampler`: what makes the engine's sampler, called as `CurvZOSampler` is (the `sampler` and `engine` sections,
    the block sizes, the mask uniforms); None: `CurvZOSampler`. A subclass serves (experiments/ inject an oracle).
    """

    def __init__(self, model, loss_fn: LossFn, config: ZOConfig | None = None, *, group=None,
                 topology: Topology | None = None, sampler: Callable[..., CurvZOSampler] | None = None, **overrides):
        self.cfg = cfg = engine_config(config, overrides)
        self.model = model
        self.module = ds_compat.module_of(model)
        if ds_compat.is_ds_engine(model):
            ds_compat.check_engine_supported(model)
        self.loss_fn = loss_fn
        # The step's all-reduce spans the job; ZeRO-3's partition and the micro-batches are the shard group's.
        self.topology = topology if topology is not None else Topology.of(group)
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
        self.noise = NoiseSource(cfg.seed, cfg.perturbation)
        # Statistics and losses meet on the collectives' device, or with one rank on the weights' (no group needed).
        self.device = self.comm.device if self.comm.world_size > 1 else ds_compat.storage_device(self.entries[0].param)
        self.sampler = (sampler or CurvZOSampler)(section(cfg, "sampler"), section(cfg, "engine"), self.sizes,
                                                  self.noise.mask_uniforms, cfg.perturbation)
        self.estimator = FiniteDifference(cfg.difference, cfg.step_normalization, cfg.zo_eps)
        self.rate = Rate(cfg.learning_rate, cfg.lr_scheduler_type, cfg.max_steps, cfg.plateau_factor,
                         cfg.plateau_patience)
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
        if self.topology.job.world_size > 1:  # RanksDisagree at once, not shards with inconsistent noise later
            check_ranks_agree(self.topology.job, {
                "config": dataclasses.asdict(cfg), "blocks": [(b.name, b.size) for b in self.blocks],
                "noise": self.noise.describe(), "kernel": self.noise.reference_digest(self.device)})
        corrected = ("" if METHOD_SPECS[Method(cfg.method)].every_block else
                     " x min pi per step (rate_correction=max_weight)" if cfg.rate_correction == "max_weight" else "")
        normalized = (f", step_normalization {cfg.step_normalization}" if cfg.step_normalization != "none" else "")
        log.info("ZOEngine: method %s, difference %s, num_directions %d%s, learning_rate %s%s (%s), zo_eps %g, "
                 "weight_decay %g; %d blocks, %d trainable parameters; perturbation %s, noise %s", cfg.method,
                 cfg.difference, cfg.num_directions, normalized, cfg.learning_rate, corrected, cfg.lr_scheduler_type,
                 cfg.zo_eps, cfg.weight_decay, self.num_blocks, self.num_params, cfg.perturbation, self.noise.ident)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def set_perturbation(self, perturbation: str) -> None:
        """Draw z of `perturbation` from now on (a resumed run keeps its checkpoint's: EngineState.load_state_dict):
        the config, the noise source and everything that holds it, and the sampler's moments. The same on every rank
        (each reads the same checkpoint)."""
        if perturbation == self.cfg.perturbation:
            return
        self.cfg = engine_config(dataclasses.replace(self.cfg, perturbation=perturbation), {})
        self.noise = NoiseSource(self.cfg.seed, self.cfg.perturbation)
        self.perturber.noise = self.noise
        self.sampler.perturbation = Perturbation(self.cfg.perturbation)
        self.sampler.schedule = section(self.cfg, "engine")
        self.sampler.mask_uniforms = self.noise.mask_uniforms

    def fit_static_mask(self, batches) -> StaticMask:
        """static_mask (docs/algorithm.md, "A static mask"): pick the top `cfg.static_mask` fraction of elements by
        one backprop per batch of `batches` (the first `static_mask_batches` training batches), and perturb only
        those from now on. Collective; call it once before the first step (the CLI does)."""
        self._check_static_mask_key()
        self.set_static_mask(fit_mask(self, batches, self.cfg.static_mask))
        log.info("static_mask: %d of %d trainable elements (%.4g%%) chosen by backprop on %d batches",
                 self.static_mask.selected, self.num_params, 100 * self.static_mask.selected / self.num_params,
                 len(batches))
        return self.static_mask

    def set_static_mask(self, mask: StaticMask) -> None:
        """Perturb and update only the elements of `mask` (a checkpoint's, or fit_static_mask's)."""
        self._check_static_mask_key()
        self.gather_persistent()
        self.static_mask = mask
        self.perturber = MaskedPerturber(mask, self.noise)

    def gather_persistent(self) -> None:
        """Under ZeRO-3, gather the persistent parameters as the first forward does, so that each one's region (all
        of it) can be read and written before any step: a static mask, or the checkpoint-0 a run saves first."""
        if self.partitioned:
            ds_compat.gather_persistent([e.param for e in self.entries])

    def _check_static_mask_key(self) -> None:
        """A static mask is the `static_mask` key's (whose validation states what it needs: method=mezo)."""
        if not self.cfg.static_mask:
            raise ValueError("a static mask needs the static_mask key: set static_mask to the fraction of elements "
                             "to perturb (and method=mezo) in the engine's config")

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, batch, stop_requested: bool | None = None) -> StepResult:
        """One update on `batch` (a MicroBatches of the global batch, or this rank's own batch).

        `stop_requested` (the CLI's pre-emption flag): summed over the ranks in the step's own all-reduce, so that
        every rank learns at the same step that one of them was asked to stop (`StepResult.stop`)."""
        self._check_step(batch)
        if self.rate.needs_choice:  # learning_rate: auto, where no one chose before the first step (the CLI does)
            self.choose_rate([batch])
        plan = self.sampler.plan(self.step_count)
        lr = self.rate.at(self.step_count) * plan.rate_scale
        info = self._describe(plan, lr)
        if plan.n_selected == 0:  # no block drawn: no forwards, no score update; the step is counted
            self._end_step(plan, None, None)
            return StepResult(plan.step + 1, None, None, None, None, skipped="empty_mask",
                              stop=self._agree(stop_requested), **info)
        evals, moved, at = self._perturb_and_forward(plan, batch)
        with self._section("reduce"):
            red = self._reduce(evals, batch, moved, stop_requested)
        est = self.estimator.estimate(red.losses)  # the finite difference: algo/differences.py
        info.update(stop=red.stop, loss_spread=est.loss_spread, loss_std=est.loss_std,
                    **(self.visibility.report(red.moved, plan.mask) if red.moved is not None else {}))
        if not est.finite:
            return self._skip_non_finite(plan, est, red.losses, info, at)
        self._update(plan, est, lr, at)
        self._end_step(plan, est.score_deltas, red.block_sq)  # the scores
        return StepResult(plan.step + 1, est.loss, est.loss_plus, est.loss_minus, est.delta, **info)

    @torch.no_grad()
    def choose_rate(self, batches: list) -> float:
        """learning_rate: auto (docs/algorithm.md, "The rate of a normalised step"): before the first step, for each
        of `cfg.auto_rate_probes` probes k (batch k mod len(batches)), the step's own direction u_k per unit rate
        (the first step's plan, probe k's own noise: the keys of step -1 - k, which no step uses) from its forwards;
        the batch loss at w, w - tau u_k and w + tau u_k gives the slope and curvature of the line; eta is
        algo/rate.py's `line_rate` of them, decided on job rank 0 and broadcast. The weights come back to w (values
        kept in a copy of w are written from it) and the estimator's state is left as it was. Collective; the
        step's forwards + 3 a probe; recorded in the state. The CLI calls it with the first train batches; step()
        calls it with its own batch where no one has."""
        cfg, q = self.cfg, self.cfg.num_directions
        tau = line_tau(cfg.step_normalization, q, cfg.zo_eps)
        log.info("learning_rate auto: measuring the rate along the step's direction on %d probes (%d forwards each)",
                 cfg.auto_rate_probes, self.estimator.spec.forwards(q) + 3)
        saved, timer, self.timer = self.estimator.state_dict(), self.timer, None  # no step's profile counts them
        first = self.sampler.plan(self.step_count)
        self.last_mask = first.mask
        moves, mixed = self._line_blocks()
        slopes, curvatures = [], []
        for k in range(cfg.auto_rate_probes):
            batch = batches[k % len(batches)]
            plan = dataclasses.replace(first, step=-1 - k)
            base = self.loss(batch)
            evals, moved, at = self._perturb_and_forward(plan, batch)
            est = self.estimator.estimate(self._reduce(evals, batch, moved).losses)
            if not est.finite:
                self.perturber.move(at, None)
                continue
            unit, keep = self.sampler.direction_updates(plan, est.deltas, plan.rate_scale)  # u: the step at rate 1
            unit = [c * moves for c in unit]  # LoRA: along the B factors only (_line_blocks)
            self.perturber.update([tau * c for c in unit], keep, at, 0.0, keep_copies=True)  # w - tau u
            down = self.loss(batch)
            self.perturber.line(unit, tau, -tau)  # w + tau u
            up = self.loss(batch)
            self.perturber.line(unit, -tau, 0.0)  # w
            if all(math.isfinite(x) for x in (base, down, up)):
                slopes.append((up - down) / (2 * tau))
                curvatures.append((up + down - 2 * base) / tau ** 2)
        self.estimator.load_state_dict(saved)
        self.timer = timer
        job = self.topology.job
        try:
            fix = LORA_MIXED_FIX if mixed else NUMBER_FIX
            chosen = line_rate(slopes, curvatures, cfg.auto_rate_fraction, fix) if job.rank == 0 else None
        except RateRefused as e:
            chosen = str(e)
        chosen = job.broadcast_object(chosen)  # every rank takes rank 0's rate (or its refusal)
        if isinstance(chosen, str):
            raise RateRefused(chosen)
        if chosen.greedy > 20 * tau:
            log.warning("learning_rate auto: the greedy rate %.4g is %.0fx the probe's span tau=%.3g: the line was "
                        "measured at +-tau only, so check the first evaluations (or set learning_rate)",
                        chosen.greedy, chosen.greedy / tau, tau)
        self.rate.choose(chosen.eta, chosen.reason, chosen.greedy)
        return chosen.eta

    def _line_blocks(self) -> tuple[torch.Tensor, bool]:
        """[G] 1.0 for the blocks the rate probe's line moves, 0.0 for those it holds: a LoRA adapter's A factors
        (blocks of lora_A / lora_embedding_A tensors only); and whether a block mixes A factors with other tensors.
        The adapter's product moves by dB A + B dA + dB dA; with B = 0 (a fresh adapter) the step's first order is
        dB A alone, and along the whole step the dB dA term makes the line concave (on SmolLM2 `sentiment`:
        curvature -0.76 per probe), so it has no greedy rate. Along the B factors the product moves linearly and the
        line has the model's own curvature. Layer blocks that mix A and B tensors move whole (a concave line's
        refusal then names block_granularity=tensor)."""
        factors = [[is_lora_a(self.entries[e].name) for e, _, _ in b.segments] for b in self.blocks]
        held = [all(f) for f in factors]
        if any(held):
            log.info("learning_rate auto: the probe's line holds the %d LoRA A-factor blocks (it runs along the B "
                     "factors, the step's first order on a fresh adapter)", sum(held))
        mixed = any(any(f) and not all(f) for f in factors)
        return torch.tensor([0.0 if h else 1.0 for h in held], dtype=torch.float64), mixed

    def _check_step(self, batch) -> None:
        check_batch(batch)
        if self.cfg.static_mask and self.static_mask is None:
            raise ValueError(f"static_mask={self.cfg.static_mask} needs its mask: call engine.fit_static_mask(batches) "
                             "before the first step (curvzo-ds train does)")

    def _describe(self, plan: StepPlan, lr: float) -> dict[str, Any]:
        """The StepResult fields that the plan decides; records the step's mask (state_hash reads it)."""
        self.last_mask = plan.mask
        fraction = (self.static_mask.selected / self.num_params if self.static_mask is not None
                    else plan.param_fraction(self.sizes))
        return dict(budget=plan.budget, n_selected=plan.n_selected, param_fraction=fraction,
                    max_inv_pi=plan.max_inv_pi, learning_rate=lr, d_eff=plan.d_eff, score_entropy=plan.entropy,
                    pi=plan.pi)

    def _perturb_and_forward(self, plan: StepPlan, batch) -> tuple[list, torch.Tensor | None, Point]:
        """Walk the step's chain of points w + o eps z_d, for d = 0 .. q-1 and the estimator's offsets o (central:
        +1, -1; rloo: +1), one move each (shard/perturb.py). Every replica group walks the whole chain, so that each
        point is the same bits whatever the grouping; a group runs the forwards of its own directions (d = its index
        mod the number of groups), with the block sums of z_d^2 at the first point when the method scores. Returns
        [(direction, block sums, [loss rows per point])], the visibility counts and the last point, where the
        weights are left."""
        replicas, replica = self.topology.replicas, self.topology.replica
        if replicas > 1 and not isinstance(batch, MicroBatches):
            raise ValueError("with replica groups, step() takes the global batch as MicroBatches (every group "
                             "evaluates the same data)")
        eps, q, perturber = self.cfg.zo_eps, self.cfg.num_directions, self.perturber
        # A step with several directions edits the same tables from its first pass to its last: persistent
        # parameters are gathered first, as the first forward would do, in every copy.
        if q > 1 and self.partitioned:
            ds_compat.gather_persistent([e.param for e in self.entries])
        perturber.begin(plan.step, plan.mask, q)
        evals, at = [], None
        with eval_mode(self.module):
            # The visibility counts come from direction 0 (replica group 0); the other groups send zeros.
            # A static mask writes its elements from fp32 values: no block to watch.
            watch = (self.visibility.watch(plan.step, perturber if replica == 0 else None)
                     if self.static_mask is None else None)
            moved = None if replica == 0 else self.visibility.moved(watch)
            for d in range(q):
                mine, rows, block_fixed = d % replicas == replica, [], None
                for i, offset in enumerate(self.estimator.offsets):
                    with self._section("perturb_stats" if i == 0 else "perturb"):
                        fixed = perturber.move(at, (d, offset * eps), stats=mine and i == 0 and self._drawn_stats)
                    at = (d, offset * eps)
                    if not mine:
                        continue
                    if i == 0:
                        block_fixed = fixed
                        if d == 0:
                            moved = self.visibility.moved(watch)
                    with self._section("forwards"):
                        rows.append(self._forwards(batch))
                if mine:
                    evals.append((d, block_fixed, rows))
        return evals, moved, at

    @property
    def _drawn_stats(self) -> bool:
        """Whether the passes count the block sums of z^2 for the scores: only a scored method with Gaussian z (with
        +-1 z the sum over a drawn block is its size, exactly: `_reduce` writes it without any pass or all-reduce
        work; the fixed-point sums the passes would return are those same numbers, bit for bit)."""
        return self.sampler.scored and not self.noise.rademacher

    def _forwards(self, batch) -> list[tuple[int, torch.Tensor]]:
        return run_forwards(self.model, self.loss_fn, batch, self.comm, self.device, self.partitioned)

    def _reduce(self, evals, batch, moved=None, stop_requested=None) -> Reduced:
        """The step's one all-reduce over every rank (all replica groups): reduce_step (forwards.py)."""
        red = reduce_step(self.topology.job, evals, slot_count(batch, self.comm.world_size),
                          directions=self.cfg.num_directions, evaluations=self.estimator.spec.points,
                          sums=self.num_blocks if self._drawn_stats else 0, blocks=self.num_blocks, moved=moved,
                          stop_requested=stop_requested, device=self.device)
        if self.sampler.scored and self.noise.rademacher:  # ||z_B||^2 = |B| for every direction (0 where not drawn)
            red.block_sq = torch.where(self.last_mask, self.sizes, 0.0).repeat(self.cfg.num_directions)
            if self.cfg.num_directions == 1:
                red.block_sq = red.block_sq[:self.num_blocks]
        return red

    def _skip_non_finite(self, plan: StepPlan, red: Estimate, losses: list[tuple[float, ...]], info: dict[str, Any],
                         at: Point) -> StepResult:
        """Move the weights back from the last point `at`, count the skip, stop at max_consecutive_skips. The
        warning names every direction's losses, one per evaluation point (offsets in units of eps)."""
        self.perturber.move(at, None)
        self._end_step(plan, None, None)
        self.skips_in_row += 1
        self.skipped_total += 1
        log.warning("step %d: non-finite loss (%s); weights restored, step skipped (%d in a row)",
                    plan.step + 1, describe_losses(self.estimator.offsets, losses), self.skips_in_row)
        if self.skips_in_row >= self.cfg.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{self.skips_in_row} consecutive steps had a non-finite loss (last at step {plan.step + 1}); "
                "lower learning_rate or zo_eps, or check the data and the model's dtype")
        return StepResult(plan.step + 1, _finite_or_none(red.loss), _finite_or_none(red.loss_plus),
                          _finite_or_none(red.loss_minus), None, skipped="non_finite_loss", **info)

    def _update(self, plan: StepPlan, est: Estimate, lr: float, at: Point) -> None:
        """The update of the weights from the last point `at` (the same pass undoes the perturbation)."""
        self.skips_in_row = 0
        with self._section("update"):
            coefs, keep = self.sampler.direction_updates(plan, est.deltas, lr, self.cfg.weight_decay)
            self.perturber.update(coefs, keep, at, self.cfg.weight_decay)

    def _section(self, name: str):
        return self.timer.section(name) if self.timer is not None else contextlib.nullcontext()

    def _end_step(self, plan: StepPlan, delta: list[float] | None, block_sq: torch.Tensor | None) -> None:
        """The sampler's scores learn from the step (or note a skipped one); the step is counted."""
        if delta is None:
            self.sampler.skip(plan)
        else:
            self.sampler.observe(plan, delta, block_sq)
        self.step_count = plan.step + 1

    def _agree(self, flag: bool | None) -> bool:
        """True on every rank if `flag` is set on any (a step without forwards has no all-reduce to carry it)."""
        job = self.topology.job
        return flag is not None and bool(job.all_reduce_sum_int64(torch.tensor([int(flag)], dtype=torch.int64)).item())

    @torch.no_grad()
    def loss(self, batch) -> float:
        """The loss of the current weights on `batch` (the step's reduction over the shard group, no perturbation)."""
        check_batch(batch)
        with eval_mode(self.module):
            local = self._forwards(batch)
        return reduce_step(self.comm, [(0, None, [local])], slot_count(batch, self.comm.world_size),
                           directions=1, evaluations=1, device=self.device).losses[0][0]


def describe_losses(offsets: tuple[int, ...], losses: list[tuple[float, ...]]) -> str:
    """Each direction's losses at its points: "L(+1)=0.69, L(-1)=nan" (central), "L_0(+1)=..., L_1(+1)=..." (q
    directions)."""
    several = len(losses) > 1
    return ", ".join(f"L{f'_{d}' if several else ''}({o:+d})={value:.6g}"
                     for d, row in enumerate(losses) for o, value in zip(offsets, row))


def _finite_or_none(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None
