"""Graceful preemption: turn SIGTERM into "finish this optimizer step, checkpoint, exit with a known code".

The signal handler only sets a flag and notes the time (no IO, no locks: a handler can interrupt any bytecode, a
half-written file included). At every optimizer-step boundary both front doors call
:meth:`PreemptionProtocol.at_step_boundary`, which agrees across ranks (one all-reduce, MAX) and returns a
:class:`PreemptionAction`; with a notice, :func:`fits_another_step` decides whether to train on. The rule and where
to send the signal: docs/trainer.md#the-preemption-notice.

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

import enum
import logging
import math
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import FrameType, TracebackType
from typing import Any

import torch

from .distributed import settle

logger = logging.getLogger(__name__)

__all__ = ["NOTICE_MARGIN_S", "NOTICE_MARGIN_SHARE", "NOTICE_SAFETY_FACTOR", "PREEMPTION_EXIT_CODE",
           "PreemptionAction", "PreemptionHandler", "PreemptionProtocol", "check_notice", "exit_after_preemption",
           "fits_another_step"]

# Exit status of a process that stopped because of SIGTERM *after* committing a checkpoint:
# 128 + SIGTERM(15), the status schedulers (SLURM, Kubernetes) expect from a terminated job, so a
# requeue policy keyed on it keeps working. The log line "preempted: checkpoint ... committed" tells
# a clean preemption apart from a kill.
PREEMPTION_EXIT_CODE = 143

# The notice rule (fits_another_step): the time left must hold this many times a step plus the final save...
NOTICE_SAFETY_FACTOR = 1.5
# ...plus this margin (slack for the estimates and the ranks' agreement): the larger of these two.
NOTICE_MARGIN_S = 1.0
NOTICE_MARGIN_SHARE = 0.1
_STEP_WINDOW = 16  # recent step durations kept for the step-time estimate


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
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only assignments here: no logging, no IO (the interrupted code may hold their locks).
        if self.received_at is None:
            self.received_at = time.monotonic()
        self.requested = True
        self.received = signum

    def reset(self) -> None:
        """Forget a signal received before (a new ``train()`` starts)."""
        self.requested, self.received, self.received_at = False, None, None

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


def check_notice(notice: Any) -> float | None:
    """``notice`` as seconds (``None``: no notice).

    Raises:
        ValueError: ``notice`` is not ``None`` nor a positive, finite number of seconds.
    """
    if notice is None:
        return None
    if isinstance(notice, bool) or not isinstance(notice, (int, float)) or not math.isfinite(notice) or notice <= 0:
        raise ValueError(f"preemption_notice must be a positive number of seconds (the time from SIGTERM to SIGKILL, "
                         f"e.g. Kubernetes' terminationGracePeriodSeconds) or None, got {notice!r}.")
    return float(notice)


def fits_another_step(*, time_left_s: float, step_s: float, save_s: float, notice_s: float) -> bool:
    """The notice rule, PURE: whether another step and a final save fit in ``time_left_s``, with a margin.

    ``time_left_s >= NOTICE_SAFETY_FACTOR * (step_s + save_s) + max(NOTICE_MARGIN_S, NOTICE_MARGIN_SHARE *
    notice_s)``.

    Example:

    ```python
    >>> fits_another_step(time_left_s=20.0, step_s=0.5, save_s=3.0, notice_s=30.0)  # needs 1.5 x 3.5 + 3 s
    True
    >>> fits_another_step(time_left_s=8.0, step_s=0.5, save_s=3.0, notice_s=30.0)
    False
    ```
    """
    margin = max(NOTICE_MARGIN_S, NOTICE_MARGIN_SHARE * notice_s)
    return time_left_s >= NOTICE_SAFETY_FACTOR * (step_s + save_s) + margin


class PreemptionAction(enum.Enum):
    """What every rank does at a step boundary (:meth:`PreemptionProtocol.at_step_boundary`)."""

    TRAIN = "train"  # no signal, or the notice leaves time: train on
    SAVE_AND_TRAIN = "save and train"  # the first boundary after a signal, with a notice: checkpoint, train on
    SAVE_AND_EXIT = "save and exit"  # save this step, wait for its commit, exit
    EXIT = "exit"  # this step's checkpoint is already written or being written: wait for its commit, exit

    @property
    def saves(self) -> bool:
        """Whether the front door saves the current step."""
        return self in (PreemptionAction.SAVE_AND_TRAIN, PreemptionAction.SAVE_AND_EXIT)

    @property
    def exits(self) -> bool:
        """Whether the front door stops training (and exits, with ``exit_on_preemption``)."""
        return self in (PreemptionAction.SAVE_AND_EXIT, PreemptionAction.EXIT)


# What a rank proposes at a step boundary, combined with MAX: the most urgent proposal wins.
_NO_SIGNAL, _IN_NOTICE, _STOP = 0, 1, 2


class PreemptionProtocol:
    """The preemption protocol of both front doors, run by every rank at every optimizer-step boundary.

    Args:
        handler (`PreemptionHandler`, *optional*): this process's signal flag (``None``: never preempted).
        notice (`float`, *optional*): seconds from SIGTERM to SIGKILL. ``None``: save the signal's step and exit at
            once. With a notice, the rule is :func:`fits_another_step`.
        clock (`Callable[[], float]`, *optional*, defaults to `time.monotonic`): the clock the notice is timed with
            (the handler's ``received_at`` is ``time.monotonic()``).

    Raises:
        ValueError: ``notice`` is not a positive number of seconds.

    Example:

    ```python
    >>> import torch
    >>> protocol = PreemptionProtocol(PreemptionHandler(), notice=None)
    >>> protocol.at_step_boundary(device=torch.device("cpu"), step=1)
    <PreemptionAction.TRAIN: 'train'>
    ```
    """

    def __init__(self, handler: PreemptionHandler | None, *, notice: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handler = handler
        self.notice = check_notice(notice)
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """Start over (a new ``train()``): no signal, no step measured."""
        if self.handler is not None:
            self.handler.reset()
        self.signalled_at: float | None = None  # when this rank's notice started (clock); None: no signal agreed
        self.saved_step: int | None = None  # the step of the notice checkpoint
        self._steps: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._last: tuple[int, float] | None = None  # (step, clock) of the previous boundary
        self._stall = 0.0  # seconds of the previous boundary's save that ended up in this step's interval
        self._save_started: float | None = None
        self._save_done: float | None = None

    @property
    def signalled(self) -> bool:
        """Whether the ranks have agreed that a preemption signal came (and, with a notice, train on inside it)."""
        return self.signalled_at is not None

    def at_step_boundary(self, *, device: Any, step: int) -> PreemptionAction:
        """What to do at the end of optimizer step ``step``, the same answer on every rank.

        Collective under torch.distributed: every rank calls it at the same boundaries (one all-reduce of one int32
        on ``device``, the process group's).
        """
        now = self.clock()
        self._time_step(step, now)
        agreed = _all_reduce_max(self._proposal(step, now), device)
        if agreed == _NO_SIGNAL:
            return PreemptionAction.TRAIN
        if not self.signalled:
            self._note_signal(step, now)
        if agreed == _STOP:
            return PreemptionAction.EXIT if step == self.saved_step else PreemptionAction.SAVE_AND_EXIT
        if self.saved_step is None:
            self.saved_step = step
            logger.warning("Preemption signal: checkpointing step %d and training on within the %.0f s notice while "
                           "another step and a final save fit.", step, self.notice)
            return PreemptionAction.SAVE_AND_TRAIN
        return PreemptionAction.TRAIN

    def notice_saved(self, *, started: float, future: Future | None) -> None:
        """Time the notice checkpoint, saved since ``started`` (``clock()`` before the save call): done now for a
        blocking save (``future=None``), when ``future`` is for a background one."""
        now = self.clock()
        self._save_started, self._stall = started, now - started
        if future is None:
            self._save_done = now
        else:
            future.add_done_callback(lambda _: setattr(self, "_save_done", self.clock()))

    def estimates(self, now: float) -> tuple[float, float]:
        """The step time and the final save's duration the notice rule uses at ``now``."""
        step = max(statistics.median(self._steps), self._steps[-1]) if self._steps else 0.0
        if self._save_started is None:
            return step, 0.0
        if self._save_done is not None:
            return step, self._save_done - self._save_started
        return step, 3 * (now - self._save_started)

    def _time_step(self, step: int, now: float) -> None:
        if self._last is not None and step > self._last[0]:
            seconds = (now - self._last[1] - self._stall) / (step - self._last[0])
            self._steps.append(max(seconds, 0.0))
            self._stall = 0.0
        if self._last is None or step > self._last[0]:
            self._last = (step, now)

    def _proposal(self, step: int, now: float) -> int:
        signalled = self.signalled or (self.handler is not None and self.handler.requested)
        if not signalled:
            return _NO_SIGNAL
        if self.notice is None:
            return _STOP
        if self.saved_step is None or step == self.saved_step:
            return _IN_NOTICE  # the notice checkpoint is (being) saved first
        started = self.signalled_at if self.signalled_at is not None else now
        step_s, save_s = self.estimates(now)
        time_left = started + self.notice - now
        fits = fits_another_step(time_left_s=time_left, step_s=step_s, save_s=save_s, notice_s=self.notice)
        logger.debug("Preemption notice: %.1f s left after step %d (a step %.2f s, the final save %.2f s): %s.",
                     time_left, step, step_s, save_s, "training on" if fits else "saving and exiting")
        return _IN_NOTICE if fits else _STOP

    def _note_signal(self, step: int, now: float) -> None:
        received = self.handler.received_at if self.handler is not None and self.handler.requested else None
        self.signalled_at = received if received is not None else now
        if received is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            logger.warning("Rank %d: another rank received a preemption signal; saving step %d on every rank%s.",
                           rank, step, "" if self.notice is None else " and training on within the notice")


def _all_reduce_max(value: int, device: Any) -> int:
    """``value`` combined over the ranks with MAX (one all-reduce of an int32 on ``device``); itself alone."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() <= 1:
        return value
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    settle(flag)  # the agreement may be a process's last collective before it exits
    return int(flag.item())


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
