"""static_mask (curvzo_ds/shard/mask.py): the backprop probe's choice, the masked step, and an exact resume. The same
trajectory at 1, 2 and 3 ZeRO-3 ranks is tests/test_zero3.py's "static_mask" scenario."""

import json
import subprocess
import sys

import pytest
import torch

from curvzo_ds import MicroBatches, ZOConfig, ZOEngine
from curvzo_ds.checkpoint.manager import load_checkpoint, save_checkpoint
from curvzo_ds.cli import main
from curvzo_ds.errors import ConfigError
from curvzo_ds.shard.digest import params_digest
from tests.toys import TinyNet, ce_loss, toy_task

X, Y = toy_task(256)


def batch(t: int) -> MicroBatches:
    """Step t's global batch: two micro-batches of 16 examples."""
    at = 32 * (t % 8)
    return MicroBatches([(X[at: at + 16], Y[at: at + 16]), (X[at + 16: at + 32], Y[at + 16: at + 32])])


def engine(fraction=0.05, **kw) -> ZOEngine:
    torch.manual_seed(0)
    cfg = dict(method="mezo", learning_rate=1e-2, zo_eps=1e-3, max_steps=10, seed=3, static_mask=fraction)
    return ZOEngine(TinyNet(), ce_loss, ZOConfig(**{**cfg, **kw}))


def test_the_probe_keeps_the_largest_squared_batch_gradients():
    zo = engine(0.05)
    mask = zo.fit_static_mask([batch(0), batch(1)])
    assert all(e.param.grad is None for e in zo.entries)  # the probe leaves no gradient behind
    # The same statistic by a plain backward of each batch's mean loss, on the concatenated batch.
    squared = [torch.zeros(e.numel, dtype=torch.float64) for e in zo.entries]
    for t in (0, 1):
        zo.module.zero_grad()
        x = torch.cat([mb[0] for mb in batch(t).items])
        y = torch.cat([mb[1] for mb in batch(t).items])
        loss_sum, count = ce_loss(zo.module, (x, y))
        (loss_sum / count).backward()
        for s, e in zip(squared, zo.entries):
            s += e.param.grad.reshape(-1).double() ** 2
    k = round(0.05 * zo.num_params)
    assert k <= mask.selected <= k + 2  # ties at the k-th value are all kept (2 classes: pairs of equal squares)
    kth = torch.cat(squared).topk(k).values[-1]
    for s, idx in zip(squared, mask.index):
        assert (s[idx] >= kth * (1 - 1e-4)).all()  # every chosen element is among the k largest
        assert int((s > kth * (1 + 1e-4)).sum()) <= len(idx)  # and none of the clearly larger ones is left out


def test_a_step_moves_only_the_chosen_elements_by_minus_lr_delta_z():
    zo = engine(0.05)
    mask = zo.fit_static_mask([batch(0)])
    before = [e.param.detach().clone().reshape(-1) for e in zo.entries]
    r = zo.step(batch(0))
    assert r.param_fraction == pytest.approx(mask.selected / zo.num_params) and r.max_inv_pi == 1.0
    for i, e in enumerate(zo.entries):
        now, idx = e.param.detach().reshape(-1), mask.index[i]
        outside = torch.ones(e.numel, dtype=torch.bool)
        outside[idx] = False
        assert torch.equal(now[outside], before[i][outside])
        if len(idx):
            z = zo.noise.slice(0, e.name, mask.total[i], mask.before[i], len(idx))
            torch.testing.assert_close(now[idx], before[i][idx] - 1e-2 * r.projected_grad * z, rtol=0, atol=2e-7)


def test_a_resume_from_a_checkpoint_continues_bit_for_bit(tmp_path):
    straight = engine(0.05)
    straight.fit_static_mask([batch(0), batch(1)])
    for t in range(6):
        straight.step(batch(t))
    first = engine(0.05)
    first.fit_static_mask([batch(0), batch(1)])
    for t in range(3):
        first.step(batch(t))
    path = save_checkpoint(first, str(tmp_path))
    resumed = engine(0.05)  # the initial weights again: the mask and the weights come from the checkpoint
    load_checkpoint(resumed, path)
    assert [torch.equal(a, b) for a, b in zip(resumed.static_mask.index, first.static_mask.index)] == \
        [True] * len(first.entries)
    for t in range(3, 6):
        resumed.step(batch(t))
    assert params_digest(resumed.entries, resumed.comm) == params_digest(straight.entries, straight.comm)


def test_static_mask_needs_mezo_and_its_mask():
    with pytest.raises(ConfigError, match="static_mask=0.01 needs method=mezo"):
        ZOConfig(method="curvzo", static_mask=0.01).validate()
    with pytest.raises(ConfigError, match="static_mask"):
        ZOConfig(method="mezo", static_mask=1.5).validate()
    with pytest.raises(ValueError, match="fit_static_mask"):
        engine(0.05).step(batch(0))


@pytest.mark.multirank
def test_the_cli_run_resumes_at_another_world_size_and_exports(tmp_path):
    """`curvzo-ds train --set method=mezo --set static_mask=0.01` as a user runs it: the probe at 2 ranks, a resume
    at 3 ranks from the checkpoint's mask equals the straight 1-rank run, and the export holds its weights."""
    from tests.helpers import CHECK, train

    mask = ["--set", "method=mezo", "--set", "static_mask=0.01", "--set", "learning_rate=1e-3"]
    straight = train("python", 1, tmp_path / "straight", *mask, "--set", "max_steps=6")
    out = tmp_path / "resumed"
    train("torchrun", 2, out, *mask, "--set", "max_steps=3")
    manifest = json.loads((out / "checkpoint-3" / "manifest.json").read_text())
    assert manifest["static_mask"]["fraction"] == 0.01 and manifest["static_mask"]["selected"] > 0
    resumed = train("torchrun", 3, out, *mask, "--set", "max_steps=6", "--resume")
    assert resumed["params_digest"] == straight["params_digest"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fractions = {r["param_fraction"] for r in rows if "split" not in r}
    assert len(fractions) == 1 and 0.0099 < fractions.pop() < 0.0101  # the mask's share of the elements
    export = tmp_path / "hf"
    assert main(["export", str(out / "checkpoint-6"), "--out", str(export)]) == 0
    check = subprocess.run([sys.executable, str(CHECK), str(out), "--export", str(export)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
