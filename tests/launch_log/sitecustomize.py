"""One line per Python interpreter started with the tests' environment (tests/launches.py counts them).

Python imports `sitecustomize` at start-up from its path; the tests put this directory on PYTHONPATH and name the
log in CURVZO_TEST_LAUNCH_LOG, so every interpreter they start, and every one those start (a launcher's ranks, a
benchmark's workers), appends its line. A forked process starts no interpreter and writes none.
"""

import os
import sys

_log = os.environ.get("CURVZO_TEST_LAUNCH_LOG")
if _log:
    # One short write in append mode: the lines of processes starting at once do not mix.
    with open(_log, "a") as _f:
        _f.write(f"{os.getpid()} {' '.join(sys.argv[:2])[:200]}\n")
