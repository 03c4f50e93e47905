"""resumable_download: ranged GETs into a ``.part`` file that survives the process (huggingface_hub 2.x deletes
partial downloads when a process dies, so a multi-GB file would restart from zero)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from ..constants import PART_SUFFIX, SIDECAR_SUFFIX
from ..errors import CorruptCheckpointError, HubError
from ..format.safetensors_io import FileRecord, check_file, hash_file
from ..format.sharding import check_relative_name
from ._common import hub_errors

logger = logging.getLogger(__name__)

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")  # an LFS file's ETag is its sha256
_HASH_READ = 8 * 1024 * 1024  # bytes read at a time to hash a file already on disk


# --------------------------------------------------------------------------------------------------- resumable GET
@dataclass(frozen=True)
class _RemoteFile:
    """What the HEAD said about a file: where to GET it and which version it is."""

    url: str
    commit: str | None
    etag: str | None
    size: int | None

    def sidecar(self) -> dict[str, Any]:
        return {"commit": self.commit, "etag": self.etag, "size": self.size}


def _remote_file(repo_id: str, filename: str, revision: str | None, token: str | None, repo_type: str) -> _RemoteFile:
    url = hf_hub_url(repo_id, filename, revision=revision, repo_type=repo_type)
    meta = get_hf_file_metadata(url, token=token, retry_on_errors=True)
    return _RemoteFile(meta.location, meta.commit_hash, meta.etag, meta.size)


def _prepare_part(part: Path, sidecar: Path, remote: _RemoteFile) -> int:
    """Bytes already in ``part`` for this exact remote version (0 after starting over)."""
    try:
        previous = json.loads(sidecar.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        previous = None
    if previous == remote.sidecar() and part.exists():
        return part.stat().st_size
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(b"")
    sidecar.write_text(json.dumps(remote.sidecar()), encoding="utf-8")
    return 0


def _request_headers(url: str, token: str | None, start: int) -> dict[str, str]:
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"
    if urllib.parse.urlsplit(url)[:2] != urllib.parse.urlsplit(constants.ENDPOINT)[:2]:
        headers.pop("authorization", None)  # like huggingface_hub: never send the token to a CDN
        headers.pop("Authorization", None)
    if start:
        headers["Range"] = f"bytes={start}-"
    return headers


def _fetch_into(part: Path, remote: _RemoteFile, start: int, token: str | None) -> int:
    """GET ``remote`` from byte ``start`` and append to ``part``; return the new size (raises on a cut body)."""
    with get_session().stream("GET", remote.url, headers=_request_headers(remote.url, token, start),
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, follow_redirects=True) as response:
        if response.status_code == 416 and start and start == remote.size:
            return start
        hf_raise_for_status(response)
        mode = "ab" if response.status_code == 206 else "wb"  # 200: the server ignored Range, start over
        size = start if mode == "ab" else 0
        with open(part, mode) as f:
            for chunk in response.iter_bytes():
                f.write(chunk)
                f.flush()
                size += len(chunk)
            os.fsync(f.fileno())
    return size


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_READ):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    """The sha256 of a downloaded file, computed on demand: what the Hub knows an LFS file by (its oid)."""
    return hash_file(path, xxh3_128=False, sha256=True).sha256


def _is_up_to_date(target: Path, remote: _RemoteFile, expected_sha256: str | None,
                   expected: FileRecord | None) -> bool:
    """Whether ``target`` already holds the remote file (by the record ``expected``, by sha256, or by the git blob id
    of a regular file)."""
    if not target.is_file() or (remote.size is not None and target.stat().st_size != remote.size):
        return False
    if expected is not None:
        return check_file(target, expected) is None
    if expected_sha256 is not None or (remote.etag and _SHA256_RE.match(remote.etag)):
        return _sha256_of(target) == (expected_sha256 or remote.etag)
    return bool(remote.etag) and _git_blob_sha1(target) == remote.etag


def _finish_download(part: Path, target: Path, expected_sha256: str | None, expected: FileRecord | None,
                     source: str) -> None:
    """Move the downloaded ``part`` into place once it checks out: against the record ``expected`` (a manifest's: its
    xxh3-128, or sha256 where it has no other) when given, else against ``expected_sha256`` (or the LFS oid)."""
    if expected is not None:
        problem = check_file(part, expected)
    elif expected_sha256 is not None and (actual := _sha256_of(part)) != expected_sha256:
        problem = f"sha256 {actual} but expected {expected_sha256}"
    else:
        problem = None
    if problem is not None:
        part.unlink()
        raise CorruptCheckpointError(
            f"{source}: downloaded {problem}; the partial file was removed. Retry; if it persists, the remote file is"
            " corrupt: re-push it."
        )
    os.replace(part, target)


def resumable_download(
    repo_id: str,
    filename: str,
    *,
    revision: str | None = None,
    local_dir: str | os.PathLike,
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    expected: FileRecord | None = None,
    token: str | None = None,
    repo_type: str = "model",
    max_retries: int = 3,
) -> Path:
    """Download one file so that a killed process resumes where it stopped instead of restarting.

    Bytes go to ``<local_dir>/<filename>.part``, with a sidecar ``.part.json`` recording the commit, ETag and size
    they belong to. A later call (in any process) continues with ``Range: bytes=<part size>-`` when the sidecar still
    matches the remote file, checks the file against the record ``expected`` (else against ``expected_sha256``, else
    against the ETag of an LFS file, which is its sha256), then renames the file into place atomically.

    > [!WARNING]
    > Two processes must not download the same file into the same ``local_dir`` at the same time: they would append
    > to one ``.part`` file.

    Args:
        repo_id (`str`): the repo.
        filename (`str`): path inside the repo.
        revision (`str`, *optional*): branch, tag or commit sha; pass a commit to pin the version.
        local_dir (`str` or `os.PathLike`): destination root; the file lands at ``local_dir/filename``.
        expected_sha256 (`str`, *optional*): required sha256.
        expected_size (`int`, *optional*): required size in bytes.
        expected ([`~hf_resumable.format.safetensors_io.FileRecord`], *optional*): the file's record in a
            checkpoint manifest; it is checked by its xxh3-128 (or its sha256 where it has no other), and the
            sha256 of the LFS oid is then not computed.
        token (`str`, *optional*): Hub token.
        repo_type (`str`, *optional*, defaults to `"model"`): the repo type.
        max_retries (`int`, *optional*, defaults to `3`): in-call retries after a dropped connection.

    Returns:
        `Path`: the complete local file.

    Raises:
        UnsafeIndexError: if ``filename`` escapes ``local_dir``.
        CorruptCheckpointError: on a size or hash mismatch (the partial file is removed).
        HubError: if the connection keeps failing; the ``.part`` file is kept for the next call.
        HubEntryNotFoundError: if the file does not exist at ``revision`` (also huggingface_hub's
            ``EntryNotFoundError``).
        HubServerError: if the Hub answers 5xx or cannot be reached.

    Example:

    ```python
    >>> path = resumable_download("me/run", "checkpoint-120/model-00001-of-00002.safetensors",  # doctest: +SKIP
    ...                           revision="step-120", local_dir="pulled")
    ```
    """
    check_relative_name(filename, source=f"{repo_id}", suffix=None)
    target = Path(local_dir) / filename
    source = f"{repo_id}@{revision or 'main'}/{filename}"
    with hub_errors(source):
        remote = _remote_file(repo_id, filename, revision, token, repo_type)
    if expected_size is not None and remote.size is not None and remote.size != expected_size:
        raise CorruptCheckpointError(f"{source}: the Hub reports {remote.size} bytes, expected {expected_size}.")
    if _is_up_to_date(target, remote, expected_sha256, expected):
        return target
    part, sidecar = target.with_name(target.name + PART_SUFFIX), target.with_name(target.name + SIDECAR_SUFFIX)
    size = _prepare_part(part, sidecar, remote)
    for attempt in range(max_retries + 1):
        try:
            size = _fetch_into(part, remote, size, token)
            break
        except (httpx2.TransportError, httpx2.StreamError) as err:
            size = part.stat().st_size
            if attempt == max_retries:
                raise HubError(f"{source}: download failed after {max_retries + 1} attempts ({err!r}); {size} bytes "
                               f"are kept in {part}, call resumable_download again to continue.") from err
            logger.warning("%s: connection dropped at byte %d (%s); resuming", source, size, err)
            time.sleep(min(8.0, 0.5 * 2**attempt))
    if remote.size is not None and size != remote.size:
        part.unlink()
        raise CorruptCheckpointError(f"{source}: got {size} bytes, the Hub announced {remote.size}; retry.")
    lfs_sha = remote.etag if remote.etag and _SHA256_RE.match(remote.etag) else None
    _finish_download(part, target, expected_sha256 or lfs_sha, expected, source)
    sidecar.unlink(missing_ok=True)
    return target


