"""Accumulating 4 micro-batches equals one batch 4x larger (issue 8; docs/architecture.md).

Both runs see the same 8 examples per step, the same noise and the same blocks. The loss of a
step is sum(loss_sum) / sum(count) either way; what differs is arithmetic, not the method:
each micro-batch is padded to its own longest sequence, the big batch to the longest of all,
and the per-example float64 losses are added in a different grouping. So the runs agree to
within fp32 rounding of the forwards, not bitwise. The bounds below are set from that before
running anything:
  - losses: relative 1e-5. A forward of this 2-layer fp32 model rounds at relative ~6e-8 per
    operation, and a few dozen operations in sequence stay far below 1e-5.
  - projected gradient: |L+ - L-| / (2 eps) moves by at most 2 * 1e-5 * L / (2 eps).
  - weights after T steps: |dw| <= sum_t lr * dg_t * max(1/pi) * max|z|, with max|z| < 6 (fp32 normal draws
    over ~10^5 elements stay below 6 with overwhelming probability).
A control run on other examples must differ by far more than these bounds.
"""

import torch

from curvzo_ds import MicroBatches, ZOEngine
from curvzo_ds import data as D
from curvzo_ds.tasks import demo_model_config, get_task, load_splits
from curvzo_ds.tasks.demo import load_tokenizer

STEPS, EPS, LR = 6, 1e-2, 1e-3
REL_LOSS = 1e-5


def _setup():
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer("llama")
    task = get_task("demo")
    train = load_splits(task, 0, 16 * STEPS, 8, 8)["train"]
    encoded = [D.encode(task, tok, ex, 128, True) for ex in train]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(demo_model_config("llama"))
    return tok, encoded, model


def _run(model_state, model, encoded, pad_id, group_size: int, offset: int = 0):
    model.load_state_dict(model_state)
    engine = ZOEngine(model, D.classification_loss, method="curvzo", learning_rate=LR, zo_eps=EPS, seed=3,
                      score_warmup_steps=2)
    results = []
    for t in range(STEPS):
        ex = encoded[offset + 8 * t: offset + 8 * t + 8]
        parts = [D.collate(ex[i:i + group_size], pad_id) for i in range(0, 8, group_size)]
        batch = MicroBatches(parts) if len(parts) > 1 else parts[0]
        results.append(engine.step(batch))
    weights = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    return results, weights


def test_four_micro_batches_equal_one_batch_four_times_larger():
    tok, encoded, model = _setup()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lengths = {len(e["input_ids"][0]) for e in encoded[:8 * STEPS]}
    assert len(lengths) > 1, "the examples must have different lengths, so the padding differs"

    acc, w_acc = _run(state, model, encoded, tok.pad_token_id, group_size=2)
    big, w_big = _run(state, model, encoded, tok.pad_token_id, group_size=8)
    other, w_other = _run(state, model, encoded, tok.pad_token_id, group_size=8, offset=8 * STEPS)

    dw_bound = 0.0
    for a, b in zip(acc, big):
        assert a.n_selected == b.n_selected  # the budget moves with the scores by rounding; the draw must not
        for key in ("loss_plus", "loss_minus"):
            x, y = getattr(a, key), getattr(b, key)
            assert abs(x - y) <= REL_LOSS * abs(y), (a.step, key, x, y)
        dg = 2 * REL_LOSS * max(a.loss_plus, a.loss_minus) / (2 * EPS)
        assert abs(a.projected_grad - b.projected_grad) <= dg, (a.step, a.projected_grad, b.projected_grad)
        dw_bound += LR * dg * a.max_inv_pi * 6.0  # the update is lr * g / pi * z
    assert (w_acc - w_big).abs().max().item() <= dw_bound
    # Control: other examples move the weights by far more than the bound, so the check has teeth.
    assert (w_other - w_big).abs().max().item() > 10 * dw_bound
