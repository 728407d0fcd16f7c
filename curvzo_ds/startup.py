"""Process start-up details: a JIT build cache per Python environment, and DeepSpeed's start-up prints kept off
stdout.

- DeepSpeed compiles its CPU shared-memory op (and torch any other JIT extension) into `TORCH_EXTENSIONS_DIR`,
  by default `~/.cache/torch_extensions`, shared by every Python environment of the user. Two environments with
  different torch or DeepSpeed builds then rebuild the op on every start (60-130 s). Unless the user set it,
  `TORCH_EXTENSIONS_DIR` becomes `<cache>/torch_extensions/<this environment>`, where `<cache>` is
  `$CURVZO_DS_CACHE` or `~/.cache/curvzo_ds` (as for the noise kernel) and the last part names `sys.prefix`.
- `quiet_known_warnings()`: torch warns once per rank, on every ZeRO-3 run, that DeepSpeed's call of
  `all_gather_into_tensor` is deprecated; that is DeepSpeed's to change, not the user's, so it is filtered (that
  message only). peft imports bitsandbytes whenever it is installed, and on a CPU with AVX512-bf16 bitsandbytes
  warns at import that an optional kernel package is missing, then runs its own fallback: nothing a user must
  act on, so its logger shows errors only.
- `defer_mlflow()`: DeepSpeed's autotuner imports mlflow when it is installed (`try: import mlflow`), and only the
  autotuner's own runs use it; that import is 1.7-2.5 s of every process's start-up here. When DeepSpeed is first
  imported (`import curvzo_ds` does not import it), it runs with mlflow hidden; mlflow is un-hidden at once, so a
  run that reports to mlflow imports it as usual.
- `exit_now(code)`: leave without the interpreter's teardown, which can abort or hang in a communication library's
  threads once the process group is gone ("terminate called without an active exception", pytorch/pytorch#190489).
- `stdout_to_log()`: what DeepSpeed prints while it starts (`... built successfully`) is kept and logged by
  `logs.setup_logging` (the rank's log file, and rank 0's console on stderr); compiler output goes to stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import io
import logging
import os
import sys
import warnings
from typing import NoReturn

_captured: list[str] = []


def extensions_dir() -> str:
    """TORCH_EXTENSIONS_DIR for this Python environment (the user's own setting wins); sets it and returns it."""
    from curvzo_ds.environment import cache_dir, directory

    if directory("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    cache = cache_dir()
    prefix = os.path.realpath(sys.prefix)
    name = f"{os.path.basename(prefix) or 'python'}-{hashlib.sha256(prefix.encode()).hexdigest()[:12]}"
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, "torch_extensions", name)
    return os.environ["TORCH_EXTENSIONS_DIR"]


class _HideMlflow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `deepspeed` with the finders after it, and runs its `__init__` with `import mlflow` failing; leaves
    sys.meta_path once DeepSpeed is imported. (A `find_spec("deepspeed")` that only asks whether DeepSpeed is
    installed, as transformers does, imports nothing, so the finder stays for the import that follows.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" or "mlflow" in sys.modules:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    self.inner, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        module.__spec__.loader = module.__loader__ = self.inner
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError; the autotuner's try sets has_mlflow
        try:
            self.inner.exec_module(module)
        finally:
            if sys.modules.get("mlflow", False) is None:
                del sys.modules["mlflow"]


def defer_mlflow() -> None:
    """DeepSpeed's first import skips its autotuner's mlflow import (module docstring); nothing once it is done."""
    if "deepspeed" not in sys.modules and not any(isinstance(f, _HideMlflow) for f in sys.meta_path):
        sys.meta_path.insert(0, _HideMlflow())


def quiet_known_warnings() -> None:
    """Filter the one warning every ZeRO-3 rank printed that only DeepSpeed can act on, and bitsandbytes' missing
    optional CPU kernel (module docstring)."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@contextlib.contextmanager
def environment_ninja_first():
    """For the body: the `ninja` of this Python environment (pip's, which DeepSpeed requires) comes first on PATH.

    torch builds DeepSpeed's CPU op with whichever `ninja` PATH finds, and two ninja versions hash a command line
    differently: each one rebuilds the other's build (1-2 minutes) in the shared TORCH_EXTENSIONS_DIR. `mpirun`
    puts its own bin directory (often /usr/bin, with the system's ninja) first on its ranks' PATH, so a run under
    mpirun and one under torchrun rebuilt the op in turn. With this, every launcher uses the same ninja.
    """
    try:
        import ninja  # the pip package: its binary, also from a venv with --system-site-packages

        own = os.path.join(ninja.BIN_DIR, "ninja")
    except (ImportError, AttributeError):
        own = os.path.join(os.path.dirname(sys.executable), "ninja")
    saved = os.environ.get("PATH", "")
    if os.access(own, os.X_OK):
        os.environ["PATH"] = os.path.dirname(own) + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@contextlib.contextmanager
def stdout_to_log():
    """For the body: Python's stdout is kept for the log (take_captured), file descriptor 1 goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        _captured.extend(line for line in buffer.getvalue().splitlines() if line.strip())


def take_captured() -> list[str]:
    """The lines kept by stdout_to_log since the last call."""
    lines = list(_captured)
    _captured.clear()
    return lines


def exit_now(code: int) -> NoReturn:
    """Exit with `code` at once, log handlers closed and stdout/stderr flushed first, skipping the interpreter's
    teardown (module-level docstring). For a process whose results are written and whose process group is left or
    aborted: the CLI after a Ctrl-C or a pre-emption, a test's or a benchmark's rank worker."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
