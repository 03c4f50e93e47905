"""BackgroundUploader: the one queue of background uploads, for the Hub and for object stores alike.

A checkpoint is pushed in submission order, never skipped; failed attempts are retried with exponential
backoff while the error is transient; a checkpoint is *confirmed* only once its push returned (the remote
copy is committed) and *pending* until then (also after a final failure), so local retention can keep
everything that is not safely remote. A final failure is raised once, by the next ``submit`` or ``wait``.

Example:

```python
>>> from pathlib import Path
>>> pushed = []
>>> with BackgroundUploader(lambda path: pushed.append(path.name) or f"remote/{path.name}", name="demo") as up:
...     up.submit("out/checkpoint-1")
...     up.wait()
['remote/checkpoint-1']
>>> pushed
['checkpoint-1']

```
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..errors import HfResumableError, UploadTimeoutError

logger = logging.getLogger(__name__)

__all__ = ["BackgroundUploader"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Job:
    path: Path
    options: dict[str, Any] = field(default_factory=dict)


class BackgroundUploader(Generic[T]):
    """Run ``push(path, **options)`` for every submitted checkpoint on one background thread.

    Args:
        push (`Callable[..., T]`): uploads one committed local checkpoint; returns where it landed.
        name (`str`): where the uploads go, for messages (``"me/run"``, ``"s3://bucket/run"``).
        is_retryable (`Callable[[BaseException], bool]`, *optional*): which failures are transient (default:
            ``OSError``, ``ConnectionError``, ``TimeoutError``).
        error_type (`type[HfResumableError]`, *optional*): the type final failures are raised as.
        max_retries (`int`, *optional*, defaults to `5`): retries per checkpoint after the first attempt.
        base_delay (`float`, *optional*, defaults to `1.0`): first backoff in seconds (doubled each retry).
        max_delay (`float`, *optional*, defaults to `60.0`): backoff cap in seconds.

    Raises:
        ValueError: for negative retries or delays, or ``max_delay < base_delay``.
    """

    def __init__(self, push: Callable[..., T], *, name: str,
                 is_retryable: Callable[[BaseException], bool] | None = None,
                 error_type: type[HfResumableError] = HfResumableError, max_retries: int = 5,
                 base_delay: float = 1.0,
                 max_delay: float = 60.0) -> None:
        if max_retries < 0 or base_delay < 0 or max_delay < base_delay:
            raise ValueError(f"Need max_retries >= 0 and 0 <= base_delay <= max_delay, got {max_retries}, "
                             f"{base_delay}, {max_delay}.")
        self.name = name
        self._push = push
        self._is_retryable = is_retryable or (lambda err: isinstance(err, (OSError, ConnectionError, TimeoutError)))
        self._error_type = error_type
        self.max_retries, self.base_delay, self.max_delay = max_retries, base_delay, max_delay
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending: dict[Path, None] = {}  # resolved paths, in submission order
        self._results: dict[Path, T] = {}
        self._errors: list[BaseException] = []
        self._unfinished = 0
        self._thread: threading.Thread | None = threading.Thread(target=self._run, daemon=True,
                                                                 name=f"hf_resumable-upload-{name}")
        self._thread.start()

    # ---- the caller's side
    def submit(self, local_dir: str | os.PathLike, **options: Any) -> None:
        """Queue one committed local checkpoint (``options`` go to ``push``).

        Raises:
            the ``error_type``: if an earlier upload failed for good (raised once, then cleared), or after
                :meth:`close`.
        """
        self._raise_failures()
        path = Path(local_dir).resolve()
        with self._lock:
            if self._thread is None:
                raise self._error_type(f"The uploader to {self.name} is closed; create a new one to upload more.")
            self._pending[path] = None
            self._unfinished += 1
        self._queue.put(_Job(path, options))

    def wait(self, timeout: float | None = None) -> list[T]:
        """Block until every queued upload finished; return what ``push`` returned for every confirmed checkpoint,
        in the order they were confirmed.

        Raises:
            UploadTimeoutError: if ``timeout`` seconds passed first (also a ``TimeoutError``).
            the ``error_type``: if an upload failed for good.
        """
        with self._lock:
            if not self._lock.wait_for(lambda: self._unfinished == 0, timeout=timeout):
                raise UploadTimeoutError(f"Uploads to {self.name}: {self._unfinished} still running after "
                                         f"{timeout} s; they continue in the background.")
        self._raise_failures()
        return list(self.results().values())

    def pending(self) -> set[Path]:
        """Local checkpoints (resolved paths) submitted but not confirmed, including failed ones."""
        with self._lock:
            return set(self._pending)

    def confirmed(self) -> set[Path]:
        """Local checkpoints (resolved paths) whose upload is committed remotely."""
        with self._lock:
            return set(self._results)

    def results(self) -> dict[Path, T]:
        """Confirmed checkpoints and what ``push`` returned for each, in the order they were confirmed."""
        with self._lock:
            return dict(self._results)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker (after draining the queue when ``wait``); later submits raise."""
        if wait:
            with self._lock:
                self._lock.wait_for(lambda: self._unfinished == 0)
        self._queue.put(None)
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def __enter__(self) -> BackgroundUploader[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=True)

    def _raise_failures(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    # ---- the worker's side
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                result = self._push_with_retries(job)
            except Exception as err:  # noqa: BLE001 - raised in the caller's thread by submit()/wait()
                self._record_failure(job, err)
            else:
                with self._lock:
                    self._pending.pop(job.path, None)
                    self._results[job.path] = result
            finally:
                with self._lock:
                    self._unfinished -= 1
                    self._lock.notify_all()

    def _record_failure(self, job: _Job, err: Exception) -> None:
        if not isinstance(err, self._error_type):
            wrapped = self._error_type(f"Uploading {job.path} to {self.name} failed ({type(err).__name__}: {err}); "
                                       "it stays pending. Fix the cause and submit it again.")
            wrapped.__cause__ = err
            err = wrapped
        logger.warning("%s", err)
        with self._lock:
            self._errors.append(err)

    def _push_with_retries(self, job: _Job) -> T:
        attempt = 0
        while True:
            try:
                return self._push(job.path, **job.options)
            except Exception as err:
                if not self._is_retryable(err):
                    raise
                if attempt >= self.max_retries:
                    raise self._error_type(
                        f"Uploading {job.path} to {self.name} failed after {attempt + 1} attempts ({err!r}); it stays "
                        "pending. Submit it again once the remote is reachable.") from err
                delay = min(self.max_delay, self.base_delay * 2**attempt)
                logger.warning("Upload of %s to %s failed (%r); retry %d/%d in %.1f s", job.path, self.name, err,
                               attempt + 1, self.max_retries, delay)
                time.sleep(delay)
                attempt += 1
