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
    from helpers import zygote

    assert zygote._is_runtime("HF_RESUMABLE_SPLIT_REPLICAS") and not zygote._is_runtime("HF_ENDPOINT")
    assert found == [], f"read at import time: {found}"


# Nothing outside checkpoint/ imports its private modules (a ``_``-prefixed module or package under it): the package's
# front (``hf_resumable.checkpoint``, ``checkpoint.api``) and each room's door (``checkpoint.commit``,
# ``checkpoint.pieces``, ``checkpoint.background``, ``checkpoint.state``: the names their ``__init__`` re-exports) are
# the way in.
def _is_private_to(module: str, package: str) -> bool:
    """``module`` lies inside ``package`` under a ``_``-prefixed name (``checkpoint._types``, ``checkpoint.x._y``)."""
    inner = module.split(".")[len(package.split(".")):]
    return _within(module, package) and any(part.startswith("_") for part in inner)


def test_nothing_outside_checkpoint_imports_its_private_modules():
    found = sorted(f"{a} -> {b}" for a in MODULES if not _within(a, "checkpoint") for b in _imports(a, ancestors=True)
                   if _is_private_to(b, "checkpoint"))
    assert not found, ("modules outside hf_resumable/checkpoint/ import its private modules; import the name from "
                       "hf_resumable.checkpoint, checkpoint.api or the room's package (checkpoint.commit, "
                       "checkpoint.pieces, checkpoint.background, checkpoint.state) instead:\n" + "\n".join(found))


# The rooms of checkpoint/, lowest first: a module of a room imports its own room and the rooms below it, never one
# above (docs/architecture.md, "checkpoint/"). ``state`` and ``commit`` share a level: neither imports the other.
CHECKPOINT_ROOMS: list[tuple[str, list[str]]] = [
    ("types", ["checkpoint._types"]),
    ("state, commit", ["checkpoint.state", "checkpoint.commit"]),
    ("background", ["checkpoint.background"]),
    ("pieces", ["checkpoint.pieces"]),
    ("front", ["checkpoint"]),
]


def _room(module: str) -> int:
    for index, (_name, prefixes) in enumerate(CHECKPOINT_ROOMS):
        if any(_within(module, prefix) for prefix in prefixes):
            return index
    raise AssertionError(f"hf_resumable.{module} is in no room of checkpoint/: add it to CHECKPOINT_ROOMS")


def _upward_in_checkpoint(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"hf_resumable.{a} ({CHECKPOINT_ROOMS[_room(a)][0]}) imports hf_resumable.{b} "
                  f"({CHECKPOINT_ROOMS[_room(b)][0]})"
                  for a, targets in graph.items() if _within(a, "checkpoint")
                  for b in targets if _within(b, "checkpoint") and _room(b) > _room(a))


def test_checkpoint_rooms_import_one_way():
    upward = _upward_in_checkpoint(GRAPH)
    assert not upward, "upward imports between checkpoint/'s rooms:\n" + "\n".join(upward)


def test_state_and_commit_import_neither_other():
    across = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    for room, other in (("checkpoint.state", "checkpoint.commit"),
                                        ("checkpoint.commit", "checkpoint.state"))
                    if _within(a, room) and _within(b, other))
    assert not across, across


def test_the_room_check_sees_an_upward_import():
    # Guards the check above on the real modules: the writer importing the piece planner would be a regression.
    assert _upward_in_checkpoint({"checkpoint.commit._writer": {"checkpoint.pieces._pieces"}})
    assert _upward_in_checkpoint({"checkpoint._types": {"checkpoint.state._model"}})
    assert not _upward_in_checkpoint({"checkpoint.pieces._pieces": {"checkpoint.commit._writer"}})
    assert {_room(m) for m in MODULES if _within(m, "checkpoint")} == set(range(len(CHECKPOINT_ROOMS)))


def test_the_private_module_test_knows_a_private_module():
    # Guards the check above: these are private to checkpoint/ (or not), whatever modules exist today.
    assert _is_private_to("checkpoint._types", "checkpoint") and _is_private_to("checkpoint.commit._fs", "checkpoint")
    assert not _is_private_to("checkpoint.api", "checkpoint") and not _is_private_to("checkpoint", "checkpoint")
    assert not _is_private_to("conversions._commit", "checkpoint")


# The test suite follows the same rooms: every helper that more than one test module (or a test's worker script)
# uses lives in tests/helpers/; tests/ itself holds conftest.py and the test modules, and no file of the suite (nor of
# benchmarks/) imports a test module. A test module imported by another runs its module-level code and registers its
# fixtures twice, and ties two files' bodies together.
TESTS = PACKAGE.parent / "tests"
HELPERS = TESTS / "helpers"
BENCHMARKS = PACKAGE.parent / "benchmarks"


def _suite_files() -> list[Path]:
    """Every Python file of tests/ (helpers, scripts, fixtures included) and benchmarks/."""
    return sorted(list(TESTS.rglob("*.py")) + list(BENCHMARKS.rglob("*.py")))


def _imported_names(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``source`` imports or starts: ``import``/``from`` statements at any depth
    (inside functions too), ``importlib.import_module``/``__import__`` of a literal name, and ``-m NAME`` in a
    literal command line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, (ast.List, ast.Tuple)):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [(node.lineno, name) for flag, name in zip(values, values[1:])
                      if flag == "-m" and isinstance(name, str)]
    return found


def _test_module_imports(source: str) -> list[str]:
    """Where ``source`` imports a test module (``test_*``, whatever its dotted path)."""
    return [f"line {line}: {name}" for line, name in _imported_names(source)
            if any(part.startswith("test_") for part in name.split("."))]


def test_no_file_of_the_suite_imports_a_test_module():
    offenders = [f"{path.relative_to(PACKAGE.parent)} {where}" for path in _suite_files()
                 for where in _test_module_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, ("a test module is imported; move what is shared into the tests/helpers/ module named for "
                           "its job and import it from there:\n" + "\n".join(offenders))


@pytest.mark.parametrize("source", [
    "import test_trainer_resume",
    "from test_trainer_resume import KILLED, _run",
    "def test_x():\n    import test_trainer_resume as grid\n    grid._run()",
    "class A:\n    def f(self):\n        from test_engines import _reference",
    "import importlib\nimportlib.import_module('test_engines')",
    "command = [sys.executable, '-m', 'test_engines']",
])
def test_the_test_module_import_scan_finds(source):
    assert _test_module_imports(source)


@pytest.mark.parametrize("source", [
    "from helpers.trainer_runs import KILLED, assert_identical",
    "from helpers import zygote",
    "import pytest\nfrom transformers.testing_utils import require_torch",
    "command = [sys.executable, '-m', 'hf_resumable', 'test_run']",
])
def test_the_test_module_import_scan_allows(source):
    assert not _test_module_imports(source)


def _is_script(path: Path) -> bool:
    """A file run as a process: it has an ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)):
            return True
    return False


def test_shared_helpers_live_in_tests_helpers():
    top = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py" and not p.name.startswith("test_"))
    assert not top, f"tests/ holds conftest.py and test modules only; move these into tests/helpers/: {top}"
    assert (HELPERS / "__init__.py").is_file()
    # A module of tests/ outside helpers/ that another file imports must be a script run as a process (its building
    # blocks may be reused, as train_tiny.py's are); a module that only defines things is a helper.
    by_name: dict[str, list[Path]] = {}
    for path in TESTS.rglob("*.py"):
        if HELPERS not in path.parents and not path.name.startswith("test_") and path.name != "conftest.py":
            by_name.setdefault(path.stem, []).append(path)
    offenders = []
    for path in _suite_files():
        for line, name in _imported_names(path.read_text(encoding="utf-8")):
            for target in by_name.get(name.split(".")[0], []):
                if target != path and not _is_script(target):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)} line {line} imports "
                                     f"{target.relative_to(PACKAGE.parent)}, which is not a script")
    assert not offenders, "move these helpers into tests/helpers/:\n" + "\n".join(offenders)


def test_the_helper_scan_sees_the_suite():
    # Guards the scans: the suite has helpers, scripts that import them, and test modules that import scripts.
    assert {"zygote", "distributed_launch", "tiny_models", "trainer_runs"} <= {p.stem for p in HELPERS.glob("*.py")}
    worker = TESTS / "scripts" / "fsdp_trainer_worker.py"
    assert _is_script(worker) and not _is_script(HELPERS / "tiny_models.py")
    assert any(name.startswith("helpers") for _, name in _imported_names(worker.read_text(encoding="utf-8")))
    assert any(name == "train_tiny" for path in TESTS.glob("test_*.py")
               for _, name in _imported_names(path.read_text(encoding="utf-8")))
