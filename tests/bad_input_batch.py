"""Runs many `curvzo-ds` bad inputs in one process (tests/test_bad_inputs.py's BATCHED table): each case is
`curvzo_ds.cli.main(argv)` with its own environment and its stderr captured at the file descriptor, and none may
start a process group (they are all refused before one). A fork per case would cost the suite's launch budget.

    python tests/bad_input_batch.py CASES.json RESULTS.json ROOT
CASES.json: [{"id", "argv", "env"}]; RESULTS.json: {id: {"returncode", "stderr", "tree"}}, where `tree` is the
SHA-256 of every file under ROOT after the case (the finished run that the cases point at must stay as it was)."""

import hashlib
import json
import os
import pathlib
import sys
import tempfile
import traceback


def tree(root: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + (p.read_bytes() if p.is_file() else b"dir") + b"\0")
    return h.hexdigest()


def run(case: dict) -> tuple[int | str, str]:
    from curvzo_ds.cli import main

    saved_env = dict(os.environ)
    os.environ.update(case.get("env") or {})
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            code = main(case["argv"])
        except BaseException:  # noqa: BLE001 - a traceback is the failure the test looks for
            traceback.print_exc()
            code = "raised"
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            os.environ.clear()
            os.environ.update(saved_env)
        captured.seek(0)
        err = captured.read().decode("utf-8", "replace")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the case got past validation: it belongs in CASES
        err += "\nTraceback: a process group was started (move the case to the forked CASES table)\n"
        dist.destroy_process_group()
    return code, err


def main() -> None:
    cases_path, results_path, root = sys.argv[1:4]
    cases = json.loads(pathlib.Path(cases_path).read_text())
    results = {}
    for case in cases:
        code, err = run(case)
        results[case["id"]] = {"returncode": code, "stderr": err, "tree": tree(pathlib.Path(root))}
    pathlib.Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
