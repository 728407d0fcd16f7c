"""Counts the processes the suite starts, per test, so that CI's time cannot grow unnoticed (issue 35).

A process of ours costs seconds before it does anything: 6-8 s of imports on the 2-core CI machine for an
interpreter started from scratch (`started`), about 1 s for a command forked from tests/cli_server.py (`forked`).
Seconds are noisy on a shared machine; counts are not. So:
- every test's counts are recorded in tests/launches.json (`CURVZO_RECORD_LAUNCHES=1 bash tools/test.sh`);
  launches made while a session- or module-scoped fixture is set up are recorded under `fixture:<name>`;
- a full-suite run fails when a test or fixture starts more than its record says (conftest.py), so the record
  cannot understate;
- tests/test_launch_budget.py (unit tier) fails when the recorded total exceeds BUDGET.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

RECORD = pathlib.Path(__file__).with_name("launches.json")
# Set from the suite's measurement of 2026-11-26 (docs/testing.md), with a little room: raising a budget is a
# decision to make CI slower, taken in review, not by a test that happens to fit.
BUDGET = {"started": 80, "forked": 420}

counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
owner: list[str] = ["<session>"]  # who is launching now: a test id or fixture:<name>

# A process started from one of these is one of ours or a launcher of ours; utilities (pgrep, squeue, mount, cp,
# git, ruff, apt) are not counted.
LAUNCHERS = {"python", "python3", "torchrun", "deepspeed", "accelerate", "mpirun", "srun", "sbatch", "bash",
             "curvzo-ds"}


def is_launch(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    first = os.path.basename(str(argv[0]))
    return first in LAUNCHERS or str(argv[0]) == sys.executable or first.startswith("python3.")


def count(kind: str) -> None:
    counts[owner[-1]][kind] += 1


def install() -> None:
    """Count every subprocess.Popen that starts an interpreter or a launcher (subprocess.run goes through it)."""
    original = subprocess.Popen.__init__
    if getattr(original, "_counted", False):
        return

    def counted_init(self, args, *rest, **kwargs):
        if is_launch(args) and "cli_server.py" in str(args):
            counts["cli-server"]["started"] += 1  # the session's, not the first test's that needed one
        elif is_launch(args):
            count("started")
        original(self, args, *rest, **kwargs)

    counted_init._counted = True
    subprocess.Popen.__init__ = counted_init


def load() -> dict[str, dict[str, int]]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def excess(recorded: dict[str, dict[str, int]]) -> list[str]:
    """Each test or fixture of this run that launched more than its record allows, as one line."""
    lines = []
    for who, kinds in sorted(counts.items()):
        for kind, n in sorted(kinds.items()):
            allowed = recorded.get(who, {}).get(kind, 0)
            if n > allowed:
                lines.append(f"{who}: {n} {kind} launches, recorded {allowed}")
    return lines


def save(recorded: dict[str, dict[str, int]]) -> None:
    """Merge this run's counts into the record (tests that did not run keep theirs)."""
    merged = dict(recorded)
    for who, kinds in counts.items():
        merged[who] = {k: kinds[k] for k in sorted(kinds) if kinds[k]}
    merged = {k: v for k, v in sorted(merged.items()) if v}
    RECORD.write_text(json.dumps(merged, indent=1) + "\n")


def totals(recorded: dict[str, dict[str, int]]) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for kinds in recorded.values():
        total.update(kinds)
    return dict(total)
