"""The supported version ranges: one table (curvzo_ds/versions.py), stated again in setup.cfg, checked on import."""

import configparser
import re
import warnings

import pytest

from curvzo_ds.versions import SUPPORTED, UnsupportedVersionWarning, check_versions, release, requirement
from tests.helpers import ROOT

TESTED = {"torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.23.0", "accelerate": "1.15.0",
          "peft": "0.21.2"}


def test_setup_cfg_states_the_same_ranges():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    stated = [line for line in lines if re.split("[<>=]", line)[0] in SUPPORTED]
    assert sorted(stated) == sorted(requirement(name) for name in SUPPORTED)


def test_release_ignores_dev_pre_and_local_parts():
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("2.14.0.dev20260301+cu128") == (2, 14, 0)
    assert release("1.0.0rc1") == (1, 0, 0)
    assert release("unknown") is None


def test_tested_versions_and_nightlies_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions(TESTED)
        check_versions({**TESTED, "torch": "2.14.0.dev20260301+cu128", "peft": None})  # peft not installed
        check_versions({**TESTED, "torch": "2.4.0a0+git1234"})  # a source build of the lowest release


def test_too_old_is_a_warning_naming_each_package_never_an_import_error():
    """A GPU image's older library must not stop a run: one warning names each package, its range and the fix."""
    with pytest.warns(UnsupportedVersionWarning) as caught:
        check_versions({**TESTED, "deepspeed": "0.18.2", "peft": "0.16.0"})
    message = str(caught[0].message)
    assert "deepspeed>=0.19,<0.20 (installed: 0.18.2)" in message and "peft>=0.17,<0.22 (installed: 0.16.0)" in message
    assert "pip install 'deepspeed>=0.19,<0.20' 'peft>=0.17,<0.22'" in message


def test_too_new_is_a_warning_naming_the_range():
    with pytest.warns(UnsupportedVersionWarning, match=r"deepspeed>=0\.19,<0\.20 \(installed: 0\.20\.0\)"):
        check_versions({**TESTED, "deepspeed": "0.20.0"})
