"""What a ZOEngine saves, checks and restores (checkpoints) and what its ranks compare (state_hash): the step, the
sampler's and the estimator's state, the skip counters, the noise generator and the blocks. ZOEngine inherits it;
it reads the engine's fields and writes none but the restored ones."""

from __future__ import annotations

import hashlib
from typing import Any


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
        self.estimator.load_state_dict(state)
        self.rate.load_state_dict(state.get("rate", {}))
        self.skipped_total = int(state["skipped_total"])
        self.skips_in_row = int(state["skips_in_row"])
