"""Issue 47's protocol runner (experiments/protocol.py): the rate rule on made-up caches, the reuse of issue 37's
cached runs, and (slow tier) the runner end to end on a tiny random Llama at the `ci` config (16 forwards a run)."""

import json
import math
import os
import pathlib

import pytest
import torch

from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.errors import RateRefused
from experiments import protocol as P
from experiments import rate_rule as RU
from experiments.report import report_lines
from experiments.smollm import GGUF_SHA256
from experiments.stats import rloo_rate_ratio

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fake_cache(tmp_path, plan=None):
    plan = plan or dict(RU.CONFIGS["ci"], max_grid=8, pilot_seeds=[0, 1, 2])
    return RU.Cache(plan, "ci", "tiny", str(tmp_path), None)


def put(cache, arm, lr, seed, tail=None, diverge=False):
    """A made-up run of 16 forwards whose tail mean log loss is `tail` (or which diverged)."""
    f = [0, 8, 16]
    loss = [1.0, 0.9, math.exp(tail)] if not diverge else [1.0, 0.9, float("nan")]
    run = dict(settings=dict(RU.settings_of(cache.plan, cache.model, "sentiment", arm, lr, seed)),
               curve=[dict(step=x // 2, forwards=x, loss=y, accuracy=0.5) for x, y in zip(f, loss)],
               test=dict(accuracy=0.5), seconds=60.0)
    path = cache.path("sentiment", arm, lr, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(run))


def rate(k):
    return RU.lattice("ci", "sentiment", "mezo", k)


def test_the_lattice_is_sqrt2_steps_rounded_to_3_digits():
    assert [rate(k) for k in range(-1, 4)] == [7.07e-4, 1e-3, 1.41e-3, 2e-3, 2.83e-3]
    # the full protocol's RLOO-8 start lies on the lattice anchored at MeZO's rate, so it meets issue 37's x2 rates
    anchor, m = RU.start_point("full", "topic", "rloo-8")
    assert anchor == 5e-5 and 2 ** (m / 2) <= rloo_rate_ratio(8, RU.X_DEV["topic"] or 0.0) < 2 ** ((m + 1) / 2)
    assert [RU.lattice("full", "topic", "rloo-8", 2 - m + 2 * j) for j in range(3)] == [1e-4, 2e-4, 4e-4]
    assert rloo_rate_ratio(8, 0.0) == pytest.approx(7) and rloo_rate_ratio(8, 0.25) < 7


def test_the_report_pairs_issue_58s_pilots_by_seed_at_the_chosen_rate(tmp_path):
    """+-1 directions (the `-pm1` arm) against Gaussian, at the rate the rule chose for the base arm, paired by
    pilot seed; no worse when the mean paired difference is within the Gaussian tails' spread."""
    cache = fake_cache(tmp_path)
    assert P.PROTOCOL_ARMS == ["mezo", "rloo-8", "rloo-8-std"]  # the pilots' arms are not the protocol's
    for s in range(3):
        put(cache, "mezo", rate(0), s, tail=-1.0)
        put(cache, "mezo", rate(1), s, tail=-1.2 - 0.05 * s)  # chosen; the tails' sd is 0.05
        put(cache, "mezo", rate(2), s, tail=-1.1)
        put(cache, "mezo-pm1", rate(1), s, tail=-1.17 - 0.05 * s)  # 0.03 worse on every seed: within the spread
    lines = report_lines(cache, ["sentiment"], ["mezo"], None)
    rows = [x for x in lines[lines.index(next(x for x in lines if x.startswith("Issue 58's pilots"))):]
            if x.startswith("| sentiment")]
    assert len(rows) == 1 and rows[0].startswith(f"| sentiment | mezo | {rate(1):g} | 3 |")
    assert "+0.030 (+0.030, +0.030, +0.030) | 0.050 |" in rows[0] and rows[0].endswith("| yes |")
    for s in range(3):
        put(cache, "mezo-pm1", rate(1), s, tail=-1.1 - 0.05 * s)  # 0.1 worse: beyond the spread
    rows = [x for x in report_lines(cache, ["sentiment"], ["mezo"], None) if x.startswith("| sentiment | mezo | ")
            and x.endswith("|") and "(+0.100" in x]
    assert len(rows) == 1 and rows[0].endswith("| no |")


def test_the_grid_goes_up_until_the_tail_gets_worse(tmp_path):
    cache = fake_cache(tmp_path)
    for s in range(3):
        put(cache, "mezo", rate(0), s, tail=-1.0)
        put(cache, "mezo", rate(1), s, tail=-1.2)
        put(cache, "mezo", rate(2), s, tail=-1.1 - 0.01 * s)
    st = RU.pilot_state(cache, "sentiment", "mezo")
    assert st["chosen"] == rate(1) and "worse than" in st["why"] and st["missing"] == []
    assert [lr for lr, _ in st["grid"]] == [rate(0), rate(1), rate(2)]


def test_a_rate_that_diverges_on_one_seed_ends_the_grid(tmp_path):
    cache = fake_cache(tmp_path)
    for s in range(3):
        put(cache, "mezo", rate(0), s, tail=-1.0)
        put(cache, "mezo", rate(1), s, tail=-1.5)
    put(cache, "mezo", rate(2), 1, diverge=True)  # seeds 0 and 2 of this rate need not run
    st = RU.pilot_state(cache, "sentiment", "mezo")
    assert st["chosen"] == rate(1) and st["why"] == f"{rate(2):g} diverged on seed 1"


def test_missing_pilots_are_the_next_runs(tmp_path):
    cache = fake_cache(tmp_path)
    put(cache, "mezo", rate(0), 0, tail=-1.0)
    st = RU.pilot_state(cache, "sentiment", "mezo")
    assert st["chosen"] is None and st["missing"] == [(rate(0), 1), (rate(0), 2)]
    for s in (1, 2):
        put(cache, "mezo", rate(0), s, tail=-1.0)
    assert RU.pilot_state(cache, "sentiment", "mezo")["missing"] == [(rate(1), s) for s in range(3)]
    lines = "\n".join(P.plan_lines(cache, ["sentiment"], ["mezo"], "OUT"))
    assert f"--run --arm mezo --task sentiment --runs {rate(1):g}:0 {rate(1):g}:1 {rate(1):g}:2 --out OUT" in lines


def test_a_start_rate_that_diverges_sends_the_grid_down(tmp_path):
    cache = fake_cache(tmp_path)
    put(cache, "mezo", rate(0), 2, diverge=True)
    assert RU.pilot_state(cache, "sentiment", "mezo")["missing"] == [(rate(-1), s) for s in range(3)]
    put(cache, "mezo", rate(-1), 0, diverge=True)
    for s in range(3):
        put(cache, "mezo", rate(-2), s, tail=-0.5)
    st = RU.pilot_state(cache, "sentiment", "mezo")
    assert st["chosen"] == rate(-2) and "first stable rate below" in st["why"]


def test_a_run_that_ends_above_its_zero_shot_loss_has_diverged(tmp_path):
    cache = fake_cache(tmp_path)
    put(cache, "mezo", rate(0), 0, tail=math.log(1.2))  # finite, but above the zero-shot 1.0
    assert RU.diverged(cache.get("sentiment", "mezo", rate(0), 0))


def test_issue_37s_cached_runs_are_found_by_their_settings():
    """Every MeZO and RLOO q = 8 run of issue 37 is found under protocol.py's description of its settings, as a pilot
    of the full config (the lookup that lets them serve as pilots)."""
    runs = ROOT / "experiments" / "results" / "real-model" / "runs"
    cache = RU.Cache(RU.CONFIGS["full"], "full", f"smollm2-135m-{GGUF_SHA256[:16]}", "/nonexistent", str(runs))
    found = 0
    for path in sorted(runs.glob("*.json")):
        s = json.loads(path.read_text())["settings"]
        if s["arm"] in ("mezo", "rloo-8"):
            assert cache.reused_path(s["task"], s["arm"], s["lr"], s["seed"]) == str(path)
            assert cache.get(s["task"], s["arm"], s["lr"], s["seed"])["source"] == "issue 37"
            found += 1
    assert found >= 20
    # a fresh seed is never taken from issue 37's runs (they evaluate differently)
    assert cache.reused_path("sentiment", "mezo", 1e-4, 3) is None


def test_workers_share_the_queue_by_claims(tmp_path, monkeypatch):
    """--work runs what the plan needs next, skips a run another worker holds (its flock), reads the plan again
    after each run (the pilot grid chooses its rate, then the fresh seeds follow) and stops when nothing is left."""
    cache = RU.Cache(RU.CONFIGS["ci"], "ci", "tiny", str(tmp_path), None)
    ran = []

    def fake_run(cache, model_dir, task, task_dir, arm, lr, seed, log):
        ran.append((lr, seed))
        put(cache, arm, lr, seed, tail=-0.5 if lr == rate(0) else -0.4)

    monkeypatch.setattr(P, "one_run", fake_run)
    args = (cache, ["sentiment"], ["mezo"], "model", {"sentiment": "task"}, lambda line: None)
    other = P.claim(cache, "sentiment", "mezo", rate(0), 0)  # another worker is running pilot seed 0
    assert other is not None and P.claim(cache, "sentiment", "mezo", rate(0), 0) is None
    assert P.work(*args) == 1 and ran == [(rate(0), 1)]
    other.close()  # that worker died: the kernel drops its lock
    assert P.work(*args) == 5
    assert ran[1:] == [(rate(0), 0), (rate(1), 0), (rate(1), 1), (rate(0), 2), (rate(0), 3)]
    assert P.needed(cache, "sentiment", "mezo") == [] and P.work(*args) == 0


def put_fresh(cache, arm, seed, final):
    """A made-up fresh run at the arm's start rate: dev and subset losses 1.0, 0.9, `final` at 0, 8 and 16
    forwards (a final above 1.0 has diverged)."""
    lr = RU.lattice("ci", "sentiment", arm, 0)
    run = dict(settings=RU.settings_of(cache.plan, cache.model, "sentiment", arm, lr, seed),
               curve=[dict(step=x // 2, forwards=x, loss=y, subset_loss=y, accuracy=0.5)
                      for x, y in zip([0, 8, 16], [1.0, 0.9, final])], test=dict(accuracy=0.5), seconds=60.0)
    path = cache.path("sentiment", arm, lr, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(run))


def test_the_report_shows_a_diverged_seed_left_out_beside_the_rule(tmp_path):
    """The rule counts every fresh seed; where some diverged, a second table compares without them."""
    cache = fake_cache(tmp_path, dict(RU.CONFIGS["ci"], max_grid=8, pilot_seeds=[0, 1, 2], fresh_seeds=[3, 4, 5]))
    for arm in ("mezo", "rloo-8"):
        for seed in cache.plan["pilot_seeds"]:
            put(cache, arm, RU.lattice("ci", "sentiment", arm, 0), seed, tail=-0.5)
            put(cache, arm, RU.lattice("ci", "sentiment", arm, 1), seed, tail=-0.4)
    for seed, mezo, rloo in zip(cache.plan["fresh_seeds"], [0.5, 0.4, 0.45], [0.3, 0.2, 0.25]):
        put_fresh(cache, "mezo", seed, mezo)
        put_fresh(cache, "rloo-8", seed, rloo)
    assert "Without the diverged" not in "\n".join(report_lines(cache, ["sentiment"], ["mezo", "rloo-8"], None))
    put_fresh(cache, "mezo", 5, 50.0)  # MeZO's third seed diverges
    lines = report_lines(cache, ["sentiment"], ["mezo", "rloo-8"], None)
    assert [line for line in lines if line.startswith("| sentiment | mezo |")][0].split(" | ")[3] == "3 (1)"
    start = lines.index(next(x for x in lines if x.startswith("Without the diverged")))
    end = lines.index(next(x for x in lines if x.startswith("The time-warp factor that never extrapolates")))
    rows = [line for line in lines[start:end] if line.startswith("| sentiment |")]
    assert len(rows) == 1 and rows[0].startswith("| sentiment | rloo-8 | 3 of 3 | 2 of 3 |")
    # without the diverged seed MeZO's tail is the mean of log 0.5 and log 0.4: the difference shrinks
    kept = float(rows[0].split(" | ")[4].split()[0])
    rule = float([x for x in lines if x.startswith("| sentiment | rloo-8 |")][0].split(" | ")[5].split()[0])
    arm = (math.log(0.3) + math.log(0.2) + math.log(0.25)) / 3
    assert kept == pytest.approx(arm - (math.log(0.5) + math.log(0.4)) / 2, abs=1e-4)  # the tail: 16 alone
    assert rule < kept
    # MeZO's mean curve rises at its end (the diverged seed): no extension reaches the arm's tail, the factor is capped
    assert "capped" in [x for x in lines if x.startswith("| sentiment | rloo-8 |")][0]


def test_the_report_checks_the_prediction_for_loss_std_against_rloo8(tmp_path):
    """The issue predicts loss_std's tail mean at least 0.1 below RLOO-8's: a Welch interval, decided on full seeds."""
    cache = fake_cache(tmp_path, dict(RU.CONFIGS["ci"], max_grid=8, pilot_seeds=[0, 1, 2], fresh_seeds=[3, 4, 5]))
    arms = ["mezo", "rloo-8", "rloo-8-std"]
    for arm in arms:
        for seed in cache.plan["pilot_seeds"]:
            put(cache, arm, RU.lattice("ci", "sentiment", arm, 0), seed, tail=-0.5)
            put(cache, arm, RU.lattice("ci", "sentiment", arm, 1), seed, tail=-0.4)
    for seed, mezo, plain, std in zip([3, 4, 5], [0.5, 0.4, 0.45], [0.3, 0.2, 0.25], [0.1, 0.12, 0.08]):
        put_fresh(cache, "mezo", seed, mezo)
        put_fresh(cache, "rloo-8", seed, plain)
        if seed < 5:
            put_fresh(cache, "rloo-8-std", seed, std)

    def row():
        lines = report_lines(cache, ["sentiment"], arms, None)
        start = lines.index(next(x for x in lines if x.startswith("The issue's prediction")))
        return next(x for x in lines[start:] if x.startswith("| sentiment |")).split(" | ")

    assert row()[1:3] == ["2", "3"] and row()[4] == "pending |"
    put_fresh(cache, "rloo-8-std", 5, 0.08)
    cells = row()
    # the tail is the 16th forward alone
    want = sum(map(math.log, [0.1, 0.12, 0.08])) / 3 - sum(map(math.log, [0.3, 0.2, 0.25])) / 3
    assert float(cells[3].split()[0]) == pytest.approx(want, abs=1e-4) and cells[4] == "yes |"
    put_fresh(cache, "rloo-8-std", 5, 0.9)  # one bad seed widens the interval past -0.1
    assert row()[4] == "no |"
    assert not any(x.startswith("The issue's prediction") for x in report_lines(cache, ["sentiment"], arms[:2], None))


@pytest.mark.slow
def test_protocol_end_to_end_on_a_tiny_model(tiny_model, tmp_path, capsys):
    """--plan, --run, --report on a tiny random Llama (16 forwards a run). A random model's loss moves by noise, so
    the pilots that decide the rates are made up (stable, the second rate worse: each arm chooses its start rate);
    one real pilot run checks the pilot's evaluation; the fresh seeds run for real, and the report compares them."""
    arms = ["mezo", "rloo-8"] + (["rloo-8-std"] if "step_normalization" in TrainConfig.__dataclass_fields__ else [])
    out = tmp_path / "out"
    common = ["--config", "ci", "--model", tiny_model, "--out", str(out), "--reuse", ""]
    cache = RU.Cache(RU.CONFIGS["ci"], "ci", os.path.basename(tiny_model), str(out), None)
    P.main(["--plan", *common])
    first = f"--run --arm mezo --task sentiment --runs {rate(0):g}:0 {rate(0):g}:1 --out {out}"
    assert first in capsys.readouterr().out
    threads = torch.get_num_threads()
    try:
        P.main(["--run", "--arm", "mezo", "--task", "sentiment", "--runs", f"{rate(3):g}:0", *common])
        pilot = cache.get("sentiment", "mezo", rate(3), 0)
        assert [c["forwards"] for c in pilot["curve"]] == [0, 8, 16] and "subset_loss" not in pilot["curve"][0]
        for arm in arms:
            for seed in RU.CONFIGS["ci"]["pilot_seeds"]:
                put(cache, arm, RU.lattice("ci", "sentiment", arm, 0), seed, tail=-0.5)
                put(cache, arm, RU.lattice("ci", "sentiment", arm, 1), seed, tail=-0.4)
            st = RU.pilot_state(cache, "sentiment", arm)
            assert st["chosen"] == RU.lattice("ci", "sentiment", arm, 0) and not st["missing"]
        P.main(["--work", "--arms", *arms, *common])  # every arm's fresh seeds, as --plan lists them
    finally:
        torch.set_num_threads(threads)
    fresh = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    fresh = [r for r in fresh if r["settings"]["stage"] == "fresh"]
    assert len(fresh) == len(RU.CONFIGS["ci"]["fresh_seeds"]) * len(arms)
    for r in fresh:
        points = {c["forwards"]: c for c in r["curve"]}
        if not RU.diverged(r):
            assert sorted(points) == [0, 8, 16] and all("subset_loss" in c and "loss" in c for c in points.values())
        assert r["provenance"]["code"]["path"] == str(ROOT) and "commit" in r["provenance"]["code"]
        assert r["provenance"]["machine"]["node"] and r["seconds"] > 0 and "accuracy" in r["test"]
        assert "cpu" in r["provenance"]["machine"]  # the CPU's model name: pretraining differs between CPUs
    # the subset is the same examples in every run: the zero-shot subset loss is the same whatever the seed
    assert len({round(r["curve"][0]["subset_loss"], 9) for r in fresh}) == 1
    log_lines = (out / "progress.log").read_text().count(" run ")
    P.main(["--run", "--arm", "mezo", "--task", "sentiment", "--runs", f"{rate(0):g}:2", *common])
    assert (out / "progress.log").read_text().count(" run ") == log_lines  # from the cache
    capsys.readouterr()
    P.main(["--report", "--arms", *arms, *common])
    report, pilots = capsys.readouterr().out.split("Pilot grids")
    first = report.split("Without the diverged")[0].split("The issue's prediction")[0]  # the rule's table alone
    rows = [line for line in first.splitlines() if line.startswith("| sentiment |")]
    pilot_rows = [line for line in pilots.splitlines() if line.startswith("| sentiment |")]
    assert len(pilot_rows) == 2 * len(arms) * len(RU.CONFIGS["ci"]["pilot_seeds"])  # the grid's two rates per arm
    assert [row.split(" | ")[1] for row in rows] == arms
    assert all(row.endswith(("| yes |", "| no |")) for row in rows[1:]) and rows[0].endswith("| - |")
    # an arm short of its fresh seeds gets intervals but no verdict
    seeds = RU.CONFIGS["ci"]["fresh_seeds"]
    for path in (out / "runs").glob("*.json"):
        s = json.loads(path.read_text())["settings"]
        if (s["stage"], s["arm"], s["seed"]) == ("fresh", "rloo-8", seeds[0]):
            path.unlink()
    P.main(["--report", "--arms", *arms, *common])
    rows = [line for line in capsys.readouterr().out.split("Without the diverged")[0].split("Pilot grids")[0]
            .splitlines() if line.startswith("| sentiment | rloo-8 |")]
    assert rows[0].endswith(f"| pending (1 and MeZO's {len(seeds)} of {len(seeds)} seeds) |"), rows
    P.main(["--plan", *common])
    assert "still to run (fresh): none" in capsys.readouterr().out


@pytest.mark.slow
def test_the_horizon_protocol_end_to_end_on_a_tiny_model(tiny_model, tmp_path, capsys, monkeypatch):
    """experiments/horizon.py --work and --report at its `ci` config (32 forwards, the noisy cell, MeZO and the two
    auto arms with the plateau schedule, 2 seeds): every planned run is cached with its curve, an auto arm's chosen
    rate is recorded at each evaluation point, and the report has a row per arm against MeZO."""
    from experiments import horizon as H

    out = tmp_path / "h"
    threads = torch.get_num_threads()
    common = ["--config", "ci", "--work", "--model", tiny_model, "--out", str(out), "--cache", str(tmp_path)]
    try:
        H.main([*common, "--arms", "mezo"])  # a worker given arms runs only theirs
        assert sorted(H.load_runs(str(out), "ci")) == [("sentiment", "noisy", "mezo")]
        H.main(common)
    finally:
        torch.set_num_threads(threads)
    runs = H.load_runs(str(out), "ci")
    assert sorted(runs) == sorted(("sentiment", "noisy", arm) for arm in H.CONFIGS["ci"]["arms"])
    assert all(len(v) == 2 for v in runs.values())
    auto = runs[("sentiment", "noisy", "std-auto-plateau")][0]
    assert [c["forwards"] for c in auto["curve"]] == [0, 16, 32] and auto["curve"][-1]["learning_rate"] > 0
    assert auto["settings"]["auto_rule"] == H.AUTO_RULE and "the greedy rate" in auto["rate_reason"]
    assert auto["learning_rate_chosen"] == auto["curve"][1]["learning_rate"]
    # the CLI's divergence rollback (its dev rule at each evaluation) is part of every run's settings, and recorded
    assert all(r["settings"]["rollback"] == H.ROLLBACK and isinstance(r["rollbacks"], list)
               for v in runs.values() for r in v)
    text = capsys.readouterr().out
    assert "| std-auto-plateau | 2 |" in text and "| rms-auto-plateau | 2 |" in text
    H.main(["--config", "ci", "--plan", "--out", str(out)])
    assert "nothing missing" in capsys.readouterr().out
    assert auto["device"] == "cpu"  # a run records where it ran (--device cuda on a GPU)
    from curvzo_ds.algo.rate import AUTO_RATE_PROBES

    # the forwards the rule spent before step 1 count in the time-warp: a probe is a step's forwards and 3 more
    assert H.probe_forwards(auto["settings"]) == AUTO_RATE_PROBES * (8 + 3)
    assert H.probe_forwards(runs[("sentiment", "noisy", "rms-auto-plateau")][0]["settings"]) == AUTO_RATE_PROBES * 5
    assert H.probe_forwards(runs[("sentiment", "noisy", "mezo")][0]["settings"]) == 0
    # a seed whose auto rate the rule refuses is an outcome: kept as a run (no curve), listed, never run again, and
    # done for --plan (here rms-auto-plateau's seed 1, its run's cache removed)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RateRefused("learning_rate=auto: ... a rate needs a falling, convex line")

    monkeypatch.setattr(H, "run_curve", refuse)
    log = H.Log(str(tmp_path / "log"))
    setup = H.Setup("ci", str(tmp_path), tiny_model, str(tmp_path), log)
    os.remove(H.cached(str(out), H.settings_of("ci", tiny_model, "sentiment", "noisy", "rms-auto-plateau", 1))[0])
    for _ in range(2):
        H.one_run(setup, str(out), "sentiment", "noisy", "rms-auto-plateau", 1, log)
    assert len(calls) == 1
    (refused,) = H.load_runs(str(out), "ci")[("sentiment", "noisy", "rms-auto-plateau (refused)")]
    assert refused["settings"]["seed"] == 1 and "convex line" in refused["refused"]
    table = H.report(str(out), "ci")
    assert "| rms-auto-plateau (refused) | 1 | | | | | | | seeds 1 |" in table
    assert any(row.startswith("| rms-auto-plateau | 1 |") and row.endswith("| no (1 refused) |") for row in table)
    H.main(["--config", "ci", "--plan", "--out", str(out)])
    assert "nothing missing" in capsys.readouterr().out
    # experiments/line_rate.py: the rule's measurement per seed, and the rate it takes (its fraction, 3 digits)
    from experiments import line_rate

    line_rate.main(["--config", "ci", "--model", tiny_model, "--seeds", "0", "--arms", "std-auto-plateau"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split(" | ")
    from curvzo_ds.algo.rate import AUTO_RATE_FRACTION, AUTO_RATE_PROBES

    assert row[1:5] == ["clean", "std-auto-plateau", "0", str(AUTO_RATE_PROBES)]
    assert float(row[6]) == pytest.approx(AUTO_RATE_FRACTION * float(row[5]), rel=5e-3)  # 3 digits of 4
    # a refusal is a row with the rule's slope and curvature: here the engine's rule is handed curvatures that
    # straddle zero (mean -1, se 2) in place of the 2 probes' own, on the noisy variant
    import curvzo_ds.engine.core as engine_core

    probed = []
    rule = engine_core.line_rate
    monkeypatch.setattr(engine_core, "line_rate",
                        lambda s, c, *a: probed.append(len(s)) or rule([1.0, 1.0], [-3.0, 1.0]))
    line_rate.main(["--config", "ci", "--model", tiny_model, "--seeds", "0", "--arms", "std-auto-plateau",
                    "--variant", "noisy", "--probes", "2"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert probed == [2] and row == ("| sentiment | noisy | std-auto-plateau | 0 | 2 | refused | | the loss falls "
                                     "(slope 1) but the probes do not resolve the line's curvature (-1 +- 2 per "
                                     "probe) |")
    # a worker whose model of the same name has another zero-shot loss than the cached runs' (a pretraining that came
    # out different on another CPU) refuses to add to them, in one line; the same model passes the check (above)
    path = H.cached(str(out), H.settings_of("ci", tiny_model, "sentiment", "noisy", "mezo", 0))[0]
    with open(path) as f:
        run = json.load(f)
    run["curve"][0]["loss"] *= 1.01
    with open(path, "w") as f:
        json.dump(run, f)
    refusal = r"zero-shot dev loss [0-9.]+ on sentiment, 1 of the cached runs in .* a different model"
    try:
        with pytest.raises(SystemExit, match=refusal):
            H.main(common)
    finally:
        torch.set_num_threads(threads)


def put_horizon(out, task, variant, arm, seed, losses, accuracy):
    """A made-up run of experiments/horizon.py's `smollm` config: its dev losses at 0, 200, ..., 2000 forwards."""
    from experiments import horizon as H
    from experiments.core import cached

    settings = H.settings_of("smollm", "tiny", task, variant, arm, seed)
    path = cached(str(out), settings)[0]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    curve = [dict(step=f // 2, forwards=f, loss=y) for f, y in zip(range(0, 2001, 200), losses)]
    pathlib.Path(path).write_text(json.dumps(dict(settings=settings, curve=curve, test=dict(accuracy=accuracy))))


def test_the_horizon_report_decides_item_5_and_compares_without_meZOs_diverged_seeds(tmp_path):
    """The decision line takes running_rms first, then the auto normalised step, where one passes on every SmolLM2
    cell, else MeZO stays, and says it is provisional while a cell lacks seeds, unless the arms before are out (they
    fail a cell holding all its seeds). Where the CLI's divergence rule would have rolled back one of MeZO's seeds, a
    second table compares against its other seeds; the rule counts them all."""
    from experiments import horizon as H
    from experiments.core import cached

    def drop(task, variant, arm, seed):
        os.remove(cached(str(tmp_path), H.settings_of("smollm", "tiny", task, variant, arm, seed))[0])

    plan = H.CONFIGS["smollm"]
    forwards = range(0, 2001, 200)
    for task, variant in plan["cells"]:
        for seed in plan["seeds"]:
            jitter = 1 + 0.01 * seed
            put_horizon(tmp_path, task, variant, "mezo", seed, [0.7 * jitter * math.exp(-f / 1000) for f in forwards],
                        0.80 + 0.005 * seed)
            for arm in ("std-auto-plateau", "rms-auto-plateau"):  # 2.5x MeZO's speed, 0.05 more accurate
                put_horizon(tmp_path, task, variant, arm, seed, [0.7 * jitter * math.exp(-f / 400) for f in forwards],
                            0.85 + 0.005 * seed)
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So the default for full fine-tuning is `rms-auto-plateau`." and not any(
        "met the CLI's divergence rule" in x for x in lines)
    assert sum(x.startswith("| rms-auto-plateau | 4 |") and x.endswith("| passes |") for x in lines) == 3
    # running_rms fails on one cell (less accurate than MeZO): the auto normalised step is next
    put_horizon(tmp_path, "topic", "clean", "rms-auto-plateau", 3, [0.7 * math.exp(-f / 400) for f in forwards], 0.5)
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So the default for full fine-tuning is `std-auto-plateau`."
    assert "- rms-auto-plateau: out (fails a complete cell) (" in "\n".join(lines)
    # running_rms lacks a seed elsewhere: it is out all the same, and the decision is final
    drop("sentiment", "noisy", "rms-auto-plateau", 6)
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So the default for full fine-tuning is `std-auto-plateau`."
    assert "(final: every arm before it is out, its own cells complete)" in "\n".join(lines)
    # one of MeZO's seeds blows up on `sentiment` clean (a dev loss above 2x its best: `curvzo-ds train` would roll it
    # back): MeZO's mean curve never gets below its start, so no arm passes there by the rule, which counts every seed
    blown = [0.7, 0.5] + [1e6] * 9
    put_horizon(tmp_path, "sentiment", "clean", "mezo", 4, blown, 0.5)
    assert H.unstable(dict(curve=[dict(step=f // 2, forwards=f, loss=y) for f, y in zip(forwards, blown)]))
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So the default for full fine-tuning is `mezo` (no arm passes on every cell)."
    start = lines.index(next(x for x in lines if x.startswith("MeZO's seed 4 met the CLI's divergence rule")))
    assert "Against MeZO's seeds 3, 5, 6 alone" in lines[start]
    second = [x for x in lines[start:start + 8] if x.startswith("| std-auto-plateau | 4 |")]
    assert len(second) == 1 and "x0." in second[0].split(" | ")[3]  # against the other seeds: faster, as elsewhere
    # the failing cell short of a seed: the auto normalised step is not out, and the decision provisional
    drop("sentiment", "clean", "std-auto-plateau", 6)
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So far no arm passes on every cell: `mezo` stays."
    assert "(provisional: not every cell has its 4 seeds yet)" in "\n".join(lines)
    assert "- std-auto-plateau: no (" in "\n".join(lines)
    # it fails a complete cell too (less accurate on `topic`): every arm is out, and MeZO stays for good
    put_horizon(tmp_path, "topic", "clean", "std-auto-plateau", 3, [0.7 * math.exp(-f / 400) for f in forwards], 0.5)
    lines = H.report(str(tmp_path), "smollm")
    assert lines[-2] == "So the default for full fine-tuning is `mezo` (no arm passes on every cell)."
    assert "(final before every cell is complete: every arm fails a complete cell)" in "\n".join(lines)


def test_runs_cached_before_rollback_are_adopted_where_none_met_its_rule(tmp_path):
    """A run of a plan with rollback cached without it (before the setting existed) that never met the dev rule is the
    run with it step for step: `--adopt` moves it to its key with the rollback. One that met the rule stays, " (no
    rollback)" in the report beside the arm's row, and its seed is planned again."""
    from experiments import horizon as H
    from experiments.core import cached

    forwards = range(0, 2001, 200)
    put_horizon(tmp_path, "topic", "clean", "mezo", 3, [0.7 * math.exp(-f / 1000) for f in forwards], 0.9)
    put_horizon(tmp_path, "topic", "clean", "mezo", 4, [0.7, 0.5] + [1e6] * 9, 0.5)
    for path in (tmp_path / "runs").iterdir():  # as they were cached before: no rollback in their settings
        run = json.loads(path.read_text())
        del run["settings"]["rollback"]
        path.unlink()
        pathlib.Path(cached(str(tmp_path), run["settings"])[0]).write_text(json.dumps(run))
    labels = sorted(H.load_runs(str(tmp_path), "smollm"))
    assert labels == [("topic", "clean", "mezo (no rollback)")]
    H.main(["--config", "smollm", "--adopt", "--out", str(tmp_path)])
    runs = H.load_runs(str(tmp_path), "smollm")
    (kept,) = runs[("topic", "clean", "mezo")]
    assert kept["settings"] == H.settings_of("smollm", "tiny", "topic", "clean", "mezo", 3) and kept["rollbacks"] == []
    assert "no evaluation met the dev rule" in kept["adopted"]
    assert [r["settings"]["seed"] for r in runs[("topic", "clean", "mezo (no rollback)")]] == [4]
    assert len(list((tmp_path / "runs").iterdir())) == 2
    missing = [r for r in H.plan_runs("smollm") if r[:3] == ("topic", "clean", "mezo")]
    H.main(["--config", "smollm", "--plan", "--out", str(tmp_path)])
    assert H.unstable(runs[("topic", "clean", "mezo (no rollback)")][0]) and len(missing) == 4
    assert any(x.startswith("| mezo (no rollback) | 1 | 1 |") for x in H.report(str(tmp_path), "smollm"))
