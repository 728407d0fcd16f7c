"""`curvzo-ds plan`: the verdict line, its errors, the AdamW figure, shard scaling, and the planned peak against
the measured one (slow tier: runs of the CLI's defaults at 1 and 2 ranks, peak RSS above the runtime baseline).

Run as a script under torchrun, this file is the measuring worker (`_measure`).
"""

import json
import pathlib

import pytest

from curvzo_ds.cli import main
from curvzo_ds.layout.memory import GiB, parse_memory, plan_memory, published_key, shard_elements

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_last_line_says_fits_or_does_not_fit_and_the_exit_code_follows(capsys):
    """docs/plan.md: exit 0 when the plan fits, 1 when it does not, so that a script can branch on it."""
    code, out, _ = run_plan(capsys, "--model", "llama2-7b", "--world-size", "8", "--batch", "16", "--seq-len", "256")
    assert code == 0 and out.strip().splitlines()[-1].startswith("fits: ")
    code, out, _ = run_plan(capsys, "--model", "llama2-13b", "--world-size", "1", "--gpu-memory", "24GiB")
    assert code == 1 and out.strip().splitlines()[-1].startswith("does not fit: ")


def test_a_plan_that_does_not_fit_says_whether_offloading_makes_it_fit(capsys):
    args = ["--model", "llama2-13b", "--world-size", "1"]
    code, out, _ = run_plan(capsys, *args, "--gpu-memory", "24GiB")
    *_, hint, verdict = out.strip().splitlines()
    assert code == 1 and verdict.startswith("does not fit: ")
    assert hint.startswith("offload: with --offload cpu it fits (train with --set offload_param=cpu): "), hint
    offloaded = plan_memory(model="llama2-13b", world_size=1, offload="cpu", gpu_memory="24GiB")
    # the bf16 weights (26 GB) move to the host; ZeRO-3 fetches them to the GPU module by module even at K = 1
    assert offloaded.fits and offloaded.host > 24 * GiB and 0 < offloaded.gathered < offloaded.total < 24 * GiB
    assert f"{offloaded.total / GiB:.2f} GiB of 24.0 GiB per rank on the GPU" in hint
    code, out, _ = run_plan(capsys, *args, "--gpu-memory", "1GiB")
    *_, hint, verdict = out.strip().splitlines()
    assert code == 1 and verdict.startswith("does not fit: ")
    assert hint.startswith("offload: --offload cpu does not make it fit either: "), hint
    for other, expected in ((["--gpu-memory", "80GiB"], 0), (["--offload", "cpu", "--gpu-memory", "1GiB"], 1)):
        code, out, _ = run_plan(capsys, *args, *other)
        assert code == expected and "offload:" not in out


@pytest.mark.parametrize("args", [["--world-size", "0"], ["--world-size", "-8"],
                                  ["--world-size", "8", "--shard-group-size", "3"],
                                  ["--world-size", "2", "--gpu-memory", "lots"],
                                  ["--world-size", "2", "--model", "no-such-model-anywhere"]])
def test_bad_arguments_are_one_line_and_exit_2(capsys, args):
    code, out, err = run_plan(capsys, "--model", "demo", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("curvzo-ds plan: error: ")


def test_a_directory_without_config_json_is_one_line(capsys, tmp_path):
    code, _, err = run_plan(capsys, "--model", str(tmp_path), "--world-size", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "config.json" in err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: auto)", "(default: 4)", "(default: 512)", "(default: 80GiB)", "(default: demo)"):
        assert default in text, default
    assert "else bf16" in text and "local cache" in text


def test_dtype_auto_follows_the_model_configs_torch_dtype(capsys, tmp_path):
    """Issue 28 §10: without --dtype, a float32 model is planned in float32 (4 bytes a weight), and the plan says
    why; a config that names no dtype is planned in bf16; --dtype and a DeepSpeed bf16 section still win."""
    from transformers import LlamaConfig

    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    for name, dtype in (("fp32", "float32"), ("fp16", "float16"), ("none", None)):
        LlamaConfig(**small).save_pretrained(tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        config.pop("dtype", None)
        if dtype:
            config["torch_dtype"] = dtype  # the older key, as most published checkpoints still write it
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    fp32 = plan_memory(str(tmp_path / "fp32"), 2, dtype="auto")
    assert (fp32.dtype, fp32.dtype_from) == ("float32", "the model config's torch_dtype")
    assert fp32.shard == 2 * plan_memory(str(tmp_path / "fp32"), 2, dtype="bf16").shard
    assert plan_memory(str(tmp_path / "fp16"), 2, dtype="auto").dtype == "float16"
    assert plan_memory(str(tmp_path / "none"), 2, dtype="auto").dtype == "bfloat16"
    assert plan_memory(str(tmp_path / "fp32"), 2, dtype="fp16").dtype == "float16"
    (tmp_path / "bf16.json").write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    assert plan_memory(str(tmp_path / "fp32"), 2, dtype="auto", deepspeed=str(tmp_path / "bf16.json")).dtype_from \
        .startswith("the deepspeed config")
    code, out, _ = run_plan(capsys, "--model", str(tmp_path / "fp32"), "--world-size", "2")
    assert code == 0 and "float32 (the model config's torch_dtype)" in out.splitlines()[0]


def test_plan_recommends_the_layout_auto_takes(capsys):
    """docs/scaling.md: llama2-7b fits whole on each of 8 x 80 GiB, so `auto` takes stage 0 (replicas); llama2-70b
    does not fit one 80 GiB device, so it takes ZeRO-3 shard groups, the whole job at num_directions=1 and the
    smallest fitting group (4, inside a node) when the directions keep its replica groups busy. The layout lines
    come before the verdict, with the alternatives that fit and what they all-gather."""
    code, out, _ = run_plan(capsys, "--model", "llama2-7b", "--world-size", "8", "--gpu-memory", "80GiB")
    lines = out.strip().splitlines()
    assert code == 0 and lines[-1].startswith("fits: ")
    layout = [line for line in lines if line.startswith("layout: ")]
    assert len(layout) == 1 and layout[0].startswith("layout: zero_stage=0 replicas=8"), out
    # the table and the verdict are the chosen layout's: the whole model on each rank (shard group 1)
    whole = plan_memory("llama2-7b", 8, shard_group_size=1)
    assert "world size 8, shard group 1," in lines[0] and lines[-1].startswith(f"fits: {whole.total / GiB:.2f} GiB")
    assert layout[0].split(": ")[2].startswith(f"{whole.total / GiB:.2f} GiB per rank")
    also = [line for line in lines if line.startswith("  also fits: ")]
    assert any("zero_stage=3 shard_group_size=8" in line and "all-gathered per rank per step" in line
               for line in also), out
    assert lines.index(layout[0]) < len(lines) - 1

    code, out, _ = run_plan(capsys, "--model", "llama2-70b", "--world-size", "16", "--gpu-memory", "80GiB")
    layout = [line for line in out.splitlines() if line.startswith("layout: ")]
    assert code == 0 and layout[0].startswith("layout: zero_stage=3 shard_group_size=16 replicas=1"), out
    assert "does not fit one device" in layout[0]
    assert not any("zero_stage=0" in line for line in out.splitlines()), out
    code, out, _ = run_plan(capsys, "--model", "llama2-70b", "--world-size", "16", "--gpu-memory", "80GiB",
                            "--num-directions", "4")
    layout = [line for line in out.splitlines() if line.startswith("layout: ")]
    assert layout[0].startswith("layout: zero_stage=3 shard_group_size=4 replicas=4"), out


def test_plan_counts_the_all_gathers_of_the_runs_difference(capsys):
    """--difference rloo: one forward per direction, so a ZeRO-3 layout all-gathers half of central's parameter
    bytes per step (DIFFERENCE_SPECS); central is the default; rloo with one direction is refused (exit 2)."""
    args = ("--model", "llama2-13b", "--world-size", "8", "--batch", "16", "--num-directions", "4")

    def gathered(out):
        return {line.split("shard_group_size=")[1].split()[0]: float(line.split("GiB per rank, ")[1].split()[0])
                for line in out.splitlines() if line.startswith("  also fits: zero_stage=3")}

    central, rloo = (gathered(run_plan(capsys, *args, *extra)[1]) for extra in ((), ("--difference", "rloo")))
    assert central == gathered(run_plan(capsys, *args, "--difference", "central")[1])
    assert central.keys() == rloo.keys() and len(central) == 3
    full = plan_memory("llama2-13b", 8, shard_group_size=8)
    assert central["8"] == pytest.approx(2 * 4 * full.params * 2 / GiB, abs=0.01)  # 2 forwards x 4 directions, bf16
    for k in central:
        assert rloo[k] == pytest.approx(central[k] / 2, abs=0.01)
    code, _, err = run_plan(capsys, "--model", "demo", "--world-size", "2", "--difference", "rloo")
    assert code == 2 and "--difference rloo needs --num-directions 2 or more" in err


def test_a_step_of_several_directions_counts_its_copy_of_the_bf16_weights_only(capsys):
    """--num-directions q > 1: bf16 weights without an fp32 copy are copied once per step (shard/perturb.py), fp32
    weights and fp32-copied tensors not at all; at q = 1 nothing. The copy is the shard of those tensors."""
    one = plan_memory("llama2-7b", 8, shard_group_size=8, dtype="bf16")
    eight = plan_memory("llama2-7b", 8, shard_group_size=8, dtype="bf16", num_directions=8)
    assert one.step_copy == 0 and eight.total - one.total == eight.step_copy
    masters = plan_memory("llama2-7b", 8, shard_group_size=8, dtype="bf16", fp32_master=True, num_directions=8)
    assert masters.step_copy == 0
    # auto: the 1-D tensors have fp32 copies, so the copy is the matrices' shard: all but a sliver of the weights
    assert 0.99 * eight.shard < eight.step_copy < eight.shard
    assert plan_memory("llama2-7b", 8, shard_group_size=8, dtype="fp32", num_directions=8).step_copy == 0
    code, out, _ = run_plan(capsys, "--model", "llama2-7b", "--world-size", "8", "--shard-group-size", "8",
                            "--dtype", "bf16", "--num-directions", "8")
    row = next(line for line in out.splitlines() if "copy of bf16/fp16 weights for a step of 8 directions" in line)
    assert code == 0 and row.rstrip().endswith(f"{eight.step_copy / GiB:.3f} GiB")


def test_auto_prefers_groups_inside_a_node():
    from curvzo_ds.layout.choice import group_candidates

    assert group_candidates(16, 8) == [1, 2, 4, 8, 16]
    assert group_candidates(12, 4) == [1, 2, 4, 3, 6, 12]
    assert group_candidates(3) == [1, 3]


def test_published_names_and_parameter_counts():
    assert {published_key(n) for n in ("llama2-7b", "Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf")} == {"llama2-7b"}
    assert published_key("facebook/OPT-13B") == "opt-13b"
    # The parameter counts of the published checkpoints.
    counts = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "opt-2.7b": 2_651_596_800}
    for name, n in counts.items():
        assert plan_memory(name, 8).params == n, name


def test_adamw_needs_more_than_curvzo():
    for w in (1, 8):
        p = plan_memory("llama2-7b", w, batch=16, seq_len=256)
        assert p.adamw > 2 * p.total, (w, p.adamw, p.total)
        assert p.adamw_states >= 18 * p.params / w


def test_shard_scales_with_world_size_and_shard_group():
    one = plan_memory("opt-2.7b", 1)
    eight = plan_memory("opt-2.7b", 8)
    assert one.shard / 8 <= eight.shard <= one.shard / 8 + 2 * one.tensors  # ceil(numel / 8) per tensor, bf16
    assert one.gathered == 0 and one.persistent == 0  # one rank gathers nothing
    hybrid = plan_memory("opt-2.7b", 8, shard_group_size=2)
    assert hybrid.shard == plan_memory("opt-2.7b", 2).shard and hybrid.group == 2
    assert plan_memory("opt-2.7b", 64).shard < eight.shard


def test_max_batch_is_the_boundary():
    p = plan_memory("llama2-7b", 8, batch=16, seq_len=256)
    at = plan_memory("llama2-7b", 8, batch=p.max_batch, seq_len=256)
    over = plan_memory("llama2-7b", 8, batch=p.max_batch + 1, seq_len=256)
    assert at.fits and not over.fits
    assert plan_memory("llama2-70b", 1, batch=1, seq_len=256).max_batch == 0


def test_tensors_beyond_2_to_the_31_on_the_meta_device(tmp_path):
    from transformers import LlamaConfig

    big = 2**20 + 3  # vocabulary: an embedding of 4.3e9 elements, never allocated
    LlamaConfig(vocab_size=big, hidden_size=4096, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
                tie_word_embeddings=True).save_pretrained(tmp_path)
    p = plan_memory(str(tmp_path), 7, dtype="fp32")
    assert big * 4096 > 2**32 and shard_elements(big * 4096, 7) == -(-big * 4096 // 7)
    assert p.largest_module == big * 4096
    assert p.shard >= 4 * shard_elements(big * 4096, 7)


def test_gather_peak_replays_deepspeeds_prefetcher():
    """A chain of four 100-element tensors, K = 2, 4-byte weights: the root's call prefetches a bucket of two (flat
    buffer); the first tensor's wait copies both out; its call prefetches the next two while the first buffer
    lives (one tensor of it still unfetched). With gloo, the second gather's own temporary too."""
    from types import SimpleNamespace

    from curvzo_ds.layout.prefetch import gather_peak

    zero = SimpleNamespace(max_live_parameters=10**9, prefetch_bucket_size=150, max_reuse_distance=0)
    calls = [[], [0], [1], [2], [3]]
    assert gather_peak(calls, [100] * 4, set(), 2, zero, 4) == (4 * 600, 4 * 600)
    assert gather_peak(calls, [100] * 4, set(), 2, zero, 4, gloo=True)[0] == 4 * 800
    # No prefetch (bucket 0): one module at a time; several tensors are copied out, one is used in place (its
    # buffer padded to K * ceil(numel / K)); persistent tensors are never gathered.
    zero.prefetch_bucket_size = 0
    assert gather_peak([[], [0, 1], [2]], [100, 50, 300], set(), 2, zero, 4)[0] == 4 * 300
    assert gather_peak([[], [0, 1], [2]], [100, 50, 301], {1}, 2, zero, 2)[0] == 2 * 302


def test_fp32_copy_follows_the_rule():
    assert plan_memory("llama2-7b", 8, fp32_master="false").master == 0
    auto = plan_memory("llama2-7b", 8)  # 1-D tensors: the norms, each persistent (4096 elements): whole
    assert auto.master == 4 * (2 * 32 + 1) * 4096
    full = plan_memory("llama2-7b", 8, fp32_master="true")
    assert full.master >= 2 * full.shard - 1  # 4 bytes per owned bf16 element
    assert plan_memory("llama2-7b", 8, dtype="fp32", fp32_master="true").master == 0


def test_table_row_is_the_perturbers():
    from curvzo_ds.layout import memory
    from curvzo_ds.noise import rows

    assert memory.TABLE_ROW == rows.ROW_BYTES == 8 * len(rows.COLUMNS)


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * GiB == parse_memory("80G") == parse_memory("80 gib")
    assert parse_memory("80GB") == 80 * 10**9 and parse_memory("512MiB") == 512 * 2**20


# ---------------------------------------------------------------------------------------------------------------
# Planned against measured: peak RSS above the runtime baseline, CLI defaults (float32, ds_configs/zero3.json,
# micro batch 4, global batch 16, the demo task). On CPU the memory that must fit is the process's.

TOLERANCE = 0.15
STEPS = 3  # the first records ZeRO-3's trace; prefetching starts with the second forward


def _measure(args: list[str], out_path: str) -> dict:
    """One rank: the runtime baseline (the libraries imported; the process group up), then the
    CLI's Job (build) at its defaults and STEPS steps; per-rank bytes and the shapes the forwards saw
    (rank 0 writes)."""
    import gc
    import importlib

    from curvzo_ds.config.load import load_config
    from curvzo_ds.layout.memory import trained_extent
    from curvzo_ds.shard.distributed import init_distributed
    from curvzo_ds.sysinfo import peak_rss_bytes, rss_bytes
    from curvzo_ds.train.build import build

    model, tokenizer = args[0], args[1] or None
    rank, world, _ = init_distributed()
    # The libraries a run imports on its way (torch._dynamo from DeepSpeed's engine, 82 MiB here; transformers'
    # modeling and tokenizer modules, which import scipy) are runtime, which the plan does not count: loaded before the
    # baseline. (peft loaded them at start-up until it became LoRA-only.)
    for name in ("torch._dynamo", "transformers.modeling_utils", "transformers.modeling_layers",
                 "transformers.masking_utils", "transformers.processing_utils", "transformers.tokenization_python",
                 "transformers.tokenization_utils_tokenizers"):
        importlib.import_module(name)
    gc.collect()
    baseline = rss_bytes(trim=True)
    sets = [f"model={model}", "max_steps=3", "disable_tqdm=true", "report_to=none", "output_dir=unused"]
    if tokenizer:
        sets.append(f"tokenizer={tokenizer}")
    run = build(load_config(None, sets, str(ROOT / "ds_configs" / "zero3.json")))
    loaded = peak_rss_bytes()
    rows, seq, positions = trained_extent(run, STEPS)
    figures = run.engine.comm.all_gather_object(dict(rank=rank, baseline=baseline, loaded_peak=loaded,
                                                     peak=peak_rss_bytes()))
    return dict(world=world, rows=rows, seq=seq, positions=positions, dtype=run.cfg.dtype, ranks=figures)


def measure(world: int, model: str, tokenizer: str | None, out: pathlib.Path) -> dict:
    from tests.helpers import ENV, free_port, run_checked, torchrun

    run_checked(torchrun(world, free_port(), __file__, model, tokenizer or "", str(out)), env=ENV)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def opt125m(tmp_path_factory):
    """An OPT model of facebook/opt-125m's shape (OPTConfig's defaults), saved as a local directory."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from curvzo_ds.tasks import load_tokenizer

    path = tmp_path_factory.mktemp("opt125m")
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig()).save_pretrained(path)
    load_tokenizer("opt").save_pretrained(path)
    return path


def check_against_plan(m: dict, model: str) -> tuple[int, int]:
    """(planned, measured) bytes: the plan of what ran against the largest rank's peak above its baseline."""
    p = plan_memory(model, m["world"], dtype=m["dtype"], batch=m["rows"], seq_len=m["seq"],
                    label_positions=m["positions"], deepspeed=str(ROOT / "ds_configs" / "zero3.json"), device="cpu")
    measured = max(r["peak"] - r["baseline"] for r in m["ranks"])
    print(f"{model} W={m['world']}: planned {p.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB "
          f"({m['rows']} x {m['seq']} tokens); per rank {[(r['peak'] - r['baseline']) >> 20 for r in m['ranks']]} "
          f"MiB, peak after loading {[(r['loaded_peak'] - r['baseline']) >> 20 for r in m['ranks']]} MiB")
    return p.total, measured


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("which", ["demo", "opt125m"])
def test_planned_peak_is_within_15_percent_of_the_measured(which, world, request, tmp_path):
    model = "demo" if which == "demo" else str(request.getfixturevalue("opt125m"))
    m = measure(world, model, None, tmp_path / "m.json")
    planned, measured = check_against_plan(m, model)
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


if __name__ == "__main__":
    from tests.multirank.common import main as worker_main

    worker_main(_measure)
