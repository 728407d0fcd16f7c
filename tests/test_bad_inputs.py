"""Every bad input is one line and exit 2 (issue 20 §4), through the real CLI in a subprocess.

Each case runs `python -m curvzo_ds.cli ...` and must exit with 2, print no traceback, print exactly one line
"curvzo-ds <cmd>: error: ..." holding the case's words, and leave a finished run's output directory (`{done}`,
which every train and eval case points at) byte for byte as it was. All fail in validation, before any step.
"""

import concurrent.futures
import hashlib
import json
import pathlib
import shutil
import sys

import pytest

from tests.helpers import COMMON, ENV, ROOT, cli, run_checked, run_cli

# ~110 processes of 3-10 s each, two at a time, all in the first test's set-up: more than the 600 s per test of
# pyproject.toml on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
DS = ROOT / "tests" / "ds_configs"
# Train and eval cases start from the finished run's own settings, so only the case's key differs.
BASE = [*COMMON, "--set", "max_steps=3", "--set", "output_dir={done}"]
GOOD_TASK = {"name": "t", "template": "{text} It was", "label_words": [" bad", " good"], "metric": "accuracy"}
GOOD_LINES = [{"text": f"example {i}", "label": i % 2} for i in range(40)]

# (id, command and arguments, words the error line must hold). {done}: the finished run; {tmp}: a scratch
# directory with the prepared bad files; {ds}: tests/ds_configs.
CASES = [
    # config keys
    ("unknown-key", ["train", "--set", "no_such_key=1"], "unknown key 'no_such_key'"),
    ("typo-key", ["train", "--set", "learnin_rate=1e-3"], "did you mean 'learning_rate'"),
    ("no-equals", ["train", "--set", "novalue"], "KEY=VALUE"),
    ("max-steps-text", ["train", "--set", "max_steps=abc"], "max_steps"),
    ("max-steps-negative", ["train", "--set", "max_steps=-1"], "max_steps"),
    ("global-batch-zero", ["train", "--set", "global_batch_size=0"], "global_batch_size=0"),
    ("global-batch-negative", ["train", "--set", "global_batch_size=-4"], "global_batch_size=-4"),
    ("global-batch-float", ["train", "--set", "global_batch_size=2.5"], "must be an integer"),
    ("micro-batch-zero", ["train", "--set", "micro_batch_size=0"], "micro_batch_size=0"),
    ("global-batch-over-data", ["train", "--set", "global_batch_size=5000"], "lower global_batch_size"),
    ("global-batch-over-samples", ["train", "--set", "task=sst2", "--set", "data_dir=samples", "--set",
                                   "global_batch_size=16"], "larger than the 13 training examples (num_train=200, "
     "from the bundled samples): only 13 are left after dev and test are drawn: lower global_batch_size"),
    ("max-length-no-prompt", ["train", "--set", "max_length=2"], "max_length=2 cuts away the prompt of every "
     "training example (only the label tokens are left): raise max_length to at least"),
    ("lr-huge", ["train", "--set", "learning_rate=1e30"], "learning_rate=1e+30"),
    ("lr-zero", ["train", "--set", "learning_rate=0"], "learning_rate=0"),
    ("lr-negative", ["train", "--set", "learning_rate=-1e-3"], "learning_rate"),
    ("lr-nan", ["train", "--set", "learning_rate=.nan"], "learning_rate"),
    ("lr-text", ["train", "--set", "learning_rate=fast"], "learning_rate"),
    ("eps-zero", ["train", "--set", "zo_eps=0"], "zo_eps=0"),
    ("eps-one", ["train", "--set", "zo_eps=1"], "zo_eps=1"),
    ("eps-inf", ["train", "--set", "zo_eps=.inf"], "zo_eps"),
    ("num-train-zero", ["train", "--set", "num_train=0"], "num_train=0"),
    ("num-dev-negative", ["train", "--set", "num_dev=-1"], "num_dev=-1"),
    ("method", ["train", "--set", "method=adam"], "method='adam'"),
    ("rloo-one-direction", ["train", "--set", "difference=rloo"], "difference=rloo needs num_directions >= 2"),
    ("difference-unknown", ["train", "--set", "difference=forward"], "difference='forward' is invalid"),
    ("budget-zero", ["train", "--set", "method=fixed", "--set", "budget=0"], "budget=0"),
    ("budget-over-one", ["train", "--set", "budget=1.5"], "budget=1.5"),
    ("budget-min-over-max", ["train", "--set", "budget_min=0.9", "--set", "budget_max=0.2"], "budget_min"),
    ("budget-alpha", ["train", "--set", "budget_alpha=2"], "budget_alpha"),
    ("score-beta", ["train", "--set", "score_beta=0"], "score_beta"),
    ("score-estimator", ["train", "--set", "score_estimator=magic"], "score_estimator"),
    ("seed-negative", ["train", "--set", "seed=-1"], "seed=-1"),
    ("seed-float", ["train", "--set", "seed=1.5"], "seed"),
    ("scheduler", ["train", "--set", "lr_scheduler_type=cosine"], "lr_scheduler_type"),
    ("dtype", ["train", "--set", "dtype=int8"], "dtype"),
    # issue 38 §5: paths that are no directory, refused before the hub is asked (it answered with 4 tracebacks)
    ("tokenizer-missing-path", ["train", "--set", "tokenizer={tmp}/no-tokenizer"], "no-tokenizer': no such directory"),
    ("model-missing-path", ["train", "--set", "model={tmp}/no-model"], "no-model': no such directory"),
    ("zero-stage-2", ["train", "--set", "zero_stage=2"], "zero_stage=2"),
    ("lora-not-bool", ["train", "--set", "lora=maybe"], "lora"),
    ("granularity", ["train", "--set", "block_granularity=row"], "block_granularity"),
    ("save-total-limit", ["train", "--set", "save_total_limit=0"], "save_total_limit"),
    ("report-to", ["train", "--set", "report_to=nosuch"], "report_to"),
    ("trust-remote-code", ["train", "--set", "trust_remote_code=yes please"], "trust_remote_code"),
    ("config-missing", ["train", "--config", "{tmp}/none.yaml"], "none.yaml: no such file"),
    ("config-is-dir", ["train", "--config", "{tmp}"], "is a directory"),
    ("config-bad-yaml", ["train", "--config", "{tmp}/bad.yaml"], "not valid YAML"),
    ("config-a-list", ["train", "--config", "{tmp}/list.yaml"], "must be a mapping"),
    ("config-duplicate-key", ["train", "--config", "{tmp}/duplicate.yaml"],
     "duplicate.yaml line 3: duplicate key 'learning_rate' (first at line 1)"),
    ("config-bad-yaml-line", ["train", "--config", "{tmp}/bad-line-3.yaml"], "bad-line-3.yaml line 3 column"),
    ("linear-without-max-steps", ["train", "--set", "lr_scheduler_type=linear", "--set", "max_steps=0"],
     "lr_scheduler_type=linear needs max_steps"),
    ("save-steps-negative", ["train", "--set", "save_steps=-1"], "an integer >= 0 (0: only at the end)"),
    ("task-upper-case", ["train", "--set", "task=SST2"], "names are lower case"),
    ("model-missing", ["train", "--set", "model={tmp}/no-model"], "no-model"),
    ("model-remote-code", ["train", "--set", "model={tmp}/remote-model"], "runs only with trust_remote_code=true"),
    ("tokenizer-remote-code", ["train", "--set", "tokenizer={tmp}/remote-tokenizer"],
     "runs only with trust_remote_code=true"),
    ("data-dir-missing", ["train", "--set", "data_dir={tmp}/no-data"], "no such file or directory"),
    ("output-dir-a-file", ["train", "--set", "output_dir={done}/summary.json"], "is a file"),
    ("output-dir-holds-a-run", ["train"], "already holds a run"),
    # --deepspeed files
    ("ds-missing", ["train", "--deepspeed", "{tmp}/none.json"], "none.json"),
    ("ds-invalid-json", ["train", "--deepspeed", "{tmp}/bad.json"], "not valid JSON"),
    ("ds-a-list", ["train", "--deepspeed", "{tmp}/list.json"], "JSON object"),
    ("ds-stage-1", ["train", "--deepspeed", "{ds}/zero1.json"], "zero_optimization.stage=1"),
    ("ds-stage-2", ["train", "--deepspeed", "{ds}/zero2.json"], "zero_optimization.stage=2"),
    ("ds-hpz", ["train", "--deepspeed", "{ds}/zeropp_hpz.json"], "zero_hpz_partition_size=8"),
    ("ds-quantized-weights", ["train", "--deepspeed", "{ds}/zeropp_quantized_weights.json"], "zero_quantized_weights"),
    ("ds-nvme", ["train", "--deepspeed", "{ds}/nvme_offload.json"], "nvme"),
    ("ds-pipeline", ["train", "--deepspeed", "{ds}/pipeline.json"], "pipeline.stages=2"),
    ("ds-tensor-parallel", ["train", "--deepspeed", "{ds}/tensor_parallel.json"], "autotp_size=2"),
    ("ds-key-typo", ["train", "--deepspeed", "{ds}/zero_key_typo.json"], "stage3_prefetch_bucket"),
    ("ds-bf16-and-fp16", ["train", "--deepspeed", "{ds}/bf16_and_fp16.json"], "bf16.enabled and fp16.enabled"),
    ("ds-mics", ["train", "--deepspeed", "{tmp}/mics.json"], "mics_shard_size"),
    ("ds-micro-batch-zero", ["train", "--deepspeed", "{tmp}/micro.json"], "train_micro_batch_size_per_gpu=0"),
    # a key set explicitly (BASE's --set, or the YAML) that the --deepspeed file sets to another value (issue 28 §1):
    # refused naming both values and where each came from, for every key the DeepSpeed config maps
    ("ds-conflict-global-batch", ["train", "--deepspeed", "{tmp}/batch32.json"],
     "global_batch_size=8 (--set) conflicts with train_batch_size=32 (--deepspeed {tmp}/batch32.json)"),
    ("ds-conflict-accumulation", ["train", "--deepspeed", "{tmp}/accum2.json"],
     "global_batch_size=8 (--set) conflicts with gradient_accumulation_steps=2 (x micro_batch_size 2 x 1 rank = 4)"),
    ("ds-conflict-micro-batch", ["train", "--deepspeed", "{tmp}/micro4.json"],
     "micro_batch_size=2 (--set) conflicts with train_micro_batch_size_per_gpu=4 (--deepspeed {tmp}/micro4.json)"),
    ("ds-conflict-bf16", ["train", "--set", "dtype=float32", "--deepspeed", "{tmp}/bf16.json"],
     "dtype=float32 (--set) conflicts with bf16.enabled=true (--deepspeed {tmp}/bf16.json)"),
    ("ds-conflict-fp16", ["train", "--set", "dtype=bfloat16", "--deepspeed", "{tmp}/fp16.json"],
     "dtype=bfloat16 (--set) conflicts with fp16.enabled=true"),
    ("ds-conflict-stage", ["train", "--set", "zero_stage=3", "--deepspeed", "{tmp}/stage0.json"],
     "zero_stage=3 (--set) conflicts with zero_optimization.stage=0"),
    ("ds-conflict-offload", ["train", "--set", "offload_param=none", "--deepspeed", "{tmp}/offload.json"],
     "offload_param=none (--set) conflicts with zero_optimization.offload_param.device=cpu"),
    ("ds-conflict-from-yaml", ["train", "--config", "{tmp}/float32.yaml", "--deepspeed", "{tmp}/bf16.json"],
     "dtype=float32 (--config {tmp}/float32.yaml) conflicts with bf16.enabled=true (--deepspeed {tmp}/bf16.json)"),
    ("eval-ds-conflict", ["eval", "--resume", "{done}/checkpoint-3", "--deepspeed", "{tmp}/batch32.json"],
     "global_batch_size=8 (--set) conflicts with train_batch_size=32"),
    # task directories
    ("task-dir-missing", ["train", "--set", "task={tmp}/no-task"], "neither a built-in task"),
    ("task-no-task-json", ["train", "--set", "task={tmp}/tasks/no-task-json"], "no task.json"),
    ("task-no-train", ["train", "--set", "task={tmp}/tasks/no-train"], "no train.jsonl"),
    ("task-duplicate-labels", ["train", "--set", "task={tmp}/tasks/duplicate-labels"], "repeats a word"),
    ("task-null-field", ["train", "--set", "task={tmp}/tasks/null-field"], "line 3: field 'text' is null"),
    ("task-missing-field", ["train", "--set", "task={tmp}/tasks/missing-field"], "line 2: missing field 'text'"),
    ("task-label-range", ["train", "--set", "task={tmp}/tasks/label-range"], "line 4: label 5 is out of range"),
    ("task-non-utf8", ["train", "--set", "task={tmp}/tasks/non-utf8"], "train.jsonl line 2: byte 0xff"),
    ("task-json-non-utf8", ["train", "--set", "task={tmp}/tasks/task-json-non-utf8"], "task.json: not valid"),
    ("task-bad-json-line", ["train", "--set", "task={tmp}/tasks/bad-json-line"], "line 2: not valid JSON"),
    ("task-empty-train", ["train", "--set", "task={tmp}/tasks/empty-train"], "holds no examples"),
    ("task-bad-metric", ["train", "--set", "task={tmp}/tasks/bad-metric"], "metric 'f1'"),
    ("output-dir-empty", ["train", "--set", "output_dir="], "output_dir=None is invalid"),
    ("task-misspelt-key", ["train", "--set", "task={tmp}/tasks/misspelt-key"], "did you mean 'label_words'"),
    # a user's own generation data (issue 48 §1): completion and chat task directories, each line checked
    ("task-kind-unknown", ["train", "--set", "task={tmp}/tasks/kind-unknown"],
     "kind 'compleition' is not one of classification, completion, chat (did you mean 'completion'?)"),
    ("completion-template-field", ["train", "--set", "task={tmp}/tasks/completion-template-field"],
     "unknown field 'template'; the known fields of a completion task are name, kind"),
    ("completion-missing-field", ["train", "--set", "task={tmp}/tasks/completion-missing-field"],
     "train.jsonl line 2: missing field 'completion'"),
    ("completion-empty", ["train", "--set", "task={tmp}/tasks/completion-empty"],
     "train.jsonl line 3: the completion is empty"),
    ("completion-prompt-cut-away", ["train", "--set", "task={tmp}/tasks/completion-long", "--set", "max_length=32",
                                    "--set", "max_new_tokens=8"],
     "train.jsonl line 5: max_length=32 cuts the prompt to nothing"),
    ("chat-bad-role", ["train", "--set", "task={tmp}/tasks/chat-bad-role", "--set", "tokenizer={tmp}/chat-tokenizer"],
     "train.jsonl line 2: message 1 has role 'human', not one of system, user, assistant"),
    ("chat-ends-with-user", ["train", "--set", "task={tmp}/tasks/chat-ends-with-user", "--set",
                             "tokenizer={tmp}/chat-tokenizer"],
     "train.jsonl line 4: the conversation ends with a user turn; it must end with an assistant turn"),
    ("chat-messages-not-a-list", ["train", "--set", "task={tmp}/tasks/chat-messages-text", "--set",
                                  "tokenizer={tmp}/chat-tokenizer"],
     "train.jsonl line 1: field 'messages' must be a non-empty list"),
    ("chat-assistant-turns", ["train", "--set", "task={tmp}/tasks/chat-assistant-turns"],
     "\"assistant_turns\" is 'every', not one of 'last', 'all'"),
    ("chat-no-template", ["train", "--set", "task={tmp}/tasks/chat-good"],
     "is a chat task, but the tokenizer"),
    # objective (issue 48 §3): the metric must fit the task
    ("objective-unknown", ["train", "--set", "objective=bleu"],
     "objective='bleu' is invalid: it must be loss, accuracy or f1"),
    ("objective-accuracy-generation", ["train", "--set", "task=squad", "--set", "data_dir=samples", "--set",
                                       "objective=accuracy"], "objective=accuracy needs a classification task"),
    ("objective-f1-classification", ["train", "--set", "objective=f1"],
     "objective=f1 needs a generation task (squad, drop, or a completion or chat task directory); task demo is a "
     "classification task"),
    ("objective-accuracy-chat", ["train", "--set", "task={tmp}/tasks/chat-good", "--set",
                                 "tokenizer={tmp}/chat-tokenizer", "--set", "objective=accuracy"],
     "task grocery is a chat task"),
    # quantization (issue 48 §4): a bitsandbytes base needs LoRA and stage 0
    ("quantization-unknown", ["train", "--set", "quantization=2bit"],
     "quantization='2bit' is invalid: it must be none, 8bit or 4bit"),
    ("quantization-a-number", ["train", "--set", "quantization=4"], "quantization=4 must be a string"),
    ("quantization-without-lora", ["train", "--set", "quantization=4bit"],
     "quantization=4bit needs lora=true: the quantised base is frozen and only LoRA adapters train"),
    ("quantization-zero-stage-3", ["train", "--set", "lora=true", "--set", "quantization=8bit", "--set",
                                   "zero_stage=3"], "quantization=8bit needs zero_stage=0 (a bitsandbytes base is "
     "whole on every rank; ZeRO-3 cannot partition or offload it), not zero_stage=3: set zero_stage=auto"),
    ("quantization-offload", ["train", "--set", "lora=true", "--set", "quantization=4bit", "--set",
                              "offload_param=cpu"], "not offload_param=cpu"),
    # BASE's --deepspeed file is ZeRO-3: refused by the layout, naming the file and the fix
    ("quantization-ds-zero3", ["train", "--set", "lora=true", "--set", "quantization=4bit"],
     "not zero_optimization.stage=3 in --deepspeed"),
    ("quantization-eval-changes", ["eval", "--set", "quantization=4bit", "--resume", "{done}/checkpoint-3"],
     "quantization: 'none' -> '4bit'"),
    ("plan-quantization-unknown", ["plan", "--world-size", "1", "--quantization", "3bit"],
     "--quantization 3bit: use none, 8bit or 4bit"),
    ("plan-quantization-sharded", ["plan", "--world-size", "2", "--shard-group-size", "2", "--quantization", "4bit"],
     "plan it with --shard-group-size 1 and no --offload"),
    ("plan-quantization-target", ["plan", "--world-size", "1", "--quantization", "4bit", "--lora-target-modules",
                                  "qkv"], "--lora-target-modules qkv: no linear layer of demo is named so"),
    # --resume
    ("resume-missing", ["train", "--resume", "{tmp}/no-checkpoint"], "no such checkpoint directory"),
    ("resume-not-a-checkpoint", ["train", "--resume", "{done}"], "no manifest.json"),
    ("resume-other-model", ["train", "--set", "model=demo-opt", "--resume", "{done}/checkpoint-3"],
     "model: 'demo' -> 'demo-opt'"),
    ("resume-other-lora", ["train", "--set", "lora=true", "--resume", "{done}/checkpoint-3"], "lora: False -> True"),
    ("resume-other-task", ["train", "--set", "task=sst2", "--set", "data_dir=samples", "--set", "num_train=8",
                           "--set", "global_batch_size=4", "--resume", "{done}/checkpoint-3"],
     "task: 'demo' -> 'sst2'"),
    ("resume-checksum", ["train", "--resume", "{tmp}/corrupt"], "checksum mismatch"),
    ("resume-max-steps-below", ["train", "--set", "max_steps=2", "--resume", "{done}/checkpoint-3"],
     "max_steps=2 is below"),
    # eval
    ("eval-bad-key", ["eval", "--set", "zo_eps=-1"], "zo_eps"),
    ("eval-not-a-checkpoint", ["eval", "--resume", "{done}"], "no manifest.json"),
    ("eval-checksum", ["eval", "--resume", "{tmp}/corrupt"], "checksum mismatch"),
    ("eval-changes-model", ["eval", "--set", "model=demo-opt", "--resume", "{done}/checkpoint-3"], "model"),
    # eval with no --resume would evaluate the untrained model, next to a finished run (issue 28 §2)
    ("eval-no-resume-on-a-run", ["eval"], "holds a run"),
    # export
    ("export-out-a-file", ["export", "{done}/checkpoint-3", "--out", "{done}/summary.json"], "existing file"),
    ("export-merge-full", ["export", "{done}/checkpoint-3", "--out", "{tmp}/merged", "--merge-lora"],
     "full fine-tuning checkpoint"),
    ("export-not-a-checkpoint", ["export", "{done}", "--out", "{tmp}/export"], "no manifest.json"),
    ("export-missing", ["export", "{tmp}/no-checkpoint", "--out", "{tmp}/export"], "no-checkpoint"),
    ("export-checksum", ["export", "{tmp}/corrupt", "--out", "{tmp}/export"], "checksum mismatch"),
    # an export over a non-empty directory would mix two exports' files (issue 28 §4); one that holds anything but an
    # earlier export is never replaced (issue 59 §2)
    ("export-out-not-empty", ["export", "{done}/checkpoint-3", "--out", "{tmp}/tasks"],
     "holds files that no export writes (bad-json-line/, bad-metric/"),
    # plot
    ("plot-empty-dir", ["plot", "{tmp}/empty"], "holds no metrics.jsonl"),
    ("plot-missing-dir", ["plot", "{tmp}/no-run"], "no such directory"),
    ("plot-out-txt", ["plot", "{done}", "--out", "{tmp}/x.txt"], ".png"),
    # plan
    ("plan-gpu-memory-zero", ["plan", "--world-size", "8", "--gpu-memory", "0GB"], "must be more than 0"),
    ("plan-world-zero", ["plan", "--world-size", "0"], "world-size"),
    ("plan-world-negative", ["plan", "--world-size", "-8"], "world-size"),
    ("plan-group-not-dividing", ["plan", "--world-size", "4", "--shard-group-size", "3"], "shard-group-size"),
    ("plan-no-config-json", ["plan", "--model", "{tmp}/empty", "--world-size", "2"], "config.json"),
]


# Issue 59: refused before any process group, so run in ONE forked process (tests/bad_input_batch.py: main(argv) per
# case, each case's stderr captured), not a fork each (the suite's launch budget, tests/launches.json). Same
# columns, plus the case's environment; the same checks. {tmp} also holds, for these: finished-run (a run's files),
# earlier-export (an export's), dtype-mismatch (the finished checkpoint, its manifest claiming bfloat16).
BATCHED = [
    # export --overwrite never deletes a run, live or finished (a live one: tests/test_export.py)
    ("export-overwrite-a-finished-run", ["export", "{done}/checkpoint-3", "--out", "{tmp}/finished-run", "--overwrite"],
     "holds a run (checkpoint-8, config.json, metrics.jsonl): an export never replaces a run's files", {}),
    ("export-overwrite-other-files", ["export", "{done}/checkpoint-3", "--out", "{tmp}/tasks", "--overwrite"],
     "holds files that no export writes", {}),
    ("export-earlier-export-needs-overwrite", ["export", "{done}/checkpoint-3", "--out", "{tmp}/earlier-export"],
     "is not empty: it holds an earlier export", {}),
    # a manifest whose dtype its tensors do not have
    ("export-dtype-mismatch", ["export", "{tmp}/dtype-mismatch/checkpoint-3", "--out", "{tmp}/x"],
     "where the manifest records dtype bfloat16: the manifest and the tensors disagree", {}),
    ("eval-dtype-mismatch", ["eval", "--resume", "{tmp}/dtype-mismatch/checkpoint-3"],
     "the manifest and the tensors disagree", {}),
    # the directions rule, in plan and before any rank starts
    ("plan-directions-refused", ["plan", "--world-size", "4", "--shard-group-size", "2", "--num-directions", "3"],
     "refused: num_directions=3 must be a multiple of the number of replica groups (2 = world size 4 / "
     "shard_group_size 2)", {}),
    ("plan-directions-refused-8", ["plan", "--world-size", "8", "--shard-group-size", "2", "--num-directions", "6"],
     "use --num-directions a multiple of 4", {}),
    ("check-directions-refused", ["train", "--check", "--world-size", "4", "--set", "shard_group_size=2", "--set",
                                  "num_directions=3"], "num_directions=3 must be a multiple of the number of replica "
     "groups (2 = world size 4 / shard_group_size 2)", {}),
    ("check-group-not-dividing", ["train", "--check", "--world-size", "3", "--set", "shard_group_size=2"],
     "shard_group_size=2 must divide the world size 3", {}),
    ("check-world-size-zero", ["train", "--check", "--world-size", "0"], "--world-size 0: use an integer >= 1", {}),
    ("world-size-without-check", ["train", "--world-size", "2"], "--world-size goes with --check only", {}),
    # several --config files: each is read (the first was dropped)
    ("config-first-of-two-missing", ["train", "--config", "{tmp}/none.yaml", "--config", "{tmp}/float32.yaml"],
     "none.yaml: no such file", {}),
    ("config-second-of-two-a-list", ["train", "--config", "{tmp}/float32.yaml", "--config", "{tmp}/list.yaml"],
     "list.yaml: must be a mapping", {}),
    # path-valued keys: the kind of path each needs
    ("task-a-file", ["train", "--set", "task={tmp}/bad.json"], "bad.json is a file, not a directory: give a task "
     "directory (the one holding task.json) or a built-in task", {}),
    ("model-a-file", ["train", "--set", "model={tmp}/bad.json"], "model={tmp}/bad.json is a file, not a directory", {}),
    ("tokenizer-a-file", ["train", "--set", "tokenizer={tmp}/bad.json"], "tokenizer={tmp}/bad.json is a file", {}),
    ("data-dir-a-file", ["train", "--set", "data_dir={tmp}/bad.json"], "data_dir={tmp}/bad.json is a file", {}),
    ("deepspeed-a-directory", ["train", "--deepspeed", "{tmp}/empty"], "is a directory: name the DeepSpeed JSON "
     "file", {}),
    # the environment variables the project reads
    ("env-noise-kernel", ["train", "--check"], "CURVZO_DS_NOISE_KERNEL='fast' is not one of auto, torch, triton",
     {"CURVZO_DS_NOISE_KERNEL": "fast"}),
    ("env-ds-accelerator", ["plan", "--world-size", "1"], "DS_ACCELERATOR='gpu' is not one of DeepSpeed's",
     {"DS_ACCELERATOR": "gpu"}),
    ("env-extensions-dir-a-file", ["train"], "TORCH_EXTENSIONS_DIR={tmp}/bad.json is a file, not a directory",
     {"TORCH_EXTENSIONS_DIR": "{tmp}/bad.json"}),
    ("env-master-addr", ["train", "--check"], "MASTER_ADDR=no-such-host.invalid (MASTER_PORT=29500) cannot be "
     "resolved", {"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}),
    # the newest keys: directions, differences, step_normalization, objectives, quantization, static masks
    ("num-directions-zero", ["train", "--set", "num_directions=0"], "num_directions=0 is invalid: it must be an "
     "integer >= 1", {}),
    ("num-directions-negative", ["train", "--set", "num_directions=-2"], "num_directions=-2 is invalid", {}),
    ("num-directions-float", ["train", "--set", "num_directions=2.5"], "num_directions=2.5 must be an integer", {}),
    ("num-directions-absurd", ["train", "--set", "num_directions=1000000"], "num_directions=1000000 is more than "
     "1024: each step would be 2,000,000 forwards", {}),
    ("difference-upper-case", ["train", "--set", "difference=RLOO"], "difference='RLOO' is invalid: it must be "
     "central or rloo", {}),
    ("difference-a-number", ["train", "--set", "difference=2"], "difference=2 must be a string", {}),
    ("step-normalization-unknown", ["train", "--set", "step_normalization=rms"], "step_normalization='rms' is "
     "invalid", {}),
    ("step-normalization-a-number", ["train", "--set", "step_normalization=1"], "step_normalization=1 must be a "
     "string", {}),
    ("step-normalization-central", ["train", "--set", "step_normalization=loss_std"],
     "step_normalization=loss_std needs difference=rloo", {}),
    ("step-normalization-rloo-one-direction", ["train", "--set", "step_normalization=loss_std", "--set",
                                               "difference=rloo"], "difference=rloo needs num_directions >= 2", {}),
    ("objective-upper-case", ["train", "--set", "objective=F1"], "objective='F1' is invalid: it must be loss, "
     "accuracy or f1", {}),
    ("objective-a-list", ["train", "--set", "objective=[f1]"], "objective=['f1'] must be a string", {}),
    ("quantization-upper-case", ["train", "--set", "quantization=NONE"], "quantization='NONE' is invalid", {}),
    ("quantization-lora-false", ["train", "--set", "quantization=8bit", "--set", "lora=false"],
     "quantization=8bit needs lora=true", {}),
    ("quantization-8bit-offload", ["train", "--set", "lora=true", "--set", "quantization=8bit", "--set",
                                   "offload_param=cpu"], "quantization=8bit needs zero_stage=0", {}),
    ("static-mask-curvzo", ["train", "--set", "static_mask=0.1", "--set", "method=curvzo"],
     "static_mask=0.1 needs method=mezo", {}),
    ("static-mask-over-one", ["train", "--set", "static_mask=1.5"], "static_mask=1.5 is invalid", {}),
    ("plan-num-directions-zero", ["plan", "--world-size", "1", "--num-directions", "0"], "use integers >= 1", {}),
    ("plan-quantization-8bit-offload", ["plan", "--world-size", "1", "--quantization", "8bit", "--offload", "cpu"],
     "plan it with --shard-group-size 1 and no --offload", {}),
    # issue 57's rate and issue 59's divergence keys
    ("auto-rate-unnormalised", ["train", "--set", "learning_rate=auto"],
     "learning_rate=auto needs a normalised step", {}),
    ("auto-rate-no-probes", ["train", "--set", "learning_rate=auto", "--set", "step_normalization=running_rms",
                             "--set", "auto_rate_probes=0"], "auto_rate_probes=0 is invalid", {}),
    ("auto-rate-misspelt", ["train", "--set", "learning_rate=automatic"], "learning_rate='automatic' is invalid", {}),
    ("plateau-without-evaluations", ["train", "--set", "lr_scheduler_type=plateau", "--set", "eval_steps=0"],
     "lr_scheduler_type=plateau needs evaluations during the run", {}),
    ("plateau-factor-one", ["train", "--set", "plateau_factor=1"], "plateau_factor=1.0 is invalid", {}),
    ("plateau-patience-zero", ["train", "--set", "plateau_patience=0"], "plateau_patience=0 is invalid", {}),
    ("scheduler-unknown", ["train", "--set", "lr_scheduler_type=cosine"], "constant, linear, plateau", {}),
    ("running-rms-with-rloo", ["train", "--set", "step_normalization=running_rms", "--set", "difference=rloo",
                               "--set", "num_directions=4"], "step_normalization=running_rms needs "
     "difference=central", {}),
    ("loss-std-with-central", ["train", "--set", "step_normalization=loss_std"],
     "step_normalization=loss_std needs difference=rloo", {}),
    ("auto-rate-fraction-zero", ["train", "--set", "auto_rate_fraction=0"], "auto_rate_fraction=0.0 is invalid", {}),
    ("on-divergence-unknown", ["train", "--set", "on_divergence=ignore"], "on_divergence='ignore' is invalid", {}),
    ("max-rollbacks-negative", ["train", "--set", "max_rollbacks=-1"], "max_rollbacks=-1 is invalid", {}),
    # issue 58's perturbation
    ("perturbation-unknown", ["train", "--set", "perturbation=uniform"], "perturbation='uniform' is invalid", {}),
    ("perturbation-a-number", ["train", "--set", "perturbation=1"], "perturbation=1", {}),
]


@pytest.fixture(scope="module")
def batched(places, tmp_path_factory) -> dict:
    """Every BATCHED case, in one process forked once (tests/bad_input_batch.py), against one copy of the run."""
    root = tmp_path_factory.mktemp("batched")
    tmp = pathlib.Path(places["tmp"])
    run = tmp / "finished-run"
    (run / "checkpoint-8").mkdir(parents=True)
    (run / "checkpoint-8" / "manifest.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"output_dir": str(run), "method": "mezo"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n')
    (tmp / "earlier-export").mkdir()
    (tmp / "earlier-export" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp / "earlier-export" / "model.safetensors").write_bytes(b"")
    mismatch = tmp / "dtype-mismatch" / "checkpoint-3"
    shutil.copytree(pathlib.Path(places["done"]) / "checkpoint-3", mismatch)
    manifest = json.loads((mismatch / "manifest.json").read_text())
    first = sorted(manifest["tensors"])[0]
    manifest["tensors"][first].update(dtype="bfloat16", master=False)
    (mismatch / "manifest.json").write_text(json.dumps(manifest))
    own = {**places, "done": str(root / "done")}
    shutil.copytree(places["done"], own["done"])
    cases = [{"id": name, "env": {k: v.format(**own) for k, v in env.items()},
              "argv": [a.format(**own) for a in (args[:1] + BASE + args[1:] if args[0] in ("train", "eval")
                                                 else args)]} for name, args, _, env in BATCHED]
    (root / "cases.json").write_text(json.dumps(cases))
    proc = cli(str(root / "cases.json"), str(root / "results.json"), own["done"],
               script=ROOT / "tests" / "bad_input_batch.py", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"own": own, "results": json.loads((root / "results.json").read_text()),
            "before": _snapshot(pathlib.Path(places["done"]))}


@pytest.mark.parametrize("name,args,words,env", BATCHED, ids=[c[0] for c in BATCHED])
def test_a_batched_bad_input_is_one_line_and_exit_2(batched, name, args, words, env):
    result, own = batched["results"][name], batched["own"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith(f"curvzo-ds {args[0]}: error:")]
    assert result["returncode"] == 2 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert len(errors) == 1 and words.format(**own) in errors[0], result["stderr"][-3000:]
    assert _snapshot(pathlib.Path(own["done"])) == batched["before"], f"{own['done']} changed"


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every path under root: a directory's entry, or a file's SHA-256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _task_dir(root: pathlib.Path, name: str, spec: dict | None = GOOD_TASK, train: bytes | None = None) -> None:
    d = root / name
    d.mkdir(parents=True)
    if spec is not None:
        (d / "task.json").write_text(json.dumps(spec))
    if train is None:
        train = "".join(json.dumps(x) + "\n" for x in GOOD_LINES).encode()
    if train != b"-":
        (d / "train.jsonl").write_bytes(train)


def _lines(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """{done}: a finished 3-step run; {tmp}: the bad files; {ds}: the repository's DeepSpeed configs."""
    root = tmp_path_factory.mktemp("bad-inputs")
    done = root / "done"
    run_checked([sys.executable, "-m", "curvzo_ds.cli", "train", *[a.format(done=done) for a in BASE]])
    tmp = root / "tmp"
    tmp.mkdir()
    (tmp / "empty").mkdir()
    (tmp / "bad.yaml").write_text("learning_rate: [1e-3\n")
    (tmp / "list.yaml").write_text("- learning_rate\n")
    (tmp / "bad.json").write_text('{"zero_optimization": {"stage": 3},}\n')
    (tmp / "list.json").write_text("[3]\n")
    (tmp / "mics.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}))
    (tmp / "micro.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 0}))
    for name, ds in (("batch32", {"train_batch_size": 32}), ("accum2", {"gradient_accumulation_steps": 2}),
                     ("micro4", {"train_micro_batch_size_per_gpu": 4}), ("bf16", {"bf16": {"enabled": True}}),
                     ("fp16", {"fp16": {"enabled": True}}), ("stage0", {"zero_optimization": {"stage": 0}}),
                     ("offload", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})):
        (tmp / f"{name}.json").write_text(json.dumps(ds))
    (tmp / "float32.yaml").write_text("dtype: float32\n")
    (tmp / "duplicate.yaml").write_text("learning_rate: 1e-3\nseed: 1\nlearning_rate: 1e-4\n")
    (tmp / "bad-line-3.yaml").write_text("seed: 1\nzo_eps: 1e-3\nlearning_rate: 1e-3: 2\n")
    # Hub-style directories whose config names code of their own: it must never run (it would exit 1).
    for name, config, module in (("remote-model", "config.json", "configuration_x"),
                                 ("remote-tokenizer", "tokenizer_config.json", "tokenization_x")):
        (tmp / name).mkdir()
        auto_map = ({"AutoConfig": f"{module}.XConfig"} if name == "remote-model" else
                    {"AutoTokenizer": [f"{module}.XTokenizer", None]})
        (tmp / name / config).write_text(json.dumps({"model_type": "x", "auto_map": auto_map}))
        (tmp / name / f"{module}.py").write_text("raise SystemExit('remote code ran')\n")
    tasks = tmp / "tasks"
    ok = GOOD_LINES[:3]
    _task_dir(tasks, "no-task-json", spec=None)
    _task_dir(tasks, "no-train", train=b"-")
    _task_dir(tasks, "duplicate-labels", spec={**GOOD_TASK, "label_words": [" good", " good"]})
    _task_dir(tasks, "null-field", train=_lines(*ok[:2], {"text": None, "label": 0}, *GOOD_LINES[3:]))
    _task_dir(tasks, "missing-field", train=_lines(ok[0], {"label": 0}, *GOOD_LINES[2:]))
    _task_dir(tasks, "label-range", train=_lines(*ok, {"text": "x", "label": 5}, *GOOD_LINES[4:]))
    _task_dir(tasks, "non-utf8", train=_lines(ok[0]) + b'{"text": "caf\xff", "label": 1}\n' + _lines(*GOOD_LINES[2:]))
    _task_dir(tasks, "bad-json-line", train=_lines(ok[0], '{"text": "a", "label": 0', *GOOD_LINES[2:]))
    _task_dir(tasks, "empty-train", train=b"\n")
    _task_dir(tasks, "bad-metric", spec={**GOOD_TASK, "metric": "f1"})
    _task_dir(tasks, "misspelt-key", spec={**GOOD_TASK, "lable_words": [" bad", " good"]})
    _task_dir(tasks, "task-json-non-utf8", spec=None)
    completion = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(40)]
    chat = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}
            for i in range(40)]
    _task_dir(tasks, "kind-unknown", spec={"name": "t", "kind": "compleition"}, train=_lines(*completion))
    _task_dir(tasks, "completion-template-field", spec={"name": "t", "kind": "completion", "template": "{prompt}"},
              train=_lines(*completion))
    _task_dir(tasks, "completion-missing-field", spec={"name": "t", "kind": "completion"},
              train=_lines(completion[0], {"prompt": "1 + 1 ="}, *completion[2:]))
    _task_dir(tasks, "completion-empty", spec={"name": "t", "kind": "completion"},
              train=_lines(*completion[:2], {"prompt": "2 + 1 =", "completion": ""}, *completion[3:]))
    long = {"prompt": "4 + 1 =", "completion": " five" * 40}  # line 5: a completion longer than max_length
    _task_dir(tasks, "completion-long", spec={"name": "t", "kind": "completion"},
              train=_lines(*completion[:4], long, *completion[5:]))
    _task_dir(tasks, "chat-bad-role", spec={"name": "t", "kind": "chat"},
              train=_lines(chat[0], {"messages": [{"role": "human", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello."}]}, *chat[2:]))
    _task_dir(tasks, "chat-ends-with-user", spec={"name": "t", "kind": "chat"},
              train=_lines(*chat[:3], {"messages": chat[3]["messages"][:1]}, *chat[4:]))
    _task_dir(tasks, "chat-messages-text", spec={"name": "t", "kind": "chat"},
              train=_lines({"messages": "user: Hi\nassistant: Hello."}, *chat[1:]))
    _task_dir(tasks, "chat-assistant-turns", spec={"name": "t", "kind": "chat", "assistant_turns": "every"},
              train=_lines(*chat))
    _task_dir(tasks, "chat-good", spec={"name": "grocery", "kind": "chat"}, train=_lines(*chat))
    shutil.copytree(ROOT / "curvzo_ds" / "assets" / "tokenizer-llama", tmp / "chat-tokenizer")  # with a template:
    (tmp / "chat-tokenizer" / "chat_template.jinja").write_text(  # the refusal is the objective's, not the template's
        "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    (tasks / "task-json-non-utf8" / "task.json").write_bytes(json.dumps(GOOD_TASK).encode().replace(b"bad", b"b\xffd"))
    corrupt = tmp / "corrupt"
    shutil.copytree(done / "checkpoint-3", corrupt)
    rank_file = next(corrupt.glob("rank-*.safetensors"))
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    return {"done": str(done), "tmp": str(tmp), "ds": str(DS)}


@pytest.fixture(scope="module")
def outcomes(places, tmp_path_factory) -> dict:
    """Every case run once, two at a time (each process spends seconds importing torch and DeepSpeed). Each case
    points at its own copy of the finished run, so that each copy can be compared with the original."""
    root = tmp_path_factory.mktemp("cases")

    def run(case):
        name, args, _ = case
        own = {**places, "done": str(root / name)}
        shutil.copytree(places["done"], own["done"])
        command = args[0]
        argv = [a.format(**own) for a in (args[:1] + BASE + args[1:] if command in ("train", "eval") else args)]
        proc = run_cli([sys.executable, "-m", "curvzo_ds.cli", *argv], env=ENV, capture_output=True,
                              text=True, timeout=300, cwd=str(ROOT))
        return proc, own, _snapshot(pathlib.Path(own["done"]))

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([c[0] for c in CASES], pool.map(run, CASES)))


@pytest.mark.parametrize("name,args,words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_exit_2(places, outcomes, name, args, words):
    proc, own, after = outcomes[name]
    command = args[0]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"curvzo-ds {command}: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and words.format(**own) in errors[0], proc.stderr[-3000:]
    assert after == _snapshot(pathlib.Path(places["done"])), f"{own['done']} changed"


def test_the_table_is_large_and_its_ids_unique():
    ids = [c[0] for c in CASES + BATCHED]
    assert len(CASES) >= 112 and len(BATCHED) >= 40 and len(set(ids)) == len(ids)


def test_float16_is_refused_in_one_line_where_the_device_has_none(places, tmp_path):
    """Issue 38 §5: `--set dtype=float16` on a CPU without float16 was DeepSpeed's ValueError traceback. Where the
    device has float16 (DeepSpeed's accelerator says so), the same command trains."""
    from deepspeed.accelerator import get_accelerator

    out = tmp_path / "fp16"
    argv = [a.format(done=out) for a in BASE] + ["--set", "dtype=float16"]
    proc = cli("train", *argv)
    if get_accelerator().is_fp16_supported():
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    errors = [line for line in proc.stderr.splitlines() if line.startswith("curvzo-ds train: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "dtype=float16" in errors[0] and "bfloat16" in errors[0], errors
    assert not out.exists()  # refused before anything was written
