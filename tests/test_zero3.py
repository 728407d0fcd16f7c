"""ZeRO-3 engine with real processes: bit-identical trajectories at 1, 2 and 3 ranks.

One torchrun launch per world size runs every scenario (tests/multirank/worker.py).
"""

import json
import pathlib

import pytest

from tests.helpers import ROOT, run_worker

WORKER = ROOT / "tests" / "multirank" / "worker.py"

ZO = {"learning_rate": 1e-3, "zo_eps": 1e-3, "score_warmup_steps": 5}
RAD = {"perturbation": "rademacher"}
SCENARIOS = [
    # Adaptive CurvZO, persistent (norm) and partitioned tensors, Philox groups of 4 straddling shard edges,
    # 4 micro-batches per step padded each to its own length.
    {"name": "curvzo", "steps": 60, "n_micro": 4, "zo": {**ZO, "method": "curvzo"}},
    {"name": "mezo", "steps": 15, "n_micro": 4, "zo": {**ZO, "method": "mezo"}},
    {"name": "offload", "steps": 15, "n_micro": 4, "offload": True, "zo": {**ZO, "method": "curvzo"}},
    # A global batch smaller than the world: ranks without data run zero-weight forwards.
    {"name": "small_batch", "steps": 15, "n_micro": 1, "zo": {**ZO, "method": "curvzo"}},
    # LoRA: every adapter tensor is persistent under the default threshold.
    {"name": "lora", "steps": 20, "n_micro": 2, "lora": True, "persist": 100000,
     "zo": {**ZO, "method": "curvzo", "learning_rate": 1e-2}},
    # bf16 shards, edited in place or through an fp32 master copy of the owned slice only.
    {"name": "bf16", "steps": 15, "n_micro": 2, "bf16": True,
     "zo": {**ZO, "method": "curvzo", "zo_eps": 1e-2, "fp32_master_weights": False}},
    {"name": "bf16_master", "steps": 15, "n_micro": 2, "bf16": True,
     "zo": {**ZO, "method": "curvzo", "zo_eps": 1e-2, "fp32_master_weights": True}},
    # static_mask: the probe's backprop through the ZeRO-3 module, the mask's noise counted per tensor.
    {"name": "static_mask", "steps": 15, "n_micro": 3,
     "zo": {**ZO, "method": "mezo", "learning_rate": 1e-2, "static_mask": 0.05}},
    {"name": "static_mask_bf16", "steps": 15, "n_micro": 2, "bf16": True,
     "zo": {**ZO, "method": "mezo", "learning_rate": 1e-2, "zo_eps": 1e-2, "static_mask": 0.05}},
    {"name": "stage3_short", "steps": 10, "n_micro": 3, "zo": {**ZO, "method": "curvzo"}},
    {"name": "stage0_short", "steps": 10, "n_micro": 3, "stage": 0, "zo": {**ZO, "method": "curvzo"}},
    # difference=rloo (q forwards, the leave-one-out baseline): CurvZO's scores fed by every direction, MeZO, bf16
    # shards edited in place (restored from the snapshot), and replica groups of one rank (shard_group_size=1: at
    # 2 and 3 ranks each group evaluates q/R of the q = 6 directions).
    {"name": "rloo", "steps": 30, "n_micro": 3, "zo": {**ZO, "method": "curvzo", "num_directions": 3,
                                                       "difference": "rloo"}},
    {"name": "rloo_mezo", "steps": 15, "n_micro": 4, "zo": {**ZO, "method": "mezo", "num_directions": 2,
                                                            "difference": "rloo"}},
    {"name": "rloo_bf16", "steps": 10, "n_micro": 2, "bf16": True,
     "zo": {**ZO, "method": "curvzo", "zo_eps": 1e-2, "fp32_master_weights": False, "num_directions": 2,
            "difference": "rloo"}},
    {"name": "rloo_replicas", "steps": 10, "n_micro": 2, "shard_group_size": 1,
     "zo": {**ZO, "method": "curvzo", "num_directions": 6, "difference": "rloo"}},
    # step_normalization=loss_std: sigma and the coefficients from the same float64 losses on every rank, alone and
    # with replica groups of one rank.
    {"name": "rloo_std", "steps": 10, "n_micro": 3, "zo": {**ZO, "method": "mezo", "num_directions": 4,
                                                           "difference": "rloo", "step_normalization": "loss_std"}},
    {"name": "rloo_std_replicas", "steps": 8, "n_micro": 2, "shard_group_size": 1,
     "zo": {**ZO, "method": "mezo", "num_directions": 6, "difference": "rloo", "step_normalization": "loss_std"}},
    # issue 57: learning_rate auto (the line probe's losses all-reduced like a step's, so the same rate at every
    # world size) with loss_std and replica groups of one rank, and with the control running_rms (MeZO's Delta over
    # its running RMS) under ZeRO-3 (no evaluation here: the plateau's cut is the CLI's, tests/test_horizon.py).
    {"name": "rloo_std_auto", "steps": 8, "n_micro": 2, "shard_group_size": 1,
     "zo": {**ZO, "method": "mezo", "num_directions": 6, "difference": "rloo", "step_normalization": "loss_std",
            "learning_rate": "auto", "auto_rate_probes": 2}},
    # ... and on persistent LoRA adapters, whose probe holds the A factors (engine/core.py `_line_blocks`)
    {"name": "lora_std_auto", "steps": 6, "n_micro": 2, "lora": True, "persist": 100000,
     "zo": {**ZO, "method": "mezo", "num_directions": 4, "difference": "rloo", "step_normalization": "loss_std",
            "learning_rate": "auto", "auto_rate_probes": 2}},
    {"name": "running_rms_auto", "steps": 10, "n_micro": 3,
     "zo": {**ZO, "method": "mezo", "step_normalization": "running_rms", "learning_rate": "auto",
            "auto_rate_probes": 2}},
    {"name": "running_rms_curvzo", "steps": 10, "n_micro": 2,
     "zo": {**ZO, "method": "curvzo", "num_directions": 2, "step_normalization": "running_rms"}},
    {"name": "disagree", "steps": 0, "n_micro": 1, "disagree": "seed", "min_world": 2, "zo": ZO},
    # choose_layout's directions rule at 2 and 3 ranks, shard groups of one rank (no training)
    {"name": "directions_layouts", "directions_layouts": [1, 2, 3, 6], "min_world": 2},
    # perturbation=rademacher (issue 58), in the same launches: ZeRO-3 with a checkpoint after step 6 that the next
    # launch resumes (1 -> 1, 1 -> 2, 2 -> 3), Appendix B's scores, stage 0 against stage 3, LoRA, bf16 in place and
    # through fp32 master copies, replica groups of one rank, a static mask; and a Gaussian run resumed with
    # rademacher asked, which keeps its checkpoint's perturbation.
    {"name": "rad_curvzo", "steps": 12, "n_micro": 4, "resume": True, "save_at": 6, "zo": {**ZO, **RAD,
                                                                                               "method": "curvzo"}},
    {"name": "rad_unbiased", "steps": 8, "n_micro": 2, "zo": {**ZO, **RAD, "method": "curvzo",
                                                                "score_estimator": "unbiased"}},
    {"name": "rad_stage3", "steps": 10, "n_micro": 3, "zo": {**ZO, **RAD, "method": "curvzo"}},
    {"name": "rad_stage0", "steps": 10, "n_micro": 3, "stage": 0, "zo": {**ZO, **RAD, "method": "curvzo"}},
    {"name": "rad_lora", "steps": 10, "n_micro": 2, "lora": True, "persist": 100000,
     "zo": {**ZO, **RAD, "method": "curvzo", "learning_rate": 1e-2}},
    {"name": "rad_bf16", "steps": 10, "n_micro": 2, "bf16": True,
     "zo": {**ZO, **RAD, "method": "curvzo", "zo_eps": 1e-2, "fp32_master_weights": False}},
    {"name": "rad_bf16_master", "steps": 10, "n_micro": 2, "bf16": True,
     "zo": {**ZO, **RAD, "method": "curvzo", "zo_eps": 1e-2, "fp32_master_weights": True}},
    {"name": "rad_rloo_replicas", "steps": 8, "n_micro": 2, "shard_group_size": 1,
     "zo": {**ZO, **RAD, "method": "curvzo", "num_directions": 6, "difference": "rloo"}},
    {"name": "rad_static_mask", "steps": 10, "n_micro": 3,
     "zo": {**ZO, **RAD, "method": "mezo", "learning_rate": 1e-2, "static_mask": 0.05}},
    {"name": "keeps_gaussian", "steps": 10, "n_micro": 2, "resume": True, "save_at": 5, "resume_zo": RAD,
     "zo": {**ZO, "method": "curvzo"}},
]
RADEMACHER = [s["name"] for s in SCENARIOS if s.get("zo", {}).get("perturbation") == "rademacher"]


def launch(world: int, tmp: pathlib.Path) -> dict:
    spec = tmp / "spec.json"
    # a resume scenario's checkpoints go under one directory shared by the three launches
    spec.write_text(json.dumps([{**s, "resume": str(tmp / "resume" / s["name"])} if s.get("resume") else s
                                for s in SCENARIOS]))
    return run_worker(world, WORKER, spec, tmp / f"out{world}.json")["results"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    return {w: launch(w, tmp) for w in (1, 2, 3)}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["curvzo", "mezo", "offload", "small_batch", "lora", "bf16", "bf16_master",
                                  "static_mask", "static_mask_bf16", "rloo", "rloo_mezo", "rloo_bf16", "rloo_replicas",
                                  "rloo_std", "rloo_std_replicas", "rloo_std_auto", "lora_std_auto", "running_rms_auto",
                                  "running_rms_curvzo", "keeps_gaussian", *RADEMACHER])
def test_bit_identical_at_1_2_3_ranks(runs, name):
    ref = runs[1][name]
    assert len(ref["traj"]) > 0
    for w in (2, 3):
        other = runs[w][name]
        for a, b in zip(ref["traj"], other["traj"]):
            assert a == b, f"{name}: world size {w} differs at step {a['step']}: {a} vs {b}"
        assert other["digest"] == ref["digest"]


@pytest.mark.multirank
def test_rademacher_runs_draw_signs_and_resume_across_world_sizes(runs):
    """perturbation=rademacher: every such scenario ran with the +-1 generator, a loss at each step, none skipped; its
    checkpoint resumed 1 -> 1, 1 -> 2 and 2 -> 3 continues the straight run bit for bit;
    stage 0 gives stage 3's trajectory; and it is another trajectory than the Gaussian one."""
    for w in (1, 2, 3):
        for name in RADEMACHER:
            res = runs[w][name]
            assert res["perturbation"] == "rademacher" and res["noise"] == "philox4x32-10-rademacher-v1", name
            assert all(r["loss"] is not None and not r.get("skipped") for r in res["traj"]), name
        straight, resumed = runs[w]["rad_curvzo"], runs[w]["rad_curvzo"]["resumed"]
        assert resumed["from_world"] == max(1, w - 1) and resumed["perturbation"] == "rademacher"
        assert resumed["traj"] == straight["traj"][6:] and resumed["digest"] == straight["digest"], w
        assert runs[w]["rad_stage0"]["traj"] == runs[w]["rad_stage3"]["traj"]
        assert runs[w]["rad_stage0"]["digest"] == runs[w]["rad_stage3"]["digest"]
        assert runs[w]["rad_stage3"]["digest"] != runs[w]["stage3_short"]["digest"]
        # the block sums are the block sizes: not all-reduced (the same steps and micro-batches, G integers fewer)
        assert (runs[w]["rad_stage3"]["engine_all_reduce"]["all_reduce_elements"]
                < runs[w]["stage3_short"]["engine_all_reduce"]["all_reduce_elements"])


@pytest.mark.multirank
def test_a_resume_keeps_its_checkpoints_perturbation(runs):
    """A Gaussian run's checkpoint resumed by an engine configured with perturbation=rademacher continues with
    Gaussian z (the checkpoint's noise identifier decides, CONTRACTS.md), to the straight run's digest."""
    for w in (1, 2, 3):
        straight, resumed = runs[w]["keeps_gaussian"], runs[w]["keeps_gaussian"]["resumed"]
        assert straight["perturbation"] == resumed["perturbation"] == "gaussian"
        assert resumed["noise"] == "philox4x32-10-boxmuller-f32-v1"
        assert resumed["traj"] == straight["traj"][5:] and resumed["digest"] == straight["digest"]


@pytest.mark.multirank
def test_adaptive_run_is_non_uniform_and_has_persistent_params(runs):
    res = runs[3]["curvzo"]
    assert res["persistent"], "no persistent parameter in the scenario"
    assert len(res["persistent"]) < res["num_blocks"]
    late = res["traj"][30:]  # 30 steps after the scores' first 30
    # Uniform pi would give 1/pi = G/B; curvature-guided pi is far from it.
    assert all(r["max_inv_pi"] > 2 * res["num_blocks"] / r["budget"] for r in late)
    assert min(r["d_eff"] for r in late) < res["num_blocks"] - 1
    assert len({r["pi"] for r in late}) > 25  # pi really moves with the scores


@pytest.mark.multirank
def test_lora_adapters_are_all_persistent(runs):
    res = runs[2]["lora"]
    assert len(res["persistent"]) == res["num_blocks"] == 8  # 2 layers x (q, v) x (A, B)


@pytest.mark.multirank
def test_stage0_equals_stage3(runs):
    for w in (1, 2):
        assert runs[w]["stage0_short"]["traj"] == runs[w]["stage3_short"]["traj"]
        assert runs[w]["stage0_short"]["digest"] == runs[w]["stage3_short"]["digest"]


@pytest.mark.multirank
def test_cpu_parameter_offload_equals_no_offload(runs):
    """The offload scenario is the curvzo one with offload_param cpu, for 15 steps: the same trajectory."""
    for w in (1, 2, 3):
        assert runs[w]["offload"]["traj"] == runs[w]["curvzo"]["traj"][:15]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["curvzo", "mezo"])
def test_one_collective_of_g_plus_3k_values_per_step(runs, name):
    """CurvZO sends the G block sums and 3 values per micro-batch; MeZO, which never reads scores, only the 3k."""
    for w in (1, 2, 3):
        res = runs[w][name]
        steps = [r for r in res["traj"] if r.get("skipped") != "empty_mask"]
        per_step = (res["num_blocks"] if name == "curvzo" else 0) + 3 * 4
        assert res["engine_all_reduce"]["all_reduce"] == len(steps)
        assert res["engine_all_reduce"]["all_reduce_elements"] == per_step * len(steps)
        if w > 1:
            # Nothing else in the step all-reduces (DeepSpeed's gathers are all-gathers).
            assert res["torch_all_reduce"] == {"n": len(steps), "elements": per_step * len(steps)}


@pytest.mark.multirank
@pytest.mark.parametrize("name,q", [("rloo", 3), ("rloo_mezo", 2)])
def test_rloo_sends_one_collective_per_step_and_reports_its_spread(runs, name, q):
    """difference=rloo: the step's one all-reduce carries q x G block sums (CurvZO) and 2 values per direction and
    micro-batch (its one loss and the count: the spec's one point); each line has the spread of the q losses, no L+
    or L-, and a positive projected_grad (the RMS)."""
    for w in (1, 2, 3):
        res = runs[w][name]
        n_micro = 3 if name == "rloo" else 4
        steps = [r for r in res["traj"] if r.get("skipped") != "empty_mask"]
        per_step = (q * res["num_blocks"] if name == "rloo" else 0) + 2 * q * n_micro
        assert res["engine_all_reduce"]["all_reduce"] == len(steps) > 0
        assert res["engine_all_reduce"]["all_reduce_elements"] == per_step * len(steps)
        for r in steps:
            assert r["loss_plus"] is None and r["loss_minus"] is None and r["loss_spread"] > 0
            assert r["projected_grad"] > 0 and r["loss"] > 0
    assert runs[1]["rloo_replicas"]["digest"] != runs[1]["rloo"]["digest"]


@pytest.mark.multirank
def test_each_rank_owns_about_one_over_w(runs):
    for w in (2, 3):
        res = runs[w]["curvzo"]
        owned = res["owned_per_rank"]
        assert sum(owned) == res["num_params"]
        # Each tensor's shard is ceil(numel / W): at most one element per tensor above an even split.
        assert max(owned) <= res["num_params"] / w + res["num_blocks"]


@pytest.mark.multirank
def test_disagreeing_rank_is_detected_at_start(runs):
    for w in (2, 3):
        msg = runs[w]["disagree"]["error"]
        assert msg and "seed" in msg and "disagrees with rank 0" in msg
        assert all(e == msg for e in runs[w]["disagree"]["errors"])  # every rank stops, with the same line


@pytest.mark.multirank
def test_replica_groups_that_do_not_divide_the_directions_are_refused(runs):
    """check_directions (layout/choice.py) at 2 and 3 ranks in shard groups of one rank (W replica groups): q must be a
    multiple of W, or the run is refused in one line that names the numbers; a multiple gets W replicas."""
    for w in (2, 3):
        for q, got in runs[w]["directions_layouts"].items():
            if int(q) % w == 0:
                assert got == {"replicas": w}, (w, q, got)
                continue
            msg = got.get("refused", "")
            assert "\n" not in msg and msg.startswith(f"num_directions={q} must be a multiple of the number of "
                                                      f"replica groups ({w} = world size {w} / shard_group_size 1)"), \
                (w, q, got)


@pytest.fixture(scope="module")
def odd_rank(tmp_path_factory):
    """One 2-rank launch in which rank 1 differs: its CPU noise kernel writes float32 values whose last bit differs
    (another build), or it tokenized other data."""
    tmp = tmp_path_factory.mktemp("odd_rank")
    spec = tmp / "spec.json"
    spec.write_text(json.dumps([{"name": "kernel", "steps": 0, "n_micro": 1, "disagree": "kernel", "zo": ZO},
                                {"name": "data", "disagree": "data"}]))
    return run_worker(2, WORKER, spec, tmp / "out.json")["results"]


@pytest.mark.multirank
def test_a_rank_with_another_noise_kernel_fails_at_start_in_one_line(odd_rank):
    """Every rank's ZOEngine refuses to start, in the same one line, naming the kernel and both reference digests."""
    result = odd_rank["kernel"]
    msg = result["error"]
    assert msg and "\n" not in msg and msg.startswith("rank 1 disagrees with rank 0 on the noise kernel")
    digests = msg.split("reference digest ")[1].split(",")[0].split(" vs ")
    assert len(digests) == 2 and digests[0] != digests[1]
    assert result["errors"] == [msg, msg]


@pytest.mark.multirank
def test_a_rank_with_other_tokenized_data_stops_every_rank(odd_rank):
    result = odd_rank["data"]
    msg = result["error"]
    assert msg and "ranks tokenized different data" in msg and "same files with the same tokenizer" in msg
    assert result["errors"] == [msg, msg]


@pytest.mark.multirank
def test_bf16_master_copy_covers_the_edited_region_only(runs):
    for w in (1, 2, 3):
        plain, master = runs[w]["bf16"], runs[w]["bf16_master"]
        assert plain["dtypes"] == master["dtypes"] == ["torch.bfloat16"]
        assert plain["master_elements"] == 0
        # fp32 copies of the owned shards plus the replicated persistent tensors, never whole models.
        owned, persistent = master["owned_per_rank"], master["persistent"]
        assert master["master_elements"] >= max(owned)
        if w > 1 and not persistent:
            assert master["master_elements"] == owned[0]
        assert master["digest"] != plain["digest"]
