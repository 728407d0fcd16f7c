"""Time per test file and the processes each starts, as a Markdown table for docs/testing.md (issue 35).

    python -m pytest --junitxml=run.xml ...        # any run of the suite
    python tools/test_report.py run.xml [--launches tests/launches.json]

Times come from the JUnit XML (each test's set-up, call and tear-down; a shared fixture's set-up is in the time of
the first test that needs it). Processes come from tests/launches.json (tests/launches.py): `started` are
interpreters and launchers started from scratch, `forked` are commands forked from tests/cli_server.py (one per rank).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import xml.etree.ElementTree as ET


def file_of(test_id: str) -> str:
    """tests/test_x.py from 'tests/test_x.py::test_y[...]' or 'fixture:tests/test_x.py::name'."""
    test_id = test_id.removeprefix("fixture:")
    if test_id.startswith("tests::"):
        return "tests/conftest.py"
    return test_id.split("::")[0] if test_id.startswith("tests/") else "(the CLI servers)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--launches", default=str(pathlib.Path(__file__).parents[1] / "tests" / "launches.json"))
    args = parser.parse_args()

    seconds: dict[str, float] = collections.defaultdict(float)
    tests: dict[str, int] = collections.Counter()
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        name = "tests/" + case.get("classname", "").split(".")[1] + ".py" if "." in case.get("classname", "") else "?"
        seconds[name] += float(case.get("time", 0))
        tests[name] += 1
    started: dict[str, int] = collections.Counter()
    forked: dict[str, int] = collections.Counter()
    path = pathlib.Path(args.launches)
    for who, kinds in (json.loads(path.read_text()) if path.exists() else {}).items():
        started[file_of(who)] += kinds.get("started", 0)
        forked[file_of(who)] += kinds.get("forked", 0)

    total = sum(seconds.values())
    print("| file | tests | seconds | share | started | forked |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in sorted(set(seconds) | set(started) | set(forked), key=lambda n: -seconds.get(n, 0)):
        share = f"{100 * seconds.get(name, 0) / total:.1f}%" if total else "-"
        print(f"| {name} | {tests.get(name, 0)} | {seconds.get(name, 0):.1f} | {share} | {started.get(name, 0)} | "
              f"{forked.get(name, 0)} |")
    print(f"| **all** | {sum(tests.values())} | {total:.1f} | 100% | {sum(started.values())} | "
          f"{sum(forked.values())} |")


if __name__ == "__main__":
    main()
