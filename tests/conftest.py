import pytest


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The reference run of tests/test_app.py's settings: one process, 12 steps (shared by test files)."""
    from tests.helpers import train

    out = tmp_path_factory.mktemp("app") / "straight-1"
    return out, train("python", 1, out)
