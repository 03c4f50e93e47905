"""The package's imports, parsed with ``ast``: no import cycles, the layers of docs/architecture.md import one
way only (a module may import its own layer and the layers below it, never a layer above), and only
``integrations/`` imports ``transformers.Trainer`` or ``accelerate.Accelerator``.

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
    ("format", ["_version", "errors", "constants", "_tuning", "_urls", "progress", "preemption", "distributed",
                "trace", "format"]),
    ("checkpoint", ["checkpoint"]),
    ("data, remote", ["data", "remote"]),
    ("hub, lazy, conversions", ["hub", "lazy", "conversions"]),
    ("locations", ["locations"]),
    ("integrations", ["integrations"]),
    ("entry points", ["cli", "check", "demo", "restart", "__main__", ""]),
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


def _imports(module: str, *, ancestors: bool = False) -> set[str]:
    """Modules of the package that ``module`` imports (with ``ancestors``, its own packages too)."""
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
    if ancestors:
        return found - {module}
    own_packages = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}
    return {name for name in found if name != module and name not in own_packages}


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


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# Rooms that must stand below others they share a layer with: (a module or package, what it must not import).
_BELOW = [
    # The checkpoint core writes and reads local files; remote storage and the Hub sit above it.
    ("checkpoint", ("remote", "hub", "locations", "lazy")),
    # The checkpoint vocabulary (Payload, TensorFile, IndexSpec, Box) is the bottom both checkpoint stacks stand on.
    ("checkpoint._types", ("checkpoint",)),
]


@pytest.mark.parametrize(("room", "above"), _BELOW, ids=[room for room, _ in _BELOW])
def test_rooms_import_nothing_above_them(room, above):
    # Own packages count here: checkpoint/_types.py importing from hf_resumable.checkpoint (its __init__) would import
    # the whole package above it.
    assert room in MODULES, f"hf_resumable.{room} does not exist: update _BELOW"
    offenders = [f"{a} -> {b}" for a in MODULES if _within(a, room) for b in _imports(a, ancestors=True)
                 if any(_within(b, prefix) for prefix in above)]
    assert not offenders, offenders


def test_the_graph_is_not_trivially_empty():
    # Guards the parser itself: these edges exist, so a parser that found none would let everything pass.
    assert "checkpoint.api" in GRAPH["checkpoint"] and "checkpoint" in GRAPH["locations"]
    assert "remote.uploader" in GRAPH["hub.uploader"]


# Only integrations/ may touch the training loops: transformers.Trainer (or a transformers.trainer* module, where its
# helpers live) and accelerate.Accelerator (or the accelerate.accelerator module).
_LOOP_NAMES = {"transformers": ("Trainer",), "accelerate": ("Accelerator",)}
_LOOP_MODULES = {"transformers": "trainer", "accelerate": "accelerator"}


def _is_loop_module(dotted: str) -> bool:
    """``transformers.trainer*`` or ``accelerate.accelerator*`` (a module of either package holding its loop)."""
    top, _, rest = dotted.partition(".")
    return top in _LOOP_MODULES and rest.split(".")[0].startswith(_LOOP_MODULES[top])


def _is_loop_name(package: str, name: str) -> bool:
    return name in _LOOP_NAMES.get(package, ()) or _is_loop_module(f"{package}.{name}")


def _loop_imports(source: str) -> list[str]:
    """Where ``source`` imports (or reaches as an attribute or via ``import_module``) a training loop's class/module.

    Every import counts, ``if TYPE_CHECKING:`` ones included: an annotation naming the Trainer still ties the module
    to it.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_loop_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [a.name for a in node.names]
            if _is_loop_module(node.module) or any(_is_loop_name(node.module, name) for name in names):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if _is_loop_name(node.value.id, node.attr):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            target = node.args[0].value
            if func in ("import_module", "__import__") and isinstance(target, str) and _is_loop_module(target):
                found.append(f"line {node.lineno}: {func}({target!r})")
    return found


def test_only_integrations_import_the_trainer_or_the_accelerator():
    outside = {m: p for m, p in MODULES.items() if m != "integrations" and not m.startswith("integrations.")}
    offenders = [f"hf_resumable/{path.relative_to(PACKAGE)} {where}" for path in sorted(outside.values())
                 for where in _loop_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, ("only hf_resumable/integrations/ may import transformers.Trainer / transformers.trainer* "
                           "or accelerate.Accelerator / accelerate.accelerator:\n" + "\n".join(offenders))


@pytest.mark.parametrize("source", [
    "from transformers import Trainer",
    "from transformers.trainer_pt_utils import safe_globals",
    "import transformers.trainer_utils",
    "import transformers\ntransformers.Trainer.get_decay_parameter_names(None, model)",
    "from accelerate import Accelerator",
    "from accelerate.accelerator import Accelerator",
    "import importlib\nimportlib.import_module('transformers.trainer')",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from transformers import Trainer",
])
def test_the_loop_import_scan_finds(source):
    assert _loop_imports(source)


@pytest.mark.parametrize("source", [
    "from transformers import TrainerCallback, TrainingArguments, AutoModel",
    "from transformers.modeling_utils import PreTrainedModel",
    "from accelerate import init_empty_weights",
    "from accelerate.utils import set_seed",
    "extra = {'converted_from': 'transformers.Trainer'}",
])
def test_the_loop_import_scan_allows(source):
    assert not _loop_imports(source)


def test_the_integrations_do_import_the_loops():
    # Guards the scan: the two modules that wrap the loops import them, so a scan that found nothing there is broken.
    assert _loop_imports(MODULES["integrations.trainer"].read_text(encoding="utf-8"))
    assert _loop_imports(MODULES["integrations.accelerate"].read_text(encoding="utf-8"))


def test_the_package_reads_no_environment_variable_at_import():
    """The zygote serves any ``HF_RESUMABLE_*`` value from one import (``RUNTIME_PREFIXES``): that holds only while no
    module of the package reads the environment outside a function."""
    package = PACKAGE
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "environ" not in text and "getenv" not in text:
            continue
        tree = ast.parse(text)
        module_level = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef))]
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        module_level += [n for c in classes for n in c.body
                         if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for statement in module_level:
            for node in ast.walk(statement):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                    found.append(f"{path.relative_to(package)}:{node.lineno}")
    import zygote

    assert zygote._is_runtime("HF_RESUMABLE_SPLIT_REPLICAS") and not zygote._is_runtime("HF_ENDPOINT")
    assert found == [], f"read at import time: {found}"
