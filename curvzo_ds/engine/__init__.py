"""ZOEngine: one CurvZO (or baseline) step on a plain module or a DeepSpeed engine.

The algorithm's decisions (pi, the budget, the mask, the update coefficients, the scores) are the
sampler's (algo/sampling.py), the finite difference (where the forwards evaluate, what their losses give, the
step's normalisation) the estimator's (algo/differences.py). The engine does the rest of a step
(docs/algorithm.md, docs/deepspeed.md):
1. each rank walks the step's chain of points w + o eps z_d (d = 0 .. q-1, the estimator's offsets o: central +1
   then -1, rloo +1), one pass over the part of each selected tensor it edits per point (its ZeRO-3 shard, or the
   whole tensor where a gathered replica must follow), computing the fixed-point sums of z_d^2 over the part it
   owns at a direction's first point (methods that read scores); forwards of its micro-batches at every point of
   the directions its replica group evaluates;
2. one all-reduce of int64 values: the block sums (none for MeZO), each micro-batch's loss sums and count, and, on
   visibility steps or with a stop request, the moved-element counts and the stop flag;
3. every rank computes the same estimate and applies the same update in one pass, which also undoes the last
   point, so a MeZO step generates each selected element's noise three times, not four, and a step of q
   directions reads its weights q + 1 times (rloo; central 2q + 1).
A step computes no gradient and holds no optimizer state; the only whole parameters it gathers are those that
ZeRO-3 gathers anyway (each forward's layers, and the small persistent tensors). Only `fit_static_mask`
(static_mask) runs backprops: one per probe batch, once before training, each gradient moved into an fp32
accumulator of the rank's region and freed (shard/mask.py). The passes over the weights are the Perturber's
(shard/perturb.py), the forwards and the all-reduce of their losses shard/forwards.py's (StepPacket's wire
format, shard/comm.py), the bf16/fp16 visibility check VisibilityMonitor's (shard/visibility.py), and which
ranks share what the Topology's (shard/distributed.py). `core`: ZOEngine; `result`: StepResult and StepTimer.
"""

from curvzo_ds.engine.core import ZOEngine
from curvzo_ds.engine.result import LossFn, StepResult, StepTimer

__all__ = ["ZOEngine", "StepResult", "StepTimer", "LossFn"]
