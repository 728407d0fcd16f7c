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
