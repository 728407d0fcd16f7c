"""What a ZOEngine saves, checks and restores (checkpoints) and what its ranks compare (state_hash): the step, the
sampler's and the estimator's state, the skip counters, the noise generator and the blocks. ZOEngine inherits it;
it reads the engine's fields and writes none but the restored ones."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from curvzo_ds.noise.gaussian import perturbation_of

log = logging.getLogger("curvzo_ds")


class EngineState:
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
            **self.estimator.state_dict(),
            "rate": self.rate.state_dict(),
            "skipped_total": self.skipped_total,
            "skips_in_row": self.skips_in_row,
            "noise": self.noise.describe(),
            "blocks": [b.name for b in self.blocks],
            "method": self.cfg.method,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError if a checkpoint's engine state cannot continue this engine (noise, blocks, seed). Another
        perturbation is no reason: load_state_dict takes the checkpoint's."""
        try:
            perturbation_of(state["noise"])
        except ValueError:
            raise ValueError(f"checkpoint noise {state['noise']} differs from this engine's "
                             f"{self.noise.describe()}: it was written by another noise generator; resume it with the "
                             "curvzo_ds version that wrote it") from None
        if list(state["blocks"]) != [b.name for b in self.blocks]:
            raise ValueError("checkpoint blocks differ from this model's trainable parameters "
                             "(another model, LoRA setting or block_granularity?)")
        if state["seed"] != self.cfg.seed:
            raise ValueError(f"checkpoint seed {state['seed']} differs from seed={self.cfg.seed}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state; its perturbation (from its noise record) replaces the configured one,
        with a log line when they differ: a resumed run keeps the z it was started with."""
        self.check_state(state)
        saved = perturbation_of(state["noise"]).value
        if saved != self.cfg.perturbation:
            log.info("resume: the checkpoint's run draws perturbation=%s; it keeps it (perturbation=%s is not "
                     "taken: a run's z stay of one law from its first step to its last)", saved, self.cfg.perturbation)
            self.set_perturbation(saved)
        self.step_count = int(state["step"])
        self.sampler.load_state_dict(state)
        self.estimator.load_state_dict(state)
        self.rate.load_state_dict(state.get("rate", {}))
        self.skipped_total = int(state["skipped_total"])
        self.skips_in_row = int(state["skips_in_row"])
