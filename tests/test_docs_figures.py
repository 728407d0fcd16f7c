"""docs/measurements.md's demo figures are what tools/measure_docs.py gets by rerunning their commands (issue 28)."""

import subprocess
import sys

import pytest

from tests.helpers import ENV, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # two 300-step runs of the demo, one of them on 2 ranks


def test_the_demo_figures_are_a_rerun_of_their_commands():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "measure_docs.py"), "--check"], env=ENV,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
