"""The versions of the libraries curvzo_ds supports, checked when the package is imported.

SUPPORTED is the one table: setup.cfg's install_requires states the same ranges (tests/test_versions.py keeps them
equal). The lower bound is the oldest release whose API the code uses; the upper bound is the first release nobody
has vouched for: the next minor for DeepSpeed (ds_compat.py reads its private attributes;
tests/test_ds_contract.py checks them) and for peft (0.x, whose adapter key names enter params_digest), the next
major for the others.

Outside a range, `import curvzo_ds` warns in one line that names every such package, its installed version and the
range, and the run goes on: never an ImportError that stops a run (a GPU image with an older torch or transformers,
a nightly, a fresh release). The line says what to install if the run then fails.
Only the release numbers are compared: a dev, pre-release or local build (`2.14.0.dev20260301+cu128`) counts as
its release.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata

SUPPORTED = {  # package: (lowest supported, first not vouched for)
    "torch": ("2.4", "3"),
    "deepspeed": ("0.19", "0.20"),
    "transformers": ("5.0", "6"),
    "accelerate": ("1.10", "2"),
    "peft": ("0.17", "0.22"),
}


class UnsupportedVersionWarning(UserWarning):
    """An installed library is newer than any release curvzo_ds was tested with."""


def release(version: str) -> tuple[int, ...] | None:
    """The leading release numbers of a version string ("2.13.0+cpu" -> (2, 13, 0)); None if it has none."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in m.group().split(".")) if m else None


def requirement(name: str) -> str:
    lo, hi = SUPPORTED[name]
    return f"{name}>={lo},<{hi}"


def out_of_range(installed: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(too old, too new): the packages outside their range; a package not installed is skipped."""
    old, new = [], []
    for name, (lo, hi) in SUPPORTED.items():
        got = release(installed.get(name) or "")
        if got is not None and got < release(lo):
            old.append(name)
        elif got is not None and got >= release(hi):
            new.append(name)
    return old, new


def installed_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in SUPPORTED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Warn (UnsupportedVersionWarning, one line each for too old and too new) about the libraries outside their
    range; never raise."""
    installed = installed_versions() if installed is None else installed
    old, new = out_of_range(installed)
    named = lambda names: ", ".join(f"{requirement(n)} (installed: {installed[n]})" for n in names)
    fix = lambda names: "pip install " + " ".join(f"'{requirement(n)}'" for n in names)
    if old:
        warnings.warn(f"curvzo_ds supports {named(old)}: older releases may lack an API it calls; going on, and if "
                      f"the run fails, {fix(old)}", UnsupportedVersionWarning, stacklevel=2)
    if new:
        warnings.warn(f"curvzo_ds is tested with {named(new)}, not with these newer releases: if a run fails, "
                      f"{fix(new)}", UnsupportedVersionWarning, stacklevel=2)
