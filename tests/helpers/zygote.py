"""Start test subprocesses by forking a server that has already imported torch, transformers and hf_resumable.

Most of the suite's kill/restart tests run ``python script.py ...`` in a fresh process, and a fresh process spends
about 5-10 s of CPU importing torch, transformers (with peft, bitsandbytes, accelerate) before it does anything. A
*zygote* pays that once: it imports everything, then forks one child per request. The child is a real, separate
process with its own pid: tests SIGKILL it, SIGTERM it, read its exit status (``-9`` after SIGKILL), and its
output goes to the files or pipes the test gave, exactly as with :class:`subprocess.Popen`.

What a forked child shares with a fresh interpreter, and how the rest is made equal:

- **Environment read at import time** (``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``OMP_NUM_THREADS``,
  ``PYTHONHASHSEED``, ``PYTHONPATH``, ...): a zygote serves only children whose environment equals the one it was
  started with, except for variables that are read at run time (``RANK``, ``MASTER_PORT``, the tests' own
  ``HFR_*`` switches, ...: :data:`RUNTIME_VARIABLES`). Another environment gets another zygote (a few are kept).
- ``sys.argv``, ``sys.path[0]``, the working directory, ``__main__`` and the signal handlers are set up as
  ``python script.py`` / ``python -m module`` would; the child leaves through the normal interpreter shutdown
  (atexit handlers, non-daemon threads joined, buffers flushed).
- Anything else (interpreter flags such as ``-X``/``-W``, another interpreter, ``preexec_fn``) is started as a
  plain subprocess.

``torchrun``'s workers come from a zygote too, with the command line unchanged: torchrun starts each worker as
``$PYTHON_EXEC -u script ...``, and :func:`torchrun_env` points ``PYTHON_EXEC`` at a small client (a
``python -S`` script, tens of milliseconds) that has a zygote fork the worker, forwards every signal torchrun sends
it and exits as the worker did. The worker dies with its client (it watches the client's pid), so SIGKILLing
torchrun's process tree, as the kill tests do, kills the workers too. An environment the zygote was not started with,
or interpreter flags other than ``-u``, make the client ``exec`` the real interpreter instead.

``HF_RESUMABLE_TEST_ZYGOTE=0`` turns it off (every process is then a plain subprocess).

This module is test infrastructure; nothing in the package uses it.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import io
import itertools
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["Popen", "run", "shutdown", "RUNTIME_VARIABLES"]

REPO_ROOT = Path(__file__).resolve().parents[2]

# Read by the child at run time, never at import: they may differ between children of one zygote.
RUNTIME_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST",
                     # what torchrun's agent adds for its workers, and its choice of interpreter
                     "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC",
                     "MPLBACKEND")  # matplotlib is not among the imports (PRELOAD)
# Every ``HF_RESUMABLE_*`` switch of the package is read at run time (none at import; hf_resumable.trace's tracer,
# started at import, is started in the child: see _become), and so are the tests' own switches.
RUNTIME_PREFIXES = ("HFR_", "HF_RESUMABLE_", "TORCHELASTIC_")

# Imported by the zygote before it forks: what the test scripts spend their start-up on.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.utils.data", "safetensors.torch", "huggingface_hub", "datasets", "accelerate", "transformers",
           "transformers.trainer", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert", "peft", "trl",
           "psutil", "hf_resumable", "hf_resumable.cli", "hf_resumable.integrations.trainer",
           "hf_resumable.integrations.accelerate", "hf_resumable.hub")

# Set in a forked child: the pid of the client that asked for it, i.e. the process its launcher (torchrun) started.
# The child's own parent is the zygote; a script that must signal its launcher finds it as this pid's parent.
CLIENT_PID_ENV = "HFR_ZYGOTE_CLIENT_PID"
_HEADER = struct.Struct("!I")
_MAX_ZYGOTES = 10


def _enabled() -> bool:
    return os.environ.get("HF_RESUMABLE_TEST_ZYGOTE", "1") != "0"


def _is_runtime(name: str) -> bool:
    return name in RUNTIME_VARIABLES or name.startswith(RUNTIME_PREFIXES)


def _import_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if not _is_runtime(k)))


# ---------------------------------------------------------------------------------------------------------------
# The server (runs as ``python tests/helpers/zygote.py <socket>``)
# ---------------------------------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (and the descriptors that came with it); ``(None, [])`` at end of stream."""
    fds: list[int] = []
    buffer = b""
    while len(buffer) < _HEADER.size:
        chunk, ancdata, _, _ = sock.recvmsg(_HEADER.size - len(buffer), socket.CMSG_SPACE(max(1, max_fds) * 4))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        buffer += chunk
    (size,) = _HEADER.unpack(buffer)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, []
        body += chunk
    return json.loads(body), fds


def _serve(listener: socket.socket) -> dict:
    """Fork a child per request; returns (in the child only) the request it is to run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                conn.setblocking(True)
                request, fds = _receive(conn, max_fds=3)
                if request is None:
                    conn.close()
                    continue
                if request.get("command") == "exit":
                    conn.close()
                    for pid in waiting:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    raise SystemExit(0)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    listener.close()
                    conn.close()
                    for other in waiting.values():
                        other.close()
                    request["fds"] = fds
                    return request
                for fd in fds:
                    os.close(fd)
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    pass
                waiting[pid] = conn
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                while waiting:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            _send(conn, {"returncode": _returncode(status)})
                        conn.close()


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _die_with(pid: int) -> None:
    """SIGKILL this process as soon as process ``pid`` (the torchrun client that asked for it) has exited."""
    import select

    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-client-watch", daemon=True).start()


def _become(request: dict) -> None:
    """Turn this forked process into ``python <argv>`` as the request describes, then run it."""
    stdin, stdout, stderr = request["fds"]
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(fd, target)
    for fd in set(request["fds"]):
        if fd > 2:
            os.close(fd)
    for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("watch"):
        _die_with(request["watch"])
    if request["new_session"]:
        os.setsid()
    else:  # a group of its own, so that signalling it never reaches the zygote or its other children
        os.setpgid(0, 0)
    # A fresh interpreter seeds torch's and numpy's global generators from the OS (Python's random reseeds itself
    # after a fork); the zygote's seeds would otherwise be shared by every child.
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("watch"):  # the process its launcher started (torchrun's worker pid)
        os.environ[CLIENT_PID_ENV] = str(request["watch"])
    # A fresh interpreter's stdio: new objects on fds 0-2, unbuffered when the child asked for it.
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), write_through=unbuffered,
                                  line_buffering=name == "stderr" or raw.isatty(),
                                  errors="backslashreplace" if name == "stderr" else "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # hf_resumable.trace starts its tracer when it is imported with HF_RESUMABLE_TRACE set; the zygote imported it
    # without, so a child launched by ``hf-resumable check`` starts it now (it taps the new stdout), as its fresh
    # interpreter would have done at import.
    trace = sys.modules.get("hf_resumable.trace")
    if trace is not None and trace._TRACER is None and os.environ.get(trace.TRACE_ENV):
        trace._TRACER = trace._start()
    argv = request["argv"]
    if argv[0] == "-m":
        import runpy
        import types

        # runpy runs the module in ``sys.modules["__main__"]``'s namespace: a fresh one, not this file's own
        sys.modules["__main__"] = types.ModuleType("__main__")
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = request["cwd"]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what ``python -m`` itself calls
        return
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        source, filename = argv[1], "<string>"
    else:
        path = os.path.join(request["cwd"], argv[0])
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        with open(path, "rb") as handle:
            source, filename = handle.read(), path
    import types

    main = types.ModuleType("__main__")
    main.__file__ = filename if filename != "<string>" else None
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def _server_main(socket_path: str) -> None:
    import ctypes
    import importlib

    # Die with the test process (PR_SET_PDEATHSIG); the children, forked later, do not inherit this.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:  # forking a multi-threaded process is unsafe: refuse to serve, the client falls back
        raise SystemExit(f"zygote: threads running after the imports: {extra}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # Objects that exist now are shared with every child: the collector need never visit them (a visit writes to
    # their pages, which then stop being shared).
    gc.freeze()
    request = _serve(listener)
    del listener
    try:
        _become(request)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        raise  # the interpreter re-raises SIGINT when it exits, as a fresh one would
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _shut_down(code)


def _exit_status(code: object) -> int:
    """The status ``raise SystemExit(code)`` leaves a fresh interpreter with (a message goes to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _shut_down(code: int) -> None:
    """Leave as a fresh interpreter does, without tearing down the modules the zygote imported.

    Interpreter shutdown waits for non-daemon threads, runs the atexit handlers and flushes stdio, then clears every
    module: in a forked child that last part writes to every page the zygote shares with it (seconds of copying),
    and frees nothing the operating system does not free anyway. So the script's own globals are cleared (their
    files closed, their finalizers run) and the rest is left to ``os._exit``.
    """
    threading._shutdown()
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------------------------
# The client (in the test process)
# ---------------------------------------------------------------------------------------------------------------


class _Zygote:
    def __init__(self, env: dict[str, str]):
        self.directory = tempfile.mkdtemp(prefix="hfr-zygote-")
        self.socket_path = os.path.join(self.directory, "socket")
        self.log = open(os.path.join(self.directory, "log"), "wb")
        self.process = subprocess.Popen([sys.executable, __file__, self.socket_path], env=env, cwd=REPO_ROOT,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
                                        start_new_session=True)
        self._ready = threading.Event()
        self._failed = False
        threading.Thread(target=self._wait_ready, daemon=True).start()
        self.last_used = time.monotonic()

    def _wait_ready(self) -> None:
        line = self.process.stdout.readline()
        self._failed = line.strip() != b"ready"
        self._ready.set()

    def usable(self, timeout: float = 240.0) -> bool:
        self._ready.wait(timeout)
        return self._ready.is_set() and not self._failed and self.process.poll() is None

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.socket_path)
        return sock

    def close(self) -> None:
        if self.process.poll() is None and self._ready.is_set() and not self._failed:
            with contextlib.suppress(OSError), self.connect() as sock:
                _send(sock, {"command": "exit"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.log.close()
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)


_zygotes: dict[tuple, _Zygote] = {}
_lock = threading.Lock()


_turn = itertools.count()
_seen: dict[tuple, int] = {}


def _log_choice(env: dict[str, str], choice: str) -> None:
    """With ``HF_RESUMABLE_TEST_ZYGOTE_LOG`` set (a file): append which test asked, what was chosen (a plain process,
    a zygote started or reused) and the import-time variables that differ from this process's own environment,
    the usual reason for a plain process or a zygote of its own."""
    log = os.environ.get("HF_RESUMABLE_TEST_ZYGOTE_LOG")
    if not log:
        return
    differing = sorted(k for k in set(env) | set(os.environ)
                       if not _is_runtime(k) and env.get(k) != os.environ.get(k))
    with open(log, "a") as handle:
        handle.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "choice": choice,
                                 "differing": differing}) + "\n")


def _zygote_for(env: dict[str, str], *, eager: bool = False, wait: bool = True) -> _Zygote | None:
    """The zygote for ``env``'s import-time environment, ``None`` if there is none (yet) or it cannot serve.

    A zygote is started the second time an environment is asked for (the first time if ``eager``): one that is used
    once (a test's private ``HF_HOME``) costs a plain process, not a zygote's imports. ``wait=False`` returns the
    zygote while it may still be importing (:meth:`_Zygote.usable` waits). A zygote dies with the thread that
    started it (``PR_SET_PDEATHSIG``): start them from a thread that lives as long as they should.
    """
    zygote_env = {k: v for k, v in env.items() if not _is_runtime(k)}
    key = _import_environment(env)
    with _lock:
        _seen[key] = _seen.get(key, 0) + 1
        if _seen[key] < 2 and not eager:
            _log_choice(env, "plain")
            return None
    if "PYTHONHASHSEED" not in env:
        # Fresh interpreters hash strings with a random seed each: alternate between two zygotes with different
        # seeds, so that two consecutive processes (a run and its resume) do not share one.
        slot = next(_turn) % 2
        key += (("", str(slot)),)
        zygote_env["PYTHONHASHSEED"] = str(1 + slot + 2 * (os.getpid() % 1000))
    with _lock:
        zygote = _zygotes.get(key)
        _log_choice(env, "started" if zygote is None else "reused")
        if zygote is None:
            if len(_zygotes) >= _MAX_ZYGOTES:
                oldest = min(_zygotes, key=lambda k: _zygotes[k].last_used)
                _zygotes.pop(oldest).close()
            zygote = _zygotes[key] = _Zygote(zygote_env)
        zygote.last_used = time.monotonic()
    if not wait:  # started (or starting): the caller waits with usable()
        return zygote
    return zygote if zygote.usable() else None


def _environment_key(env: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(_import_environment(env)).encode()).hexdigest()


def torchrun_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a ``torchrun`` command whose workers are forked from a zygote (``env`` itself if none serves)."""
    if not _enabled():
        return env
    zygote = _zygote_for(env, eager=True)
    if zygote is None:
        return env
    client = os.path.join(zygote.directory, "python")
    if not os.path.exists(client):
        with open(client + ".tmp", "w") as handle:
            handle.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(REPO_ROOT / 'tests')!r})\n"
                         f"from helpers import zygote\nzygote.as_python({sys.executable!r})\n")
        os.chmod(client + ".tmp", 0o755)
        os.replace(client + ".tmp", client)
    return {**env, "PYTHON_EXEC": client, "HF_RESUMABLE_TEST_ZYGOTE_SOCKET": zygote.socket_path,
            "HF_RESUMABLE_TEST_ZYGOTE_KEY": _environment_key(env)}


def as_python(interpreter: str) -> None:
    """Main of the ``PYTHON_EXEC`` client: run ``python -u script args`` as a zygote's child (see the module doc)."""
    args = sys.argv[1:]
    argv = args[1:] if args[:1] == ["-u"] else args
    socket_path = os.environ.get("HF_RESUMABLE_TEST_ZYGOTE_SOCKET", "")
    usable = (argv and (argv[0] in ("-m", "-c") or not argv[0].startswith("-")) and socket_path
              and os.environ.get("HF_RESUMABLE_TEST_ZYGOTE_KEY") == _environment_key(dict(os.environ)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if args[:1] == ["-u"] else dict(os.environ)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not usable:
            raise OSError("not a zygote's command")
        sock.connect(socket_path)
        _send(sock, {"argv": argv, "env": env, "cwd": os.getcwd(), "new_session": False, "watch": os.getpid()},
              [0, 1, 2])
        reply, _ = _receive(sock)
        if not reply or "pid" not in reply:
            raise OSError("the zygote did not fork")
    except OSError:
        sock.close()
        os.execv(interpreter, [interpreter, *args])
    pid = reply["pid"]

    def forward(number, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, forward)
    while True:
        try:
            reply, _ = _receive(sock)
            break
        except InterruptedError:
            continue
    returncode = reply["returncode"] if reply else -signal.SIGKILL
    if returncode < 0:  # die of the same signal, as torchrun would have seen the worker die
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    os._exit(returncode)


def shutdown() -> None:
    """Stop every zygote (their running children are SIGKILLed)."""
    with _lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


def _python_argv(args) -> list[str] | None:
    """The interpreter arguments of ``args`` when a zygote can run them, else ``None``."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = [os.fspath(a) for a in args]
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable) or len(args) < 2:
        return None
    rest = args[1:]
    if rest[0] in ("-m", "-c"):
        return rest if len(rest) >= 2 else None
    if rest[0].startswith("-"):
        return None
    return rest


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` for ``[sys.executable, script, ...]``, forked from a preloaded zygote.

    Accepts the arguments the tests use (``env``, ``cwd``, ``stdin``/``stdout``/``stderr`` as files, descriptors,
    ``PIPE``, ``DEVNULL``, ``STDOUT``, ``text``/``universal_newlines``, ``start_new_session``); anything else, or
    a command that is not this interpreter running a script or module, is started by :class:`subprocess.Popen`
    itself.
    """

    def __new__(cls, args, *pargs, **kwargs):
        if not _enabled() or pargs or _python_argv(args) is None or set(kwargs) - _SUPPORTED:
            return subprocess.Popen(args, *pargs, **kwargs)
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        zygote = _zygote_for(env)
        if zygote is None:
            return subprocess.Popen(args, *pargs, **kwargs)
        process = super().__new__(cls)
        process._zygote = zygote
        return process

    def __init__(self, args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=None,
                 universal_newlines=None, start_new_session=False, encoding=None, errors=None, bufsize=-1):
        self.args = args
        self.returncode = None
        self.stdin = self.stdout = self.stderr = None
        self.text_mode = bool(text or universal_newlines or encoding or errors)
        self._encoding, self._errors = encoding, errors
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = False
        self._child_created = False
        env = dict(os.environ if env is None else env)
        to_close: list[int] = []

        def child_fd(spec, default: int, mode: str):
            if spec is None:
                return default
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                to_close.append(fd)
                return fd
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                ours, theirs = (write, read) if mode == "r" else (read, write)
                to_close.append(theirs)
                return ours, theirs
            return spec if isinstance(spec, int) else spec.fileno()

        stdin_fd = child_fd(stdin, 0, "r")
        stdout_fd = child_fd(stdout, 1, "w")
        stderr_fd = stdout_fd if stderr == subprocess.STDOUT else child_fd(stderr, 2, "w")
        pipes = {}
        fds = []
        for name, value in (("stdin", stdin_fd), ("stdout", stdout_fd), ("stderr", stderr_fd)):
            if isinstance(value, tuple):
                if not (name == "stderr" and stderr == subprocess.STDOUT):
                    pipes[name] = value[0]
                value = value[1]
            fds.append(value)
        self._sock = self._zygote.connect()
        try:
            _send(self._sock, {"argv": _python_argv(args), "env": env, "cwd": os.fspath(cwd or os.getcwd()),
                               "new_session": bool(start_new_session)}, fds)
            reply, _ = _receive(self._sock)
        finally:
            for fd in to_close:
                os.close(fd)
        if reply is None or "pid" not in reply:
            for fd in pipes.values():
                os.close(fd)
            raise OSError(f"the test zygote did not start {args!r}")
        self.pid = reply["pid"]
        self._child_created = True
        for name, fd in pipes.items():
            mode = "wb" if name == "stdin" else "rb"
            stream = open(fd, mode, buffering=-1 if bufsize != 0 else 0)
            if self.text_mode:
                stream = io.TextIOWrapper(stream, encoding=encoding, errors=errors, write_through=name == "stdin")
            setattr(self, name, stream)

    # subprocess.Popen's own waiting uses os.waitpid, which only works for our children: ask the zygote instead.
    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):
        if self.returncode is None:
            self._read_status(blocking=False)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            self._read_status(blocking=True)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status(blocking=True, timeout=remaining)
        return self.returncode

    def _read_status(self, *, blocking: bool, timeout: float | None = None) -> None:
        self._sock.settimeout(timeout if blocking else 0.0)
        try:
            reply, _ = _receive(self._sock)
        except (BlockingIOError, TimeoutError, socket.timeout):
            return
        finally:
            self._sock.settimeout(None)
        self._sock.close()
        # End of stream without a status: the zygote itself died; the child is gone with it (SIGKILLed).
        self.returncode = reply["returncode"] if reply else -signal.SIGKILL

    def send_signal(self, sig):
        self.poll()
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def __del__(self):
        pass


_SUPPORTED = {"env", "cwd", "stdin", "stdout", "stderr", "text", "universal_newlines", "start_new_session",
              "encoding", "errors", "bufsize"}


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """:func:`subprocess.run` whose process comes from :class:`Popen` (a zygote when it can)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)


if __name__ == "__main__":
    _server_main(sys.argv[1])
