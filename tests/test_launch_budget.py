"""The guard against regrowth of CI's time (issue 35): the processes the suite starts stay within a budget.

tests/launches.json records, per test and shared fixture, the Python interpreters it starts (launchers and their
ranks included) and the commands it forks from tests/cli_server.py. Every run of the suite fails if one of them
launches more than its record (tests/conftest.py), so the record is an upper bound. This test keeps the recorded
total within BUDGET."""

import subprocess
import sys

import pytest

from tests import launches
from tests.helpers import ENV


def test_the_recorded_launches_stay_within_the_budget():
    recorded = launches.load()
    assert recorded, "tests/launches.json is missing: record it with CURVZO_RECORD_LAUNCHES=1 bash tools/test.sh"
    total = launches.totals(recorded)
    for kind, budget in launches.BUDGET.items():
        heaviest = sorted(((v.get(kind, 0), k) for k, v in recorded.items()), reverse=True)[:5]
        assert total.get(kind, 0) <= budget, (
            f"the suite {kind} {total.get(kind, 0)} processes, over the budget of {budget} (tests/launches.py): "
            f"share a launch between tests (a fixture) or fork from the CLI server; the heaviest: {heaviest}")


SCRATCH = '''
import subprocess, sys

def test_starts_an_interpreter():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_nothing():
    pass
'''


@pytest.mark.slow
def test_a_launch_above_the_record_fails_a_run_in_two_workers(tmp_path):
    """tools/test.sh runs the suite in two pytest-xdist workers: each counts its own tests' launches, the controller
    fails the run on a worker's excess, and the workers themselves are not counted (tests/launches.py)."""
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    env = {k: v for k, v in ENV.items() if not k.startswith("PYTEST_XDIST") and k != "CURVZO_RECORD_LAUNCHES"}
    env["CURVZO_TEST_LAUNCH_WORKER"] = "outer"  # this child session keeps its own log, as a worker does
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "--rootdir", str(tmp_path), "test_scratch.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    excess = [line.strip() for line in proc.stdout.splitlines() if "launches, recorded" in line]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1 and excess == [
        "test_scratch.py::test_starts_an_interpreter: 1 started launches, recorded 0"], proc.stdout[-3000:]
