"""The one front for checkpoint locations: local directories, the Hub (``hf://``, ``user/repo``) and object stores
(``s3://``, ``gs://``, ... through fsspec).

The checkpoint core reads and writes local directories only. Here a remote checkpoint or run root (its newest
committed checkpoint) is downloaded and hash-checked first, a ``resume_from_checkpoint=`` value becomes a verified
local directory (rank 0 downloads, the others wait), and a ``push_checkpoints_to=`` value a background uploader.

Example:

```python
>>> uploader = open_uploader("hf://me/run")  # doctest: +SKIP
>>> uploader.submit("out/checkpoint-100")  # doctest: +SKIP
>>> resolve_resume_path("hf://me/run", cache_dir="out/.remote")  # doctest: +SKIP
PosixPath('out/.remote/checkpoint-100')
>>> load_checkpoint("s3://bucket/run", model=model, storage_options=opts).step  # doctest: +SKIP
100

```
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from . import checkpoint as _core
from ._urls import is_remote, location_kind
from .distributed import barrier, rank_and_world_size
from .errors import CheckpointNotFoundError, IncompleteCheckpointError

logger = logging.getLogger(__name__)

__all__ = ["Uploader", "is_remote", "open_uploader", "resolve_resume_path", "find_latest_checkpoint",
           "open_checkpoint", "load_checkpoint"]


class Uploader(Protocol):
    """What the integrations need from a background uploader."""

    def submit(self, local_dir: str | os.PathLike) -> None: ...

    def pending(self) -> set[Path]: ...

    def wait(self, timeout: float | None = None) -> Any: ...


def open_uploader(target: str, *, token: str | None = None, storage_options: dict | None = None) -> Uploader:
    """A background uploader for ``target``: ``"user/repo"`` or ``"hf://user/repo[@branch][/path]"`` (the Hub,
    one commit per checkpoint under ``<path>/checkpoint-N``) or an fsspec URL such as ``"s3://bucket/run"``.

    Raises:
        ValueError: if ``target`` is neither.
    """
    if location_kind(target) == "object_store":
        from .remote import CheckpointMirror

        return CheckpointMirror(target, storage_options=storage_options)
    if target.startswith("hf://") or (target.count("/") == 1 and "://" not in target and not Path(target).exists()):
        from .hub import CheckpointUploader, parse_hf_url

        url = parse_hf_url(target)
        return CheckpointUploader(url.repo_id, token=token, branch=url.revision, path_prefix=url.path_in_repo or None)
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


def _download(text: str, cache_dir: Path | None, *, token: str | None, storage_options: dict | None) -> Path:
    if location_kind(text) == "hub":
        from .hub import pull_checkpoint

        try:
            path = pull_checkpoint(text, local_dir=cache_dir, token=token)
        except IncompleteCheckpointError as err:
            raise CheckpointNotFoundError(f"{text} holds no committed checkpoint: {err}") from err
        logger.info("Resuming from %s, pulled into %s", text, path)
        return path
    from .remote import resolve_checkpoint

    return resolve_checkpoint(text, storage_options=storage_options)


def find_latest_checkpoint(root: str | os.PathLike, *, cleanup: bool = True, full: bool = False,
                           storage_options: dict | None = None, **kwargs: Any) -> Path | str | None:
    """:func:`hf_resumable.checkpoint.find_latest_checkpoint` for any location.

    For an object-store root (``s3://bucket/run``) the result is the URL of its newest checkpoint whose manifest
    and files are all present; for ``hf://user/repo[/path]`` the ``hf://`` reference of the newest committed one
    (pinned to its commit); for a local root the newest local checkpoint that verifies.

    Args:
        root (`str` or `os.PathLike`): a local run directory, ``hf://user/repo[/path]`` or an fsspec URL.
        storage_options (`dict`, *optional*): fsspec options (credentials, endpoint) for an object-store ``root``.

    Raises:
        ValueError: if ``storage_options`` are given for a local or ``hf://`` root (only fsspec reads them).
    """
    kind = location_kind(root) if isinstance(root, (str, os.PathLike)) else "local"
    _check_storage_options(root, kind, storage_options)
    if kind == "object_store":
        from .remote import find_latest_remote_checkpoint

        return find_latest_remote_checkpoint(os.fspath(root), storage_options=storage_options)
    if kind == "hub":
        from .hub import find_latest_hub_checkpoint

        return find_latest_hub_checkpoint(os.fspath(root))
    return _core.find_latest_checkpoint(root, cleanup=cleanup, full=full, **kwargs)


def open_checkpoint(location: str | os.PathLike, *, storage_options: dict | None = None, token: str | None = None,
                    **kwargs: Any) -> _core.OpenedCheckpoint:
    """:func:`hf_resumable.checkpoint.open_checkpoint` for any location (remote ones are downloaded first).

    Raises:
        ValueError: if ``storage_options`` are given for a local or ``hf://`` location (only fsspec reads them).
    """
    return _core.open_checkpoint(_local(location, storage_options=storage_options, token=token), **kwargs)


def load_checkpoint(location: str | os.PathLike, *, storage_options: dict | None = None, token: str | None = None,
                    **kwargs: Any) -> _core.LoadedCheckpoint:
    """:func:`hf_resumable.checkpoint.load_checkpoint` for any location (remote ones are downloaded and
    hash-checked first; a remote run root loads its newest committed checkpoint).

    Args:
        location (`str` or `os.PathLike`): a local checkpoint, ``hf://user/repo[/path]`` or an fsspec URL (a
            checkpoint or a run root).
        storage_options (`dict`, *optional*): fsspec options (credentials, endpoint) for an object-store location.
        token (`str`, *optional*): Hub token for an ``hf://`` location.
        **kwargs: the options of :func:`hf_resumable.checkpoint.load_checkpoint` (``model``, ``optimizer``, ...).

    Raises:
        ValueError: if ``storage_options`` are given for a local or ``hf://`` location (only fsspec reads them).

    Example:

    ```python
    >>> load_checkpoint("s3://bucket/run", model=model, optimizer=optimizer,
    ...                 storage_options={"endpoint_url": "http://127.0.0.1:8333"}).step  # doctest: +SKIP
    120

    ```
    """
    return _core.load_checkpoint(_local(location, storage_options=storage_options, token=token), **kwargs)


def _local(location: str | os.PathLike, *, storage_options: dict | None, token: str | None) -> str | os.PathLike:
    kind = location_kind(location) if isinstance(location, (str, os.PathLike)) else "local"
    _check_storage_options(location, kind, storage_options)
    if kind == "local":
        return location
    return _download(os.fspath(location), None, token=token, storage_options=storage_options)


def _check_storage_options(location: Any, kind: str, storage_options: dict | None) -> None:
    """``storage_options`` configure fsspec, which only object-store locations go through; refuse them elsewhere
    rather than drop them (a caller relying on them, say for credentials, would never learn they were unused)."""
    if storage_options and kind != "object_store":
        where = "a Hub" if kind == "hub" else "a local"
        raise ValueError(f"storage_options apply only to object-store locations (s3://, gs://, ... read through "
                         f"fsspec); {location!r} is {where} location. Drop storage_options, or give an object-store "
                         "URL.")
