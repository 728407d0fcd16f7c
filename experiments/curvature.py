"""Which curvature model a model supports (docs/algorithm.md §2): per block, Hutchinson's diagonal Hessian against
the gradient energy (experiments/real_model.py's table)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from curvzo_ds.jsonio import write_json_atomic
from curvzo_ds.train.plain import PlainRun
from experiments.core import digest
from experiments.smollm import DATA, base_config


def block_curvature(run: PlainRun, batches: int, samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, e) per block over the first `batches` training batches: h_i the mean diagonal Hessian entry of block i
    by Hutchinson's estimator, sum over Rademacher v of v_i . (H v)_i / n_i (`samples` Hessian-vector products by
    double backprop per batch), and e_i = ||g_i||^2 / n_i the per-element gradient energy of the same batches."""
    engine = run.engine
    params = [e.param for e in engine.entries]
    owner = [block.segments[0][0] for block in engine.blocks]
    gen = torch.Generator().manual_seed(seed)
    run.model.set_attn_implementation("eager")  # SDPA's CPU kernels have no double backward
    h = torch.zeros(engine.num_blocks, dtype=torch.float64)
    energy = torch.zeros(engine.num_blocks, dtype=torch.float64)
    run.model.eval()
    for t in range(batches):
        batch = run.batch(t)
        energy += run.block_energy(batch)
        with torch.enable_grad():
            sums = [run.loss(run.model, mb) for mb in batch.items]
            loss = sum(s for s, _ in sums) / sum(float(c) for _, c in sums)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for _ in range(samples):
                vs = [torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1 for p in params]
                hv = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
                for b, ei in enumerate(owner):
                    h[b] += (vs[ei] * hv[ei]).sum().double()
    return h / (batches * samples) / engine.sizes, energy / batches / engine.sizes


def curvature_table(plan: dict, model: str, tasks: dict, out: str) -> list[str]:
    """Which curvature model the model supports (docs/algorithm.md §2): flat (h independent of e) or h ∝ e (the
    Fisher): the slope of log h on log e over the blocks, and their correlation (cached)."""
    task = plan["tasks"][0]
    key = digest(dict(model=os.path.basename(model), task=task, data=DATA, curvature=plan["curvature"]))
    path = os.path.join(out, "diagnose", f"curvature-{key}.json")
    if not os.path.exists(path):
        torch.set_num_threads(1)
        run = PlainRun(base_config(model, tasks[task], 1e-6, 0, 1, method="mezo"))
        h, e = block_curvature(run, *plan["curvature"])
        write_json_atomic(path, dict(names=[b.name for b in run.engine.blocks], sizes=run.engine.sizes.tolist(),
                                     h=h.tolist(), e=e.tolist()))
    with open(path) as f:
        rec = json.load(f)
    h, e, n = (np.array(rec[k]) for k in ("h", "e", "sizes"))
    top = np.argsort(-h)[:3]
    lines = [f"Curvature: task {task}, Hutchinson's diagonal (batches, samples) = {tuple(plan['curvature'])}, "
             f"{len(h)} blocks ({os.path.basename(path)}); largest h: "
             + ", ".join(f"{rec['names'][i]} {h[i]:.3g}" for i in top) + ".", "",
             "| blocks | how many | slope of log h on log e | corr(log h, log e) | corr(log h, log n) | sd(log h) | "
             "sd(log e) |", "|---|---:|---:|---:|---:|---:|---:|"]
    # Matrices and vectors apart too: across all blocks, both h and e are larger per element in the small vectors.
    for label, keep, hh in (("h > 0", h > 0, h), ("h > 0, matrices (n > 10^4)", (h > 0) & (n > 1e4), h),
                            ("h > 0, vectors", (h > 0) & (n <= 1e4), h), ("all, by abs(h)", h != 0, np.abs(h))):
        keep &= e > 0
        lh, le, ln = np.log(hh[keep]), np.log(e[keep]), np.log(n[keep])
        fit = keep.sum() > 2
        slope = np.polyfit(le, lh, 1)[0] if fit else math.nan
        corr = [np.corrcoef(x, lh)[0, 1] if fit and x.std() > 1e-9 else math.nan for x in (le, ln)]
        lines.append(f"| {label} | {int(keep.sum())} of {len(h)} | {slope:+.2f} | {corr[0]:+.2f} | {corr[1]:+.2f} | "
                     f"{lh.std():.2f} | {le.std():.2f} |")
    return lines
