"""The package's tuning: every mechanism that exists only to be faster, each behind one switch read here.

A switch is an ``HF_RESUMABLE_*`` environment variable, read at the call (never at import, so a process may change
it between saves) and validated: a value that is not understood raises ``ValueError`` naming the variable. Each was
kept because a benchmark in ``benchmarks/`` showed that it helps: docs/performance.md lists them with their defaults,
docs/benchmarks.md#tuning-switches has the measurements and their commands.

Example:

```python
>>> TuningOptions(read_streams=2, writer_priority=False).background_deletes
True
```
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .format._libc import linux_madvise

logger = logging.getLogger(__name__)

__all__ = ["TuningOptions", "tuning_options", "read_streams", "default_read_streams", "READ_WORKERS",
           "WRITER_NICE_INCREMENT", "Lowering", "lower_thread_priority", "restore_thread_priorities",
           "defer_to_running_threads", "READ_STREAMS_ENV", "WRITER_PRIORITY_ENV",
           "BACKGROUND_DELETES_ENV", "SPLIT_REPLICAS_ENV", "PREFAULT_ENV", "Prefault", "view_address"]

READ_STREAMS_ENV = "HF_RESUMABLE_READ_STREAMS"
WRITER_PRIORITY_ENV = "HF_RESUMABLE_WRITER_PRIORITY"
BACKGROUND_DELETES_ENV = "HF_RESUMABLE_BACKGROUND_DELETES"
SPLIT_REPLICAS_ENV = "HF_RESUMABLE_SPLIT_REPLICAS"
PREFAULT_ENV = "HF_RESUMABLE_PREFAULT"

# Most read streams by default (all files share them).
READ_WORKERS = 4
# Nice steps by which a background write runs below the training thread (Linux, per thread).
WRITER_NICE_INCREMENT = 10


@dataclass(frozen=True, kw_only=True)
class TuningOptions:
    """The switches, as read from the environment by :func:`tuning_options`."""

    read_streams: int | None = None  # ``HF_RESUMABLE_READ_STREAMS``; ``None``: :func:`default_read_streams`
    writer_priority: bool = True  # ``HF_RESUMABLE_WRITER_PRIORITY``
    background_deletes: bool = True  # ``HF_RESUMABLE_BACKGROUND_DELETES``
    split_replicas: bool = True  # ``HF_RESUMABLE_SPLIT_REPLICAS``
    prefault: bool = True  # ``HF_RESUMABLE_PREFAULT``

    def __post_init__(self) -> None:
        if self.read_streams is not None and self.read_streams < 1:
            raise ValueError(f"{READ_STREAMS_ENV}={self.read_streams}: expected the number of read streams, an "
                             "integer >= 1.")


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1 (on, the default) or 0 (off).")


def _on(name: str) -> bool:
    """:func:`_flag` for the background threads, which must not fail: a value it refuses counts as on (the default);
    the caller's thread refused it already (an async save calls :func:`tuning_options` before it starts)."""
    try:
        return _flag(name)
    except ValueError:
        return True


def _count(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected the number of read streams, an integer >= 1.")
    return int(value)


def tuning_options() -> TuningOptions:
    """The switches as the environment sets them now.

    Raises:
        ValueError: a switch holds a value it does not take (the message names the variable).
    """
    return TuningOptions(read_streams=_count(READ_STREAMS_ENV), writer_priority=_flag(WRITER_PRIORITY_ENV),
                         background_deletes=_flag(BACKGROUND_DELETES_ENV), split_replicas=_flag(SPLIT_REPLICAS_ENV),
                         prefault=_flag(PREFAULT_ENV))


# ------------------------------------------------------------------------------------------------ read streams
def read_streams() -> int:
    """Reads a load keeps in flight: ``HF_RESUMABLE_READ_STREAMS`` when set, else :func:`default_read_streams`.

    Raises:
        ValueError: ``HF_RESUMABLE_READ_STREAMS`` is not an integer >= 1.
    """
    streams = _count(READ_STREAMS_ENV)
    return streams if streams is not None else default_read_streams(_usable_cores())


def default_read_streams(cores: int) -> int:
    """Read streams for a process that may run on ``cores`` cores: one per two, at least 1, at most ``READ_WORKERS``.
    Each stream copies and hashes at memory speed, so it needs a core; more streams than that only take a larger
    share of a busy machine.

    Example:
        >>> [default_read_streams(n) for n in (1, 2, 3, 4, 8, 64)]
        [1, 1, 1, 2, 4, 4]
    """
    return max(1, min(READ_WORKERS, cores // 2))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------------ prefaulting
# madvise(2) advice that faults in a range's pages writable without changing their contents (Linux >= 5.14).
_MADV_POPULATE_WRITE = 23
_MADVISE = linux_madvise()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Less new memory than this is not worth a thread; larger ranges are faulted in (and handed over) in steps of this.
PREFAULT_MIN_BYTES = 64 << 20
PREFAULT_STEP_BYTES = 8 << 20


def view_address(view: memoryview) -> int:
    """The address of a writable, contiguous, non-empty byte view's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Prefault:
    """Fault in a load's new memory on a helper thread, in the order the load fills it. A process's new pages are
    zeroed by the kernel on their first touch, which in a fresh process's load (new optimizer state) costs about as
    long as the read itself; done on another core, it overlaps with the reads. ``HF_RESUMABLE_PREFAULT`` (on by
    default; Linux >= 5.14: ``MADV_POPULATE_WRITE``, which never changes the contents).

    A step of the memory goes to whichever of the two reaches it first: a reader calls :func:`Prefault.claim` with
    the view it is about to fill, which waits only while a helper is faulting in that very step; the helper skips
    what a reader claimed. Use as a context manager: the helper stops (at the step in progress) on exit, before the
    memory may be freed.
    """

    _active: list[Prefault] = []
    _registry = threading.Lock()

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._steps: list[tuple[int, int]] = []
        for address, nbytes in ranges:  # the whole pages inside each range; a reader touches the rest itself
            first, end = -(-address // _PAGE) * _PAGE, (address + nbytes) // _PAGE * _PAGE
            self._steps += [(at, min(PREFAULT_STEP_BYTES, end - at)) for at in range(first, end, PREFAULT_STEP_BYTES)]
        self._starts = sorted((at, index) for index, (at, _) in enumerate(self._steps))
        self._taken = [False] * len(self._steps)
        self._busy: int | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, ranges: Sequence[tuple[int, int]]) -> Prefault:
        """A helper over the ``(address, nbytes)`` ranges of new memory, in fill order; it does nothing where it is
        switched off, not available, or the ranges are too small to be worth it."""
        prefault = cls(ranges)
        nbytes = sum(n for _, n in prefault._steps)
        if _MADVISE is not None and nbytes >= PREFAULT_MIN_BYTES and _flag(PREFAULT_ENV):
            with cls._registry:
                cls._active.append(prefault)
            logger.debug("Faulting in %d MiB of new memory on a helper thread", nbytes >> 20)
            prefault._thread = threading.Thread(target=prefault._run, name="hf_resumable-prefault", daemon=True)
            prefault._thread.start()
        return prefault

    def __enter__(self) -> Prefault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        for index, (address, nbytes) in enumerate(self._steps):
            with self._changed:
                if self._taken[index]:
                    continue
                self._taken[index], self._busy = True, index
            failed = _MADVISE(address, nbytes, _MADV_POPULATE_WRITE) != 0
            with self._changed:
                self._busy = None
                self._changed.notify_all()
            if failed:  # a kernel without the advice (EINVAL), or no memory left: the readers fault them in
                logger.debug("Prefaulting stopped: madvise errno %d", ctypes.get_errno())
                return

    @classmethod
    def claim(cls, view: memoryview) -> None:
        """A reader is about to fill ``view``: the steps of running helpers that it overlaps are its own from now,
        once no helper is faulting one of them in."""
        if not cls._active or not len(view):
            return
        address = view_address(view)
        for prefault in list(cls._active):
            prefault._claim(address, address + len(view))

    def _claim(self, start: int, end: int) -> None:
        first = max(bisect.bisect_right(self._starts, (start, len(self._steps))) - 1, 0)
        with self._changed:
            for position in range(first, len(self._starts)):
                index = self._starts[position][1]
                step_start, nbytes = self._steps[index]
                if step_start >= end:
                    break
                if step_start + nbytes > start:
                    self._taken[index] = True
                    while self._busy == index:
                        self._changed.wait()

    def stop(self) -> None:
        """Stop at the step in progress and wait for the helper."""
        if self._thread is None:
            return
        with self._changed:
            self._taken = [True] * len(self._steps)
        self._thread.join()
        with self._registry:
            self._active.remove(self)
        self._thread = None


# ------------------------------------------------------------------------------------------- thread priorities
# Linux keeps a nice value per thread (``setpriority(PRIO_PROCESS, tid)``) and a thread inherits its creator's;
# elsewhere ``PRIO_PROCESS`` would renice the whole process, so priorities are left alone there.
_PER_THREAD_NICE = sys.platform.startswith("linux") and hasattr(os, "setpriority")
# Linux's scheduling policy is per thread as well (``sched_setscheduler(0, ...)`` sets the calling thread's).
_PER_THREAD_POLICY = sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")


class Lowering(NamedTuple):
    """What :func:`lower_thread_priority` changed, for :func:`restore_thread_priorities`."""

    base: int  # the main thread's nice value
    lowered: int  # the nice value set (``base`` itself when the process already runs at 19)
    policy: int | None  # the policy that ``SCHED_IDLE`` replaced; ``None`` if the policy was left alone


def lower_thread_priority(increment: int = WRITER_NICE_INCREMENT) -> Lowering | None:
    """Run the calling thread ``increment`` nice steps below the process's main thread, and every thread it starts
    from now on (they inherit it). Linux only; a no-op elsewhere, for ``increment <= 0`` or with
    ``HF_RESUMABLE_WRITER_PRIORITY=0``.

    The base is the main thread's nice value, not the caller's own, so that a thread whose priority could not be
    raised again (see :func:`restore_thread_priorities`) is not lowered further at every call. Nice values stop at
    19: where that leaves less than half of ``increment`` below the base (a job started with ``nice -n 15`` or more),
    the thread also moves to Linux's ``SCHED_IDLE`` policy, which runs below every nice value. Not sooner: where nice
    values still separate the two, ``SCHED_IDLE`` starves the writer so much that later saves wait for it.

    Returns:
        `Lowering | None`: what changed, for :func:`restore_thread_priorities`; ``None`` if nothing did.
    """
    if not _PER_THREAD_NICE or increment <= 0 or not _on(WRITER_PRIORITY_ENV):
        return None
    tid = threading.get_native_id()
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's (on Linux the pid is its tid)
        lowered = min(19, base + increment)
        if lowered > base and os.getpriority(os.PRIO_PROCESS, tid) != lowered:
            os.setpriority(os.PRIO_PROCESS, tid, lowered)
    except OSError as err:  # e.g. a seccomp profile that refuses it: the save runs at the priority it has
        logger.debug("Could not lower the priority of thread %d: %s", tid, err)
        return None
    policy = _idle(tid) if 2 * (lowered - base) < increment else None
    if lowered == base and policy is None:
        return None
    return Lowering(base, lowered, policy)


def _idle(tid: int) -> int | None:
    """Move the calling thread to ``SCHED_IDLE``; the policy it replaced, or ``None`` (already idle, refused, or not
    Linux)."""
    if not _PER_THREAD_POLICY or not hasattr(os, "SCHED_IDLE"):
        return None
    try:
        policy = os.sched_getscheduler(0)
        if policy == os.SCHED_IDLE:  # lowered by an earlier call and never restored (no privilege to)
            return None
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as err:
        logger.debug("Could not set SCHED_IDLE for thread %d: %s", tid, err)
        return None
    return policy


def restore_thread_priorities(change: Lowering | None) -> None:
    """Undo :func:`lower_thread_priority` for every thread of this process still at its lowered value (the thread
    and those it started), e.g. because the training loop now waits for them.

    Raising a priority again (or leaving ``SCHED_IDLE``) needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it;
    without either, the threads keep the lower priority (they still get every idle core).
    """
    if change is None or not _PER_THREAD_NICE:
        return
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != change.lowered:
                continue
            if change.policy is not None and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, change.policy, os.sched_param(0))
            if change.lowered != change.base:
                os.setpriority(os.PRIO_PROCESS, tid, change.base)
        except ProcessLookupError:  # the thread ended
            continue
        except OSError as err:  # raising a priority is not allowed here: the thread keeps the lower one
            logger.debug("Could not restore the priority of thread %d: %s", tid, err)


def defer_to_running_threads() -> bool:
    """Put the calling thread under Linux's ``SCHED_BATCH`` policy: it keeps its CPU share (its nice value still
    decides that), but its wake-ups no longer preempt the thread that is running; inherited by the threads it starts.
    For the saver's thread, woken as an async save's call returns: at the normal policy on a busy machine it would
    preempt the training thread in the last microseconds of the call. Part of ``HF_RESUMABLE_WRITER_PRIORITY``: with
    ``0`` the thread goes back to the normal policy.

    Moving between the normal and the batch policy needs no privilege; a refusal (a seccomp profile) is logged at
    debug and changes nothing. A no-op elsewhere than Linux.

    Returns:
        `bool`: whether the calling thread now runs under ``SCHED_BATCH``.
    """
    if not _PER_THREAD_POLICY:
        return False
    wanted = os.SCHED_BATCH if _on(WRITER_PRIORITY_ENV) else os.SCHED_OTHER
    try:
        policy = os.sched_getscheduler(0)
        if policy != wanted and policy in (os.SCHED_BATCH, os.SCHED_OTHER):
            os.sched_setscheduler(0, wanted, os.sched_param(0))
    except OSError as err:
        logger.debug("Could not set the scheduling policy of thread %d: %s", threading.get_native_id(), err)
        return False
    return wanted == os.SCHED_BATCH
