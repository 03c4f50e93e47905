"""A fan-out on plain threads, shared by the writer, the reader and the verifier."""

from __future__ import annotations

import threading


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
