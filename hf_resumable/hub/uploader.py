"""CheckpointUploader: queued, retried background pushes of committed checkpoints to the Hub."""

from __future__ import annotations

import os
from pathlib import Path

import httpx2
from huggingface_hub.errors import HfHubHTTPError

from ..errors import HubError, HubServerError
from ..remote.uploader import BackgroundUploader
from .checkpoints import PushedCheckpoint, push_checkpoint

__all__ = ["CheckpointUploader"]


def _is_retryable(err: BaseException) -> bool:
    """Transient Hub failures: 5xx, 408/429 and connection errors."""
    if isinstance(err, HubServerError):
        return True
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        return status is None or status >= 500 or status in (408, 429)
    return isinstance(err, (httpx2.TransportError, ConnectionError, TimeoutError))


class CheckpointUploader(BackgroundUploader[PushedCheckpoint]):
    """Push committed checkpoints to the Hub from a background thread, in submission order, never skipping one.

    A :class:`~hf_resumable.remote.BackgroundUploader` (confirmed only once committed, pending until then) whose push
    is :func:`push_checkpoint` (one commit per checkpoint), retrying 5xx, 408/429 and connection errors; a final
    failure is raised as [`HubError`] by the next :meth:`submit` or :meth:`wait`.

    Args:
        repo_id (`str`): target repo.
        token (`str`, *optional*): Hub token.
        private (`bool`, *optional*): visibility of a newly created repo.
        branch (`str`, *optional*): default branch of every push (``submit(branch=)`` overrides it).
        path_prefix (`str`, *optional*): push each checkpoint to ``<path_prefix>/<its directory name>`` unless
            ``submit(path_in_repo=)`` says otherwise.
        max_retries, base_delay, max_delay: as for :class:`~hf_resumable.remote.BackgroundUploader`.

    Example:

    ```python
    >>> with CheckpointUploader("me/run") as uploader:  # doctest: +SKIP
    ...     uploader.submit("out/checkpoint-120", branch="step-120")
    ...     uploader.wait()
    >>> Path("out/checkpoint-120").resolve() in uploader.confirmed()  # doctest: +SKIP
    True

    ```
    """

    def __init__(self, repo_id: str, *, token: str | None = None, private: bool | None = None,
                 branch: str | None = None, path_prefix: str | None = None, max_retries: int = 5,
                 base_delay: float = 1.0, max_delay: float = 60.0) -> None:
        self.repo_id, self.token, self.private = repo_id, token, private
        self.branch, self.path_prefix = branch, path_prefix
        super().__init__(self._push_one, name=repo_id, is_retryable=_is_retryable, error_type=HubError,
                         max_retries=max_retries, base_delay=base_delay, max_delay=max_delay)

    def submit(self, local_checkpoint_dir: str | os.PathLike, *, branch: str | None = None, tag: str | None = None,
               path_in_repo: str | None = None, commit_message: str | None = None) -> None:
        """Queue one checkpoint directory (same options as :func:`push_checkpoint`).

        Raises:
            HubError: if an earlier upload failed for good (raised once, then cleared), or after ``close``.
        """
        if path_in_repo is None and self.path_prefix:
            path_in_repo = f"{self.path_prefix.strip('/')}/{Path(local_checkpoint_dir).name}"
        super().submit(local_checkpoint_dir, branch=branch or self.branch, tag=tag, path_in_repo=path_in_repo,
                       commit_message=commit_message)

    def _push_one(self, path: Path, **options) -> PushedCheckpoint:
        return push_checkpoint(path, self.repo_id, token=self.token, private=self.private, **options)
