"""The package's imports, parsed with ``ast``: no import cycles, and the layers of docs/architecture.md import one
way only (a module may import its own layer and the layers below it, never a layer above).

Every import counts, also the ones inside functions (a lazy import is still a dependency), except those under
``if TYPE_CHECKING:``. A new module must be given a layer here (and in docs/architecture.md) or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_resumable"

# Lowest first. A module belongs to the first layer with a prefix that names it or one of its packages.
LAYERS: list[tuple[str, list[str]]] = [
    ("format", ["_version", "errors", "constants", "_urls", "progress", "preemption", "distributed", "format"]),
    ("checkpoint", ["checkpoint"]),
    ("data, remote", ["data", "remote"]),
    ("hub, lazy, conversions", ["hub", "lazy", "conversions"]),
    ("locations", ["locations"]),
    ("integrations", ["integrations"]),
    ("entry points", ["cli", "demo", "__main__", ""]),
    # Import paths of earlier releases, each re-exporting the module that moved; nothing in the package imports them.
    ("compatibility paths", ["storage", "elastic", "sharded", "cards", "convert", "demo_train"]),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> set[str]:
    """Modules of the package that ``module`` imports."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if module == "":
        package = []
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - child.level + 1] if child.level > 1 else package
                    name = ".".join(base + ([child.module] if child.module else []))
                elif child.module == "hf_resumable" or (child.module or "").startswith("hf_resumable."):
                    name = child.module.removeprefix("hf_resumable").lstrip(".")
                else:
                    name = None
                if name is not None:
                    submodules = [f"{name}.{a.name}".lstrip(".") for a in child.names
                                  if f"{name}.{a.name}".lstrip(".") in MODULES]
                    found.update(submodules or ([name] if name in MODULES else []))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "hf_resumable" or alias.name.startswith("hf_resumable."):
                        name = alias.name.removeprefix("hf_resumable").lstrip(".")
                        if name in MODULES:
                            found.add(name)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    # A module's own packages are always initialized before it; importing from them is not a dependency edge.
    ancestors = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}
    return {name for name in found if name != module and name not in ancestors}


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> int:
    for index, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                return index
    raise AssertionError(f"hf_resumable.{module} has no layer: add it to LAYERS here and to docs/architecture.md")


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_cycles():
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                names = (f"hf_resumable.{m}" if m else "hf_resumable" for m in cycle)
                pytest.fail("import cycle: " + " -> ".join(names))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2
        order.append(module)

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert len(order) == len(MODULES)


def test_layers_import_one_way():
    upward = [f"hf_resumable.{a or '__init__'} ({LAYERS[_layer(a)][0]}) imports hf_resumable.{b} "
              f"({LAYERS[_layer(b)][0]})"
              for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a)]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_the_checkpoint_core_imports_nothing_remote():
    core = [m for m in MODULES if m == "checkpoint" or m.startswith("checkpoint.")]
    remote = [f"{a} -> {b}" for a in core for b in GRAPH[a]
              if b.split(".")[0] in ("remote", "storage", "hub", "locations", "lazy")]
    assert not remote, remote


def test_the_graph_is_not_trivially_empty():
    # Guards the parser itself: these edges exist, so a parser that found none would let everything pass.
    assert "checkpoint.api" in GRAPH["checkpoint"] and "checkpoint" in GRAPH["locations"]
    assert "remote.uploader" in GRAPH["hub.uploader"]
