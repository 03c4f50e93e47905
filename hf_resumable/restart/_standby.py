"""A standby interpreter: it runs a script's leading imports ahead of time, then waits to become the next attempt.

Run by the supervisor as a file (``python [options] _standby.py GO_FD PLAN_JSON``), never imported: it uses the
standard library only, so that nothing but the planned imports is loaded before the run starts (not even
``hf_resumable``), and so that any interpreter can run it. Started with the command's own interpreter, options,
working directory and environment, it is the fresh process the command would start, with its first import
statements already executed:

1. ``sys.path[0]`` is set to what the command's interpreter would put there (the script's directory, or the working
   directory for ``-m``), then each planned import statement is executed in a throwaway namespace, except those that
   load the user's own modules (under the script's or the working directory, outside any ``site-packages``: they may
   change before the run starts). One that fails is skipped: the run executes it again and fails as it would have.
2. It blocks on ``GO_FD``, ignoring SIGINT (a Ctrl-C at the terminal is for the running attempt). End of file (the
   supervisor is gone, or the standby is not needed) exits quietly.
3. On ``go N``: ``HF_RESUMABLE_RESTARTS=N`` and ``HF_RESUMABLE_WARM=1`` are set, ``sys.argv`` becomes the command's,
   and the script runs as ``__main__`` the way the interpreter runs one (a module through :mod:`runpy`). Its exit
   status is the process's.
"""

import json
import os
import runpy
import signal
import sys


def _is_local(places, local_dirs, installed_dirs):
    """Whether a module lives in the user's own code: under the script's directory or the working directory, and
    not in an environment there (a ``./.venv``, any ``site-packages``: installed packages)."""
    for place in places:
        place = os.path.realpath(place)
        installed = any(place.startswith(d) for d in installed_dirs) or any(
            part in ("site-packages", "dist-packages") for part in place.split(os.sep))
        if any(place.startswith(d) for d in local_dirs) and not installed:
            return True
    return False


def _imports(statements, local_dirs):
    """Execute the planned import statements, except those that load the user's own modules (which may change
    before the run starts) or that cannot be found now (the run reports those itself)."""
    import importlib.util
    import site
    import sysconfig

    installed = {sys.prefix, sys.base_prefix, sysconfig.get_paths().get("purelib", ""),
                 sysconfig.get_paths().get("platlib", "")}
    try:
        installed.update(site.getsitepackages())
        installed.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    installed_dirs = [os.path.join(os.path.realpath(d), "") for d in installed if d]
    for statement, roots in statements:
        skip = False
        for root in roots:
            try:
                spec = importlib.util.find_spec(root)
            except (ImportError, ValueError):
                spec = None
            places = [] if spec is None else list(spec.submodule_search_locations or []) or [spec.origin or ""]
            if spec is None or _is_local(places, local_dirs, installed_dirs):
                skip = True
                break
        if skip:
            continue
        try:
            exec(compile(statement, "<hf_resumable standby>", "exec"), {"__name__": "__hf_resumable_standby__"})
        except Exception:  # noqa: BLE001 - the run executes the statement again and reports it
            pass


def main():
    go_fd, plan = int(sys.argv[1]), json.loads(sys.argv[2])
    # A Ctrl-C at the terminal reaches the whole process group: it is for the running attempt, not for the standby.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[0] = plan["path0"]
    prefixes = [os.path.join(os.path.realpath(p), "") for p in {plan["path0"], os.getcwd()}]
    _imports(plan["imports"], prefixes)
    with os.fdopen(go_fd, "rb") as go:
        line = go.readline().decode("ascii", "replace").split()
    if len(line) != 2 or line[0] != "go":
        os._exit(0)  # the supervisor closed the pipe: this standby is not needed
    os.environ["HF_RESUMABLE_RESTARTS"] = line[1]
    os.environ["HF_RESUMABLE_WARM"] = "1"
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # as a new interpreter has it (unless an import set one)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = list(plan["argv"])
    if plan["module"]:
        runpy.run_module(plan["target"], run_name="__main__", alter_sys=True)
    else:
        _run_script(plan["target"])


def _run_script(target):
    """Run a script file as ``python script.py`` does: a fresh ``__main__`` module whose ``__file__`` is the
    absolute path, ``sys.argv[0]`` as given (``runpy.run_path`` would make it the path it was passed)."""
    import importlib.machinery
    import io
    import types

    path = os.path.abspath(target)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main_module = types.ModuleType("__main__")
    main_module.__file__ = path
    main_module.__cached__ = None
    main_module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main_module.__builtins__ = __builtins__
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


if __name__ == "__main__":
    main()
