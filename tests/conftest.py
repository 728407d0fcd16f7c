import pytest


def pytest_collection_modifyitems(items):
    """Every multi-rank test is in the slow tier: `python -m pytest -m "not slow"` is the unit tier."""
    for item in items:
        if item.get_closest_marker("multirank"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The reference run of the helpers' COMMON settings: one process, 12 steps (shared by test files)."""
    from tests.helpers import train

    out = tmp_path_factory.mktemp("app") / "straight-1"
    return out, train("python", 1, out)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster for the session (tests/slurm_cluster.py); yields the environment that reaches it."""
    from tests.slurm_cluster import cluster

    yield from cluster(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> str:
    """params_digest of the uninterrupted 400-step run (one process; every world size gives the same)."""
    import json
    import subprocess

    from tests.helpers import CLI, ENV, ROOT, RUN

    out = tmp_path_factory.mktemp("reliability") / "straight"
    proc = subprocess.run(CLI + RUN + ["--set", f"output_dir={out}"], env=ENV, cwd=str(ROOT), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["params_digest"]
