"""Every third-party import is declared in setup.cfg (issue 56): a fresh venv with `pip install -e ".[test]"` must
pass README's test command, so an import that only the developer's machine happens to have fails here, on any
machine, whether or not the package is installed.

The rule, per folder: the package's imports are in install_requires or one of its extras (an optional feature);
experiments/ in install_requires or the `experiments` extra, benchmarks/ in any but `test`; and, because the tests
import all of them, everything imported anywhere in the repository is in install_requires or the `test` extra. An
import is read from the source (ast), so one inside a function counts as well.
"""

import ast
import configparser
import re
import sys

import pytest

from tests.helpers import ROOT

# import name -> distribution name, where they differ (the distribution's own metadata says so once installed; this
# table covers a fresh machine where it is not)
DISTRIBUTION = {"yaml": "pyyaml", "mlflow": "mlflow-skinny", "PIL": "pillow"}
LOCAL = {"curvzo_ds", "tests", "experiments", "benchmarks", "tools"}


def requirement_name(line: str) -> str:
    return re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared() -> dict[str, set[str]]:
    """{"install_requires": names, extra: names} from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def names(text: str) -> set[str]:
        return {requirement_name(x) for x in text.splitlines() if x.strip() and not x.strip().startswith("#")}

    out = {"install_requires": names(cfg["options"]["install_requires"])}
    out.update({extra: names(text) for extra, text in cfg["options.extras_require"].items()})
    return out


def third_party_imports(folder: str) -> dict[str, str]:
    """{distribution name: "file:line"} of the absolute imports in `folder`'s .py files that are neither the standard
    library nor the repository's own modules (a sibling module imported by name, as `import pipeline`, included)."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        siblings = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in LOCAL or top in siblings or top == "__future__":
                    continue
                name = DISTRIBUTION.get(top, top).lower().replace("_", "-")
                found.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def undeclared(folders: list[str], allowed: set[str]) -> list[str]:
    return [f"{where} imports {name}" for folder in folders
            for name, where in third_party_imports(folder).items() if name not in allowed]


def test_the_package_imports_only_what_install_requires_or_an_extra_declares():
    extras = declared()
    allowed = set().union(*(names for extra, names in extras.items() if extra not in ("test", "experiments")))
    assert undeclared(["curvzo_ds"], allowed) == []


def test_experiments_import_only_install_requires_and_the_experiments_extra():
    extras = declared()
    assert undeclared(["experiments"], extras["install_requires"] | extras["experiments"]) == []


def test_benchmarks_import_only_what_the_package_and_its_extras_declare():
    """A benchmark measures the package's features, the optional ones (quant, plot) included."""
    extras = declared()
    assert undeclared(["benchmarks"], set().union(*(v for k, v in extras.items() if k != "test"))) == []


def test_everything_the_suite_imports_is_in_the_test_extra():
    """README's test command installs `.[test]`: whatever any test can import must come with it."""
    extras = declared()
    folders = ["curvzo_ds", "tests", "experiments", "benchmarks", "tools"]
    assert undeclared(folders, extras["install_requires"] | extras["test"]) == []


def test_the_check_names_an_undeclared_import(tmp_path, monkeypatch):
    """The check itself can fail: a module importing a package no extra declares is named with its file and line."""
    pkg = tmp_path / "experiments"
    pkg.mkdir()
    (pkg / "uses_scipy.py").write_text("import json\n\n\ndef f():\n    from scipy import stats\n    return stats\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert undeclared(["experiments"], {"numpy"}) == ["experiments/uses_scipy.py:5 imports scipy"]
    assert undeclared(["experiments"], {"scipy"}) == []


@pytest.mark.parametrize("line,name", [("torch>=2.4,<3", "torch"), ("mpi4py>=3.1", "mpi4py"),
                                       ("triton==3.4.0", "triton"), ("mlflow-skinny", "mlflow-skinny"),
                                       ("PyYAML", "pyyaml")])
def test_requirement_names(line, name):
    assert requirement_name(line) == name
