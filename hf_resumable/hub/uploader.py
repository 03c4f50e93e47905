"""CheckpointUploader: queued, retried background pushes of committed checkpoints."""


from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub.errors import HfHubHTTPError

from ..errors import HubError
from .checkpoints import PushedCheckpoint, push_checkpoint

logger = logging.getLogger(__name__)



# --------------------------------------------------------------------------------------------------- background upload
def _is_retryable(err: BaseException) -> bool:
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        return status is None or status >= 500 or status in (408, 429)
    return isinstance(err, (httpx2.TransportError, ConnectionError, TimeoutError))


@dataclass(frozen=True)
class _UploadJob:
    path: Path
    kwargs: dict[str, Any] = field(default_factory=dict)


class CheckpointUploader:
    """Push committed checkpoints to the Hub from a background thread, in submission order, never skipping one.

    Failed attempts are retried with exponential backoff on 5xx, 408/429 and connection errors. A checkpoint is in
    :meth:`confirmed` only after its commit exists; until then it is in :meth:`pending` (also after a final failure),
    so retention can keep every checkpoint that is not safely on the Hub. A final failure is raised (as
    [`HubError`]) by the next :meth:`submit` or :meth:`wait`.

    Args:
        repo_id (`str`): target repo.
        token (`str`, *optional*): Hub token.
        private (`bool`, *optional*): visibility of a newly created repo.
        max_retries (`int`, *optional*, defaults to `5`): retries per checkpoint after the first attempt.
        base_delay (`float`, *optional*, defaults to `1.0`): first backoff in seconds (doubled each retry).
        max_delay (`float`, *optional*, defaults to `60.0`): backoff cap in seconds.

    Example:

    ```python
    >>> with CheckpointUploader("me/run") as uploader:
    ...     uploader.submit("out/checkpoint-120", branch="step-120")
    ...     uploader.wait()
    >>> Path("out/checkpoint-120") in uploader.confirmed()
    True
    ```
    """

    def __init__(self, repo_id: str, *, token: str | None = None, private: bool | None = None, max_retries: int = 5,
                 base_delay: float = 1.0, max_delay: float = 60.0) -> None:
        if max_retries < 0 or base_delay < 0 or max_delay < base_delay:
            raise ValueError(f"Need max_retries >= 0 and 0 <= base_delay <= max_delay, got {max_retries}, "
                             f"{base_delay}, {max_delay}.")
        self.repo_id, self.token, self.private = repo_id, token, private
        self.max_retries, self.base_delay, self.max_delay = max_retries, base_delay, max_delay
        self._queue: queue.Queue[_UploadJob | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending: list[Path] = []
        self._confirmed: dict[Path, PushedCheckpoint] = {}
        self._errors: list[HubError] = []
        self._unfinished = 0
        self._thread = threading.Thread(target=self._run, name="hf_resumable-uploader", daemon=True)
        self._thread.start()

    def submit(self, local_checkpoint_dir: str | os.PathLike, *, branch: str | None = None, tag: str | None = None,
               path_in_repo: str | None = None, commit_message: str | None = None) -> None:
        """Queue one checkpoint directory (same options as :func:`push_checkpoint`).

        Raises:
            HubError: if an earlier upload failed for good (raised once, then cleared).
        """
        self._raise_failures()
        path = Path(local_checkpoint_dir)
        with self._lock:
            if self._thread is None:
                raise HubError("CheckpointUploader is closed; create a new one to upload more checkpoints.")
            if path not in self._pending:
                self._pending.append(path)
            self._unfinished += 1
        self._queue.put(_UploadJob(path, {"branch": branch, "tag": tag, "path_in_repo": path_in_repo,
                                          "commit_message": commit_message}))

    def wait(self, timeout: float | None = None) -> list[PushedCheckpoint]:
        """Block until every queued upload finished; return all confirmed checkpoints in order.

        Raises:
            HubError: if an upload failed for good, or ``timeout`` passed first.
        """
        with self._lock:
            if not self._lock.wait_for(lambda: self._unfinished == 0, timeout=timeout):
                raise HubError(f"CheckpointUploader.wait: {self._unfinished} uploads still running after {timeout} s.")
        self._raise_failures()
        with self._lock:
            return list(self._confirmed.values())

    def pending(self) -> set[Path]:
        """Local paths submitted but not (yet) confirmed on the Hub, including failed ones."""
        with self._lock:
            return set(self._pending)

    def confirmed(self) -> set[Path]:
        """Local paths whose commit exists on the Hub."""
        with self._lock:
            return set(self._confirmed)

    def results(self) -> dict[Path, PushedCheckpoint]:
        """Confirmed paths and where they landed."""
        with self._lock:
            return dict(self._confirmed)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker (after draining the queue when ``wait``); further submits raise."""
        if wait:
            with self._lock:
                self._lock.wait_for(lambda: self._unfinished == 0)
        self._queue.put(None)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def __enter__(self) -> CheckpointUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=True)

    def _raise_failures(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                pushed = self._push_with_retries(job)
            except Exception as err:  # recorded here, raised in the caller's thread by submit()/wait()
                self._record_failure(job, err)
            else:
                with self._lock:
                    self._pending = [p for p in self._pending if p != job.path]
                    self._confirmed[job.path] = pushed
            finally:
                with self._lock:
                    self._unfinished -= 1
                    self._lock.notify_all()

    def _record_failure(self, job: _UploadJob, err: Exception) -> None:
        if not isinstance(err, HubError):
            wrapped = HubError(f"Uploading {job.path} to {self.repo_id} failed ({err!r}); it stays pending. Fix the"
                               " cause and submit it again.")
            wrapped.__cause__ = err
            err = wrapped
        with self._lock:
            self._errors.append(err)

    def _push_with_retries(self, job: _UploadJob) -> PushedCheckpoint:
        attempt = 0
        while True:
            try:
                return push_checkpoint(job.path, self.repo_id, token=self.token, private=self.private, **job.kwargs)
            except Exception as err:
                if not _is_retryable(err):
                    raise
                if attempt >= self.max_retries:
                    raise HubError(f"Uploading {job.path} to {self.repo_id} failed after {attempt + 1} attempts "
                                   f"({err!r}); it stays pending. Submit it again once the Hub is reachable.") from err
                delay = min(self.max_delay, self.base_delay * 2**attempt)
                logger.warning("upload of %s failed (%r); retry %d/%d in %.1f s", job.path, err, attempt + 1,
                               self.max_retries, delay)
                time.sleep(delay)
                attempt += 1
