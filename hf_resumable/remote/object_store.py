"""Object-store tier through fsspec: local-first saves, background uploads, manifest-last commits.

Object stores have no atomic rename, so the commit marker is the remote ``manifest.json``, uploaded last; a remote
``checkpoint-N/`` counts as committed only if its manifest parses and every file it lists has its size. See
docs/object-stores.md.

Example:

```python
>>> from hf_resumable.remote import CheckpointMirror, find_latest_remote_checkpoint
>>> mirror = CheckpointMirror("s3://bucket/run", keep_last=2)  # doctest: +SKIP
>>> mirror.submit("out/checkpoint-100")  # returns at once; uploads in the background  # doctest: +SKIP
>>> mirror.wait()  # doctest: +SKIP
>>> find_latest_remote_checkpoint("s3://bucket/run")  # doctest: +SKIP
's3://bucket/run/checkpoint-100'
```
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._urls import is_object_store_url
from ..constants import CHECKPOINT_DIR_RE, MANIFEST_FILE, MAX_JSON_SIZE
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HfResumableError,
    StorageError,
)
from ..format.safetensors_io import FileRecord, RecordChecker
from ..progress import progress_bar
from .uploader import BackgroundUploader

logger = logging.getLogger(__name__)

__all__ = [
    "upload_checkpoint",
    "read_remote_manifest",
    "is_committed_remote",
    "list_remote_checkpoints",
    "find_latest_remote_checkpoint",
    "download_checkpoint",
    "apply_remote_retention",
    "CheckpointMirror",
]

_CHUNK = 8 * 1024 * 1024


def _fs(url: str, storage_options: Mapping[str, Any] | None):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, path.rstrip("/")


def _fresh(fs, path: str) -> None:
    """Drop fsspec's cached listings under ``path``: another process may have written there."""
    try:
        fs.invalidate_cache(path)
    except (AttributeError, TypeError):
        pass


def _url(fs, path: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return f"{protocol}://{path}"


def _with_retries(what: str, fn, *, attempts: int = 4, base_delay: float = 0.5):
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - botocore/aiohttp errors are not OSError subclasses
            if isinstance(err, (CheckpointExistsError, CorruptCheckpointError)):
                raise
            if attempt == attempts:
                if isinstance(err, (OSError, HfResumableError)):
                    raise
                raise StorageError(f"{what} failed after {attempts} attempts: {type(err).__name__}: {err}") from err
            delay = base_delay * 2 ** (attempt - 1)
            logger.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what, type(err).__name__, err, attempt,
                           attempts - 1, delay)
            time.sleep(delay)


def read_remote_manifest(remote_dir: str, *, storage_options: Mapping[str, Any] | None = None, fs=None):
    """Read and validate ``remote_dir/manifest.json``.

    Raises:
        IncompleteCheckpointError: if there is no manifest (an upload that never committed).
        CorruptCheckpointError: if it is unreadable.
    """
    from ..checkpoint.commit.manifest import Manifest
    from ..errors import IncompleteCheckpointError

    if fs is None:
        fs, remote_dir = _fs(remote_dir, storage_options)
    path = f"{remote_dir}/{MANIFEST_FILE}"
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{_url(fs, remote_dir)}: no {MANIFEST_FILE}; the upload never committed.") \
            from None
    if info.get("size", 0) > MAX_JSON_SIZE:
        raise CorruptCheckpointError(f"{_url(fs, path)}: manifest too large.")
    return Manifest.from_json(fs.cat_file(path), source=_url(fs, path))


def _remote_sizes(fs, remote_dir: str) -> dict[str, int]:
    sizes = {}
    for path, info in fs.find(remote_dir, detail=True).items():
        rel = path[len(remote_dir) + 1 :] if path.startswith(remote_dir + "/") else path
        sizes[rel] = int(info.get("size", -1))
    return sizes


def is_committed_remote(remote_dir: str, *, storage_options: Mapping[str, Any] | None = None, fs=None) -> bool:
    """A remote checkpoint counts only if its manifest is valid and every listed file has its size."""
    if fs is None:
        fs, remote_dir = _fs(remote_dir, storage_options)
    _fresh(fs, remote_dir)
    try:
        manifest = read_remote_manifest(remote_dir, fs=fs)
    except HfResumableError as err:
        logger.warning("Skipping %s: %s", _url(fs, remote_dir), err)
        return False
    sizes = _remote_sizes(fs, remote_dir)
    bad = [rel for rel, record in manifest.files.items() if sizes.get(rel) != record.size]
    if bad:
        logger.warning("Skipping %s: files missing or of the wrong size: %s", _url(fs, remote_dir), bad[:5])
    return not bad


def upload_checkpoint(
    local_dir: str | os.PathLike,
    remote_dir: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Upload a committed local checkpoint; the manifest goes last and only after every file checks out.

    Args:
        local_dir (`str` or `os.PathLike`): a committed local checkpoint (verified before upload).
        remote_dir (`str`): e.g. ``s3://bucket/run/checkpoint-100``.
        overwrite (`bool`, *optional*, defaults to `False`): replace a committed remote checkpoint.

    Returns:
        `str`: the remote URL.

    Raises:
        CheckpointExistsError: if the remote checkpoint is committed and ``overwrite`` is False.
        CorruptCheckpointError: if the local checkpoint does not verify.
        StorageError: if the store keeps failing; the remote checkpoint is then left uncommitted.
    """
    from ..checkpoint.verify import verify_checkpoint

    local_dir = Path(local_dir)
    report = verify_checkpoint(local_dir, full=False, raise_on_error=True)
    fs, root = _fs(remote_dir, storage_options)
    url = _url(fs, root)
    _fresh(fs, root)
    if fs.exists(f"{root}/{MANIFEST_FILE}"):
        if not overwrite:
            raise CheckpointExistsError(f"{url} is already a committed checkpoint; pass overwrite=True to replace it.")
        # Un-commit first, so a failure half-way never leaves a manifest over mixed files.
        fs.rm_file(f"{root}/{MANIFEST_FILE}")
    started = time.perf_counter()
    total = sum(r.size for r in report.manifest.files.values())
    with progress_bar(total=total, desc=f"uploading {local_dir.name}") as bar:
        for rel, record in sorted(report.manifest.files.items()):
            _with_retries(f"upload of {rel} to {url}",
                          lambda rel=rel: fs.put_file(str(local_dir / rel), f"{root}/{rel}"))
            bar.update(record.size)
    _fresh(fs, root)
    sizes = _remote_sizes(fs, root)
    wrong = [rel for rel, record in report.manifest.files.items() if sizes.get(rel) != record.size]
    if wrong:
        raise StorageError(f"{url}: after upload these files are missing or of the wrong size: {wrong[:5]}; "
                           "the checkpoint was not committed.")
    _with_retries(f"commit of {url}", lambda: fs.put_file(str(local_dir / MANIFEST_FILE), f"{root}/{MANIFEST_FILE}"))
    logger.info("Uploaded %s to %s (%.1f MB) in %.2f s", local_dir, url, total / 1e6, time.perf_counter() - started)
    return url


def list_remote_checkpoints(remote_root: str, *, storage_options: Mapping[str, Any] | None = None
                            ) -> list[tuple[int, str]]:
    """``(step, url)`` of every ``checkpoint-N`` prefix under ``remote_root``, by step."""
    fs, root = _fs(remote_root, storage_options)
    return [(step, _url(fs, path)) for step, path in _list_checkpoints(fs, root)]


def _list_checkpoints(fs, remote_root: str) -> list[tuple[int, str]]:
    _fresh(fs, remote_root)
    try:
        entries = fs.ls(remote_root, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = CHECKPOINT_DIR_RE.match(name)
        if match:
            found.append((int(match.group(1)), entry.rstrip("/")))
    return sorted(found)


def find_latest_remote_checkpoint(remote_root: str, *, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """URL of the newest committed ``checkpoint-N`` under ``remote_root``, or None."""
    fs, root = _fs(remote_root, storage_options)
    for _step, path in reversed(_list_checkpoints(fs, root)):
        if is_committed_remote(path, fs=fs):
            return _url(fs, path)
    return None


def default_cache_dir() -> Path:
    """Where remote checkpoints are downloaded (``$HF_RESUMABLE_CACHE`` or ``~/.cache/hf_resumable``)."""
    return Path(os.environ.get("HF_RESUMABLE_CACHE", Path.home() / ".cache" / "hf_resumable"))


def download_checkpoint(
    remote_dir: str,
    local_dir: str | os.PathLike | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> Path:
    """Download a committed remote checkpoint, hash-checking every file against the manifest.

    The files land in a temporary sibling directory that is renamed into place only when every hash
    matches, so an interrupted or corrupted download never looks like a checkpoint.

    Raises:
        IncompleteCheckpointError: if the remote checkpoint is not committed.
        CorruptCheckpointError: if a downloaded file's size or hash (xxh3-128, or the sha256 of an older manifest's
            record) differs from the manifest.
    """
    from ..checkpoint import committed_directory, verify_checkpoint
    from ..checkpoint.commit import write_bytes_durably
    from ..format.sharding import check_relative_name

    fs, root = _fs(remote_dir, storage_options)
    manifest = read_remote_manifest(root, fs=fs)
    if local_dir is None:
        key = hashlib.sha256(_url(fs, root).encode()).hexdigest()[:16]
        local_dir = default_cache_dir() / key / root.rsplit("/", 1)[-1]
    target = Path(local_dir)
    if target.exists() and verify_checkpoint(target, full=False).ok:
        return target
    with committed_directory(target, overwrite=True) as tmp:
        total = sum(r.size for r in manifest.files.values())
        with progress_bar(total=total, desc=f"downloading {target.name}") as bar:
            for rel, record in manifest.files.items():
                check_relative_name(rel, source=MANIFEST_FILE, suffix=None)
                _with_retries(f"download of {rel}", lambda rel=rel, record=record: _fetch(fs, f"{root}/{rel}",
                                                                                        tmp / rel, record))
                bar.update(record.size)
        write_bytes_durably(tmp / MANIFEST_FILE, manifest.to_json())
    return target


def _fetch(fs, remote_path: str, local_path: Path, record: FileRecord) -> None:
    local_path.parent.mkdir(parents=True, exist_ok=True)
    checker = RecordChecker(record)  # each chunk is a new bytes object: a sha256 may run on the helper thread
    try:
        with fs.open(remote_path, "rb", block_size=_CHUNK) as src, open(local_path, "wb") as dst:
            while chunk := src.read(_CHUNK):
                checker.feed(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    finally:
        checker.close()
    if (problem := checker.problem()) is not None:
        local_path.unlink(missing_ok=True)
        raise CorruptCheckpointError(f"{remote_path}: downloaded {problem}.")


def apply_remote_retention(remote_root: str, *, keep_last: int, protect: Iterable[str] = (),
                           storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Delete old remote checkpoints, keeping the newest ``keep_last`` committed ones.

    Uncommitted prefixes newer than the newest committed checkpoint (uploads in flight) are never
    touched; a deletion removes the manifest first, so a half-deleted checkpoint is never committed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}.")
    fs, root = _fs(remote_root, storage_options)
    committed = [(s, p) for s, p in _list_checkpoints(fs, root) if is_committed_remote(p, fs=fs)]
    keep = {p for _, p in committed[-keep_last:]} | {_fs(p, storage_options)[1] for p in protect}
    deleted = []
    for _step, path in committed:
        if path in keep:
            continue
        fs.rm_file(f"{path}/{MANIFEST_FILE}")
        fs.rm(path, recursive=True)
        deleted.append(_url(fs, path))
        logger.info("Remote retention removed %s", _url(fs, path))
    return deleted


class CheckpointMirror(BackgroundUploader[str]):
    """Upload committed local checkpoints to an object store on a background thread.

    A :class:`~hf_resumable.remote.BackgroundUploader` whose push is :func:`upload_checkpoint` (remote manifest
    last) followed by remote retention: uploads are queued (never skipped), retried with backoff, and confirmed
    only once the remote manifest is written. :meth:`pending` lists local checkpoints whose upload is not
    confirmed, so local retention can keep them; :meth:`results` maps each confirmed one to its URL. A failed
    upload is raised (as :class:`~hf_resumable.errors.StorageError`) at the next :meth:`submit` or :meth:`wait`.

    Args:
        remote_root (`str`): e.g. ``s3://bucket/run``; checkpoints go to ``<remote_root>/<dir name>``.
        keep_last (`int`, *optional*): remote retention applied after each confirmed upload.
        storage_options (`Mapping`, *optional*): passed to fsspec (endpoint, credentials).
        max_retries, base_delay, max_delay: as for :class:`~hf_resumable.remote.BackgroundUploader` (each upload
            already retries every file a few times).
    """

    def __init__(self, remote_root: str, *, keep_last: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, max_retries: int = 2, base_delay: float = 1.0,
                 max_delay: float = 30.0) -> None:
        if not is_object_store_url(remote_root):
            raise ValueError(f"remote_root must be an fsspec URL such as s3://bucket/run, got {remote_root!r}.")
        self.remote_root = remote_root.rstrip("/")
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        super().__init__(self._upload, name=self.remote_root, error_type=StorageError, max_retries=max_retries,
                         base_delay=base_delay, max_delay=max_delay,
                         is_retryable=lambda err: isinstance(err, (OSError, StorageError)) and not isinstance(
                             err, (CheckpointExistsError, CorruptCheckpointError)))

    def _upload(self, path: Path) -> str:
        url = upload_checkpoint(path, f"{self.remote_root}/{path.name}", storage_options=self.storage_options,
                                overwrite=True)
        if self.keep_last:
            apply_remote_retention(self.remote_root, keep_last=self.keep_last, storage_options=self.storage_options)
        return url


def resolve_checkpoint(path_or_url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Path:
    """A local directory for ``path_or_url``: remote checkpoints (or roots: their latest) are downloaded.

    Raises:
        CheckpointNotFoundError: if a remote root holds no committed checkpoint.
    """
    text = os.fspath(path_or_url)
    if not is_object_store_url(text):
        return Path(text)
    name = text.rstrip("/").rsplit("/", 1)[-1]
    if not CHECKPOINT_DIR_RE.match(name):
        latest = find_latest_remote_checkpoint(text, storage_options=storage_options)
        if latest is None:
            raise CheckpointNotFoundError(f"{text} holds no committed checkpoint.")
        text = latest
    return download_checkpoint(text, storage_options=storage_options)
