"""The environment variables curvzo_ds reads itself, each checked where it is read: a value it cannot use is a
one-line ConfigError naming the variable and what it takes (docs/reliability.md). The launchers' own variables
(RANK, WORLD_SIZE, MASTER_PORT, ...) are shard/distributed.check_launcher_env's, which also resolves MASTER_ADDR
here (`check_master_addr`) and, on a rank other than 0, waits a bounded time to reach it (`wait_for_rank0`)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from curvzo_ds.errors import ConfigError

NOISE_KERNELS = ("auto", "torch", "triton")


def noise_kernel() -> str:
    """CURVZO_DS_NOISE_KERNEL: auto (the default), torch (the reference, no C kernel) or triton."""
    value = os.environ.get("CURVZO_DS_NOISE_KERNEL", "auto") or "auto"
    if value not in NOISE_KERNELS:
        raise ConfigError(f"the environment: CURVZO_DS_NOISE_KERNEL={value!r} is not one of "
                          f"{', '.join(NOISE_KERNELS)}: unset it for auto")
    return value


def directory(name: str, default: str | None = None) -> str | None:
    """A variable that names a directory (made when missing): refused when it names a file."""
    value = os.environ.get(name) or default
    if value and os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"the environment: {name}={value} is a file, not a directory: point it at a directory (it is "
                          "made if missing), or unset it")
    return value


def cache_dir() -> str:
    """CURVZO_DS_CACHE, or ~/.cache/curvzo_ds: the compiled kernels and ops."""
    return directory("CURVZO_DS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "curvzo_ds")


def check_accelerator() -> None:
    """DS_ACCELERATOR, which DeepSpeed reads as it is imported (and this package, to pick the CPU's communication
    op): one of DeepSpeed's accelerators, where DeepSpeed's own refusal is a traceback from the import. Checked
    before DeepSpeed is imported: its list is read from its source (importing it would fail)."""
    value = os.environ.get("DS_ACCELERATOR")
    if value is None:
        return
    supported = deepspeed_accelerators()
    if supported and value not in supported:
        raise ConfigError(f"the environment: DS_ACCELERATOR={value!r} is not one of DeepSpeed's accelerators "
                          f"({', '.join(supported)}): unset it to let DeepSpeed choose")


def deepspeed_accelerators() -> list[str]:
    """DeepSpeed's SUPPORTED_ACCELERATOR_LIST, read from its source without importing it ([] if not found)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        return []
    path = os.path.join(os.path.dirname(spec.origin), "accelerator", "real_accelerator.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUPPORTED_ACCELERATOR_LIST"
                                                 for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return []
    return []


def check_master_addr(env, wait: float = 10.0) -> None:
    """MASTER_ADDR, where set, resolves to an address within `wait` seconds: an unresolvable host left every rank
    waiting for the rendezvous (past 120 s under torchrun) instead of failing. One line naming MASTER_ADDR and
    MASTER_PORT."""
    host = env.get("MASTER_ADDR")
    if not host:
        return
    found: list = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, None))
        except (OSError, UnicodeError) as e:
            found.append(e)

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(wait)
    port = env.get("MASTER_PORT", "29500")
    if not found:
        raise ConfigError(f"the environment: MASTER_ADDR={host} (MASTER_PORT={port}) did not resolve within {wait:g} "
                          "s: set MASTER_ADDR to the host name or address of the node of rank 0")
    if isinstance(found[0], Exception):
        reason = getattr(found[0], "strerror", None) or found[0]
        raise ConfigError(f"the environment: MASTER_ADDR={host} (MASTER_PORT={port}) cannot be resolved ({reason}): "
                          "set MASTER_ADDR to the host name or address of the node of rank 0")


def wait_for_rank0(env, wait: float, every: float = 30.0) -> None:
    """A rank other than 0 first reaches MASTER_ADDR:MASTER_PORT (rank 0's rendezvous, or torchrun's store) by TCP,
    for at most `wait` seconds, saying every `every` seconds that it waits: an address that resolves but where no
    rank 0 ever listens (the wrong node, a firewall) otherwise left the rank silent until ddp_timeout (30 minutes).
    One line naming MASTER_ADDR and MASTER_PORT when the wait runs out."""
    host, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "29500"), env.get("RANK", "0")
    if not host or rank == "0" or env.get("WORLD_SIZE", "1") == "1":
        return
    start = said = time.monotonic()
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, wait)).close()
            return
        except OSError as e:
            reason = e.strerror or type(e).__name__
        now = time.monotonic()
        if now - start >= wait:
            raise ConfigError(f"the environment: rank {rank} could not reach rank 0 at MASTER_ADDR={host} "
                              f"MASTER_PORT={port} in {wait:g} s ({reason}): check that rank 0 runs, on that node and "
                              "port, and that the port is open between the nodes")
        if now - said >= every:
            said = now
            print(f"curvzo-ds: rank {rank} waits for rank 0 at {host}:{port} ({now - start:.0f} s so far, {reason}; "
                  f"gives up after {wait:g} s)", file=sys.stderr, flush=True)
        time.sleep(min(1.0, max(0.0, wait - (now - start))))
