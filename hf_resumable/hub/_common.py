"""Shared pieces of the hub package: hf:// URLs, a repo pinned at one commit, index and shard checks."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)

from ..constants import MAX_JSON_SIZE, MODEL_INDEX_FILE, SHARDS_KEY, SINGLE_MODEL_FILE
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubEntryNotFoundError,
    HubError,
    HubFormatError,
    HubServerError,
)
from ..format._jsonio import parse_json
from ..format._safefile import read_regular_file
from ..format.safetensors_io import FileRecord, check_file
from ..format.sharding import ShardIndex, check_relative_name, parse_index

logger = logging.getLogger(__name__)


# Remote files push_sharded replaces on every push (stale shards of an earlier layout are deleted).
WEIGHT_PATTERNS = ["model*.safetensors", MODEL_INDEX_FILE]
# Shard headers fetched at once when an index is opened (ranged GETs; each is small).
HEADER_FETCH_WORKERS = 8


# --------------------------------------------------------------------------------------------------- errors
@contextlib.contextmanager
def hub_errors(where: str) -> Iterator[None]:
    """Turn ``huggingface_hub`` failures about one file into typed :class:`HubError` s naming ``where``.

    ``where`` is ``"<repo>@<commit>/<file>"`` (``"<repo>@<revision>"`` while resolving a revision). A 5xx answer, or
    none, is a :class:`HubServerError`, also when ``hf_hub_download`` reports it as a file it cannot find (its HEAD
    failed and nothing is cached). An unknown repo or revision keeps huggingface_hub's own
    ``RepositoryNotFoundError`` / ``RevisionNotFoundError``.
    """
    try:
        yield
    except (HubError, RepositoryNotFoundError, RevisionNotFoundError):
        raise
    except LocalEntryNotFoundError as err:  # hf_hub_download: the HEAD failed (5xx, no connection), nothing cached
        cause, status = err.__cause__ or err, _status(err.__cause__)
        if isinstance(cause, HfHubHTTPError) and status is not None and status < 500:
            raise cause from None  # e.g. 403: huggingface_hub's own error, as for any other answer
        raise _server_error(where, cause) from None
    except EntryNotFoundError:
        raise HubEntryNotFoundError(f"hf://{where}: no such file at that revision (404). The push was partial or "
                                    "the index is stale: re-push the model or checkpoint.") from None
    except SafetensorsParsingError as err:
        raise HubFormatError(f"hf://{where}: not a readable safetensors file ({err}).") from None
    except HfHubHTTPError as err:
        status = _status(err)
        if status == 404:
            raise HubEntryNotFoundError(f"hf://{where}: no such file at that revision (404).") from None
        if status is not None and status >= 500:
            raise _server_error(where, err) from None
        raise
    except OSError as err:  # connection errors (httpx errors are OSErrors here)
        raise _server_error(where, err) from None


def _server_error(where: str, err: BaseException) -> HubServerError:
    """A 5xx answer, or no answer at all, about ``where``."""
    status = _status(err)
    if isinstance(err, HfHubHTTPError) and status is not None:
        return HubServerError(f"hf://{where}: the Hub answered {status} ({_first_line(err)}); retry later.")
    return HubServerError(f"hf://{where}: cannot reach the Hub ({type(err).__name__}: {_first_line(err)}); "
                          "retry later.")


def _status(err: BaseException) -> int | None:
    return getattr(getattr(err, "response", None), "status_code", None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


# --------------------------------------------------------------------------------------------------- hf:// URLs
@dataclass(frozen=True)
class HfUrl:
    """A parsed ``hf://[datasets/]<namespace>/<name>[@<revision>][/<path>]`` reference.

    Args:
        repo_id (`str`): ``namespace/name``.
        revision (`str`, *optional*): branch, tag or commit sha (``None``: the default branch).
        path_in_repo (`str`): sub-directory inside the repo (``""``: the root).
        repo_type (`str`): ``"model"`` or ``"dataset"``.
    """

    repo_id: str
    revision: str | None = None
    path_in_repo: str = ""
    repo_type: str = "model"

    def __post_init__(self) -> None:
        if self.repo_id.count("/") != 1 or not all(self.repo_id.split("/")):
            raise ValueError(f"repo_id must look like 'namespace/name', got {self.repo_id!r}.")
        if self.path_in_repo:
            check_relative_name(self.path_in_repo, source=f"hf://{self.repo_id}", suffix=None)
        if self.repo_type not in ("model", "dataset"):
            raise ValueError(f"repo_type must be 'model' or 'dataset', got {self.repo_type!r}.")


def parse_hf_url(url: str) -> HfUrl:
    """Parse ``hf://user/repo@revision/sub/dir`` (the scheme is optional; ``@revision`` may be URL-quoted).

    Raises:
        ValueError: if the URL has no ``namespace/name`` or its path escapes the repo.

    Example:

    ```python
    >>> parse_hf_url("hf://me/run@step-120/checkpoint-120")
    HfUrl(repo_id='me/run', revision='step-120', path_in_repo='checkpoint-120', repo_type='model')
    >>> parse_hf_url("me/run").revision is None
    True
    ```
    """
    rest = url[len("hf://"):] if url.startswith("hf://") else url
    repo_type = "model"
    if rest.startswith("datasets/"):
        repo_type, rest = "dataset", rest[len("datasets/"):]
    parts = rest.strip("/").split("/")
    if len(parts) < 2:
        raise ValueError(f"Cannot parse {url!r}: expected 'hf://namespace/name[@revision][/path]'.")
    name, _, revision = parts[1].partition("@")
    path = "/".join(parts[2:])
    return HfUrl(f"{parts[0]}/{name}", urllib.parse.unquote(revision) or None, path, repo_type)


# --------------------------------------------------------------------------------------------------- remote snapshot
@dataclass(frozen=True)
class HubSnapshot:
    """One repo pinned at one commit: every file it hands out comes from that same commit.

    Create it with :meth:`HubSnapshot.resolve`, which turns a branch or tag into a commit sha once, so a push that
    lands while shards are being fetched cannot mix two versions of a model.

    Args:
        repo_id (`str`): the repo.
        commit (`str`): the 40-hex commit sha.
        token (`str`, *optional*): Hub token (default: the configured one).
        local_dir (`Path`, *optional*): download into this folder instead of the Hub cache.
        repo_type (`str`): ``"model"`` or ``"dataset"``.
    """

    repo_id: str
    commit: str
    token: str | None = None
    local_dir: Path | None = None
    repo_type: str = "model"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{40}", self.commit):
            raise ValueError(f"HubSnapshot.commit must be a 40-hex commit sha, got {self.commit!r}.")

    @classmethod
    def resolve(cls, repo_id: str, *, revision: str | None = None, token: str | None = None,
                local_dir: str | os.PathLike | None = None, repo_type: str = "model") -> HubSnapshot:
        """Resolve ``revision`` (default: the main branch) to its commit sha with one API call.

        Raises:
            HubServerError: if the Hub answers 5xx or cannot be reached (naming the repo and revision).
            RepositoryNotFoundError / RevisionNotFoundError: huggingface_hub's own, for an unknown repo or revision.

        Example:

        ```python
        >>> snapshot = HubSnapshot.resolve("me/tiny-gpt2", revision="main")  # doctest: +SKIP
        >>> len(snapshot.commit)  # doctest: +SKIP
        40
        ```
        """
        with hub_errors(f"{repo_id}@{revision or 'main'}"):
            info = HfApi(token=token).repo_info(repo_id, revision=revision, repo_type=repo_type)
        if not info.sha:
            raise HubError(f"{repo_id}@{revision or 'main'}: the Hub returned no commit sha; retry, or pass a commit.")
        return cls(repo_id, info.sha, token, Path(local_dir) if local_dir is not None else None, repo_type)

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}"

    def fetch(self, filename: str, *, expected: FileRecord | None = None) -> Path:
        """Download ``filename`` (cached) and return its local path, verified against the record ``expected`` (its
        size and xxh3-128, or sha256 for an index written before format version 2).

        Raises:
            HubEntryNotFoundError: if the commit has no such file (also an ``IncompleteCheckpointError``).
            HubServerError: if the Hub answers 5xx or cannot be reached.
            CorruptCheckpointError: if the bytes do not match ``expected``; the bad file is removed first.
        """
        with hub_errors(f"{self.label}/{filename}"):
            path = Path(hf_hub_download(self.repo_id, filename, revision=self.commit, token=self.token,
                                        local_dir=self.local_dir, repo_type=self.repo_type))
        if expected is not None:
            _verify_file(path, expected, source=f"{self.label}/{filename}",
                         recorded_by=f"its {SHARDS_KEY} record")
        return path

    def fetch_index(self) -> tuple[ShardIndex | None, Path]:
        """The parsed index (``None`` for a single ``model.safetensors``) and the local folder holding it.

        Raises:
            CheckpointNotFoundError: if the commit has neither an index nor ``model.safetensors``.
            UnsafeIndexError: if the index is malformed or names files outside the repo.
        """
        try:
            path = self.fetch(MODEL_INDEX_FILE)
        except HubEntryNotFoundError:
            path = None
        if path is not None:
            return read_index_file(path, source=f"{self.label}/{MODEL_INDEX_FILE}"), path.parent
        try:
            return None, self.fetch(SINGLE_MODEL_FILE).parent
        except HubEntryNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.label}: no {MODEL_INDEX_FILE} and no {SINGLE_MODEL_FILE}; this repo holds no safetensors "
                "model. Push one with hf_resumable.hub.push_sharded(model, repo_id), or check repo_id/revision."
            ) from None

    def fetch_shard(self, index: ShardIndex, filename: str) -> Path:
        """Download one shard named by ``index``, verified against its recorded hash when there is one.

        Raises:
            HubEntryNotFoundError: if the index names a shard the commit does not have.
            HubFormatError: if the index's record for the shard is malformed.
            CorruptCheckpointError: if the shard's bytes do not match the index's record.
        """
        expected = shard_record(index, filename, source=f"{self.label}/{MODEL_INDEX_FILE}")
        try:
            return self.fetch(filename, expected=expected)
        except HubEntryNotFoundError:
            raise HubEntryNotFoundError(
                f"{index.source} names shard {filename!r}, but {self.label} has no such file: the push was partial or"
                " the index is stale. Re-push the model with push_sharded(...)."
            ) from None

    def fetch_headers(self, index: ShardIndex) -> dict[str, Any]:
        """The safetensors header of every shard ``index`` names (ranged GETs only, no tensor data), fetched
        ``HEADER_FETCH_WORKERS`` at a time. The number of shards is bounded by ``parse_index``.

        Raises:
            HubEntryNotFoundError / HubServerError / HubFormatError: naming the repo, commit and shard.
        """
        api = HfApi(token=self.token)

        def header(filename: str) -> Any:
            with hub_errors(f"{self.label}/{filename}"):
                return api.parse_safetensors_file_metadata(self.repo_id, filename, revision=self.commit,
                                                           repo_type=self.repo_type)

        with ThreadPoolExecutor(max_workers=HEADER_FETCH_WORKERS, thread_name_prefix="hf_resumable-header") as pool:
            return dict(zip(index.filenames, pool.map(header, index.filenames)))


def shard_record(index: ShardIndex, filename: str, *, source: str | None = None) -> FileRecord | None:
    """The record (size and xxh3-128; size and sha256 in indexes written before format version 2) that
    :func:`push_sharded` or a checkpoint save wrote for ``filename``, if any.

    Raises:
        HubFormatError: if the ``hf_resumable_shards`` metadata is present but malformed (never guessed around).

    Example:

    ```python
    >>> shard_record(index, "model-00001-of-00002.safetensors")  # doctest: +SKIP
    FileRecord(size=20480, sha256=None, xxh3_128='9f86d0...')

    ```
    """
    source = source or index.source
    records = index.metadata.get(SHARDS_KEY)
    if records is None:
        return None
    if not isinstance(records, dict):
        raise HubFormatError(f"{source}: metadata {SHARDS_KEY!r} must be an object of shard records; "
                             "the index is corrupt. Re-push the model.")
    record = records.get(filename)
    if record is None:
        return None
    try:
        return FileRecord.from_json(record, source=source, where=f"{SHARDS_KEY}[{filename[:100]!r}]")
    except CorruptCheckpointError as err:
        raise HubFormatError(f"the {SHARDS_KEY} record of {filename!r} is malformed: {err} Re-push the "
                             "model.") from None


def read_index_file(path: Path, *, source: str) -> ShardIndex:
    """Parse and validate a local ``*.safetensors.index.json`` (size-capped, traversal-checked).

    Raises:
        UnsafeIndexError: if the index is malformed, names too many shards, or names files outside its directory.
        CorruptCheckpointError: if it is not (bounded) JSON, oversized, or not a regular file.

    Example:

    ```python
    >>> read_index_file(Path("out/model.safetensors.index.json"), source="out").filenames  # doctest: +SKIP
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    ```
    """
    document = parse_json(read_regular_file(path, limit=MAX_JSON_SIZE), source=source)
    return parse_index(document, source=source)


def _remove_download(path: Path) -> None:
    """Remove a downloaded file and, for a Hub-cache symlink, the blob it points to."""
    blob = Path(os.path.realpath(path))
    for target in {path, blob}:
        try:
            target.unlink()
        except FileNotFoundError:
            pass


def _verify_file(path: Path, expected: FileRecord, *, source: str, recorded_by: str) -> None:
    if (problem := check_file(path, expected, recorded_by=recorded_by)) is not None:
        _remove_download(path)
        raise CorruptCheckpointError(
            f"{source}: downloaded {problem}. The bad copy at {path} was removed; retry the download, and if it "
            "persists the remote file or its index is corrupt: re-push it."
        )


