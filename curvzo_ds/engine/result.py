"""What a step reports (`StepResult`, one metrics.jsonl line) and where its time goes (`StepTimer`)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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
    loss_spread: float | None = None  # difference=rloo: max - min of the step's q direction losses
    loss_std: float | None = None  # step_normalization=loss_std: sigma, the standard deviation of the q losses
    stop: bool = False  # with step(batch, stop_requested=...): some rank asked to stop (not a metric)
    pi: torch.Tensor | None = None  # [G] the inclusion probabilities this update drew from (not a metric)

    def as_dict(self) -> dict[str, Any]:
        """The metrics.jsonl fields (docs/outputs.md)."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ("stop", "pi"))
        return {k: v for k, v in values if v is not None or k in ALWAYS}


# metrics.jsonl's train lines always carry these (docs/contracts.md), null where not finite or not measured
ALWAYS = ("loss", "loss_plus", "loss_minus", "projected_grad")
LossFn = Callable[[Any, Any], Any]


class StepTimer:
    """Wall time per section of `ZOEngine.step`, for benchmarks: `engine.timer = StepTimer()`.

    Sections: "perturb_stats" (the move to a direction's first point, with the score statistics when the method
    has them), "perturb" (a move to another point of the same direction: -2 eps z for central), "forwards",
    "reduce" (the all-reduce and its read-back), "update" (the update, which also undoes the last point in the same
    pass).
    `sync` (torch.cuda.synchronize on a GPU) runs at each edge.
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
