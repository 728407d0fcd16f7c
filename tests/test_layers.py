"""The package's import graph, read with `ast`: layered one way, no cycles, no private names across modules.

Layers, bottom to top (docs/architecture.md draws them); a unit (a top-level module or a sub-package) imports from
its own layer or below, never from above:
0. foundations: errors, the algorithm (algo/), noise/, config/, data/, tasks/, JSON, system info, versions, the
   hub probe, start-up;
1. shard/: the weights one rank holds, the passes over them, the collectives, the DeepSpeed wing; layout/: where
   the weights live (the layout decision and the planner's memory model);
2. engine/;
3. checkpoint/ and models;
4. train/: the one build, the loop, outputs, and the Accelerate and Trainer front ends;
5. commands/;
6. the CLI and the package's public face (`curvzo_ds/__init__.py`).
Imports inside functions count as much as those at the top: they hide the graph, they do not change it.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "curvzo_ds"
LAYERS = {
    0: {"errors", "environment", "config", "jsonio", "sysinfo", "versions", "hub", "startup", "algo", "noise", "data",
        "tasks"},
    1: {"shard", "layout"},
    2: {"engine"},
    3: {"checkpoint", "models"},
    4: {"train"},
    5: {"commands"},
    6: {"cli", "__init__", "__main__"},
}
LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}


def modules() -> dict[str, pathlib.Path]:
    """Dotted name inside the package ("engine", "data.stream", "__init__" for the package itself) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "__init__"] = path
    return out


def unit(name: str) -> str:
    """What a layer is assigned to: the module, or the sub-package it belongs to."""
    return name.split(".")[0]


def imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(imported module inside the package, names imported from it, line) for every import at any depth."""
    is_package = path.name == "__init__.py"
    package = [] if name == "__init__" else name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "curvzo_ds":
                    found.append((alias.name.partition(".")[2] or "__init__", [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == "curvzo_ds":
                target = node.module.partition(".")[2]
            else:
                continue
            names = [a.name for a in node.names]
            if not target:  # `from . import engine` or `from curvzo_ds import ZOEngine`
                subs = [n for n in names if (PACKAGE / n).with_suffix(".py").exists() or (PACKAGE / n).is_dir()]
                found += [(n, [], node.lineno) for n in subs]
                if len(subs) < len(names):
                    found.append(("__init__", [n for n in names if n not in subs], node.lineno))
            else:
                found.append((target, names, node.lineno))
    return found


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        for target, _, _ in imports(name, path):
            if unit(target) != unit(name):
                graph.setdefault(unit(name), set()).add(unit(target))
    return graph


def test_every_module_has_a_layer():
    assert {unit(n) for n in modules()} - set(LAYER_OF) == set(), "add the new module to LAYERS in this test"


def test_the_reader_sees_the_imports():
    """The parser is not vacuous: it finds the engine's imports of the layer below."""
    engine = {unit(t) for t, _, _ in imports("engine.core", PACKAGE / "engine" / "core.py")}
    assert {"algo", "noise", "shard", "data", "errors"} <= engine
    assert "data" in {unit(t) for t, _, _ in imports("data", PACKAGE / "data" / "__init__.py")}


def test_no_module_imports_from_a_layer_above_it():
    bad = []
    for name, path in modules().items():
        for target, _, line in imports(name, path):
            if LAYER_OF[unit(target)] > LAYER_OF[unit(name)]:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {target} (layer {LAYER_OF[unit(target)]}) "
                           f"from layer {LAYER_OF[unit(name)]}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = edges()
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_private_names_are_imported_across_modules():
    bad = []
    for name, path in modules().items():
        for target, names, line in imports(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {private} from {target}")
    assert not bad, "\n".join(bad)
