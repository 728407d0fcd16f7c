"""docs/measurements.md's demo figures are what tools/measure_docs.py gets by rerunning their commands (issue 28); and
README command 1, `bash launch/demo.sh`, which is one of them, run as written: 2 ranks under ZeRO-3, the contract."""

import json
import subprocess
import sys

import pytest

from tests.helpers import CHECK, ENV, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # two 300-step runs of the demo, one of them on 2 ranks


def test_the_demo_figures_are_a_rerun_of_their_commands(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "measure_docs.py"), "--check", "--keep",
                           str(tmp_path)], env=ENV, cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # README command 1 (measure_docs' second run, `bash launch/demo.sh` unchanged): its summary, the contract, and
    # one log file per rank: rank 1's INFO lines, which its console leaves out, are in its own file.
    demo = tmp_path / "demo"
    summary = json.loads((demo / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"], summary["method"]) == (2, 300, "curvzo")
    check = subprocess.run([sys.executable, str(CHECK), str(demo)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    assert summary["device_names"] == ["cpu", "cpu"] and len(summary["hostnames"]) == 2
    rank1 = (demo / "logs" / "rank-00001.log").read_text()
    stderr = (tmp_path / "demo.stderr").read_text()
    assert "[rank 1] INFO model demo:" in rank1 and "[rank 1] INFO" not in stderr
    assert "[rank 0] INFO done:" in (demo / "logs" / "rank-00000.log").read_text()
