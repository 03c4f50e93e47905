"""One front for the remote tiers the integrations use: the Hub (``hf://``, ``user/repo``) and fsspec stores (``s3://``).

* :func:`open_uploader` turns a ``push_checkpoints_to=`` value into a background uploader
  (:class:`~hf_resumable.hub.CheckpointUploader` or :class:`~hf_resumable.storage.CheckpointMirror`) with
  ``submit(dir)``, ``pending()`` and ``wait()``.
* :func:`resolve_resume_path` turns a ``resume_from_checkpoint=`` value that names a remote checkpoint (or
  a remote run root: its newest committed checkpoint) into a verified local directory.

Example:

```python
>>> uploader = open_uploader("hf://me/run")  # doctest: +SKIP
>>> uploader.submit("out/checkpoint-100")  # doctest: +SKIP
>>> resolve_resume_path("hf://me/run", cache_dir="out/.remote")  # doctest: +SKIP
PosixPath('out/.remote/checkpoint-100')
```
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from .distributed import barrier, rank_and_world_size
from .errors import CheckpointNotFoundError

logger = logging.getLogger(__name__)

__all__ = ["is_remote", "open_uploader", "resolve_resume_path", "Uploader"]


class Uploader(Protocol):
    """What the integrations need from a background uploader."""

    def submit(self, local_dir: str | os.PathLike) -> None: ...

    def pending(self) -> set[Path]: ...

    def wait(self, timeout: float | None = None) -> Any: ...


def is_remote(value: str | os.PathLike | bool | None) -> bool:
    """True for ``hf://...`` and fsspec URLs such as ``s3://...``."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    from .storage import is_remote_url

    text = os.fspath(value)
    return text.startswith("hf://") or is_remote_url(text)


class _HubTarget:
    """Adapts :class:`~hf_resumable.hub.CheckpointUploader` to push each checkpoint under one repo path."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        from .hub import CheckpointUploader, parse_hf_url

        self.url = parse_hf_url(target)
        self.uploader = CheckpointUploader(self.url.repo_id, token=token)

    def submit(self, local_dir: str | os.PathLike) -> None:
        name = Path(local_dir).name
        path = f"{self.url.path_in_repo}/{name}" if self.url.path_in_repo else name
        self.uploader.submit(local_dir, branch=self.url.revision, path_in_repo=path)

    def pending(self) -> set[Path]:
        return self.uploader.pending()

    def wait(self, timeout: float | None = None) -> Any:
        return self.uploader.wait(timeout=timeout)


def open_uploader(target: str, *, token: str | None = None, storage_options: dict | None = None) -> Uploader:
    """A background uploader for ``target``: ``"user/repo"`` or ``"hf://user/repo[@branch][/path]"`` (the Hub,
    one commit per checkpoint under ``<path>/checkpoint-N``) or an fsspec URL such as ``"s3://bucket/run"``.

    Raises:
        ValueError: if ``target`` is neither.
    """
    from .storage import CheckpointMirror, is_remote_url

    if is_remote_url(target):
        return CheckpointMirror(target, storage_options=storage_options)
    if target.startswith("hf://") or (target.count("/") == 1 and "://" not in target and not Path(target).exists()):
        return _HubTarget(target, token=token)
    raise ValueError(f"push_checkpoints_to={target!r}: expected 'user/repo', 'hf://user/repo[@branch][/path]' or an "
                     "fsspec URL such as 's3://bucket/run'.")


def resolve_resume_path(value: str | os.PathLike, *, cache_dir: str | os.PathLike, token: str | None = None,
                        storage_options: dict | None = None) -> Path:
    """Download the remote checkpoint ``value`` names (or the newest under a run root) and return its local path.

    Under torch.distributed rank 0 downloads and the other ranks wait, then use the same directory.

    Raises:
        CheckpointNotFoundError: if the remote location holds no committed checkpoint.
    """
    text = os.fspath(value)
    rank, _ = rank_and_world_size()
    path: Path | None = None
    if rank == 0:
        path = _download(text, Path(cache_dir), token=token, storage_options=storage_options)
    barrier()
    if path is None:
        path = _download(text, Path(cache_dir), token=token, storage_options=storage_options)
    return path


def _download(text: str, cache_dir: Path, *, token: str | None, storage_options: dict | None) -> Path:
    from .storage import resolve_checkpoint

    if text.startswith("hf://"):
        from .errors import IncompleteCheckpointError
        from .hub import pull_checkpoint

        try:
            path = pull_checkpoint(text, local_dir=cache_dir, token=token)
        except IncompleteCheckpointError as err:
            raise CheckpointNotFoundError(f"{text} holds no committed checkpoint: {err}") from err
        logger.info("Resuming from %s, pulled into %s", text, path)
        return path
    return resolve_checkpoint(text, storage_options=storage_options)
