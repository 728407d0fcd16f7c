"""One flat configuration namespace (docs/contracts.md): the engine's keys and the application's.

`ZOConfig` holds what the optimizer needs; `TrainConfig` adds what `curvzo-ds train` needs.
Both are plain dataclasses, so users can build them in Python, and the CLI fills them from a
YAML mapping and `--set KEY=VALUE` overrides. `None` means "resolved later from a preset"
(see `resolve_presets`, config/presets.py).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from curvzo_ds.algo.differences import DIFFERENCE_SPECS, Difference, StepNormalization
from curvzo_ds.algo.estimators import ESTIMATORS, Perturbation
from curvzo_ds.algo.rate import AUTO, AUTO_RATE_FRACTION, AUTO_RATE_PROBES, Schedule
from curvzo_ds.algo.sampling import Method
from curvzo_ds.config.ds_policy import REFUSAL_BY_KEY
from curvzo_ds.config.quantization import NEEDS_LORA, NEEDS_STAGE_0, QUANTIZATIONS, VALUES_TEXT, quantization_lacks
from curvzo_ds.config.report_to import resolve_report_to
from curvzo_ds.data.objectives import OBJECTIVES
from curvzo_ds.errors import ConfigError
from curvzo_ds.tasks.task import TASK_NAMES


class Granularity(str, enum.Enum):
    """The `block_granularity` key: what one block of the algorithm is."""

    TENSOR = "tensor"  # one block per trainable tensor (the paper's setting)
    LAYER = "layer"  # the tensors of one transformer layer
    CHUNK = "chunk"  # fixed-size pieces of a tensor (block_chunk_size elements)


# The valid values of the mode keys, from their one definition each (sampling.Method, estimators.ESTIMATORS,
# Granularity above, differences.Difference and StepNormalization, objectives.Objective, quantization.Quantization,
# estimators.Perturbation).
METHODS = tuple(m.value for m in Method)
SCORE_ESTIMATORS = tuple(ESTIMATORS)
GRANULARITIES = tuple(g.value for g in Granularity)
DIFFERENCES = tuple(d.value for d in Difference)
NORMALIZATIONS = tuple(n.value for n in StepNormalization)
SCHEDULES = tuple(s.value for s in Schedule)
DIVERGENCE_ACTIONS = ("rollback", "stop")  # the `on_divergence` key (train/divergence.py)
PERTURBATIONS = tuple(p.value for p in Perturbation)


def key(default: Any, doc: str):
    """A configuration key: its default and the one-line doc that `--help` and docs/config.md show."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def key_docs(cls=None) -> dict[str, str]:
    """Each key's one-line doc, from the field metadata."""
    return {f.name: f.metadata.get("doc", "") for f in key_fields(cls or TrainConfig)}


def key_fields(cls=None) -> list[dataclasses.Field]:
    """The dataclass fields that are configuration keys (not the internal `sources`)."""
    return [f for f in dataclasses.fields(cls or TrainConfig) if not f.metadata.get("internal")]


@dataclass
class ZOConfig:
    """Hyper-parameters of the zeroth-order optimizer (paper Section 3, docs/algorithm.md).

    A config that `config.resolve` returned (or ZOEngine's own copy) is *resolved*: validated once and frozen
    (assigning a key raises dataclasses.FrozenInstanceError); `resolved` is its one mark. `dataclasses.replace`
    and `zo_part` of a resolved config: see `freeze`.
    """

    @property
    def resolved(self) -> bool:
        """True for a config that `config.resolve` (or `engine_config`) validated and froze; nothing validates it
        again."""
        return self.__dict__.get("_resolved", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_resolved", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign {name}: this config is resolved (validated once "
                                                  "and frozen); use dataclasses.replace for a new one, which "
                                                  "is validated again")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_resolved", False):
            raise dataclasses.FrozenInstanceError(f"cannot delete {name}: this config is resolved")
        super().__delattr__(name)

    # The valid ranges of learning_rate and zo_eps, (lower test, upper bound (exclusive), why): the Python API's are
    # open (a rate of 0 measures drift; toy problems take rates above 1); TrainConfig's are the CLI's.
    SCALES: ClassVar[dict] = {"learning_rate": (lambda v: v >= 0, "a number >= 0"),
                              "zo_eps": (lambda v: v > 0, "a number > 0")}

    method: str = key("mezo", "mezo (every block: the default, the method that measured best on a real model, "
                              "README 'Which method'), curvzo (the paper's: curvature-sampled blocks, adaptive "
                              "budget), us_ab (uniform pi, adaptive budget), fixed (budget B)")
    seed: int = key(42, "seeds the noise, the block masks, the data order and the demo model")
    learning_rate: float | str = key(1e-6, "MeZO's for full fine-tuning (the CLI's presets: demo 3e-4, demo "
                                           "LoRA 1e-2, full 1e-6, LoRA 5e-5); auto with a step_normalization: "
                                           "measured along the step's direction before the first step "
                                           "(docs/algorithm.md)")
    zo_eps: float = key(1e-3, "perturbation scale (the CLI's presets: demo 1e-2, full 1e-3, LoRA 1e-2)")
    weight_decay: float = key(0.0, "MeZO-style decay of matrices (never biases or norms), scaled by 1/pi")
    lr_scheduler_type: str = key("constant", "constant, linear (decay to 0 at max_steps) or plateau (the rate times "
                                             "plateau_factor after plateau_patience evaluations without a lower dev "
                                             "loss; the CLI needs eval_steps > 0; in Python, call "
                                             "engine.rate.observe_dev)")
    auto_rate_fraction: float = key(AUTO_RATE_FRACTION, "learning_rate auto: eta is this fraction of the greedy "
                                                        "rate measured along the step's direction before the first "
                                                        "step (docs/algorithm.md)")
    auto_rate_probes: int = key(AUTO_RATE_PROBES, "learning_rate auto: the directions (each on its own train batch, "
                                                  "a step's forwards + 3 each) that measure that rate")
    plateau_factor: float = key(0.5, "lr_scheduler_type=plateau: the rate's factor at each plateau, in (0, 1)")
    plateau_patience: int = key(3, "lr_scheduler_type=plateau: dev evaluations without a lower dev loss before a cut")
    max_steps: int = key(0, "the horizon of a linear schedule (0: none); the CLI trains "
                            "this many steps (presets: demo 300, otherwise 20000, the paper)")
    # The adaptive budget (Eq. 20): B = B_min + (B_max - B_min)(alpha d_eff/G + (1-alpha) H).
    budget_min: float = key(0.1, "fraction of G")
    budget_max: float = key(0.7, "fraction of G")
    budget_alpha: float = key(0.5, "alpha: weight of d_eff/G against the entropy H in the budget rule")
    budget: float = key(0.5, "the `fixed` method's budget, fraction of G")
    budget_unit: str = key("blocks", "or 'params': the budget counts expected perturbed parameters")
    score_beta: float = key(0.1, "EMA rate of the scores (Eq. 8)")
    budget_floor: float = key(0.1, "gamma: pi = (1-gamma) pi_curv + gamma B/G")
    rate_correction: str = key("max_weight", "max_weight (the learning rate times min_i pi_i each step: stable "
                                             "wherever MeZO's rate is; docs/algorithm.md §2) or none (the paper's "
                                             "step: the learning rate as given)")
    score_estimator: str = key("normalized", "Eq. 27 (paper default), 'raw' (block Eq. 5), 'unbiased' (App. B), "
                                             "'unbiased_element' (App. B / n_i), 'per_element' (Eq. 27 / n_i), 'ht' "
                                             "(Eq. 27 / pi_i); docs/algorithm.md, 'Scores that track curvature?'")
    score_init: Any = key("warmup", "'warmup' or a number: the scores at t = 0")
    score_warmup_steps: int = key(20, "uniform sampling before S := mean observed score")
    block_granularity: str = key("tensor", "'tensor' (paper), 'layer', 'chunk'")
    block_chunk_size: int = key(1 << 20, "elements per block when block_granularity = chunk")
    visibility_steps: int = key(100, "every N steps, measure which fraction of each drawn bf16/fp16 block +eps z "
                                     "changes (0: never)")
    visibility_warn: float = key(0.5, "warn when a block's visible fraction falls below this")
    max_consecutive_skips: int = key(10, "non-finite losses in a row before the run stops")
    fp32_master_weights: Any = key("auto", "fp32 copy of the owned slice of bf16/fp16 weights: auto (1-D tensors "
                                           "only: norms and biases, which bf16 cannot perturb by eps), true (all), "
                                           "false (none)")
    num_directions: int = key(1, "q: SPSA directions per step, their updates averaged (each costs two forwards "
                                 "with difference=central, one with rloo; spread over the replica groups when "
                                 "shard_group_size < world size)")
    difference: str = key("central", "the finite difference: central (L(w + eps z) - L(w - eps z), two forwards per "
                                     "direction) or rloo (one forward L(w + eps z_k) per direction, the mean of the "
                                     "other directions' losses as baseline; needs num_directions >= 2; "
                                     "docs/algorithm.md)")
    step_normalization: str = key("none", "none; loss_std (difference=rloo): the step divided by the standard "
                                          "deviation of the q losses; running_rms (difference=central): MeZO's "
                                          "Delta divided by its running RMS, clipped to +-3. Either makes "
                                          "learning_rate a step length in units of z (start near 1e-3, or auto; "
                                          "docs/algorithm.md)")
    perturbation: str = key("gaussian", "the law of each coordinate of z: gaussian (N(0, 1), the paper's) or "
                                        "rademacher (+-1 from one bit of the same counter-based stream: a pass "
                                        "near memory speed, ||z_B||^2 = |B|; docs/algorithm.md); a resumed run keeps "
                                        "its checkpoint's")
    static_mask: float = key(0.0, "perturb only this fraction of the elements, the largest squared gradients of one "
                                  "backprop per batch over static_mask_batches batches (SensZOQ's mechanism; "
                                  "method mezo; 0: off; docs/algorithm.md)")
    static_mask_batches: int = key(4, "training batches of the static_mask's backprop probe")

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value, its valid range and the fix. It marks nothing: the one
        mark is `resolved` (`freeze`), set after the one validation."""
        self._check()

    def _check(self) -> None:
        need = functools.partial(_need, self)
        need(self.method in METHODS, "method", f"one of {', '.join(METHODS)}")
        need(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0, "seed",
             "an integer >= 0")
        if self.learning_rate == AUTO and self.step_normalization == "none":
            raise ConfigError("learning_rate=auto needs a normalised step (its rate is a step length in units of z): "
                              "set step_normalization=loss_std (difference=rloo) or running_rms (difference=central), "
                              "or give learning_rate a number")
        for name, (valid, text) in self.SCALES.items():  # the one statement of the rate and eps ranges
            value = getattr(self, name)
            if name == "learning_rate" and value == AUTO:
                continue
            if value is not None and not (_finite(value) and valid(value)):
                raise ConfigError(f"{name}={value!r} is invalid: it must be {text}")
        need(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "a number >= 0")
        need(self.lr_scheduler_type in SCHEDULES, "lr_scheduler_type", ", ".join(SCHEDULES))
        need(_finite(self.plateau_factor) and 0 < self.plateau_factor < 1, "plateau_factor", "a number in (0, 1)")
        need(_finite(self.auto_rate_fraction) and self.auto_rate_fraction > 0, "auto_rate_fraction", "a number > 0")
        need(_posint(self.auto_rate_probes), "auto_rate_probes", "an integer >= 1")
        need(_posint(self.plateau_patience), "plateau_patience", "an integer >= 1")
        if self.lr_scheduler_type == "linear" and self.max_steps == 0:
            raise ConfigError("lr_scheduler_type=linear needs max_steps > 0, the step at which the learning rate "
                              "reaches 0 (with max_steps=0 it would stay constant): set max_steps, or use "
                              "lr_scheduler_type=constant")
        if self.max_steps is not None:
            need(isinstance(self.max_steps, int) and self.max_steps >= 0, "max_steps", "an integer >= 0")
        for key in ("budget_min", "budget_max", "budget"):
            need(_finite(getattr(self, key)) and 0 < getattr(self, key) <= 1, key,
                 "a fraction of the number of blocks G in (0, 1]")
        if self.budget_min > self.budget_max:
            raise ConfigError(f"budget_min={self.budget_min} is larger than budget_max={self.budget_max}: "
                              "set budget_min <= budget_max")
        need(_finite(self.budget_alpha) and 0 <= self.budget_alpha <= 1, "budget_alpha", "in [0, 1]")
        need(self.budget_unit in ("blocks", "params"), "budget_unit", "blocks or params")
        need(_finite(self.score_beta) and 0 < self.score_beta <= 1, "score_beta", "in (0, 1]")
        need(_finite(self.budget_floor) and 0 <= self.budget_floor <= 1, "budget_floor", "in [0, 1]")
        if self.rate_correction is not None:
            need(self.rate_correction in ("none", "max_weight"), "rate_correction", "none or max_weight")
        need(self.score_estimator in SCORE_ESTIMATORS, "score_estimator", f"one of {', '.join(SCORE_ESTIMATORS)}")
        need(self.score_init == "warmup" or (_finite(self.score_init) and self.score_init >= 0), "score_init",
             "'warmup' or a number >= 0")
        need(isinstance(self.score_warmup_steps, int) and self.score_warmup_steps >= 0, "score_warmup_steps",
             "an integer >= 0")
        need(self.block_granularity in GRANULARITIES, "block_granularity", f"one of {', '.join(GRANULARITIES)}")
        need(isinstance(self.block_chunk_size, int) and self.block_chunk_size >= 1, "block_chunk_size",
             "an integer >= 1")
        need(isinstance(self.visibility_steps, int) and self.visibility_steps >= 0, "visibility_steps",
             "an integer >= 0 (0: never)")
        need(_finite(self.visibility_warn) and 0 <= self.visibility_warn <= 1, "visibility_warn", "in [0, 1]")
        need(self.fp32_master_weights == "auto" or isinstance(self.fp32_master_weights, bool), "fp32_master_weights",
             "auto, true or false")
        need(isinstance(self.max_consecutive_skips, int) and self.max_consecutive_skips >= 1,
             "max_consecutive_skips", "an integer >= 1")
        need(_posint(self.num_directions), "num_directions", "an integer >= 1")
        need(self.difference in DIFFERENCES, "difference", " or ".join(DIFFERENCES))
        spec = DIFFERENCE_SPECS[Difference(self.difference)]
        if self.num_directions > MAX_DIRECTIONS:
            raise ConfigError(f"num_directions={self.num_directions} is more than {MAX_DIRECTIONS}: each step would "
                              f"be {spec.forwards(self.num_directions):,} forwards (MeZO uses 1; the RLOO preset 8): "
                              f"set num_directions to at most {MAX_DIRECTIONS}")
        if self.num_directions < spec.min_directions:
            raise ConfigError(f"difference={self.difference} needs num_directions >= {spec.min_directions} (the "
                              "baseline of a direction is the mean of the others' losses), not "
                              f"num_directions={self.num_directions}: set num_directions={spec.min_directions} or "
                              "more, or difference=central")
        need(self.step_normalization in NORMALIZATIONS, "step_normalization", " or ".join(NORMALIZATIONS))
        if self.step_normalization != "none" and StepNormalization(self.step_normalization) not in spec.normalizations:
            serves = next(d.value for d, sp in DIFFERENCE_SPECS.items()
                          if StepNormalization(self.step_normalization) in sp.normalizations)
            raise ConfigError(f"step_normalization={self.step_normalization} needs difference={serves}, not "
                              f"difference={self.difference}: set difference={serves}"
                              f"{' and num_directions >= 2' if serves == 'rloo' else ''}, or step_normalization="
                              f"{'running_rms' if serves == 'rloo' else 'loss_std'} for difference={self.difference}, "
                              "or step_normalization=none")
        need(self.perturbation in PERTURBATIONS, "perturbation", " or ".join(PERTURBATIONS))
        need(_finite(self.static_mask) and 0 <= self.static_mask <= 1, "static_mask",
             "a fraction of the trainable elements in [0, 1] (0: off)")
        need(_posint(self.static_mask_batches), "static_mask_batches", "an integer >= 1")
        if self.static_mask and self.method != "mezo":
            raise ConfigError(f"static_mask={self.static_mask} needs method=mezo (a fixed set of elements perturbed at "
                              f"every step, with no 1/pi weights), not method={self.method}: set method=mezo")


@dataclass
class TrainConfig(ZOConfig):
    """Everything `curvzo-ds train` reads. Keys and meanings: docs/config.md."""

    # A ZO update moves each weight by learning_rate * projected_grad * z, and the perturbation is zo_eps * z.
    SCALES: ClassVar[dict] = {
        "learning_rate": (lambda v: 0 < v < 1, "a number in (0, 1); a ZO update moves each weight by learning_rate * "
                          "projected_grad * z, so 0 trains nothing and 1 or more wrecks the weights in a step (MeZO: "
                          "1e-7 to 1e-4)"),
        "zo_eps": (lambda v: 0 < v < 1, "a number in (0, 1); each weight is perturbed by zo_eps * z, so 1 or more "
                   "swamps the weights (MeZO: 1e-3)")}

    # None: filled from a preset (resolve_presets) once the model and LoRA setting are known.
    learning_rate: float | str | None = key(None, "preset: demo 3e-4 (LoRA 1e-2), full 1e-6 (MeZO), LoRA 5e-5 "
                                                  "(MeZO); with a step_normalization 1e-3 (eta, a step length in "
                                                  "units of z), or auto: measured by the run along its step's "
                                                  "direction before the first step (docs/algorithm.md)")
    zo_eps: float | None = key(None, "perturbation scale; preset: demo 1e-2, full 1e-3, LoRA 1e-2 (MeZO)")
    max_steps: int | None = key(None, "training steps; preset: demo 300, otherwise 20000 (the paper)")
    rate_correction: str | None = key(None, "max_weight (the learning rate times min_i pi_i each step: stable "
                                            "wherever MeZO's rate is) or none (the paper's step); preset: none for "
                                            "the demo (its own rate), max_weight otherwise (MeZO's rate); "
                                            "docs/algorithm.md §2")

    model: str = key("demo", "hub id, local path, or the built-in 'demo' (tiny Llama) / 'demo-opt'")
    tokenizer: str | None = key(None, "defaults to the model's")
    trust_remote_code: bool = key(False, "run the Python code that a hub model or tokenizer ships (transformers' "
                                         "name); off: only the classes in transformers are used")
    task: str = key("demo", f"a built-in task ({', '.join(TASK_NAMES)}) or a task directory (task.json and "
                            "train.jsonl; docs/contracts.md)")
    data_dir: str | None = key(None, "unset: the hub dataset of a built-in task; samples: its bundled examples; "
                                     "DIR: local train/validation JSONL or CSV, or a datasets save_to_disk dir")
    output_dir: str = key("runs/demo", "where metrics.jsonl, summary.json and checkpoint-<step>/ go")
    global_batch_size: int = key(16, "examples per step over all ranks (MeZO: 16)")
    micro_batch_size: int = key(4, "examples per forward on one rank")
    num_train: int = key(1000, "training examples sampled from the task (MeZO: 1000)")
    num_dev: int | None = key(None, "None: the task's own, 500 (CB: 100, as MeZO)")
    num_eval: int = key(1000, "test examples sampled (MeZO: 1000)")
    max_length: int = key(512, "tokens per sequence; longer prompts are cut from the left")
    max_new_tokens: int = key(50, "generation tasks")
    train_as_classification: bool = key(True, "cross-entropy over candidates; false: label-token LM loss")
    objective: str = key("loss", "what a step minimizes: loss (the cross-entropy), accuracy (classification) or f1 "
                                 "(generation: greedy generation in every forward), the metric negated; raise "
                                 "zo_eps and learning_rate (docs/config.md, 'Metric objectives')")
    lora: bool = key(False, "train LoRA adapters (peft) instead of every parameter")
    lora_r: int = key(8, "LoRA rank")
    lora_alpha: int = key(16, "LoRA scaling alpha")
    lora_target_modules: Any = key(None, "default: q_proj, v_proj (MeZO)")
    quantization: str = key("none", "none, 8bit (LLM.int8) or 4bit (nf4): the base loaded quantised by bitsandbytes "
                                    "and frozen, the LoRA adapters trained; needs lora=true and stage 0 (the extra "
                                    "[quant]; docs/config.md, 'A quantised base')")
    dtype: str = key("float32", "float32, bfloat16, float16")
    zero_stage: int | str = key("auto", "auto (0 when the whole model fits one device with its activations, the ZO "
                                        "state and a margin, else 3; docs/scaling.md), 0 or 3 (stages 1 and 2 need "
                                        "an optimizer in DeepSpeed)")
    offload_param: str = key("none", "none or cpu")
    deepspeed: str | None = key(None, "a user's DeepSpeed config (JSON), mapped or refused key by key")
    threads: int | None = key(None, "torch threads per rank; default 1 on CPU (results depend on it)")
    save_steps: int = key(500, "checkpoint every N steps (0: only at the end)")
    save_total_limit: int | None = key(3, "newest checkpoints kept (the best-dev one is always kept); null keeps all")
    eval_steps: int = key(500, "evaluate on dev every N steps (0: only at the end)")
    logging_steps: int = key(1, "write a metrics.jsonl line every N steps")
    report_to: str | list = key("auto", "trackers that mirror metrics.jsonl, as Accelerate names them: tensorboard, "
                                        "wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio; a list "
                                        "or comma-separated (tensorboard,wandb); auto: tensorboard if installed; "
                                        "all: every installed one; none")
    disable_tqdm: bool = key(False, "no progress bar or progress lines")
    progress_interval: float = key(30.0, "seconds between progress log lines when stderr is not a terminal")
    overwrite_output_dir: bool = key(False, "replace the run in output_dir (its checkpoints, metrics and summary); "
                                            "without it a run refuses a directory that holds another (Hugging Face's "
                                            "name)")
    consistency_steps: int = key(100, "every N steps the ranks compare a hash of their ZO state and stop if they "
                                      "differ (0: never)")
    flat_loss_steps: int = key(20, "warn when the loss stays exactly the same with a projected gradient of 0 for N "
                                   "steps (0: never)")
    shard_group_size: int | str | None = key("auto", "ranks that share one ZeRO-3 partition (hybrid sharding: ZeRO-3 "
                                                     "inside a group, replicas across groups); auto: the smallest "
                                                     "group that fits (docs/scaling.md); null: the world size")
    on_divergence: str = key("rollback", "a diverging run (a non-finite dev loss or max_consecutive_skips non-finite "
                                         "steps; after a 20-step warm-up the train loss's running mean above twice "
                                         "its lowest; the dev loss above twice the better of its zero-shot and best "
                                         "values): rollback (to the newest checkpoint before it "
                                         "went bad, at half the rate) or stop (exit 4, the checkpoints intact); "
                                         "docs/reliability.md")
    max_rollbacks: int = key(3, "on_divergence=rollback: rollbacks before the run stops as on_divergence=stop")
    ddp_timeout: int = key(1800, "seconds a collective may wait before the job fails, so that a hung rank ends the "
                                 "job (Hugging Face's name and default)")
    log_level: str = key("info", "debug, info, warning or error (rank 0; other ranks log warnings)")
    # Not a key: where each explicitly given key came from ("--set", "--config FILE"); the DeepSpeed mapping refuses
    # a key given there that the DeepSpeed config sets otherwise (docs/deepspeed.md). A field, so that
    # dataclasses.replace keeps it; no part of equality, of to_dict (run_config.json, config.json) or of the key list.
    sources: dict = field(default_factory=dict, compare=False, repr=False, metadata={"internal": True})
    # Not a key either: the --config files, merged in this order (a later one wins); the run's log names them.
    config_files: tuple = field(default=(), compare=False, repr=False, metadata={"internal": True})

    def _check(self) -> None:
        super()._check()
        need = functools.partial(_need, self)
        # `--set output_dir=` parses to None (an empty YAML scalar); without this it fails deep inside as a TypeError.
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            raise ConfigError(f"output_dir={self.output_dir!r} is invalid: it must name a directory, for example "
                              "--set output_dir=runs/mine")
        for key in ("global_batch_size", "micro_batch_size", "num_train", "num_eval", "max_length",
                    "max_new_tokens", "lora_r", "lora_alpha", "logging_steps"):
            need(_posint(getattr(self, key)), key, "an integer >= 1")
        for key in ("save_steps", "eval_steps"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) >= 0, key,
                 "an integer >= 0 (0: only at the end)")
        if self.num_dev is not None:
            need(isinstance(self.num_dev, int) and self.num_dev >= 0, "num_dev", "an integer >= 0")
        if self.save_total_limit is not None:
            need(_posint(self.save_total_limit), "save_total_limit", "an integer >= 1 or null")
        if self.threads is not None:
            need(_posint(self.threads), "threads", "an integer >= 1 or null")
        need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "float32, bfloat16 or float16")
        need(self.objective in OBJECTIVES, "objective", f"{', '.join(OBJECTIVES[:-1])} or {OBJECTIVES[-1]}")
        stage_refusal = REFUSAL_BY_KEY["zero_optimization.stage"]
        if stage_refusal.refuses(self.zero_stage):
            raise ConfigError(f"zero_stage={self.zero_stage} is not supported: {stage_refusal.reason}; "
                              "use 3 (or 0 for no ZeRO)")
        need(self.zero_stage in ("auto", 0, 3) and not isinstance(self.zero_stage, bool), "zero_stage",
             "auto, 0 or 3")
        need(self.offload_param in ("none", "cpu"), "offload_param", "none or cpu")
        resolve_report_to(self.report_to)  # an unknown tracker, or one not installed: one line with the fix
        for key_name in ("consistency_steps", "flat_loss_steps"):
            need(isinstance(getattr(self, key_name), int) and getattr(self, key_name) >= 0, key_name,
                 "an integer >= 0 (0: never)")
        need(_posint(self.ddp_timeout), "ddp_timeout", "an integer number of seconds >= 1")
        need(self.on_divergence in DIVERGENCE_ACTIONS, "on_divergence", " or ".join(DIVERGENCE_ACTIONS))
        need(isinstance(self.max_rollbacks, int) and not isinstance(self.max_rollbacks, bool)
             and self.max_rollbacks >= 0, "max_rollbacks", "an integer >= 0")
        if self.lr_scheduler_type == "plateau" and self.eval_steps == 0:
            raise ConfigError("lr_scheduler_type=plateau needs evaluations during the run (it cuts the rate when the "
                              "dev loss stops falling), not eval_steps=0: set eval_steps, for example "
                              "--set eval_steps=100, or lr_scheduler_type=constant or linear")
        if self.shard_group_size not in (None, "auto"):
            need(_posint(self.shard_group_size), "shard_group_size",
                 "auto, null or an integer >= 1 that divides the world size")
        need(_finite(self.progress_interval) and self.progress_interval >= 0, "progress_interval", "a number >= 0")
        need(self.log_level in ("debug", "info", "warning", "error"), "log_level", "debug, info, warning or error")
        if self.lora_target_modules is not None:
            need(isinstance(self.lora_target_modules, list | str), "lora_target_modules",
                 "a list of module names or a comma-separated string")
        need(self.quantization in QUANTIZATIONS, "quantization", VALUES_TEXT)
        lacks = quantization_lacks(self.quantization, lora=self.lora, zero3=self.zero_stage == 3,
                                   offload=self.offload_param == "cpu")
        if lacks == "lora":
            raise ConfigError(f"quantization={self.quantization} needs lora=true: {NEEDS_LORA}; set lora=true, or "
                              "quantization=none")
        if lacks == "stage 0":
            given = "zero_stage=3" if self.zero_stage == 3 else "offload_param=cpu"
            raise ConfigError(f"quantization={self.quantization} needs zero_stage=0 ({NEEDS_STAGE_0}), not {given}: "
                              "set zero_stage=auto and offload_param=none, or quantization=none")


def _need(cfg, ok: bool, key: str, rng: str) -> None:
    """The one refusal of a bad value: its key, the value and the valid range."""
    if not ok:
        raise ConfigError(f"{key}={getattr(cfg, key)!r} is invalid: it must be {rng}")


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


# Above this a step is thousands of forwards: a typo (num_directions=1000000 trained for minutes without ending its
# first step), not a setting. The presets use 1 and 8.
MAX_DIRECTIONS = 1024


def _posint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def freeze(cfg: ZOConfig) -> ZOConfig:
    """Mark `cfg` resolved: validated, and frozen from now on. Only `config.resolve` and `engine_config` (after
    their one validation) and `zo_part` (of a resolved config) call it. Not a field: `dataclasses.replace` of a
    resolved config gives an unresolved, mutable one, which the engine validates again."""
    object.__setattr__(cfg, "_resolved", True)
    return cfg


__all__ = ["ZOConfig", "TrainConfig", "key", "key_docs", "key_fields", "freeze"]
