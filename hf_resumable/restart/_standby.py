"""A standby interpreter: it runs a script's leading imports ahead of time, then starts the next attempts.

Run by the supervisor as a file (``python [options] _standby.py CONTROL_FD PLAN_JSON``), never imported, standard
library only, so that nothing but the planned imports is loaded before the run starts. Started with the command's
own interpreter, options, directory and environment:

1. ``sys.path[0]`` is set as the command's interpreter would set it, then each planned import runs in a throwaway
   namespace, except the user's own modules (they may change before the run starts); one that fails is skipped (the
   run executes it again and fails as it would have).
2. It reads requests on ``CONTROL_FD``, ignoring SIGINT; end of file exits quietly.
3. ``fork N``: it forks the attempt and stays ready for the next failure, answering ``pid P``, or ``refused WHY``
   where a fork is not safe (an import started a thread or loaded a GPU driver). The attempt's parent exits at once,
   so the supervisor (a child subreaper) becomes its parent.
4. ``go N``: it becomes the attempt itself (after a refused fork).

An attempt has ``HF_RESUMABLE_RESTARTS=N`` and ``HF_RESUMABLE_WARM=1`` set, the command's ``sys.argv``, SIGINT as a
new interpreter has it and torch's and numpy's global generators seeded anew, and runs the script as ``__main__``.
"""

import json
import os
import runpy
import signal
import sys
import time


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


def _fork_refusal():
    """Why this process must not fork an attempt (``None``: it may). A fork copies only the calling thread: a Python
    thread started by an import would be missing in the attempt, with any lock it held, and a GPU driver initialised
    by an import cannot be used in a forked child. Native pools that libraries start when loaded (OpenBLAS,
    jemalloc's background thread) prepare for a fork themselves (``pthread_atfork``), as DataLoader's forked workers
    rely on."""
    import threading

    if threading.active_count() > 1:
        return f"an import started {threading.active_count() - 1} Python thread(s)"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError as err:
        return f"cannot inspect the process ({err})"
    for library in ("libcuda.so", "libhsa-runtime", "libze_loader", "libnvidia-ml"):
        if library in maps:
            return f"an import loaded the GPU driver {library}"
    return None


def _fork_attempt(restarts, plan, channel):
    """Start an attempt as a fork of this process, detached (its parent exits at once, so that the supervisor, a
    child subreaper, becomes its parent and waits for it). Returns its pid in this process; in the attempt it runs
    the script and leaves like an interpreter does (its exit status, atexit handlers, a traceback)."""
    read_pid, write_pid = os.pipe()
    middle = os.fork()
    if middle == 0:
        middle = os.getpid()
        attempt = os.fork()
        if attempt != 0:
            os.write(write_pid, str(attempt).encode())
            os._exit(0)
        os.close(read_pid)
        os.close(write_pid)
        for stream in channel:
            stream.close()
        while os.getppid() == middle:  # until the supervisor is the parent, as it is of a new interpreter
            time.sleep(0.0005)
        _reseed()
        _run(restarts, plan)
        sys.exit(0)
    os.close(write_pid)
    with os.fdopen(read_pid, "rb") as f:
        pid = int(f.read() or b"0")
    os.waitpid(middle, 0)
    return pid


def _reseed():
    """A forked attempt would share this process's global random generators; a new interpreter seeds them from the
    OS (``random`` re-seeds itself after a fork; torch's default generator and numpy's legacy global one do not)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _run(restarts, plan):
    """Become the attempt: the environment, ``sys.argv``, SIGINT as a new interpreter has it, then the script."""
    os.environ[plan["restarts_env"]] = str(restarts)  # (names given by the supervisor: this file imports nothing)
    os.environ[plan["warm_env"]] = "1"
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # as a new interpreter has it (unless an import set one)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = list(plan["argv"])
    if plan["module"]:
        runpy.run_module(plan["target"], run_name="__main__", alter_sys=True)
    else:
        _run_script(plan["target"])


def main():
    import socket

    control_fd, plan = int(sys.argv[1]), json.loads(sys.argv[2])
    # A Ctrl-C at the terminal reaches the whole process group: it is for the running attempt, not for the standby.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[0] = plan["path0"]
    prefixes = [os.path.join(os.path.realpath(p), "") for p in {plan["path0"], os.getcwd()}]
    _imports(plan["imports"], prefixes)
    control = socket.socket(fileno=control_fd)
    requests = control.makefile("rb")
    for line in requests:
        words = line.decode("ascii", "replace").split()
        if len(words) != 2 or not words[1].isdigit():
            break
        verb, restarts = words[0], int(words[1])
        if verb == "fork":
            refusal = _fork_refusal() if plan["fork"] else "forking is off"
            if refusal is None:
                pid = _fork_attempt(restarts, plan, (requests, control))
                control.sendall((f"pid {pid}\n" if pid else "refused the fork failed\n").encode())
            else:
                control.sendall(f"refused {refusal}\n".encode())
            continue
        if verb == "go":
            requests.close()
            control.close()
            _run(restarts, plan)
            return
        break
    os._exit(0)  # the supervisor closed the socket: this standby is not needed


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
