"""`PlainRun`: a one-process run on a plain model (no DeepSpeed, no process group), for `curvzo-ds diagnose` and
experiments/. Its Job is `build_plain`'s, so its steps are those of a one-rank `curvzo-ds train`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from curvzo_ds.algo.sampling import CurvZOSampler
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.data.stream import MicroBatches
from curvzo_ds.shard.forwards import eval_mode


class PlainRun:
    """The task, the data stream, the engine and the evaluation of one process.

    train/build.py's `build_plain` builds the model, data and batches exactly as `curvzo-ds train` does for one rank
    (the same presets, splits, micro-batches and loss). Two seams, so that a caller need not write the engine's or the
    evaluator's internals: `sampler` (ZOEngine's: what makes the sampler) and `add_split` (the evaluator's). It adds
    `block_energy`, the first-order ground truth of a batch.
    """

    def __init__(self, cfg: TrainConfig, sampler: Callable[..., CurvZOSampler] | None = None,
                 device: str | torch.device = "cpu"):
        # Imported here: the CLI imports commands/diagnose.py, which imports this module, to build its parser, and
        # the build brings transformers and DeepSpeed.
        from curvzo_ds.train.build import build_plain

        self.job = job = build_plain(cfg, sampler=sampler, device=device)
        self.cfg, self.task, self.tokenizer = job.cfg, job.task, job.tokenizer
        self.train_data, self.eval_data = job.train_data, job.eval_data
        self.model, self.engine = job.model, job.engine
        # the engine's loss: a micro-batch as the CPU holds it, moved to the model's device
        self.loss = job.engine.loss_fn

    def batch(self, step: int) -> MicroBatches:
        return self.job.batch(step)

    def add_split(self, name: str, examples: list[dict]) -> None:
        """Evaluate `examples` (encoded, as `eval_data`'s are) as the split `name`."""
        self.job.evaluator.add_split(name, examples)

    def evaluate(self, split: str) -> dict:
        return self.job.evaluate(split)

    def block_energy(self, batch: MicroBatches) -> torch.Tensor:
        """||g_i||^2 per block of the gradient of the batch's mean loss (the loss the step's Delta differentiates),
        by backprop in eval mode (no dropout), as the engine's forwards run."""
        module = self.model
        module.zero_grad(set_to_none=True)
        with eval_mode(module), torch.enable_grad():
            sums = [self.loss(module, mb) for mb in batch.items]
            (sum(s for s, _ in sums) / sum(float(c) for _, c in sums)).backward()
        entries = self.engine.entries
        out = torch.zeros(self.engine.num_blocks, dtype=torch.float64)
        for b, block in enumerate(self.engine.blocks):
            for ei, lo, hi in block.segments:
                grad = entries[ei].param.grad
                if grad is not None:
                    out[b] += grad.detach().reshape(-1)[lo:hi].double().pow(2).sum().item()
        module.zero_grad(set_to_none=True)
        return out
