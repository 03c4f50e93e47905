"""Planning a warm restart, without running anything: is the command a Python script or module, which interpreter
options it passes, and which of its imports a standby interpreter may run ahead of time.

Everything here is a pure function of the command line and the script's source text; nothing is imported or
executed (the source is parsed with :mod:`ast`).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

__all__ = ["WarmStart", "imported_roots", "leading_imports", "plan_warm_start"]

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?[tw]?$")  # python, python3, python3.11, python3.13t
# Interpreter options a standby can be started with unchanged; the options with an argument take the next word.
_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-b", "-bb", "-q", "-E", "-s", "-d", "-v", "-x"})
_FLAGS_WITH_VALUE = frozenset({"-W", "-X"})


@dataclass(frozen=True)
class WarmStart:
    """How a standby interpreter runs the command ``python [options] (script | -m module) [args]``.

    Attributes:
        interpreter: the command's interpreter, as the command names it (the standby is started with it).
        options: its interpreter options, passed to the standby unchanged (``-u``, ``-X dev``, ...).
        target: the script's path (as given) or the module's name.
        is_module: ``True`` for ``-m module``.
        args: the words after the target: ``sys.argv[1:]`` of the run.
    """

    interpreter: str
    options: tuple[str, ...]
    target: str
    is_module: bool
    args: tuple[str, ...]

    def argv(self) -> list[str]:
        """``sys.argv`` as the interpreter sets it for a script (a module's ``argv[0]`` is set by :mod:`runpy`)."""
        return [self.target if not self.is_module else "-m", *self.args]


def plan_warm_start(command: list[str]) -> tuple[WarmStart | None, str]:
    """Whether ``command`` can be restarted from a standby interpreter, and if not, why (one phrase).

    Only a command that starts a Python interpreter on a script or a module qualifies: a launcher such as
    ``torchrun`` or ``accelerate launch`` starts its workers itself, ``python -c`` has no file to rerun, and the
    options that change ``sys.path`` or the environment's reach (``-I``, ``-S``) are not ones the standby repeats.

    Example:

    ```python
    >>> plan_warm_start(["python", "-u", "train.py", "--lr", "1e-4"])[0].target
    'train.py'
    >>> plan_warm_start(["torchrun", "--nproc-per-node", "2", "train.py"])[1]
    'torchrun is not a Python interpreter'
    ```
    """
    if not command:
        return None, "the command is empty"
    interpreter = command[0]
    if not _PYTHON.match(os.path.basename(interpreter)):
        return None, f"{os.path.basename(interpreter)} is not a Python interpreter"
    options: list[str] = []
    i = 1
    while i < len(command):
        word = command[i]
        if word == "-m":
            if i + 1 >= len(command):
                return None, "-m names no module"
            return WarmStart(interpreter, tuple(options), command[i + 1], True, tuple(command[i + 2:])), ""
        if word in _FLAGS:
            options.append(word)
        elif word in _FLAGS_WITH_VALUE and i + 1 < len(command):
            options += [word, command[i + 1]]
            i += 1
        elif word.startswith("-") and word != "-":
            return None, f"the interpreter option {word} is not one a standby can repeat"
        else:
            return WarmStart(interpreter, tuple(options), word, False, tuple(command[i + 1:])), ""
        i += 1
    return None, "the command runs no script or module"


def leading_imports(source: str) -> list[str]:
    """The import statements at the top of a script, before its first other statement, as source text.

    A standby may run exactly these before the script starts: they are the script's first effects either way. An
    import after any other statement is left alone, since that statement may be what the import depends on (an
    ``os.environ[...] = ...`` before ``import torch``, a ``sys.path.insert``). A module docstring and
    ``from __future__`` imports are skipped. Source that does not parse gives no imports.

    Example:

    ```python
    >>> leading_imports("import os\\nfrom transformers import Trainer\\nos.environ['A'] = '1'\\nimport torch\\n")
    ['import os', 'from transformers import Trainer']
    ```
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    statements = []
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue  # the module docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
            statements.append(ast.unparse(node))
            continue
        break
    return statements


def imported_roots(statement: str) -> list[str]:
    """The top-level package names an import statement from :func:`leading_imports` loads."""
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    assert isinstance(node, ast.ImportFrom) and node.module
    return [node.module.split(".")[0]]
