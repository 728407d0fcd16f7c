"""Every command block in README.md and docs/*.md that a user would run is run here (issue 38): extracted from the
doc, with its placeholders filled and its sizes cut to CI's by the substitutions in SUBSTITUTIONS (each one listed,
nothing else changed), in a temporary directory, on CPU.

A block's command that is not run here is marked in the doc, on the line right before the block's fence:
    <!-- not run: REASON -->            the whole block
    <!-- not run, line N: REASON -->    its N-th command (commands are counted after joining `\\` continuations)
A command run verbatim by another test or script is listed in RUN_ELSEWHERE, with the text that proves it there
(checked here, so the doc and that test cannot drift apart). `test_every_command_block_is_run_or_marked` (unit tier)
fails on a block that is none of these.

Commands that start with `curvzo-ds` are forked from the tests' CLI server (tests/helpers.cli); a `| jq ...` after
one is run on its stdout by bash with pipefail. Python blocks run as a forked script (one rank, torchrun's
variables), after a prelude that defines the names the block leaves to the user (PYTHON_PRELUDES).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

from tests.helpers import ENV, ROOT, cli

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGS = {"bash", "sh", "shell", "console", "python", "py"}  # blocks a user runs; json/yaml/text are content
MARK = re.compile(r"<!--\s*not run(?:, line (\d+))?:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclasses.dataclass
class Block:
    doc: pathlib.Path
    line: int  # of the opening fence, 1-based
    number: int  # the block's place among the doc's fenced blocks, 1-based: its id, which edits elsewhere keep
    lang: str
    text: str
    not_run: dict[int | None, str]  # command number (None: the whole block) -> reason
    caption: str  # the doc's line before the block (a file name in `reviews/task.json` captions)

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}#{self.number}"

    def commands(self) -> list[str]:
        """The block's shell commands: continuations joined, comments and blank lines dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [" ".join(shlex.split(line, comments=True, posix=False)) for line in joined.splitlines()
                if shlex.split(line, comments=True)]


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for number, m in enumerate(FENCE.finditer(text), 1):
            before = text[:m.start()].splitlines()
            not_run: dict[int | None, str] = {}
            caption = ""
            for prev in reversed(before):  # the marks right above the fence
                mark = MARK.search(prev)
                if not mark:
                    caption = prev.strip()
                    break
                not_run[int(mark.group(1)) if mark.group(1) else None] = mark.group(2)
            found.append(Block(doc, len(before) + 1, number, (m.group(1).split() or [""])[0], m.group(2), not_run,
                               caption))
    return found


# A command a test or script elsewhere runs as written: (file, the text there that runs it). One run is enough.
RUN_ELSEWHERE = {
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install .":
        ("tools/wheel_check.sh", "line=$(grep -m1 'download.pytorch.org/whl/cpu' \"$repo/README.md\""),
    "bash launch/demo.sh":  # as written, 300 steps (tests/test_docs_figures.py checks its run)
        ("tools/measure_docs.py", 'demo = run(["bash", str(ROOT / "launch" / "demo.sh")], where / "demo")'),
    "bash tools/test.sh": (".ci/run", "bash tools/test.sh || status=$?"),
}

# Per doc: (as written, as run) — placeholders filled and sizes cut to CI's. Nothing else is changed.
CI_SIZE = "--set max_steps=6 --set eval_steps=3 --set save_steps=3 --set num_dev=8 --set num_eval=8"
SUBSTITUTIONS = {
    "README.md": [
        ("--set model=facebook/opt-125m", "--set model=demo"),  # the hub's OPT-125M: the built-in tiny Llama
        ("--set task=sst2", "--set task=sst2 --set data_dir=samples"),  # the hub's SST-2: its bundled examples
        ("--set max_steps=1000", f"{CI_SIZE} --set global_batch_size=4"),
        ("checkpoint-1000", "checkpoint-6"),
    ],
    "docs/config.md": [("--set max_steps=20", CI_SIZE), ("checkpoint-20", "checkpoint-6")],  # the 4-bit LoRA run
    "docs/algorithm.md": [("...", f"--set task=sst2 --set data_dir=samples --set global_batch_size=4 {CI_SIZE}")],
    "docs/tasks.md": [
        ("--set global_batch_size=8", f"--set global_batch_size=8 {CI_SIZE}"),
        ("--set model=facebook/opt-1.3b", "--set model=demo"),
        ("--set num_train=1000 --set num_dev=500", f"--set num_train=2 --set global_batch_size=2 {CI_SIZE}"),
    ],
    "docs/integrations.md": [
        ("    ...\n    return loss_sum, n_tokens",  # the user's loss: the contract's (sum of token losses, count)
         "    logits = out.logits[:, :-1].float()\n    labels = batch['input_ids'][:, 1:]\n"
         "    loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),"
         " reduction='sum')\n    n_tokens = labels.numel()\n    return loss_sum, n_tokens"),
        ("max_steps=20000,", "max_steps=4,"),
        ("eval_steps=500", "eval_steps=2"),
        ("save_steps=500", "save_steps=2"),
    ],
}

# The names a Python block leaves to the user (the model, the data), defined before it runs.
_DATA = """
import torch
from transformers import AutoModelForCausalLM
from curvzo_ds.tasks import demo_model_config
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(demo_model_config("llama"))
g = torch.Generator().manual_seed(1)
rows = [{"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids.clone()}
        for ids in torch.randint(10, 18, (64, 16), generator=g)]
"""
PYTHON_PRELUDES = {
    "docs/integrations.md#1": _DATA + "train_set = rows\n",
    "docs/integrations.md#2": _DATA + "train, dev = rows[:48], rows[48:]\n",
}
# What a Python block must have done, checked after it (its own code has no assertions).
PYTHON_CHECKS = {
    "docs/integrations.md#1": "\nassert engine.step_count == 2, engine.step_count  # 64 rows, batches of 32\n",
    "docs/integrations.md#2": "\nimport os\nassert trainer.state.global_step == 4, trainer.state.global_step\n"
                               "assert os.path.isdir('out/checkpoint-4'), os.listdir('out')\n"
                               "assert trainer.is_deepspeed_enabled  # under ds_configs/zero3.json, as written\n",
}


def substituted(block: Block, text: str) -> str:
    for old, new in SUBSTITUTIONS.get(str(block.doc.relative_to(ROOT)), []):
        text = text.replace(old, new)
    return text


def to_run(block: Block) -> list[str]:
    """The block's commands this test runs (none for a Python block: it runs whole)."""
    if block.lang not in COMMAND_LANGS or None in block.not_run or block.lang.startswith("py"):
        return []
    return [c for i, c in enumerate(block.commands(), 1) if i not in block.not_run and c not in RUN_ELSEWHERE]


def runnable() -> list[Block]:
    return [b for b in blocks() if b.lang in COMMAND_LANGS and None not in b.not_run
            and (b.lang.startswith("py") or to_run(b))]


def test_every_command_block_is_run_or_marked():
    """Each bash/python block is run here, run elsewhere (RUN_ELSEWHERE), or marked `<!-- not run: REASON -->`; every
    mark names a command that exists; every substitution still matches its doc (a doc edit cannot silently skip one)."""
    found = blocks()
    assert len(found) > 10, "no fenced blocks found: the extractor is broken"
    for b in found:
        if b.lang not in COMMAND_LANGS or b.lang.startswith("py"):
            assert set(b.not_run) <= {None}, f"{b.id} (line {b.line}): a per-line mark on a block of no commands"
            continue
        n = len(b.commands())
        assert all(k is None or 1 <= k <= n for k in b.not_run), f"{b.id} (line {b.line}): no such command"
    for doc, subs in SUBSTITUTIONS.items():
        text = (ROOT / doc).read_text()
        for old, _ in subs:
            assert old in text, f"{doc} no longer holds {old!r}: update SUBSTITUTIONS"
    python = [b.id for b in found if b.lang.startswith("py") and None not in b.not_run]
    assert sorted(python) == sorted(PYTHON_PRELUDES) == sorted(PYTHON_CHECKS), "a Python block without a prelude"


def test_commands_run_elsewhere_are_run_there_as_written():
    """RUN_ELSEWHERE: each command is in a doc, and the test or script that runs it still holds the text that does."""
    commands = {c for b in blocks() if b.lang in COMMAND_LANGS and not b.lang.startswith("py") for c in b.commands()}
    for command, (path, evidence) in RUN_ELSEWHERE.items():
        assert command in commands, f"{command!r} is in no doc block: drop it from RUN_ELSEWHERE"
        assert evidence in (ROOT / path).read_text(), f"{path} no longer runs {command!r} as the doc writes it"


def run_command(command: str, cwd: pathlib.Path) -> None:
    if command.startswith("curvzo-ds "):
        first, _, pipe = command.partition(" | ")
        proc = cli(*shlex.split(first)[1:], env=ENV, cwd=cwd)
        assert proc.returncode == 0, f"{first}\nexited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        if pipe:
            if pipe.startswith("jq ") and shutil.which("jq") is None:
                pytest.fail("jq is not installed (apt-get install jq; tools/test.sh does it)")
            piped = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", pipe], input=proc.stdout, cwd=str(cwd),
                                   env=ENV, capture_output=True, text=True, timeout=60)
            assert piped.returncode == 0 and json.loads(piped.stdout or "null") is not None, \
                f"| {pipe} gave {piped.stdout!r}, exit {piped.returncode}:\n{piped.stderr}"
        return
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=str(cwd), env=ENV,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{command}\nexited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def write_captioned_files(doc: pathlib.Path, cwd: pathlib.Path) -> None:
    """The doc's content blocks captioned with a file name (`reviews/task.json`), written where a command reads them."""
    for b in blocks():
        name = b.caption.strip("`")
        if b.doc == doc and b.lang not in COMMAND_LANGS and re.fullmatch(r"[\w./-]+\.\w+", name):
            (cwd / name).parent.mkdir(parents=True, exist_ok=True)
            (cwd / name).write_text(b.text)


@pytest.mark.slow  # CLI training runs, forked
@pytest.mark.parametrize("block_id", [b.id for b in runnable()])
def test_doc_block_runs(block_id, tmp_path):
    block = next(b for b in blocks() if b.id == block_id)
    write_captioned_files(block.doc, tmp_path)
    (tmp_path / "ds_configs").symlink_to(ROOT / "ds_configs")  # the docs' paths are the repository root's
    if block.lang.startswith("py"):
        script = tmp_path / "block.py"
        script.write_text(PYTHON_PRELUDES[block_id] + substituted(block, block.text) + PYTHON_CHECKS[block_id])
        proc = cli(script=script, env=ENV, cwd=tmp_path)
        assert proc.returncode == 0, f"{block_id} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-5000:]}"
        return
    commands = [substituted(block, c) for c in to_run(block)]
    for command in commands:
        run_command(command, tmp_path)
    trained = [c for c in commands if c.startswith("curvzo-ds train")]
    summaries = sorted(tmp_path.rglob("summary.json"))  # each training run finished and wrote its summary
    assert len(summaries) == len(trained), (summaries, trained)
    assert all(json.loads(s.read_text())["steps"] == 6 for s in summaries), summaries
