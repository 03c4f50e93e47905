"""Plain-thread helpers shared by the writer, the reader and async saves: a fan-out, and per-thread CPU priority and
scheduling policy."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NamedTuple

logger = logging.getLogger(__name__)

# Linux keeps a nice value per thread (``setpriority(PRIO_PROCESS, tid)``) and a thread inherits its creator's;
# elsewhere ``PRIO_PROCESS`` would renice the whole process, so priorities are left alone there.
_PER_THREAD_NICE = sys.platform.startswith("linux") and hasattr(os, "setpriority")
# Linux's scheduling policy is per thread as well (``sched_setscheduler(0, ...)`` sets the calling thread's).
_PER_THREAD_POLICY = sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")


def run_in_threads(fn, items: list, *, workers: int) -> list:
    """``[fn(item) for item in items]`` on up to ``workers`` plain threads (usable during interpreter exit,
    when executors refuse work); the first exception is re-raised after every thread has stopped."""
    results: list = [None] * len(items)
    errors: list[BaseException] = []
    cursor = iter(range(len(items)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(cursor, None)
                if index is None or errors:
                    return
            try:
                results[index] = fn(items[index])
            except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
                with lock:
                    errors.append(err)

    threads = [threading.Thread(target=worker, name="hf_resumable-io") for _ in range(min(workers, len(items)) - 1)]
    for thread in threads:
        thread.start()
    worker()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class Lowering(NamedTuple):
    """What :func:`lower_thread_priority` changed, for :func:`restore_thread_priorities`."""

    base: int  # the main thread's nice value
    lowered: int  # the nice value set (``base`` itself when the process already runs at 19)
    policy: int | None  # the policy that ``SCHED_IDLE`` replaced; ``None`` if the policy was left alone


def lower_thread_priority(increment: int) -> Lowering | None:
    """Run the calling thread ``increment`` nice steps below the process's main thread, and every thread it starts
    from now on (they inherit it). Linux only; a no-op elsewhere or for ``increment <= 0``.

    The base is the main thread's nice value, not the caller's own, so that a thread whose priority could not be
    raised again (see :func:`restore_thread_priorities`) is not lowered further at every call. Nice values stop at
    19: where that leaves less than half of ``increment`` below the base (a job started with ``nice -n 15`` or more),
    the thread also moves to Linux's ``SCHED_IDLE`` policy, which runs below every nice value: with the training
    process already at nice 19, a nice value alone cannot put the writer below it, and training steps would wait for
    a core while a save is written (docs/benchmarks.md, ``bench_goodput.py --inflation-only``). Not sooner: where
    nice values still separate the two, ``SCHED_IDLE`` starves the writer so much that later saves wait for it.

    Returns:
        `Lowering | None`: what changed, for :func:`restore_thread_priorities`; ``None`` if nothing did.
    """
    if not _PER_THREAD_NICE or increment <= 0:
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
    decides that), but its wake-ups no longer preempt the thread that is running. Inherited by the threads it starts.

    For the threads an async save wakes as its call returns (the staging helpers, the saver's thread): woken at the
    normal policy on a busy machine, they preempt the training thread in the last microseconds of the call, which then
    waits a whole scheduling slice to return. Under ``SCHED_BATCH`` they no longer preempt it, so the call returns
    sooner, with the same next step (docs/benchmarks.md).
    Moving between the normal and the batch policy needs no privilege; a refusal (a seccomp profile) is logged at
    debug and changes nothing. A no-op elsewhere than Linux.

    Returns:
        `bool`: whether the calling thread now runs under ``SCHED_BATCH``.
    """
    if not _PER_THREAD_POLICY:
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as err:
        logger.debug("Could not set SCHED_BATCH for thread %d: %s", threading.get_native_id(), err)
        return False
    return True
