"""The engine's forwards over micro-batches and the one reduction of their losses (docs/contracts.md).

`run_forwards`: this rank's share of a batch (micro-batch j on rank j mod W, zero-weight forwards where ZeRO-3's
collective gathers need them), each `loss_fn` result as a [loss_sum, count] float64 tensor on the reduction device,
with nothing read back to the host. `reduce_step`: a step's evaluations packed into its one all-reduce (StepPacket's
wire format, comm.py) and read back as the losses, block sums and flags that every rank shares; `ZOEngine.loss` uses
the same reduction for one unperturbed evaluation. `check_batch` and `slot_count`: what a batch may be and how
many loss slots it has; `eval_mode`: the module in eval mode for the forwards.
A loss is always `mean_loss` (data/losses.py): the sum of the loss sums over the sum of the counts, added in
float64 in micro-batch order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from curvzo_ds.data.losses import loss_parts, mean_loss
from curvzo_ds.data.stream import MicroBatches, round_robin_slots
from curvzo_ds.noise.gaussian import FIXED_POINT_BITS
from curvzo_ds.shard.comm import Comm, StepPacket


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """The body runs with `module` in eval mode (dropout would give the forwards of a step different masks);
    the mode it had is put back afterwards, also on an error."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def check_batch(batch) -> None:
    """A plain list is ambiguous (a list of micro-batches, or one batch that is a list): refuse it in one line."""
    if isinstance(batch, list):
        raise ValueError(f"step() got a plain list of {len(batch)} items: pass MicroBatches([...]) for micro-batches "
                         "(micro-batch j runs on rank j mod W; curvzo_ds.split_batch makes them), or a tuple or dict "
                         "for this rank's own batch")


def slot_count(batch, world_size: int) -> int:
    """The loss slots of a batch: one per micro-batch of a MicroBatches, else one per rank (its own batch)."""
    return len(batch.items) if isinstance(batch, MicroBatches) else world_size


def run_forwards(model, loss_fn, batch, comm: Comm, device, partitioned: bool) -> list[tuple[int, torch.Tensor]]:
    """This rank's (slot, [loss_sum, count] float64 on `device`). With MicroBatches, a rank that has no micro-batch
    in a round runs a zero-weight forward on the first one when the weights are partitioned, so that ZeRO-3's
    collective gathers stay in step. Nothing is read back to the host here."""
    w, r = comm.world_size, comm.rank
    if not isinstance(batch, MicroBatches):
        return [(r, _loss_row(loss_fn(model, batch), device))]
    items, out = batch.items, []
    for j in round_robin_slots(len(items), r, w):
        if j is not None:
            out.append((j, _loss_row(loss_fn(model, items[j]), device)))
        elif partitioned:
            loss_fn(model, items[0])  # zero weight: keeps ZeRO-3's collective gathers in step
    return out


def _loss_row(out, device) -> torch.Tensor:
    loss_sum, count = loss_parts(out)
    # A number becomes a device tensor by a fill (torch.full), never by a host-to-device copy that would wait.
    parts = [x.detach().to(device, torch.float64).reshape(()) if torch.is_tensor(x)
             else torch.full((), float(x), dtype=torch.float64, device=device) for x in (loss_sum, count)]
    return torch.stack(parts)


@dataclass
class Reduced:
    """What a step's all-reduce returns, the same on every rank: each direction's losses (one per evaluation of the
    direction, each a mean_loss over the micro-batch slots), the block sums of z^2 ([G] with one direction,
    [q * G] with q; zeros for MeZO), the counts of moved bf16/fp16 elements per block (visibility steps only), and
    whether some rank asked to stop. The estimate from the losses is algo.differences'."""

    losses: list[tuple[float, ...]]
    block_sq: torch.Tensor
    moved: torch.Tensor | None
    stop: bool


def reduce_step(comm: Comm, evals, slots: int, *, directions: int, evaluations: int, sums: int = 0, blocks: int = 0,
                moved: torch.Tensor | None = None, stop_requested: bool | None = None, device=None) -> Reduced:
    """The one all-reduce over `comm` of a step's `evals`, [(direction, its `sums` block sums of z^2, [loss rows of
    each of its `evaluations` evaluations])], the rows as run_forwards returns them: for each direction its block
    sums (`sums` = 0: none, as for MeZO, which reads no scores); with `moved`, the counts of moved bf16/fp16
    elements of the `blocks` blocks; the `evaluations` loss sums and the count of each direction and slot (the
    estimator's evaluation points, DifferenceSpec.points); with `stop_requested`, the stop flag. A direction whose
    rows do not number `evaluations` is refused, never packed short."""
    packet = StepPacket(directions, sums, slots, moved=blocks if moved is not None else 0,
                        stop=stop_requested is not None, device=device, points=evaluations)
    for d, block_fixed, rows in evals:
        if sums:
            packet.put_sums(d, block_fixed)
        if len(rows) != evaluations:
            raise ValueError(f"direction {d}: {len(rows)} evaluations, the estimator has {evaluations} points per "
                             "direction")
        for per_point in zip(*rows):
            slot = per_point[0][0]
            packet.put_losses(d, slot, [row for _, row in per_point])
    if moved is not None:
        packet.put_moved(moved)
    if stop_requested is not None:
        packet.put_stop(stop_requested)
    packet.all_reduce(comm)
    block_sq = (packet.block_sums().to(torch.float64) / 2.0**FIXED_POINT_BITS if sums
                else torch.zeros(directions * blocks, dtype=torch.float64))
    losses = [tuple(mean_loss((row[i], row[-1]) for row in rows) for i in range(evaluations))
              for rows in packet.losses()]
    return Reduced(losses, block_sq if directions > 1 else block_sq[:blocks], packet.moved(), packet.stop())
