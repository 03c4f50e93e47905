"""Plain threads (usable during interpreter exit, when executors refuse work): a fan-out shared by the writer, the
reader and the verifier, and the serial daemon threads of background saves and deletions."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable


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


class SerialThread:
    """One daemon thread, started on first use (and again in a forked child), that runs submitted jobs in order;
    ``on_wake`` runs on it before it waits for a job and again before it runs one. A job keeps its own errors."""

    def __init__(self, name: str, *, on_wake: Callable[[], None] | None = None) -> None:
        self._name, self._on_wake = name, on_wake
        self._jobs: queue.Queue[Callable[[], None]] | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._jobs, self._pid = queue.Queue(), os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def is_current(self) -> bool:
        """Whether the caller runs on this thread."""
        return self._thread is threading.current_thread()

    def wait(self) -> None:
        """Block until every job this process submitted has run."""
        jobs = self._jobs
        if jobs is not None and self._pid == os.getpid():
            jobs.join()

    def _serve(self, jobs: queue.Queue[Callable[[], None]]) -> None:
        while True:
            if self._on_wake is not None:
                self._on_wake()
            job = jobs.get()
            try:
                if self._on_wake is not None:
                    self._on_wake()
                job()
            finally:
                jobs.task_done()
