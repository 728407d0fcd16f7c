"""What a run reports about the machine: memory of this process, and the versions results depend on."""

from __future__ import annotations

import platform
import resource
import sys
from importlib import metadata

from curvzo_ds.versions import installed_versions


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def rss_bytes(trim: bool = False) -> int | None:
    """This process's resident set size now (Linux /proc; None elsewhere).

    trim: first return freed heap memory to the system (glibc malloc_trim), so the figure counts
    live memory rather than what the allocator keeps for reuse.
    """
    if trim:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of Python, curvzo_ds and the libraries a run's numbers depend on (versions.SUPPORTED; None: not
    installed)."""
    try:
        own = metadata.version("curvzo_ds")
    except metadata.PackageNotFoundError:
        own = getattr(sys.modules.get(__package__), "__version__", None)
    return {"python": platform.python_version(), "curvzo_ds": own, **installed_versions()}


def device_name(device) -> str:
    """What this rank computes on: the GPU's model name (torch.cuda.get_device_name), else the device type ("cpu")."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type
