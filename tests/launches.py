"""Counts the processes the suite starts, per test, so that CI's time cannot grow unnoticed (issue 35).

A process of ours costs seconds before it does anything: 6-8 s of imports on the 2-core CI machine for an
interpreter started from scratch (`started`), about 1 s for a command forked from tests/cli_server.py (`forked`).
Seconds are noisy on a shared machine; counts are not. So:
- every Python interpreter started with the tests' environment writes a line to a log (tests/launch_log/
  sitecustomize.py): the launchers (torchrun is one), their ranks, and whatever those start; helpers.cli counts
  each forked rank itself;
- every test's counts are recorded in tests/launches.json (`CURVZO_RECORD_LAUNCHES=1 bash tools/test.sh`);
  what starts while a session- or module-scoped fixture is set up is recorded under `fixture:<name>`, and the
  CLI servers under `cli-server`;
- a run of the suite fails when a test or fixture launches more than its record says (conftest.py), so the
  record cannot understate;
- tests/test_launch_budget.py (unit tier) fails when the recorded total exceeds BUDGET.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import tempfile

RECORD = pathlib.Path(__file__).with_name("launches.json")
HOOK_DIR = pathlib.Path(__file__).with_name("launch_log")  # put on PYTHONPATH by helpers.ENV and conftest.py
# Set from the suite's measurement of 2026-11-26 (docs/testing.md), with a little room: raising a budget is a
# decision to make CI slower, taken in review, not by a test that happens to fit.
# 2026-11-27: started 200 -> 210 for the launch scripts' one-process `train --check` before their ranks (issue 38
# item 6: a bad input is exit 2 before any rank starts): 6 launches of about 2 s each.
# 2026-11-28: started 210 -> 225 for issue 45's Ctrl-C to a launch script's whole process group, repeated 5 times
# in one test as the issue asks (20 launches: launch/torchrun.sh's check, torchrun and its 2 ranks, and a resume).
# 2026-11-28: forked 260 -> 300 for the bad-input rows that issues 45 and 48 ask for (damaged checkpoints and
# launcher variables, data formats, objective, quantization: 34 rows) and 2 quantised LoRA runs, about 1 s each.
# 2026-11-29: started 225 -> 230 and forked 300 -> 310 for issue 57's and 59's CLI checks at 1 and 2 ranks (the rate,
# the plateau, running_rms and a resume; a run forced to diverge; its stop): 8 forked runs and 4 ranks started.
BUDGET = {"started": 230, "forked": 310}

counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
owner: list[str] = ["<session>"]  # who is launching now: a test id or fixture:<name>
# This process is a test session, not one it started: the first to import this module, or a pytest-xdist worker
# (tools/test.sh runs two; each keeps its own log, which the processes its tests start inherit with the marker).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
OWN_LOG = ("CURVZO_TEST_LAUNCH_LOG" not in os.environ
           or os.environ.get("CURVZO_TEST_LAUNCH_WORKER", "") != _WORKER)
if OWN_LOG:
    os.environ["CURVZO_TEST_LAUNCH_LOG"] = os.path.join(tempfile.mkdtemp(prefix="curvzo-launches-"), "started.log")
    os.environ["CURVZO_TEST_LAUNCH_WORKER"] = _WORKER
LOG = os.environ["CURVZO_TEST_LAUNCH_LOG"]
_read = 0  # how far the log has been attributed


def settle() -> None:
    """Attribute the interpreters that started since the last call to whoever was launching then."""
    global _read
    if not os.path.exists(LOG):
        return
    with open(LOG) as f:
        f.seek(_read)
        lines = f.read().splitlines(keepends=True)
    complete = [line for line in lines if line.endswith("\n")]
    _read += sum(len(line.encode()) for line in complete)
    for line in complete:
        counts["cli-server" if "cli_server.py" in line else owner[-1]]["started"] += 1


def push(who: str) -> None:
    settle()
    owner.append(who)


def pop() -> None:
    settle()
    owner.pop()


def remove_log() -> None:
    if OWN_LOG:
        shutil.rmtree(os.path.dirname(LOG), ignore_errors=True)


def count(kind: str, n: int = 1) -> None:
    counts[owner[-1]][kind] += n


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
    # How many servers a session starts depends on which tests ran (the bad-input table uses two): keep the most.
    servers = max(recorded.get("cli-server", {}).get("started", 0), counts["cli-server"]["started"])
    merged["cli-server"] = {"started": servers} if servers else {}
    merged = {k: v for k, v in sorted(merged.items()) if v}
    RECORD.write_text(json.dumps(merged, indent=1) + "\n")


def totals(recorded: dict[str, dict[str, int]]) -> dict[str, int]:
    total: collections.Counter = collections.Counter()
    for kinds in recorded.values():
        total.update(kinds)
    return dict(total)
