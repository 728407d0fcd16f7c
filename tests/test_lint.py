"""The code base stays ruff clean (part of the one test command)."""

import pathlib
import shutil
import subprocess

import pytest


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([ruff, "check", str(root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
