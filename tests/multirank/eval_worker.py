"""One rank of the multi-rank evaluation tests: every scenario in one launch (saves start-up).

    torchrun --nproc_per_node W tests/multirank/eval_worker.py [SPEC.json] OUT.json

- "zero_init": a tiny Llama built inside `deepspeed.zero.Init` alone (no live HfDeepSpeedConfig,
  so transformers' generate() would not sync ranks by itself), evaluated on SQuAD. Its newline
  logit is scaled up so that greedy answers end after a prompt-dependent number of tokens: ranks
  stop at different lengths. Every generate() call records its length and its synced_gpus.
- "sst2", "squad": `build` (the CLI's set-up: demo model from a fixed seed, partitioned by
  deepspeed.initialize) evaluated on dev and test; the Job's data loading is timed on each rank.
- "first", "first_subgroup": `main_process_first` on the world group and on the group of ranks
  1..W-1 (whose rank 0 is global rank 1); each rank records when its body ran.
- "own_data" (with SPEC.json, at 1 and 2 ranks): `curvzo-ds train` itself (`cli.main` in each rank's process, as
  the launchers start it) for each of SPEC's runs: {name: [arguments]}, into SPEC's directory; each run's exit code,
  output directory and summary.json.
"""

import json
import time

import torch
import torch.distributed as dist
from common import main

import curvzo_ds.models
import curvzo_ds.tasks
from curvzo_ds import data as D
from curvzo_ds.config.schema import TrainConfig
from curvzo_ds.shard.comm import Comm, main_process_first
from curvzo_ds.shard.distributed import init_distributed
from curvzo_ds.train.evaluate import evaluate

MAX_NEW_TOKENS = 16


def boost_newline(module, tokenizer, scale: float) -> None:
    """Scale the lm_head row of the newline token (gathered, edited on rank 0, re-partitioned).

    The scales used were picked in one process so that greedy SQuAD answers end after 1 to 16 tokens."""
    import deepspeed

    newline = tokenizer.convert_tokens_to_ids("<0x0A>")
    weight = module.lm_head.weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            weight[newline] *= scale


def record_generate(module, calls: list) -> None:
    """Record (prompt, new token ids, synced_gpus) of every generate() call of this rank."""
    real = module.generate

    def generate(input_ids, **kwargs):
        out = real(input_ids=input_ids, **kwargs)
        prompt = input_ids[0].tolist()
        calls.append((" ".join(map(str, prompt)), out[0, len(prompt):].tolist(), kwargs.get("synced_gpus")))
        return out

    module.generate = generate


def zero_init_scenario(world: int) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    tokenizer = curvzo_ds.tasks.load_tokenizer("llama")
    task = curvzo_ds.tasks.get_task("squad")
    splits = curvzo_ds.tasks.load_splits(task, 0, 1, 8, None, data_dir="samples")
    encoded = [D.encode(task, tokenizer, ex, 512, True, MAX_NEW_TOKENS) for ex in splits["dev"] + splits["test"]]
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    config = curvzo_ds.tasks.demo_model_config("llama")  # imports transformers' modules outside zero.Init
    config.pad_token_id = None  # transformers' init zeroes the padding row, which a partitioned weight lacks
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = AutoModelForCausalLM.from_config(config)
    hf_zero3 = is_deepspeed_zero3_enabled()
    engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
    boost_newline(engine.module, tokenizer, 1.6)
    calls = []
    record_generate(engine.module, calls)
    metrics = evaluate(engine, task, tokenizer, encoded, 3, Comm(), engine.device, MAX_NEW_TOKENS, D.lm_loss)
    return {"metrics": metrics, "calls": Comm().all_gather_object(calls), "hf_zero3_enabled": hf_zero3,
            "partitioned": hasattr(engine.module.lm_head.weight, "ds_tensor")}


def run_scenario(task: str, rank: int) -> dict:
    import curvzo_ds.train.inputs
    from curvzo_ds.train.build import build

    times = []
    real_tok, real_splits = curvzo_ds.train.inputs.load_tokenizer, curvzo_ds.train.inputs.load_splits

    def timed(fn, delay):
        def wrapper(*args, **kwargs):
            start = time.time()
            if rank == 0:
                time.sleep(delay)  # so that a rank that did not wait would visibly start first
            out = fn(*args, **kwargs)
            times.append((start, time.time()))
            return out
        return wrapper

    curvzo_ds.train.inputs.load_tokenizer = timed(real_tok, 0.3)  # the names load_data() looks up
    curvzo_ds.train.inputs.load_splits = timed(real_splits, 0.3)
    try:
        num_train, num_dev = {"sst2": (4, 7), "squad": (2, 5)}[task]  # test: the whole validation file
        cfg = TrainConfig(model="demo", task=task, data_dir="samples", num_train=num_train, num_dev=num_dev,
                          global_batch_size=2, micro_batch_size=2, max_new_tokens=MAX_NEW_TOKENS,
                          disable_tqdm=True, report_to="none", log_level="warning",
                          zero_stage=3)  # ZeRO-3 evaluation: collective gathers, synced generate(), boost_newline
        run = build(cfg)
    finally:
        curvzo_ds.train.inputs.load_tokenizer, curvzo_ds.train.inputs.load_splits = real_tok, real_splits
    calls = []
    if task == "squad":
        boost_newline(run.model.module, run.tokenizer, 3.0)
        record_generate(run.model.module, calls)
    out = {s: run.evaluate(s) for s in ("dev", "test")}
    out["sizes"] = {s: len(run.eval_data[s]) for s in ("dev", "test")}
    out["load_times"] = run.engine.comm.all_gather_object(times)
    out["calls"] = run.engine.comm.all_gather_object(calls)
    return out


def first_scenario(comm: Comm) -> tuple[float, float]:
    with main_process_first(comm):
        start = time.time()
        time.sleep(0.3 if comm.rank == 0 else 0.0)
        end = time.time()
    return start, end


def own_data_scenario(spec_path: str, world: int) -> dict:
    from curvzo_ds.cli import main as cli

    spec = json.loads(open(spec_path).read())
    out = {}
    for name, args in spec["runs"].items():
        run = f"{spec['directory']}/{name}-w{world}"
        code = cli(["train", *args, "--set", f"output_dir={run}"])
        summary = json.loads(open(f"{run}/summary.json").read()) if code == 0 else None
        out[name] = {"code": code, "dir": run, "summary": summary}
    return out


def run_all(args: list[str], out_path: str) -> dict:
    rank, world, _ = init_distributed()
    comm = Comm()
    results = {"first": comm.all_gather_object(first_scenario(comm))}
    if world > 1:
        ranks = list(range(1, world))
        group = dist.new_group(ranks)  # every rank takes part in creating it
        mine = first_scenario(Comm(group)) if rank in ranks else None
        results["first_subgroup"] = comm.all_gather_object(mine)
    results["zero_init"] = zero_init_scenario(world)
    results["sst2"] = run_scenario("sst2", rank)
    results["squad"] = run_scenario("squad", rank)
    if args and world <= 2:
        results["own_data"] = own_data_scenario(args[0], world)
    return {"world_size": world, "results": results}


if __name__ == "__main__":
    main(run_all)
