"""`curvzo-ds diagnose` on the tiny demo model: the table, the JSON, the figures, and the backprop ground truth."""

import json

import pytest
import torch

from curvzo_ds.cli import main
from curvzo_ds.commands.diagnose import corr_log
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.shard.params import canonical_name
from curvzo_ds.train.plain import PlainRun


def test_diagnose_writes_the_table_json_and_figures(tmp_path, capsys):
    out = tmp_path / "diag"
    code = main(["diagnose", "--set", "model=demo", "--set", "task=demo", "--steps", "24", "--probe-every", "8",
                 "--estimators", "normalized,unbiased_element", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| normalized |" in table and "| unbiased_element |" in table
    records = json.loads((out / "diagnose.json").read_text())
    assert [r["estimator"] for r in records] == ["normalized", "unbiased_element"]
    for r in records:
        assert r["probe_step"] == [0, 8, 16, 23]
        assert len(r["pi"]) == 24 and len(r["pi"][0]) == len(r["sizes"]) == len(r["energy"][0])
        assert all(x > 0 for row in r["energy"] for x in row)  # every block gets a gradient
        # The correlations are those of the recorded pi, averaged over the probes after the 20 warm-up steps: only
        # step 23's (during warm-up pi is uniform, and its correlation undefined).
        assert r["warmup_steps"] == 20
        pi = torch.tensor([r["pi"][23]], dtype=torch.float64).mean(0)
        assert r["pi_mean"] == pi.tolist() and len(set(r["pi"][23])) > 1
        assert abs(r["corr_pi_size"] - corr_log(pi, r["sizes"])) < 1e-12
        assert 0 < r["budget_on_true_energy"] <= 1
        assert (out / f"diagnose_{r['estimator']}.png").stat().st_size > 10_000
    # The same start and the same batches: both runs see the same first batch's gradient.
    assert records[0]["energy"][0] == records[1]["energy"][0]


def test_block_energies_are_the_backprop_gradient_split_by_block():
    """Each block's energy is ||g||^2 of its own tensor (blocks are tensors by default), by name: the gradient of the
    batch's mean loss, computed here by backprop in eval mode as the diagnostic does."""
    run = PlainRun(TrainConfig(model="demo", task="demo", max_steps=1))
    batch = run.batch(0)
    energy = run.block_energy(batch)
    run.model.eval()
    run.model.zero_grad()
    sums = [run.loss(run.model, mb) for mb in batch.items]
    (sum(s for s, _ in sums) / sum(float(c) for _, c in sums)).backward()
    grads = {canonical_name(n, False): float(p.grad.reshape(-1).double().pow(2).sum())
             for n, p in run.model.named_parameters()}
    names = [b.name for b in run.engine.blocks]
    assert sorted(names) == sorted(grads)
    values = sorted(grads.values())
    assert all(b > a * (1 + 1e-4) for a, b in zip(values, values[1:]))  # distinct: a block paired wrongly shows
    # float32 gradients of the same batch in the same mode: equal up to the order of float32 sums (1e-6).
    for name, e in zip(names, energy.tolist()):
        assert abs(e - grads[name]) <= 1e-6 * grads[name], name


def test_bad_estimator_is_one_line(capsys, tmp_path):
    assert main(["diagnose", "--estimators", "magic", "--out", str(tmp_path)]) == 2
    assert "magic" in capsys.readouterr().err


def test_corr_log_ignores_non_positive_entries():
    assert abs(corr_log([1.0, 2.0, 4.0, 0.0], [2.0, 4.0, 8.0, 5.0]) - 1.0) < 1e-12


def test_a_plain_run_evaluates_an_added_split_and_its_evaluator_reads_its_sections():
    """PlainRun's seams: `add_split` gives the evaluator a split of the run's encoded examples (its metrics are those
    of the same examples), a name already there is refused; the Evaluator is built from the `eval` and `data` sections;
    a `sampler` is what makes the engine's sampler."""
    from curvzo_ds.algo.sampling import CurvZOSampler

    class Mine(CurvZOSampler):
        pass

    run = PlainRun(TrainConfig(model="demo", task="demo", max_steps=1, eval_steps=7, micro_batch_size=4,
                               global_batch_size=8), sampler=Mine)
    assert type(run.engine.sampler) is Mine
    evaluator = run.job.evaluator
    assert (evaluator.eval_steps, evaluator.micro_batch_size) == (7, 4)
    assert evaluator.max_new_tokens == run.cfg.max_new_tokens
    dev = run.eval_data["dev"]
    run.add_split("dev-again", list(dev))
    assert run.evaluate("dev-again") == run.evaluate("dev")
    run.add_split("dev-first", dev[:3])
    assert run.evaluate("dev-first") != run.evaluate("dev")
    with pytest.raises(ValueError, match="already has a split 'dev'"):
        run.add_split("dev", dev[:3])
    assert "dev-again" not in run.eval_data  # the job's own splits are not written
