"""CurvZO's algorithm: the pure math, then the stateful sampler (paper Section 3); the score estimators are in
estimators.py.

Nothing here knows about ranks, models or DeepSpeed: every function takes and returns float64
tensors of length G (the number of blocks), so it can be read against the paper and tested on its
own. `CurvZOSampler` holds the state (scores, warm-up) and makes each step's decisions: pi, the
budget, the mask, the update coefficients of Eq. 28, and the score update. Equation, proposition
and appendix numbers are those of the typeset paper (numbered in one sequence); docs/algorithm.md
restates each rule with its number.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from curvzo_ds.algo.estimators import Perturbation, block_scores, informative_blocks

log = logging.getLogger(__name__)


class Method(str, enum.Enum):
    """The `method` key: how pi and the budget are chosen (docs/algorithm.md)."""

    CURVZO = "curvzo"  # pi from the scores, adaptive budget
    MEZO = "mezo"  # every block, every step (pi = 1)
    US_AB = "us_ab"  # uniform pi, adaptive budget
    FIXED = "fixed"  # pi from the scores, budget B = budget * G


def score_distribution(scores: torch.Tensor) -> torch.Tensor:
    """p_i = sqrt(S_i) / sum_j sqrt(S_j) (Sec. 3.3, after Eq. 19). Uniform when every score is 0."""
    root = scores.clamp(min=0).sqrt()
    total = root.sum()
    if not torch.isfinite(total) or total <= 0:
        return torch.full_like(scores, 1.0 / scores.numel())
    return root / total


def effective_support(scores: torch.Tensor) -> float:
    """d_eff = (sum sqrt S)^2 / sum S in [1, G] (Eq. 18). G when every score is 0."""
    s = scores.clamp(min=0)
    total = s.sum().item()
    if total <= 0 or not math.isfinite(total):
        return float(scores.numel())
    d_eff = s.sqrt().sum().item() ** 2 / total
    return min(max(d_eff, 1.0), float(scores.numel()))


def normalized_entropy(scores: torch.Tensor) -> float:
    """H = -(1/log G) sum p log p in [0, 1] with p from `score_distribution` (Eq. 19).

    G = 1 or all-zero scores give H = 1 (a flat distribution), docs/algorithm.md.
    """
    g = scores.numel()
    if g == 1 or not (scores.clamp(min=0).sum() > 0):
        return 1.0
    p = score_distribution(scores)
    nz = p[p > 0]
    h = -(nz * nz.log()).sum().item() / math.log(g)
    return min(max(h, 0.0), 1.0)


def adaptive_budget(scores: torch.Tensor, budget_min: float, budget_max: float,
                    alpha: float) -> tuple[float, float, float]:
    """B = B_min + (B_max - B_min)(alpha d_eff/G + (1 - alpha) H) (Eq. 20), in blocks.

    Returns (B, d_eff, H): the last two are the rule's inputs, logged for study.
    """
    g = scores.numel()
    d_eff = effective_support(scores)
    h = normalized_entropy(scores)
    b = budget_min + (budget_max - budget_min) * (alpha * d_eff / g + (1 - alpha) * h)
    return b, d_eff, h


def water_filling(weights: torch.Tensor, budget: float) -> torch.Tensor:
    """pi_i = min(1, c w_i) with sum pi = B (Problem (P2), Prop. 3.10 / Eq. 31; per coordinate: Prop. 3.4 / Eq. 16).

    `weights` are the sqrt-scores. Blocks clipped at 1 hand their excess to the rest. If the
    positive weights cannot absorb B even at 1 each, the remainder is spread evenly over the
    zero-weight blocks. B >= G gives all ones; all-zero weights give uniform pi = B/G.
    """
    g = weights.numel()
    w = weights.to(torch.float64).clamp(min=0)
    if budget >= g:
        return torch.ones(g, dtype=torch.float64)
    if budget <= 0:
        return torch.zeros(g, dtype=torch.float64)
    pos = w > 0
    n_pos = int(pos.sum())
    if n_pos == 0:
        return torch.full((g,), budget / g, dtype=torch.float64)
    if budget >= n_pos:
        # Every positive block at 1; the rest of the budget goes evenly to zero-weight blocks.
        pi = torch.where(pos, torch.ones_like(w), torch.full_like(w, (budget - n_pos) / (g - n_pos)))
        return pi
    # Sort descending; find the number k of clipped blocks such that c = (B - k) / sum(rest)
    # keeps every unclipped block below 1 and every clipped one at or above 1.
    order = torch.argsort(w, descending=True, stable=True)
    ws = w[order]
    tail = torch.flip(torch.cumsum(torch.flip(ws, [0]), 0), [0])  # tail[k] = sum ws[k:]
    pi_sorted = torch.empty_like(ws)
    for k in range(n_pos):
        c = (budget - k) / tail[k].item()
        if ws[k].item() * c <= 1.0:
            pi_sorted[:k] = 1.0
            pi_sorted[k:] = (ws[k:] * c).clamp(max=1.0)
            break
    pi = torch.empty_like(w)
    pi[order] = pi_sorted
    return pi


def mix_floor(pi: torch.Tensor, budget: float, gamma: float) -> torch.Tensor:
    """pi = (1 - gamma) pi_curv + gamma B/G (docs/algorithm.md): keeps sum pi = B and pi >= gamma B/G.

    The floor keeps every block reachable, bounds the Horvitz-Thompson weight 1/pi by
    G/(gamma B), and lets a block whose score decayed be found again.
    """
    g = pi.numel()
    return ((1 - gamma) * pi + gamma * min(budget, g) / g).clamp(max=1.0)


def inclusion_probabilities(scores: torch.Tensor, budget: float, gamma: float) -> torch.Tensor:
    """pi proportional to sqrt(S) by water-filling, then mixed with the uniform floor."""
    return mix_floor(water_filling(scores.clamp(min=0).sqrt(), budget), budget, gamma)


def budget_for_param_fraction(scores: torch.Tensor, sizes: torch.Tensor, fraction: float, gamma: float) -> float:
    """The block budget B whose pi perturbs `fraction` of all parameters in expectation.

    Used when `budget_unit = params` (the paper's ablation B = rho d counts parameters).
    sum_i pi_i(B) n_i is increasing in B, so bisection finds B.
    """
    sizes = sizes.to(torch.float64)
    target = fraction * sizes.sum().item()
    lo, hi = 0.0, float(scores.numel())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if (inclusion_probabilities(scores, mid, gamma) * sizes).sum().item() < target:
            lo = mid
        else:
            hi = mid
    return hi


def rate_scale(pi: torch.Tensor, correction: str) -> float:
    """The learning rate's factor for a step with inclusion probabilities `pi` (docs/algorithm.md §2).

    `none`: 1 (the paper's). `max_weight`: min_i pi_i = 1 / max_i (1/pi_i). Under a curvature that follows the
    gradient energy (h = e), the step's second moment is J(pi) <= max_i (1/pi_i) J(1) for every energy layout (equal
    when the energy sits in the least-drawn block), so this factor keeps the quadratic term of every step at or
    below MeZO's: the step is stable wherever MeZO's rate is. It does not depend on the energies, which a ZO run
    does not know, and so it is conservative where they are spread."""
    return float(pi.min()) if correction == "max_weight" else 1.0


def ema(scores: torch.Tensor, new: torch.Tensor, beta: float) -> torch.Tensor:
    """S_i <- (1 - beta) S_i + beta s~_i (Eq. 8). Non-finite inputs leave S unchanged."""
    if not torch.isfinite(new).all():
        return scores
    return (1 - beta) * scores + beta * new


# ----------------------------------------------------------------------------------------------------
# The stateful sampler: everything CurvZO decides between two forwards, in one place.


@dataclass
class StepPlan:
    """What step t perturbs (docs/algorithm.md, steps 1-3)."""

    step: int  # 0-based update number
    pi: torch.Tensor  # [G] float64 inclusion probabilities
    budget: float  # B, in blocks
    d_eff: float | None  # the adaptive budget rule's inputs (None for MeZO and fixed)
    entropy: float | None
    mask: torch.Tensor  # [G] bool: the blocks drawn this step, the same on every rank
    warmup: bool  # a score warm-up step (uniform pi, scores summed rather than averaged)
    rate_scale: float = 1.0  # the learning rate's factor this step (`rate_correction`)

    @property
    def n_selected(self) -> int:
        return int(self.mask.sum())

    def param_fraction(self, sizes: torch.Tensor) -> float:
        """The expected fraction of parameters perturbed: sum_i pi_i n_i / sum_i n_i."""
        return float((self.pi * sizes).sum() / sizes.sum())

    @property
    def max_inv_pi(self) -> float:
        """The largest Horvitz-Thompson weight 1/pi_i."""
        return float((1.0 / self.pi).max())


class Probabilities(NamedTuple):
    """What the scores give for one step: pi [G] float64, the budget B (blocks), and the budget rule's inputs d_eff
    and H (None where the method has no adaptive budget)."""

    pi: torch.Tensor
    budget: float
    d_eff: float | None
    entropy: float | None


# The methods, one row each: the budget rule gives (fraction of G, d_eff, H), the pi rule turns the fraction into
# (pi, B in blocks). Both take the sampler (its cfg, scores, sizes and number of blocks G).

def _every_block(sampler: CurvZOSampler) -> tuple[float, None, None]:
    return 1.0, None, None


def _fixed_budget(sampler: CurvZOSampler) -> tuple[float, None, None]:
    """B = budget G: the `budget` key."""
    return sampler.cfg.budget, None, None


def _adaptive_budget(sampler: CurvZOSampler) -> tuple[float, float, float]:
    """B of Eq. 20 from the scores, with d_eff and H."""
    cfg, g = sampler.cfg, sampler.num_blocks
    b, d_eff, h = adaptive_budget(sampler.scores, cfg.budget_min * g, cfg.budget_max * g, cfg.budget_alpha)
    return b / g, d_eff, h


def _all_ones(sampler: CurvZOSampler, fraction: float) -> tuple[torch.Tensor, float]:
    """pi = 1 and B = G (MeZO)."""
    g = sampler.num_blocks
    return torch.ones(g, dtype=torch.float64), float(g)


def _uniform_pi(sampler: CurvZOSampler, fraction: float) -> tuple[torch.Tensor, float]:
    """pi_i = B/G on every block (also every method's score warm-up)."""
    g = sampler.num_blocks
    return torch.full((g,), fraction, dtype=torch.float64), fraction * g


def _score_pi(sampler: CurvZOSampler, fraction: float) -> tuple[torch.Tensor, float]:
    """pi ∝ sqrt(S) by water-filling with the floor; B counts blocks, or parameters with budget_unit=params."""
    cfg, g = sampler.cfg, sampler.num_blocks
    if cfg.budget_unit == "params":
        b = budget_for_param_fraction(sampler.scores, sampler.sizes, fraction, cfg.budget_floor)
    else:
        b = fraction * g
    return inclusion_probabilities(sampler.scores, b, cfg.budget_floor), b


class MethodSpec(NamedTuple):
    """One method: its budget rule, its pi rule, and what it needs from the scores."""

    budget: Callable[[CurvZOSampler], tuple[float, float | None, float | None]]  # (B/G, d_eff, H)
    pi: Callable[[CurvZOSampler, float], tuple[torch.Tensor, float]]  # (pi, B) from B/G
    scored: bool  # measures the block scores at all (MeZO never reads them)
    follows_scores: bool  # pi follows the scores: a score warm-up first, and budget_floor=0 can make pi = 0 absorbing

    @property
    def every_block(self) -> bool:
        """pi = 1 for every block at every step: nothing to log as pi (pi.jsonl), no min pi to correct the rate by."""
        return self.pi is _all_ones


METHOD_SPECS: dict[Method, MethodSpec] = {
    Method.CURVZO: MethodSpec(_adaptive_budget, _score_pi, scored=True, follows_scores=True),
    Method.MEZO: MethodSpec(_every_block, _all_ones, scored=False, follows_scores=False),
    Method.US_AB: MethodSpec(_adaptive_budget, _uniform_pi, scored=True, follows_scores=False),
    Method.FIXED: MethodSpec(_fixed_budget, _score_pi, scored=True, follows_scores=True),
}


class CurvZOSampler:
    """The scores S, the score warm-up, the EMA, the method and the budget rule (paper Sec. 3).

    - `plan(step)`: pi from the scores after step - 1 (causal), the budget B and its inputs, and the
      block mask from uniforms that are the same on every rank;
    - `update_coefficients(plan, delta, lr, weight_decay)`: Eq. 28's Horvitz-Thompson step per block;
    - `direction_updates(plan, deltas, lr, weight_decay)`: the same for the q directions of a step (lr/q each);
    - `observe(plan, delta, block_sq)`: the block scores of a finished step into S (warm-up sum or EMA);
    - `skip(plan)`: a step that ended without a score (empty mask, non-finite loss).
    Methods: "curvzo" (adaptive B), "fixed" (B = budget G), "us_ab" (uniform pi, adaptive B), "mezo"
    (pi = 1), one row each of METHOD_SPECS. Nothing here knows about ranks or models: all state is G floats,
    replicated.
    """

    def __init__(self, cfg, schedule, sizes: torch.Tensor, mask_uniforms: Callable[[int, int], torch.Tensor],
                 perturbation: str | Perturbation = Perturbation.GAUSSIAN):
        """`cfg`: the config's `sampler` section (config.sections: method, the budget rule, the scores);
        `schedule`: its `engine` section (unused: the rate is algo/rate.py's `Rate`, the engine's; kept so that the
        sampler is built from the same two sections everywhere). Any object with those attributes serves.
        `perturbation`: the law of z, whose fourth moment the score estimators' constants carry."""
        self.cfg = cfg
        self.perturbation = Perturbation(perturbation)
        self.schedule = schedule
        self.sizes = sizes.to(torch.float64)
        self.num_blocks = self.sizes.numel()
        self.mask_uniforms = mask_uniforms
        init = 0.0 if cfg.score_init == "warmup" else float(cfg.score_init)
        self.scores = torch.full((self.num_blocks,), init, dtype=torch.float64)
        self.warmup_sum = torch.zeros(self.num_blocks, dtype=torch.float64)
        self.spec = METHOD_SPECS[Method(cfg.method)]
        self.scored = self.spec.scored
        self._logged_scale: float | None = None  # the last rate correction logged (plan)
        if cfg.budget_floor == 0 and self.spec.follows_scores:
            log.warning("budget_floor=0 is the paper's literal rule: a block whose pi reaches 0 is never drawn "
                        "again (pi = 0 is absorbing). A floor > 0 is recommended.")

    def in_warmup(self, step: int) -> bool:
        cfg = self.cfg
        return cfg.score_init == "warmup" and step < cfg.score_warmup_steps and self.spec.follows_scores

    def probabilities(self, step: int) -> Probabilities:
        """pi, B, d_eff and H for `step` from the current scores: the method's row of METHOD_SPECS (a warm-up step
        of a method whose pi follows the scores samples uniformly at the rule's budget instead)."""
        fraction, d_eff, h = self.spec.budget(self)
        pi, b = (_uniform_pi if self.in_warmup(step) else self.spec.pi)(self, fraction)
        return Probabilities(pi, b, d_eff, h)

    def plan(self, step: int) -> StepPlan:
        pi, budget, d_eff, h = self.probabilities(step)
        mask = self.mask_uniforms(step, self.num_blocks) < pi
        scale = rate_scale(pi, self.cfg.rate_correction)
        if scale != 1.0 and (self._logged_scale is None or not 0.5 < scale / self._logged_scale < 2):
            self._logged_scale = scale  # the rate the step takes, never silently: at its first use and each 2x
            log.info("rate_correction=max_weight: step %d takes the learning rate x min pi %.4g (set "
                     "rate_correction=none for the paper's step at the rate as given; docs/algorithm.md §2)",
                     step + 1, scale)
        return StepPlan(step, pi, budget, d_eff, h, mask, self.in_warmup(step), scale)

    def update_coefficients(self, plan: StepPlan, delta: float, lr: float,
                            weight_decay: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 28 with Horvitz-Thompson weights: w_i <- keep_i w_i - coef_i z_i for a selected block i.

        (coef, keep): coef_i = lr Delta / pi_i, the step's coefficient of z; keep_i = 1 - lr wd / pi_i (MeZO-style
        decay, unbiased for the same reason as the step). Both are 0 and 1 for unselected blocks. float64 [G] each.
        """
        coef = torch.where(plan.mask, lr * delta / plan.pi, torch.zeros_like(plan.pi))
        keep = torch.where(plan.mask, 1.0 - lr * weight_decay / plan.pi, torch.ones_like(plan.pi))
        return coef, keep

    def direction_updates(self, plan: StepPlan, deltas: list[float], lr: float,
                          weight_decay: float = 0.0) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The q directions of one step: ([coef_d] per direction, keep): Eq. 28's coefficients of z_d with rate
        lr/q (the update is the mean of the q estimates, applied in one pass), and the decay factor, applied once."""
        q = len(deltas)
        keep = self.update_coefficients(plan, 0.0, lr, weight_decay)[1]
        return [self.update_coefficients(plan, x, lr / q)[0] for x in deltas], keep

    def observe(self, plan: StepPlan, delta: float | list[float], block_sq: torch.Tensor) -> None:
        """Fold the step's block scores (Eq. 27 by default) into S: summed during warm-up, else EMA (Eq. 8).

        With q directions (num_directions), `delta` is a list of q values and `block_sq` is [q, G]: the step's
        score is the mean of the q per-direction scores, which keeps the estimator's mean and divides its
        variance by about q (docs/algorithm.md). Under +-1 z, a block whose estimator says nothing about it
        (Appendix B's at pi_i = 1: `informative_blocks`) keeps its score through the EMA (during the warm-up it adds
        the estimator's 0)."""
        deltas = delta if isinstance(delta, list) else [delta]
        rows = block_sq.reshape(len(deltas), -1)
        estimator = self.cfg.score_estimator
        new = sum(block_scores(d, sq, plan.mask, plan.pi, self.sizes, estimator, self.perturbation)
                  for d, sq in zip(deltas, rows)) / len(deltas)
        if plan.warmup:
            self.warmup_sum += new
        else:
            updated = ema(self.scores, new, self.cfg.score_beta)
            if self.perturbation is not Perturbation.GAUSSIAN:  # +-1 z: a block at pi = 1 keeps its score
                updated = torch.where(informative_blocks(plan.pi, self.sizes, estimator, self.perturbation), updated,
                                      self.scores)
            self.scores = updated
        self._end(plan)

    def skip(self, plan: StepPlan) -> None:
        """A step that gave no score (empty mask or non-finite loss): S is unchanged, but a warm-up still ends."""
        self._end(plan)

    def _end(self, plan: StepPlan) -> None:
        """The last warm-up step, even a skipped one, ends with S := the mean observed score."""
        if plan.warmup and plan.step + 1 == self.cfg.score_warmup_steps:
            self.scores = self.warmup_sum / self.cfg.score_warmup_steps

    def state_dict(self) -> dict:
        return {"scores": self.scores.clone(), "warmup_sum": self.warmup_sum.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.scores = torch.as_tensor(state["scores"], dtype=torch.float64).clone()
        self.warmup_sum = torch.as_tensor(state["warmup_sum"], dtype=torch.float64).clone()
