"""One rank of the integration tests: users' own code driving CurvZO.

    accelerate launch --config_file ds_configs/accelerate_zero3.yaml tests/multirank/integ_worker.py loop OUT
    deepspeed --num_gpus 2 tests/multirank/integ_worker.py trainer OUT   (ZO_RESUME=CKPT: resume from CKPT)
    python tests/multirank/integ_worker.py trainer OUT            (one process, no DeepSpeed)

- "loop": an Accelerate loop with `curvzo_ds.from_accelerator`: an unsharded data loader whose
  global batches are cut by `split_batch` (so the trajectory is world-size independent), a
  mid-run `accelerator.save_state()`, then `load_state()` and the same steps again.
- "trainer": `ZOTrainer` with the Hugging Face ZeRO-3 config full of "auto" values (optimizer and
  scheduler included) under DeepSpeed, or no DeepSpeed in one process; logging, evaluation,
  saving with rotation, then a second trainer resumed from the middle checkpoint.
- "lora_loop BASE_DIR" / "lora_trainer BASE_DIR": the model saved in BASE_DIR, loaded with from_pretrained and
  wrapped in a peft LoRA (r=4, q_proj and v_proj), 4 steps through `from_accelerator` (then
  `accelerator.save_state()`) or `ZOTrainer` (save_steps=4): the checkpoint to export, and the digest of the
  trained adapters (params_digest: under LoRA, the keys of peft's adapter state dict).
Rank 0 writes OUT (JSON): losses, digests, what was allocated.
"""

import os

import torch
from common import main

from curvzo_ds.config.schema import ZOConfig
from curvzo_ds.shard.digest import params_digest
from curvzo_ds.shard.ds_compat import optimizer_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, N_EXAMPLES, GLOBAL, MICRO = 16, 64, 8, 2
# A rate for the paper's step on the tiny model (ZOConfig's default rate_correction, max_weight, is for MeZO's rate).
ZO = dict(method="curvzo", learning_rate=1e-3, zo_eps=1e-2, score_warmup_steps=4, seed=7, rate_correction="none")


def tiny_model():
    from transformers import AutoModelForCausalLM

    from curvzo_ds.tasks import demo_model_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(demo_model_config("llama"))


def examples(vocab: int) -> list[dict]:
    """Sequences drawn from 8 of the vocabulary's tokens: a shift of the output distribution a tiny
    randomly initialised LM can start to learn in tens of ZO steps (one-process runs at lr 1e-3, 40
    steps, seeds 1, 2, 3, 7: the loss fell by 0.23, 0.15, 0.20, 0.24 nats from 7.16)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(N_EXAMPLES):
        ids = torch.randint(10, 18, (SEQ,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()})
    return out


def lm_loss(model, batch):
    """(sum of token losses, number of predicted tokens): the loss contract of docs/contracts.md."""
    device = next(iter(batch.values())).device
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    labels = batch["labels"][:, 1:].to(device)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="sum")
    return loss, labels.numel()


def no_grads(module) -> bool:
    return all(p.grad is None for p in module.parameters())


def loop_scenario(out_dir: str) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, default_collate

    from curvzo_ds import from_accelerator, split_batch

    accelerator = Accelerator()
    model = tiny_model()
    data = examples(model.config.vocab_size)
    # Not prepared by accelerate: every rank reads the same global batches; split_batch deals them out.
    loader = DataLoader(data, batch_size=GLOBAL, shuffle=True, generator=torch.Generator().manual_seed(3),
                        collate_fn=default_collate)
    engine = from_accelerator(accelerator, model, lm_loss, ZOConfig(**ZO), micro_batch_size=MICRO)
    device = accelerator.device
    fixed = split_batch({k: v.to(device) for k, v in default_collate(data[:GLOBAL]).items()}, MICRO)
    result = {"world_size": accelerator.num_processes, "loss_before": engine.loss(fixed),
              "ds_engine": type(engine.model).__name__,
              "optimizer": type(optimizer_of(engine.model)).__name__,
              # Accelerate wraps whatever deepspeed.initialize returns as "the optimizer": under ZeRO-3 with
              # none, that is DeepSpeedZeRoOffload, which only gathers parameters and holds no state.
              "accelerator_optimizers": [type(o.optimizer).__name__ for o in accelerator._optimizers]}
    batches = [split_batch({k: v.to(device) for k, v in b.items()}, MICRO) for _ in range(5) for b in loader][:40]
    losses, digests = [], {}
    for b in batches:
        losses.append(engine.step(b).loss)
        if engine.step_count == 20:
            accelerator.save_state(os.path.join(out_dir, "state-20"))
            digests[20] = params_digest(engine.entries, engine.comm)
    digests[40] = params_digest(engine.entries, engine.comm)
    result.update(losses=losses, loss_after=engine.loss(fixed), no_grads=no_grads(engine.module))
    # Back to step 20 from the saved state; the same 20 batches must give the same weights.
    accelerator.load_state(os.path.join(out_dir, "state-20"))
    result["step_after_load"] = engine.step_count
    result["digest_after_load"] = params_digest(engine.entries, engine.comm)
    for b in batches[20:]:
        engine.step(b)
    result["digest_replayed"] = params_digest(engine.entries, engine.comm)
    result["digests"] = digests
    result["saved_files"] = sorted(os.listdir(os.path.join(out_dir, "state-20")))
    return result


class Examples(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def trainer_scenario(out_dir: str) -> dict:
    from transformers import TrainingArguments

    from curvzo_ds import ZOTrainer

    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        # Without a GPU, Accelerate's DeepSpeed set-up does not start torch.distributed, and DeepSpeed's
        # zero.Init (the model below is built under it: TrainingArguments holds a live ZeRO-3 config) would
        # take the world size for 1. On GPUs Accelerate starts it; here the launcher's environment does.
        from curvzo_ds.shard.distributed import init_distributed

        init_distributed()
    data = examples(tiny_model().config.vocab_size)
    train_set, eval_set = Examples(data[:48]), Examples(data[48:])

    def make(output_dir: str, max_steps: int, seed: int = 11):
        args = TrainingArguments(
            output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=4, per_device_eval_batch_size=4,
            learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, seed=seed,
            logging_steps=5, eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=10,
            save_total_limit=2, eval_on_start=True, report_to=["tensorboard"], use_cpu=True, disable_tqdm=True,
            deepspeed=os.path.join(ROOT, "tests", "ds_configs", "hf_zero3_auto.json") if distributed else None,
        )
        zo = ZOConfig(**{k: v for k, v in ZO.items() if k not in ("learning_rate", "seed")})
        return ZOTrainer(model=tiny_model(), args=args, train_dataset=train_set, eval_dataset=eval_set,
                         zo_config=zo, loss_fn=lm_loss)

    trainer = make(out_dir, 30)
    output = trainer.train(resume_from_checkpoint=os.environ.get("ZO_RESUME"))  # a path: resume from it
    engine = trainer.zo_engine
    result = {
        "world_size": engine.comm.world_size,
        "log_history": trainer.state.log_history,
        "train_loss": output.training_loss,
        "global_step": output.global_step,
        "digest": params_digest(engine.entries, engine.comm),
        "optimizer": type(trainer.optimizer).__name__,
        "ds_optimizer": type(optimizer_of(engine.model)).__name__,
        "ds_engine": type(engine.model).__name__,
        "no_grads": no_grads(engine.module),
        "checkpoints": sorted(n for n in os.listdir(out_dir) if n.startswith("checkpoint-")),
        "tensorboard": any(f.startswith("events") for _, _, fs in os.walk(out_dir) for f in fs),
        "world_process_zero": engine.comm.all_gather_object(trainer.state.is_world_process_zero),
    }
    if not distributed:  # a second trainer, resumed from the middle: the same final weights
        resumed = make(out_dir + "-resumed", 30)
        resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-20"))
        result["digest_resumed"] = params_digest(resumed.zo_engine.entries, resumed.zo_engine.comm)
        result["log_history_resumed"] = resumed.state.log_history
        # TrainingArguments.seed is the ZO seed (zo_config has none here): the same seed, the same weights.
        for name, seed in (("seed11", 11), ("seed11_again", 11), ("seed12", 12)):
            short = make(f"{out_dir}-{name}", 4, seed=seed)
            short.train()
            result[f"digest_{name}"] = params_digest(short.zo_engine.entries, short.zo_engine.comm)
            result[f"zo_seed_{name}"] = short.zo_engine.cfg.seed
    return result


def lora_model(base_dir: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(1)  # every rank must create the same adapters
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))


LORA_ZO = dict(method="mezo", learning_rate=1e-2, zo_eps=1e-2, seed=7)  # every adapter moves at every step


def lora_loop_scenario(out_dir: str, base_dir: str) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import default_collate

    from curvzo_ds import from_accelerator, split_batch

    accelerator = Accelerator()  # first, so that under ZeRO-3 the model is built inside zero.Init
    model = lora_model(base_dir)
    data = examples(model.config.vocab_size)
    engine = from_accelerator(accelerator, model, lm_loss, ZOConfig(**LORA_ZO), micro_batch_size=MICRO)
    for t in range(4):
        batch = default_collate(data[t * GLOBAL: (t + 1) * GLOBAL])
        engine.step(split_batch({k: v.to(accelerator.device) for k, v in batch.items()}, MICRO))
    state = os.path.join(out_dir, "state-4")
    accelerator.save_state(state)
    deepspeed = accelerator.distributed_type == "DEEPSPEED"
    checkpoint = os.path.join(state, "pytorch_model" if deepspeed else "zo_checkpoint")
    return {"world_size": engine.comm.world_size, "ds_engine": type(engine.model).__name__, "checkpoint": checkpoint,
            "digest": params_digest(engine.entries, engine.comm), "names": [e.name for e in engine.entries]}


def lora_trainer_scenario(out_dir: str, base_dir: str) -> dict:
    from transformers import TrainingArguments

    from curvzo_ds import ZOTrainer

    model = lora_model(base_dir)
    args = TrainingArguments(output_dir=out_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             lr_scheduler_type="constant", seed=7, save_strategy="steps", save_steps=4,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    zo = ZOConfig(**{k: v for k, v in LORA_ZO.items() if k not in ("learning_rate", "seed")})
    trainer = ZOTrainer(model=model, args=args, train_dataset=Examples(examples(model.config.vocab_size)),
                        zo_config=zo, loss_fn=lm_loss)
    trainer.train()
    engine = trainer.zo_engine
    return {"world_size": engine.comm.world_size, "checkpoint": os.path.join(out_dir, "checkpoint-4"),
            "digest": params_digest(engine.entries, engine.comm), "names": [e.name for e in engine.entries]}


def run_scenario(args: list[str], out_path: str) -> dict:
    scenario, *rest = args
    work = out_path + ".d"
    scenarios = {"loop": loop_scenario, "trainer": trainer_scenario, "lora_loop": lora_loop_scenario,
                 "lora_trainer": lora_trainer_scenario}
    return scenarios[scenario](work, *rest)


if __name__ == "__main__":
    main(run_scenario)
