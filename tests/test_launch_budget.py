"""The guard against regrowth of CI's time (issue 35): the processes the suite starts stay within a budget.

tests/launches.json records, per test and shared fixture, the Python interpreters it starts (launchers and their
ranks included) and the commands it forks from tests/cli_server.py. Every run of the suite fails if one of them
launches more than its record (tests/conftest.py), so the record is an upper bound. This test keeps the recorded
total within BUDGET."""

from tests import launches


def test_the_recorded_launches_stay_within_the_budget():
    recorded = launches.load()
    assert recorded, "tests/launches.json is missing: record it with CURVZO_RECORD_LAUNCHES=1 bash tools/test.sh"
    total = launches.totals(recorded)
    for kind, budget in launches.BUDGET.items():
        heaviest = sorted(((v.get(kind, 0), k) for k, v in recorded.items()), reverse=True)[:5]
        assert total.get(kind, 0) <= budget, (
            f"the suite {kind} {total.get(kind, 0)} processes, over the budget of {budget} (tests/launches.py): "
            f"share a launch between tests (a fixture) or fork from the CLI server; the heaviest: {heaviest}")
