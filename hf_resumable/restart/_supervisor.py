"""``hf-resumable run``: run a training command, and when its process dies, start it again at once.

While an attempt trains, a standby interpreter (:mod:`._standby`) has already executed the script's leading import
statements; when the attempt dies it forks the next one. Only import statements run ahead: the run's own code starts
fresh in each attempt. Which commands qualify: :func:`~hf_resumable.restart._plan.plan_warm_start`. Signals, exit
status and limits: docs/trainer.md#restarting-at-once-hf-resumable-run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._plan import WarmStart, imported_roots, leading_imports, plan_warm_start

logger = logging.getLogger(__name__)

__all__ = ["RestartOptions", "run_with_restarts", "RESTARTS_ENV", "WARM_ENV"]

RESTARTS_ENV = "HF_RESUMABLE_RESTARTS"  # restarts before this attempt: 0 in the first
WARM_ENV = "HF_RESUMABLE_WARM"  # "1" in an attempt that a standby ran
_STANDBY_FILE = Path(__file__).with_name("_standby.py")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_STANDBY_EXIT_S = 5.0  # how long a standby that is not needed gets to exit on its own
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@dataclass(frozen=True, kw_only=True)
class RestartOptions:
    """Options of :func:`run_with_restarts` (and ``hf-resumable run``).

    Args:
        max_restarts: how many times a failed attempt is started again (0: never).
        warm: keep a standby interpreter with the imports done (``False``: every restart is a new interpreter).
        preimport: more modules for the standby to import, beside the script's leading import statements (for
            imports made inside functions, e.g. ``"transformers.trainer"``).

    Example:

    ```python
    >>> RestartOptions(max_restarts=10, preimport=("transformers.trainer",)).max_restarts
    10
    ```
    """

    max_restarts: int = 3
    warm: bool = True
    preimport: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        object.__setattr__(self, "preimport", tuple(self.preimport))
        for name in self.preimport:
            if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"preimport names modules (dotted names such as 'transformers.trainer'), got "
                                 f"{name!r}")


class _Processes:
    """The processes this supervisor waits for: its children, and (as a child subreaper) the attempts a standby
    forks, whose parent exits at once. Every exit is reaped here, so that none is left a zombie."""

    def __init__(self) -> None:
        self.exited: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal)
        self._popens: dict[int, subprocess.Popen] = {}

    def start(self, args: list[str], **kwargs) -> int:
        process = subprocess.Popen(args, **kwargs)
        self._popens[process.pid] = process
        return process.pid

    def _reaped(self, pid: int, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        self.exited[pid] = code
        if pid in self._popens:  # (so that subprocess does not wait for it again)
            self._popens.pop(pid).returncode = code

    def wait(self, pid: int) -> int:
        """Wait until ``pid`` exits (reaping any other process that exits meanwhile); its exit code."""
        while pid not in self.exited:
            try:
                reaped, status = os.waitpid(-1, 0)
            except ChildProcessError:  # not ours, or already reaped elsewhere
                self.exited.setdefault(pid, 0)
                break
            self._reaped(reaped, status)
        return self.exited[pid]

    def alive(self, pid: int) -> bool:
        if pid in self.exited:
            return False
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if reaped:
            self._reaped(reaped, status)
            return False
        return True

    def signal(self, pid: int, signum: int) -> None:
        """Send ``signum`` unless ``pid`` has been reaped. Never reaps: it runs in the signal handler, which may
        interrupt :meth:`wait`, whose ``waitpid`` would then wait on for a process already gone."""
        if pid not in self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _become_subreaper(on: bool = True) -> bool:
    """Make this process the parent of orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so that it can wait
    for the attempts a standby forks (``on=False``: no longer). ``False`` where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Standby:
    """A standby interpreter and the socket that asks it for attempts."""

    def __init__(self, plan: WarmStart, imports: list[tuple[str, list[str]]], env: dict[str, str],
                 processes: _Processes, *, fork: bool) -> None:
        path0 = os.getcwd() if plan.is_module else os.path.dirname(os.path.realpath(plan.target))
        document = json.dumps({"path0": path0, "imports": imports, "argv": plan.argv(), "target": plan.target,
                               "module": plan.is_module, "fork": fork, "restarts_env": RESTARTS_ENV,
                               "warm_env": WARM_ENV})
        self._socket, theirs = socket.socketpair()
        self._replies = self._socket.makefile("rb")
        self._processes = processes
        try:
            self.pid = processes.start([plan.interpreter, *plan.options, str(_STANDBY_FILE), str(theirs.fileno()),
                                        document], env=env, pass_fds=(theirs.fileno(),))
        except BaseException:
            self._close()
            raise
        finally:
            theirs.close()

    def fork(self, restarts: int) -> tuple[int | None, str]:
        """Have the standby fork the next attempt and stay ready: (its pid, "") or (``None``, why not)."""
        try:
            self._socket.sendall(f"fork {restarts}\n".encode())
            reply = self._replies.readline().decode("ascii", "replace").split(maxsplit=1)
        except OSError as err:
            return None, f"the standby is unreachable ({err})"
        if len(reply) == 2 and reply[0] == "pid" and reply[1].strip().isdigit():
            return int(reply[1]), ""
        if len(reply) == 2 and reply[0] == "refused":
            return None, reply[1].strip()
        return None, "the standby had exited"

    def go(self, restarts: int) -> int | None:
        """Make the standby itself the next attempt: its pid, or ``None`` if it has died."""
        try:
            if not self._processes.alive(self.pid):
                return None
            self._socket.sendall(f"go {restarts}\n".encode())
            return self.pid
        except OSError:
            return None
        finally:
            self._close()

    def discard(self) -> None:
        """Tell the standby it is not needed (it exits on its own), and make sure it has."""
        self._close()
        deadline = time.monotonic() + _STANDBY_EXIT_S
        while self._processes.alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._processes.alive(self.pid):  # still importing: it reads the socket only after its imports
            self._processes.signal(self.pid, signal.SIGKILL)
            self._processes.wait(self.pid)

    def _close(self) -> None:
        self._replies.close()
        self._socket.close()


def _planned_imports(plan: WarmStart, preimport: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The statements a standby runs ahead: the script's leading imports (read, never run here), then ``preimport``."""
    statements = []
    if not plan.is_module:
        try:
            source = Path(plan.target).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:  # the attempt reports an unreadable script itself
            logger.info("the standby imports only --preimport: cannot read %s (%s)", plan.target, err)
            source = ""
        statements = leading_imports(source)
    statements += [f"import {name}" for name in preimport]
    return [(statement, imported_roots(statement)) for statement in statements]


def _terminal_signals_group() -> bool:
    """Whether this process group is the foreground group of a terminal (whose Ctrl-C reaches every member)."""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:  # standard input is not a terminal
        return False


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def run_with_restarts(command: Sequence[str], options: RestartOptions | None = None) -> int:
    """Run ``command``; start it again after each failure, up to ``options.max_restarts`` times. Returns the exit
    status of the last attempt (``128 + N`` for a signal ``N``).

    A run that checkpoints with ``ResumableTrainer`` or ``ResumableAccelerator`` continues from its latest checkpoint
    in each new attempt, as after any restart by the same command. Each attempt has ``HF_RESUMABLE_RESTARTS`` set
    to the restarts before it.

    It is meant to be a process's main function, as in ``hf-resumable run``: while it runs it handles SIGTERM,
    SIGINT and SIGHUP, is a child subreaper (Linux), and reaps every child of this process that exits.

    Example:

    ```python
    >>> options = RestartOptions(max_restarts=5)
    >>> run_with_restarts(["python", "train.py", "--output_dir", "out"], options)  # doctest: +SKIP
    0
    ```
    """
    options = options or RestartOptions()
    command = list(command)
    if not command:
        raise ValueError("give the command to run, e.g. ['python', 'train.py']")
    plan, why = plan_warm_start(command) if options.warm else (None, "warm restarts are off")
    imports = _planned_imports(plan, options.preimport) if plan else []
    if options.warm and plan is None:
        logger.warning("restarts start a new interpreter: %s", why)
    fork = plan is not None and _become_subreaper()
    processes = _Processes()
    stopped: list[int] = []
    worker: int | None = None

    def forward(signum, frame):  # noqa: ARG001
        stopped.append(signum)
        if signum == signal.SIGINT and _terminal_signals_group():
            return  # the terminal sent this Ctrl-C to the attempt too: a second one would interrupt its handling
        if worker is not None:
            processes.signal(worker, signum)

    previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED}
    standby: _Standby | None = None
    restarts = 0
    env = {**os.environ, RESTARTS_ENV: "0"}
    env.pop(WARM_ENV, None)
    try:
        worker = processes.start(command, env=env)
        while True:
            if plan is not None and standby is None and restarts < options.max_restarts and not stopped:
                standby = _Standby(plan, imports, env, processes, fork=fork)
            returncode = processes.wait(worker)
            if returncode == 0 or stopped or restarts >= options.max_restarts:
                if returncode != 0 and not stopped:
                    logger.warning("the run failed (%s) after %d restart(s), the most allowed (--max-restarts)",
                                   _describe(returncode), restarts)
                return _exit_status(returncode)
            restarts += 1
            began = time.monotonic()
            worker, how = _next_attempt(standby, restarts, command, env, processes, why)
            if standby is not None and (worker == standby.pid or not processes.alive(standby.pid)):
                standby = None  # it became the attempt, or died: a new one starts at the top of the loop
            logger.warning("attempt %d ended (%s): restart %d of %d in %.2f s, %s", restarts, _describe(returncode),
                           restarts, options.max_restarts, time.monotonic() - began, how)
            if stopped:  # a signal that came while the attempt was being started
                processes.signal(worker, stopped[-1])
    finally:
        if standby is not None:
            standby.discard()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if fork:
            _become_subreaper(False)
        if worker is not None and processes.alive(worker):  # this process is being torn down (an exception)
            processes.signal(worker, signal.SIGKILL)
            processes.wait(worker)


def _next_attempt(standby: _Standby | None, restarts: int, command: list[str], env: dict[str, str],
                  processes: _Processes, why: str) -> tuple[int, str]:
    """Start attempt ``restarts + 1``: forked by the standby, else the standby itself, else a new interpreter."""
    if standby is not None:
        pid, refused = standby.fork(restarts)
        if pid is not None:
            return pid, "warm: forked by the standby interpreter, its imports done"
        if refused != "forking is off":
            logger.info("the standby did not fork (%s): it becomes the attempt itself", refused)
        pid = standby.go(restarts)
        if pid is not None:
            return pid, "warm: the standby interpreter runs it, its imports done"
        why = "the standby had exited"
    pid = processes.start(command, env={**env, RESTARTS_ENV: str(restarts)})
    return pid, f"a new interpreter ({why})"
