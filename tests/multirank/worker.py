"""One rank of a multi-rank engine test: runs a list of scenarios in one launch (saves start-up).

    torchrun --nproc_per_node W tests/multirank/worker.py SPEC.json OUT.json

Each scenario builds a tiny Llama on every rank with the same seed, hands it to
`deepspeed.initialize` (ZeRO-3 partitions it), trains it with ZOEngine on a world-size-
independent stream of micro-batches, and records the trajectory bit for bit (floats as
Python floats, scores as hashes of their bytes) and the final params_digest. A scenario with "resume" (a directory)
also saves a checkpoint after step "save_at" under resume/w<W>, and a fresh engine resumes from the one the previous
launch (W - 1 ranks) wrote and takes the remaining steps: resumes 1 -> 1, 1 -> 2 and 2 -> 3.
"""

import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from common import main

from curvzo_ds import MicroBatches, ZOConfig, ZOEngine
from curvzo_ds.errors import RanksDisagree
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.shard.distributed import GroupMPU, Topology, init_distributed


def tiny_llama(seed: int, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    target = batch["input_ids"][:, 1:]
    mask = batch["attention_mask"][:, 1:].to(torch.float32)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                            target.reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum(), mask.sum()


def micro_batches(step: int, n_micro: int, rows: int):
    """The step's global batch: n_micro micro-batches, each padded to its own longest row."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n_micro):
        lengths = torch.randint(4, 12, (rows,), generator=gen)
        width = int(lengths.max())
        ids = torch.randint(1, 96, (rows, width), generator=gen)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask})
    return out


def run(spec: dict, rank: int, world: int) -> dict:
    if spec.get("disagree") == "data":
        return data_disagree(rank)
    if spec.get("directions_layouts"):
        return directions_layouts(spec["directions_layouts"], world)
    built = build(spec, rank, world)
    if spec.get("disagree"):
        return disagree(spec, built[0], rank)
    return train(spec, world, *built)


def build(spec: dict, rank: int, world: int, zo_extra: dict | None = None):
    """The scenario's model under deepspeed.initialize, its ZOEngine (its config with `zo_extra`) and topology."""
    import deepspeed

    model = tiny_llama(0, spec.get("tie", False))
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # every rank must create the same adapters (docs/integrations.md)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    zero = {"stage": spec.get("stage", 3), "stage3_param_persistence_threshold": spec.get("persist", 100)}
    if spec.get("offload"):
        zero["offload_param"] = {"device": "cpu"}
    # shard_group_size: hybrid sharding, each replica group its own ZeRO-3 partition and its own directions.
    topology = Topology.create(spec["shard_group_size"]) if spec.get("shard_group_size") else None
    group = topology.shard.group if topology is not None else None
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": topology.shard.world_size if topology is not None else world,
              "zero_optimization": zero}
    if spec.get("bf16"):
        model.to(torch.bfloat16)
        ds_cfg["bf16"] = {"enabled": True}
    ds_engine, *_ = deepspeed.initialize(model=model, config=ds_cfg,
                                         mpu=GroupMPU(group) if group is not None else None)
    if spec.get("disagree"):
        return ds_engine, None, topology
    zo = ZOEngine(ds_engine, lm_loss, ZOConfig(**{**spec["zo"], **(zo_extra or {})}), topology=topology)
    return ds_engine, zo, topology


def steps(spec: dict, zo: ZOEngine, first: int, traj: list, save: str | None = None) -> None:
    """Steps first .. spec["steps"] - 1 of the scenario's stream; with `save`, a checkpoint there after step
    spec["save_at"]."""
    from curvzo_ds import save_checkpoint

    for t in range(first, spec["steps"]):
        r = zo.step(MicroBatches(micro_batches(t, spec["n_micro"], spec.get("rows", 2))))
        row = r.as_dict()
        row["scores"] = hashlib.sha256(zo.sampler.scores.numpy().tobytes()).hexdigest()[:16]
        pi = zo.sampler.probabilities(zo.step_count).pi
        row["pi"] = hashlib.sha256(pi.numpy().tobytes()).hexdigest()[:16]
        traj.append(row)
        if save and zo.step_count == spec["save_at"]:
            save_checkpoint(zo, save)


def resumed(spec: dict, rank: int, world: int) -> dict:
    """spec["resume"]: a fresh engine (its config with spec.get("resume_zo")) loads the checkpoint that the previous
    launch wrote (world size W - 1; at 1, this launch's own) and takes the remaining steps."""
    from curvzo_ds import load_checkpoint

    source = os.path.join(spec["resume"], f"w{max(1, world - 1)}", f"checkpoint-{spec['save_at']}")
    _, zo, _ = build(spec, rank, world, spec.get("resume_zo"))
    load_checkpoint(zo, source)
    traj: list = []
    steps(spec, zo, spec["save_at"], traj)
    return {"traj": traj, "digest": params_digest(zo.entries, zo.comm), "perturbation": zo.cfg.perturbation,
            "noise": zo.noise.ident, "from_world": max(1, world - 1)}


def train(spec: dict, world: int, ds_engine, zo: ZOEngine, topology) -> dict:
    rank = dist.get_rank()
    if spec["zo"].get("static_mask"):  # the probe: every rank runs every micro-batch of two global batches
        zo.fit_static_mask([MicroBatches(micro_batches(500 + t, spec["n_micro"], spec.get("rows", 2)))
                            for t in range(2)])
    calls = {"n": 0, "elements": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        calls["n"] += 1
        calls["elements"] += tensor.numel()
        return real_all_reduce(tensor, *a, **k)

    dist.all_reduce = counting_all_reduce
    traj = []
    try:
        steps(spec, zo, 0, traj, os.path.join(spec["resume"], f"w{world}") if spec.get("resume") else None)
    finally:
        dist.all_reduce = real_all_reduce
    owned = sum(e.owned[1] - e.owned[0] for e in zo.entries)
    owned_all = [0] * world
    dist.all_gather_object(owned_all, owned)
    return {
        "traj": traj,
        "digest": params_digest(zo.entries, zo.comm),
        "num_blocks": zo.num_blocks,
        "num_params": zo.num_params,
        "engine_all_reduce": dict(zo.comm.stats),
        "torch_all_reduce": calls,
        "owned_per_rank": owned_all,
        "master_elements": sum(e.master.numel() for e in zo.entries if e.master is not None),
        "dtypes": sorted({str(e.param.dtype) for e in zo.entries}),
        "persistent": sorted(e.name for e in zo.entries if e.region == (0, e.numel) and e.partitioned),
        "perturbation": zo.cfg.perturbation,
        "noise": zo.noise.ident,
        **({"resumed": resumed(spec, rank, world)} if spec.get("resume") else {}),
    }


def directions_layouts(directions: list[int], world: int) -> dict:
    """choose_layout at this world size with ZeRO-3 shard groups of one rank (W replica groups) and each q of
    `directions`: the layout's replicas, or the one-line refusal (check_directions)."""
    from curvzo_ds.config.resolve import resolve
    from curvzo_ds.config.schema import TrainConfig
    from curvzo_ds.errors import ConfigError
    from curvzo_ds.layout.choice import choose_layout
    from curvzo_ds.shard.comm import Comm

    out = {}
    for q in directions:
        cfg = resolve(TrainConfig(zero_stage=3, shard_group_size=1, num_directions=q, report_to="none"))
        try:
            out[str(q)] = {"replicas": choose_layout(cfg, None, Comm()).replicas}
        except ConfigError as e:
            out[str(q)] = {"refused": str(e)}
    return out


def other_kernel(real):
    """A noise kernel of another build: the same call, but the last bit of every float32 value it writes differs."""
    def run(k0, k1, start, out, mode, scale, alpha, want_sq, *rademacher):
        total = real(k0, k1, start, out, mode, scale, alpha, want_sq, *rademacher)
        if out.dtype == torch.float32:
            out.view(torch.int32).bitwise_xor_(1)
        return total

    return run


def disagree(spec: dict, ds_engine, rank: int) -> dict:
    """Rank 1 differs from the others ("seed": its seed; "kernel": its CPU noise kernel). Every rank records the
    error its ZOEngine raised at start-up (None if it raised none)."""
    from curvzo_ds.noise import cpu as cpu_kernel

    config = ZOConfig(**{**spec["zo"], "seed": rank if spec["disagree"] == "seed" else spec["zo"].get("seed", 42)})
    real = cpu_kernel.run
    if spec["disagree"] == "kernel" and rank == 1:
        cpu_kernel.run = other_kernel(real)
    error = None
    try:
        ZOEngine(ds_engine, lm_loss, config)
    except RanksDisagree as e:
        error = str(e)
    finally:
        cpu_kernel.run = real
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return {"error": error, "errors": errors}


def data_disagree(rank: int) -> dict:
    """build's check that every rank tokenized the same data: the same data passes; rank 1's other data stops every
    rank (the error each rank raised, gathered)."""
    from curvzo_ds.shard.comm import Comm
    from curvzo_ds.train.inputs import check_data_agrees

    train, dev = [{"input_ids": [1, 2]}], {"dev": [{"input_ids": [3]}]}
    check_data_agrees(Comm(), train, dev)  # the same data everywhere: no error
    error = None
    try:
        check_data_agrees(Comm(), train, {"dev": [{"input_ids": [3 + (rank == 1)]}]})
    except RanksDisagree as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return {"error": error, "errors": errors}


def run_all(args: list[str], out_path: str) -> dict:
    rank, world, _ = init_distributed()
    results, seconds = {}, {}
    for spec in json.load(open(args[0])):
        if spec.get("min_world", 1) > world:
            continue
        if rank == 0:
            print(f"scenario {spec['name']} at world size {world}", flush=True)  # for the log of a failure
        started = time.perf_counter()
        results[spec["name"]] = run(spec, rank, world)
        seconds[spec["name"]] = round(time.perf_counter() - started, 2)  # where a slow launch spends its time
        if rank == 0:
            print(f"scenario {spec['name']} took {seconds[spec['name']]} s", flush=True)
    return {"world_size": world, "results": results, "seconds": seconds}


if __name__ == "__main__":
    main(run_all)
