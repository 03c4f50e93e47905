"""Plain-thread helpers shared by the writer, the reader and async saves: a fan-out, and per-thread CPU priority."""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

# Linux keeps a nice value per thread (``setpriority(PRIO_PROCESS, tid)``) and a thread inherits its creator's;
# elsewhere ``PRIO_PROCESS`` would renice the whole process, so priorities are left alone there.
_PER_THREAD_NICE = sys.platform.startswith("linux") and hasattr(os, "setpriority")


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


def lower_thread_priority(increment: int) -> tuple[int, int] | None:
    """Lower the calling thread's CPU priority by ``increment`` nice steps (at most to 19), for itself and every
    thread it starts from now on (they inherit it). Linux only; a no-op elsewhere or for ``increment <= 0``.

    Returns:
        `tuple[int, int] | None`: ``(before, after)`` nice values, for :func:`restore_thread_priorities`; ``None``
        if nothing changed.
    """
    if not _PER_THREAD_NICE or increment <= 0:
        return None
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        after = min(19, before + increment)
        if after == before:
            return None
        os.setpriority(os.PRIO_PROCESS, tid, after)
    except OSError as err:  # e.g. a seccomp profile that refuses it: the save runs at the normal priority
        logger.debug("Could not lower the priority of thread %d: %s", tid, err)
        return None
    return before, after


def restore_thread_priorities(change: tuple[int, int] | None) -> None:
    """Undo :func:`lower_thread_priority` for every thread of this process still at its lowered value (the thread
    and those it started), e.g. because the training loop now waits for them.

    Raising a priority again needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it; without either, the
    threads keep the lower priority (they still get every idle core).
    """
    if change is None or not _PER_THREAD_NICE:
        return
    before, after = change
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) == after:
                os.setpriority(os.PRIO_PROCESS, tid, before)
        except OSError:  # the thread ended, or raising a priority is not allowed here
            continue
