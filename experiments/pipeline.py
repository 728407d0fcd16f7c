"""Issue 19's experiment, one command: does any score estimator make CurvZO beat MeZO?

    nice -n 10 python -m experiments.pipeline --config full --jobs 2   # the issue's plan; what RESULTS.md reports
    nice -n 10 python -m experiments.pipeline --config reduced   # a subset (full-parameter, 4 methods, 2 seeds)
    python -m experiments.pipeline --config ci --out /tmp/x      # the end-to-end test's (one task, one seed)

1. pre-train a Llama-style model (about 1M parameters) by backprop on the generated language
   (experiments/language.py) and save it, with its tokenizer, as a Hugging Face directory;
2. write the three classification tasks as task directories;
3. for each task, form (full, LoRA) and method: a learning-rate grid with seed 0, the best rate by final dev
   loss, then that rate with the other seeds; dev loss every `eval_every` steps, test accuracy at the end;
4. the diagnostic (`curvzo-ds diagnose`'s code) on the pre-trained model, for the paper's and the new estimator;
5. RESULTS.md-ready tables and plots in --out (tables.md, *.png).
Every run goes through experiments/core.py's `run_curve` and is cached as runs/<hash of its settings>.json, so a
rerun only computes what changed; progress.log has one line per run. One thread per run
(torch.set_num_threads(1)); --jobs N runs N at a time in worker processes (the grid runs first, then the other seeds
at each best rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import time

import numpy as np
import torch

from curvzo_ds.commands.diagnose import diagnose
from curvzo_ds.config.schema import TrainConfig
from experiments import language
from experiments.core import Log, cached, digest, every, record_run, run_curve, run_many, sha256_file
from experiments.stats import mean_sd, reach_ratio, speedup_at_own_loss

# Methods: (name, method, budget, score_estimator). "new" is the estimator the derivation recommends.
METHODS = {"mezo": ("mezo", 0.5, "normalized"), "us_ab": ("us_ab", 0.5, "normalized"),
           "fixed-0.1": ("fixed", 0.1, "normalized"), "fixed-0.4": ("fixed", 0.4, "normalized"),
           "fixed-0.7": ("fixed", 0.7, "normalized"), "curvzo-paper": ("curvzo", 0.5, "normalized"),
           "curvzo-unbiased": ("curvzo", 0.5, "unbiased"), "curvzo-element": ("curvzo", 0.5, "unbiased_element")}
CONFIGS = {
    "full": dict(tasks=["sentiment", "agreement", "topic"], forms=["full", "lora"], methods=list(METHODS),
                 seeds=[0, 1, 2], steps=400, eval_every=50, grid={"full": [3e-5, 1e-4, 3e-4],
                                                                 "lora": [3e-4, 1e-3, 3e-3]},
                 pretrain_steps=1500, diagnose_steps=200),
    "reduced": dict(tasks=["sentiment", "agreement", "topic"], forms=["full"],
                    methods=["mezo", "fixed-0.4", "curvzo-paper", "curvzo-element"], seeds=[0, 1], steps=400,
                    eval_every=50, grid={"full": [3e-5, 1e-4, 3e-4]}, pretrain_steps=1500, diagnose_steps=200),
    "ci": dict(tasks=["sentiment"], forms=["full"], methods=["mezo", "curvzo-paper"], seeds=[0], steps=20,
               eval_every=10, grid={"full": [1e-3]}, pretrain_steps=10, diagnose_steps=12),
}
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=352, max_position_embeddings=128, tie_word_embeddings=False)
DATA = dict(num_train=512, num_dev=256, num_test=512, batch=16, eps=1e-3)


# Pretrainings whose weights ship with the project, {model key: SHA-256 of model.safetensors}: the same settings give
# another model on another CPU (experiments/RESULTS.md, "The small model is its CPU's": zero-shot `sentiment` dev loss
# 0.5806, 0.264 and 0.2285 from one pretraining on three machines), so the horizon's small model (3,000 steps) travels
# as its weights, those of the AMD EPYC machine of 2026-11-30 (the model of experiments/results/horizon-small/).
SHIPPED = {"a5c39d9fc24e8298": "ae3c566460c639255ef01a14cfa37eb9c30676b2bfcaa24a05b361a2b5f5f4e6"}
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def pretrain(out: str, steps: int, log: Log, seed: int = 0, use_shipped: bool = True) -> str:
    """The model directory (cached by its settings): a Llama trained by AdamW on the language's corpus, or, where its
    weights ship (`SHIPPED`) and `use_shipped`, those weights (a cached directory with other weights is replaced).
    `use_shipped=False` with a fresh `out` pretrains here and logs whether it gave the shipped weights bit for bit.

    A checkpoint every 100 steps lets an interrupted run (a time limit) go on where it stopped."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    key = digest(dict(MODEL, steps=steps, seed=seed, vocab=language.vocabulary(), corpus=language.CORPUS_VERSION))
    path = os.path.join(out, f"model-{key}")
    weights, shipped = os.path.join(path, "model.safetensors"), SHIPPED.get(key) if use_shipped else None
    if os.path.exists(os.path.join(path, "done")):
        if shipped is None or sha256_file(weights) == shipped:
            return path
        log(f"pretrain: {path} holds weights other than the shipped ones (a local pretraining); replacing them with "
            "experiments/assets/'s")
        os.remove(os.path.join(path, "done"))
    language.write_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    conf = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, **MODEL)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(conf)
    n_params = sum(p.numel() for p in model.parameters())
    if shipped is not None:
        model.save_pretrained(path)  # the config and generation config; the weights are the shipped file's
        shutil.copyfile(os.path.join(ASSETS, f"small-model-{key}.safetensors"), weights + ".tmp")
        if sha256_file(weights + ".tmp") != shipped:
            raise SystemExit(f"experiments/assets/small-model-{key}.safetensors is not the file pipeline.SHIPPED "
                             "names (SHA-256 differs): restore it with `git checkout experiments/assets`")
        os.replace(weights + ".tmp", weights)
        with open(os.path.join(path, "done"), "w") as f:
            json.dump({"params": n_params, "steps": steps, "shipped": shipped}, f)
        log(f"pretrained model {key}: the shipped weights (sha256 {shipped[:12]}) -> {path}")
        return path
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    first, ckpt = 0, os.path.join(path, "pretrain.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        first = state["step"]
        log(f"pretrain: resuming at step {first}")
    seq, batch = 64, 32
    start = time.time()
    for step in range(first, steps):
        rows = []
        for _ in range(batch):
            ids = []
            while len(ids) < seq:
                ids += tok.encode(language.corpus_line(rng)) + [tok.eos_token_id]
            rows.append(ids[:seq])
        x = torch.tensor(rows)
        for group in opt.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - step / steps))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0 or step == steps - 1:
            log(f"pretrain step {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), rng=rng.getstate(), step=step + 1),
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    model.save_pretrained(path)
    os.remove(ckpt)
    if key in SHIPPED:
        same = sha256_file(weights) == SHIPPED[key]
        log(f"pretrain: {'the shipped weights, bit for bit' if same else 'weights other than the shipped ones'}")
    with open(os.path.join(path, "done"), "w") as f:
        json.dump({"params": n_params, "final_loss": loss.item(), "steps": steps}, f)
    log(f"pretrained {n_params} parameters -> {path}")
    return path


def arm_of(method: str, form: str) -> dict:
    """A method of METHODS and a form (full, lora) as one row of config keys."""
    kind, budget, estimator = METHODS[method]
    return dict(method=kind, budget=budget, score_estimator=estimator, lora=form == "lora")


def run_config(model: str, task_dir: str, method: str, form: str, lr: float, seed: int, steps: int) -> TrainConfig:
    return dataclasses.replace(base_config(model, task_dir, lr, seed, steps), **arm_of(method, form))


def base_config(model: str, task_dir: str, lr: float, seed: int, steps: int) -> TrainConfig:
    return TrainConfig(model=model, task=task_dir, learning_rate=lr, zo_eps=DATA["eps"], seed=seed, max_steps=steps,
                       num_train=DATA["num_train"], num_dev=DATA["num_dev"], num_eval=DATA["num_test"],
                       global_batch_size=DATA["batch"], micro_batch_size=DATA["batch"], max_length=64,
                       rate_correction="none")  # the paper's step, as the cached results ran


def one_run(out: str, plan: dict, model: str, task: str, task_dir: str, form: str, method: str, lr: float,
            seed: int, log: Log) -> dict:
    """One training run, from runs/<hash>.json when its settings were run before."""
    settings = dict(model=os.path.basename(model), task=task, form=form, method=method, lr=lr, seed=seed,
                    steps=plan["steps"], eval_every=plan["eval_every"], data=DATA)
    path, done = cached(out, settings)
    if done is not None:
        return done
    arm = arm_of(method, form)
    result = record_run(path, settings, lambda: run_curve(
        base_config(model, task_dir, lr, seed, plan["steps"]), arm,
        every(2 * plan["eval_every"], 2 * plan["steps"]), name=method))
    final = result["curve"][-1]
    log(f"run {task} {form} {method} lr={lr:g} seed={seed}: dev loss {final['loss']:.4f} acc "
        f"{final['accuracy']:.3f}, test acc {result['test']['accuracy']:.3f} ({result['seconds']:.0f}s)")
    return result


def run_all(plan: dict, out: str, log: Log, jobs: int = 1) -> dict:
    """{(task, form, method): {"lr": best, "grid": {lr: dev loss}, "runs": [result per seed]}}."""
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    model = pretrain(out, plan["pretrain_steps"], log)
    tasks = {t: language.write_task(os.path.join(out, "tasks"), t, 0, DATA["num_train"], DATA["num_dev"],
                                    DATA["num_test"]) for t in plan["tasks"]}
    keys = [(task, form, method) for task in plan["tasks"] for form in plan["forms"] for method in plan["methods"]]

    def args(key, lr, seed):
        task, form, method = key
        return (out, plan, model, task, tasks[task], form, method, lr, seed, log)

    grid_calls = [args(key, lr, plan["seeds"][0]) for key in keys for lr in plan["grid"][key[1]]]
    grid_runs = iter(run_many(jobs, grid_calls, one_run))
    grids, best = {}, {}
    for key in keys:
        grids[key] = {lr: next(grid_runs) for lr in plan["grid"][key[1]]}
        finite = {lr: r["curve"][-1]["loss"] for lr, r in grids[key].items() if math.isfinite(r["curve"][-1]["loss"])}
        best[key] = (min(finite, key=finite.get) if finite else plan["grid"][key[1]][0], finite)
    seed_runs = iter(run_many(jobs, [args(key, best[key][0], s) for key in keys for s in plan["seeds"][1:]],
                              one_run))
    results = {}
    for key in keys:
        lr, finite = best[key]
        runs = [grids[key][lr]] + [next(seed_runs) for _ in plan["seeds"][1:]]
        results[key] = dict(lr=lr, grid=finite, runs=runs)
    return dict(model=model, tasks=tasks, results=results)


def tables(plan: dict, done: dict) -> list[str]:
    """Markdown: test accuracy and final dev loss (mean ± sd over seeds), steps to MeZO's final dev loss."""
    lines = ["| task | form | method | lr (dev) | test accuracy | final dev loss | steps to MeZO's final dev loss / "
             "MeZO's, per seed: mean ± 95% CI [min, max] | MeZO's steps to this run's final dev loss / this "
             "run's | B/G |", "|---|---|---|---|---|---|---|---|---|"]
    for task in plan["tasks"]:
        for form in plan["forms"]:
            mezo = done["results"].get((task, form, "mezo"))
            for method in plan["methods"]:
                res = done["results"][(task, form, method)]
                acc = [r["test"]["accuracy"] for r in res["runs"]]
                dev = [r["curve"][-1]["loss"] for r in res["runs"]]
                reach = reach_ratio(res["runs"], mezo["runs"]) if mezo else "-"
                speedup = speedup_at_own_loss(res["runs"], mezo["runs"]) if mezo else "-"
                budget = np.mean([r["budget_mean"] for r in res["runs"]])
                lines.append(f"| {task} | {form} | {method} | {res['lr']:g} | {mean_sd(acc)} | {mean_sd(dev)} | "
                             f"{reach} | {speedup} | {budget:.2f} |")
    return lines


def plot_curves(plan: dict, done: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for form in plan["forms"]:
        fig, axes = plt.subplots(1, len(plan["tasks"]), figsize=(5 * len(plan["tasks"]), 4), squeeze=False)
        for ax, task in zip(axes[0], plan["tasks"]):
            for method in plan["methods"]:
                runs = done["results"][(task, form, method)]["runs"]
                steps = [c["step"] for c in runs[0]["curve"]]
                losses = np.array([[c["loss"] for c in r["curve"]] for r in runs if len(r["curve"]) == len(steps)])
                ax.plot(steps, losses.mean(0), label=method)
                if len(losses) > 1:
                    ax.fill_between(steps, losses.min(0), losses.max(0), alpha=0.15)
            ax.set(title=f"{task} ({form})", xlabel="step", ylabel="dev loss")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"convergence_{form}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="full")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one thread each (default 1)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plan = CONFIGS[args.config]
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "progress.log"))
    log(f"config {args.config}: {json.dumps(plan)}")
    start = time.time()
    done = run_all(plan, args.out, log, args.jobs)
    log(f"runs done in {time.time() - start:.0f}s with --jobs {args.jobs}")
    lines = tables(plan, done)
    figures = plot_curves(plan, done, args.out)
    task = plan["tasks"][0]
    best = done["results"].get((task, "full", "curvzo-paper"), {}).get("lr", plan["grid"]["full"][0])
    cfg = run_config(done["model"], done["tasks"][task], "curvzo-paper", "full", best, 0, plan["diagnose_steps"])
    # Every estimator at the default beta, then the two unbiased ones with the longer EMA the issue names.
    diag = []
    for beta, estimators, sub in ((cfg.score_beta, ["normalized", "per_element", "ht", "unbiased", "unbiased_element"],
                                   "diagnose"), (0.02, ["unbiased", "unbiased_element"], "diagnose-beta0.02")):
        diag_dir = os.path.join(args.out, sub)
        key = digest(dict(model=os.path.basename(done["model"]), task=task, lr=best, steps=plan["diagnose_steps"],
                          estimators=estimators, beta=beta, table=3))
        cached = os.path.join(diag_dir, f"table-{key}.md")
        if os.path.exists(cached):
            with open(cached) as f:
                table = f.read().splitlines()
        else:
            table = diagnose(dataclasses.replace(cfg, score_beta=beta), estimators, plan["diagnose_steps"],
                             max(plan["diagnose_steps"] // 20, 1), diag_dir)
            with open(cached, "w") as f:
                f.write("\n".join(table) + "\n")
        diag += [f"beta = {beta:g} ({sub}/):", ""] + table + [""]
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(f"config `{args.config}`: {json.dumps(plan)}\n\n" + "\n".join(lines) + "\n\n")
        f.write(f"Diagnostic: task {task}, full, lr {best:g}, {plan['diagnose_steps']} steps\n\n")
        f.write("\n".join(diag) + "\nFigures: " + ", ".join(os.path.basename(p) for p in figures) + "\n")
    log("tables: " + os.path.join(args.out, "tables.md"))


if __name__ == "__main__":
    main()
