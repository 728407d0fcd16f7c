"""Hybrid sharding and several directions per step (docs/scaling.md), with real processes.

The same config with num_directions=2 gives the same params_digest bit for bit on 1 rank (the directions one
after the other), on 2 ranks in one shard group, and on 4 ranks in 2 shard groups of 2 (one direction per
group, in parallel), and a resume across layouts continues the same trajectory.
"""

import json

import pytest

from tests.helpers import CLI, COMMON, ENV, check_contract, checkpoints, cli, run_checked, run_cli, train

Q2 = ["--set", "num_directions=2"]


@pytest.fixture(scope="module")
def one_rank_q2(tmp_path_factory) -> dict:
    return train("python", 1, tmp_path_factory.mktemp("hybrid") / "one", *Q2)


@pytest.mark.multirank
def test_two_directions_match_at_one_rank_one_group_and_two_groups(one_rank_q2, tmp_path):
    """The same digest at 1 rank, 2 ranks in one group and 4 ranks in 2 groups; and shard_group_size may change on
    resume (RESUME_MAY_CHANGE): the 4-rank job's last checkpoint before its end, written by group 0, continues on one
    process (in a directory of its own) to the same digest."""
    one_group = train("torchrun", 2, tmp_path / "two", *Q2)
    two_groups = train("torchrun", 4, tmp_path / "four", *Q2, "--set", "shard_group_size=2")
    assert one_group["world_size"] == 2 and two_groups["world_size"] == 4
    assert one_rank_q2["params_digest"] == one_group["params_digest"] == two_groups["params_digest"]
    out, step = tmp_path / "resumed", max(s for s in checkpoints(tmp_path / "four") if s < two_groups["steps"])
    checkpoint = tmp_path / "four" / f"checkpoint-{step}"
    run_checked(CLI + COMMON + Q2 + ["--set", f"output_dir={out}", "--resume", str(checkpoint)], ENV)
    assert json.loads((out / "summary.json").read_text())["params_digest"] == one_rank_q2["params_digest"]
    # The directions differ from one direction per step (the update is their average).
    plain = train("python", 1, tmp_path / "q1")
    assert plain["params_digest"] != one_rank_q2["params_digest"]


@pytest.mark.slow
def test_bad_group_layouts_are_one_line(tmp_path):
    """One process: shard_group_size must divide the world, and must be a positive integer; num_directions too. (q
    must also be a multiple of the number of replica groups, which needs 2 ranks or more: tests/test_zero3.py's
    test_replica_groups_that_do_not_divide_the_directions_are_refused, in its worker launches.)"""

    for sets, words in ((["shard_group_size=2"], "must divide the world size 1"),
                        (["shard_group_size=0"], "shard_group_size=0 is invalid"),
                        (["num_directions=0"], "num_directions=0 is invalid")):
        cmd = CLI + COMMON + [a for s in sets for a in ("--set", s)] + ["--set", f"output_dir={tmp_path / 'x'}"]
        proc = run_cli(cmd, env=ENV, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("curvzo-ds train: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and words in errors[0], proc.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_opt_dir(tmp_path_factory):
    """A Hugging Face model directory (a tiny OPT and its tokenizer), loaded by from_pretrained under zero.Init."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from curvzo_ds.tasks import load_tokenizer

    path = tmp_path_factory.mktemp("tinyopt")
    torch.manual_seed(0)
    tok = load_tokenizer("opt")
    OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64)
                   ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.multirank
def test_a_hub_model_loads_into_every_shard_group(tiny_opt_dir, tmp_path):
    """from_pretrained under zero.Init partitions over each shard group, and group 0's weights reach the other
    groups (transformers reads the files on global rank 0 only): 4 ranks in 2 groups, and 2 ranks in groups of one,
    give the one-process digest."""
    hub = [*Q2, "--set", f"model={tiny_opt_dir}", "--set", "learning_rate=1e-3", "--set", "zo_eps=1e-2"]
    one = train("python", 1, tmp_path / "one", *hub)
    two_groups = train("torchrun", 4, tmp_path / "four", *hub, "--set", "shard_group_size=2")
    replicas = train("torchrun", 2, tmp_path / "two", *hub, "--set", "shard_group_size=1")
    assert one["skipped_steps"] == 0
    assert one["params_digest"] == two_groups["params_digest"] == replicas["params_digest"]


# COMMON without its --deepspeed file (which sets zero_optimization.stage 3): the CLI's default layout, `auto`.
DEFAULT = [a for i, a in enumerate(COMMON) if "--deepspeed" not in COMMON[max(i - 1, 0):i + 1]]


@pytest.mark.multirank
def test_the_default_layout_is_stage_0_with_the_zero3_digest(one_rank_q2, tmp_path):
    """zero_stage: auto (docs/scaling.md): the demo model fits every rank, so a default run takes stage 0 (every
    rank a whole copy, micro-batches split over the ranks) at 1, 2 and 3 ranks, and gives the params_digest of
    ZeRO-3: the DeepSpeed file's stage 3 at one rank (one_rank_q2), and `--set zero_stage=3` at 3 ranks."""
    assert "--deepspeed" not in DEFAULT and len(DEFAULT) == len(COMMON) - 2
    assert one_rank_q2["layout"]["zero_stage"] == 3 and "zero_optimization.stage=3" in one_rank_q2["layout"]["reason"]
    for n in (1, 2, 3):
        out = tmp_path / f"auto{n}"
        proc = cli("train", *DEFAULT, *Q2, "--set", f"output_dir={out}", env=ENV, nproc=n)
        assert proc.returncode == 0, proc.stderr[-4000:]
        check_contract(out)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["layout"]["zero_stage"] == 0 and summary["layout"]["replicas"] == n, summary["layout"]
        assert "fits one device" in summary["layout"]["reason"]
        assert [line for line in proc.stderr.splitlines() if "layout: zero_stage=0" in line], proc.stderr[-2000:]
        assert summary["params_digest"] == one_rank_q2["params_digest"], n
    out = tmp_path / "zero3"
    proc = cli("train", *DEFAULT, *Q2, "--set", "zero_stage=3", "--set", f"output_dir={out}", env=ENV, nproc=3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"]["zero_stage"] == 3 and summary["layout"]["shard_group_size"] == 3, summary["layout"]
    assert summary["params_digest"] == one_rank_q2["params_digest"]
    # A checkpoint written under ZeRO-3 (3 ranks, before the last step) resumes under the default layout (stage 0, 2
    # ranks).
    checkpoint = out / f"checkpoint-{max(s for s in checkpoints(out) if s < summary['steps'])}"
    out = tmp_path / "resume"
    proc = cli("train", *DEFAULT, *Q2, "--set", f"output_dir={out}", "--resume", str(checkpoint), env=ENV, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"]["zero_stage"] == 0 and summary["params_digest"] == one_rank_q2["params_digest"]
