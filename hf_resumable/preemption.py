"""Graceful preemption: turn SIGTERM into "finish this optimizer step, checkpoint, exit with a known code".

The signal handler only sets a flag (no IO, no locks: a handler can interrupt any Python bytecode,
including a half-written file). Both front doors run the same protocol at the end of every optimizer step:
:func:`agree_on_preemption` combines the flag over the ranks (one all-reduce, MAX over int32, so a signal that
reaches one rank makes every rank save the same step); they then save a checkpoint, wait for it to commit, and
:func:`exit_after_preemption` exits with :data:`PREEMPTION_EXIT_CODE`.

Send the signal to the training processes themselves (``torchrun`` forwards it to its ranks;
Kubernetes sends it to PID 1). ``DataLoader`` worker processes should not receive it: a worker that
dies of SIGTERM makes PyTorch abort the main process before it can save.

Example:

```python
>>> import os, signal
>>> from hf_resumable.preemption import PreemptionHandler
>>> handler = PreemptionHandler()
>>> with handler:
...     os.kill(os.getpid(), signal.SIGTERM)
...     handler.requested
True
```
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["PREEMPTION_EXIT_CODE", "PreemptionHandler", "agree_on_preemption", "exit_after_preemption"]

# Exit status of a process that stopped because of SIGTERM *after* committing a checkpoint:
# 128 + SIGTERM(15), the status schedulers (SLURM, Kubernetes) expect from a terminated job, so a
# requeue policy keyed on it keeps working. The log line "preempted: checkpoint ... committed" tells
# a clean preemption apart from a kill.
PREEMPTION_EXIT_CODE = 143


class PreemptionHandler:
    """Install a SIGTERM (and optionally other signals) handler that records the request and nothing else.

    Use as a context manager: the previous handlers are put back on exit. Outside the main thread
    signal handlers cannot be installed; the handler then stays inactive and says so with a WARNING.

    Args:
        signals (`tuple[int, ...]`, *optional*, defaults to `(signal.SIGTERM,)`): signals that request preemption.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only flag assignments here: no logging, no IO (the interrupted code may hold their locks).
        self.requested = True
        self.received = signum

    def install(self) -> "PreemptionHandler":
        """Start listening (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Not in the main thread: SIGTERM preemption handling is disabled for this run.")
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.uninstall()


def agree_on_preemption(handler: PreemptionHandler | None, *, device: Any, step: int) -> bool:
    """Whether any rank's ``handler`` received a preemption signal, the same answer on every rank: one all-reduce
    (MAX over int32, on ``device``: the process group's) under torch.distributed. Collective: every rank calls it at
    the same optimizer-step boundary ``step``."""
    requested = handler is not None and handler.requested
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() <= 1:
        return requested
    flag = torch.tensor([int(requested)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    agreed = bool(flag.item())
    if agreed and not requested:
        logger.warning("Rank %d: another rank received a preemption signal; saving step %d on every rank.",
                       torch.distributed.get_rank(), step)
    return agreed


def exit_after_preemption(handler: PreemptionHandler | None, *, checkpoint: str, step: int, exit: bool) -> None:
    """Log the committed preemption checkpoint, then exit with :data:`PREEMPTION_EXIT_CODE` when ``exit``.

    Raises:
        SystemExit: with :data:`PREEMPTION_EXIT_CODE`, when ``exit``.
    """
    received = handler.received if handler is not None else None
    logger.warning("Preempted (%s): checkpoint at step %d committed under %s%s.",
                   f"signal {received}" if received is not None else "signal received by another rank", step,
                   checkpoint, f"; exiting with {PREEMPTION_EXIT_CODE}" if exit else "")
    if exit:
        raise SystemExit(PREEMPTION_EXIT_CODE)
