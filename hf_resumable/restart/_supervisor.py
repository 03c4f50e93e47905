"""``hf-resumable run``: run a training command, and when its process dies, start it again at once.

The restart is what a preemption costs beside the work redone, and most of a restart is imports (torch and
transformers take 6-9 s on a small VM). So while an attempt trains, a **standby interpreter** (started with the
command's interpreter, options, directory and environment) has already executed the script's leading import
statements and waits. When the attempt's process dies, the standby becomes the next attempt: it runs the script as
``__main__`` with the same ``sys.argv``, and a new standby starts for the next failure. The run's own code (the
model, the data, the checkpoint loaded by ``ResumableTrainer``) starts fresh in each attempt, exactly as in a new
process: only import statements ran ahead. See :mod:`._standby` for what the standby does, and
:func:`~hf_resumable.restart._plan.plan_warm_start` for which commands qualify (others restart cold).

Stopping: SIGTERM, SIGINT and SIGHUP sent to this process are passed on to the running attempt, and no restart
follows; the exit status is the attempt's (``128 + N`` for a signal ``N``). An attempt that exits 0 ends the run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
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


class _Standby:
    """A standby interpreter and the pipe that tells it to run."""

    def __init__(self, plan: WarmStart, imports: list[tuple[str, list[str]]], env: dict[str, str]) -> None:
        path0 = os.getcwd() if plan.is_module else os.path.dirname(os.path.realpath(plan.target))
        document = json.dumps({"path0": path0, "imports": imports, "argv": plan.argv(), "target": plan.target,
                               "module": plan.is_module})
        read_end, self._go = os.pipe()
        try:
            self.process = subprocess.Popen(
                [plan.interpreter, *plan.options, str(_STANDBY_FILE), str(read_end), document],
                env=env, pass_fds=(read_end,))
        except BaseException:
            os.close(self._go)
            raise
        finally:
            os.close(read_end)

    def go(self, restarts: int) -> subprocess.Popen | None:
        """Make the standby the next attempt; ``None`` if it has died (the caller starts a new interpreter)."""
        try:
            if self.process.poll() is not None:
                return None
            os.write(self._go, f"go {restarts}\n".encode())
            return self.process
        except BrokenPipeError:
            return None
        finally:
            self._close()

    def discard(self) -> None:
        """Tell the standby it is not needed (it exits on its own), and make sure it has."""
        self._close()
        try:
            self.process.wait(timeout=_STANDBY_EXIT_S)
        except subprocess.TimeoutExpired:  # still importing: it reads the pipe only after its imports
            self.process.kill()
            self.process.wait()

    def _close(self) -> None:
        if self._go >= 0:
            os.close(self._go)
            self._go = -1


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
    stopped: list[int] = []
    worker: subprocess.Popen | None = None

    def forward(signum, frame):  # noqa: ARG001
        stopped.append(signum)
        if signum == signal.SIGINT and _terminal_signals_group():
            return  # the terminal sent this Ctrl-C to the attempt too: a second one would interrupt its handling
        if worker is not None and worker.poll() is None:
            worker.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED}
    standby: _Standby | None = None
    restarts = 0
    try:
        env = {**os.environ, RESTARTS_ENV: "0"}
        env.pop(WARM_ENV, None)
        worker = subprocess.Popen(command, env=env)
        while True:
            if plan is not None and standby is None and restarts < options.max_restarts and not stopped:
                standby = _Standby(plan, imports, {**env, RESTARTS_ENV: "0"})
            returncode = worker.wait()
            if returncode == 0 or stopped or restarts >= options.max_restarts:
                if returncode != 0 and not stopped:
                    logger.warning("the run failed (%s) after %d restart(s), the most allowed (--max-restarts)",
                                   _describe(returncode), restarts)
                return _exit_status(returncode)
            restarts += 1
            began = time.monotonic()
            warm = standby.go(restarts) if standby is not None else None
            standby = None
            if warm is not None:
                worker = warm
                how = "warm: the standby interpreter runs it, its imports done"
            else:
                worker = subprocess.Popen(command, env={**env, RESTARTS_ENV: str(restarts)})
                how = f"a new interpreter ({why or 'the standby had exited'})"
            logger.warning("attempt %d ended (%s): restart %d of %d in %.2f s, %s", restarts, _describe(returncode),
                           restarts, options.max_restarts, time.monotonic() - began, how)
            if stopped and worker.poll() is None:  # a signal that came while the attempt was being started
                worker.send_signal(stopped[-1])
    finally:
        if standby is not None:
            standby.discard()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if worker is not None and worker.poll() is None:  # this process is being torn down (an exception)
            worker.kill()
            worker.wait()
