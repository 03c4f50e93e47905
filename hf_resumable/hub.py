"""Move sharded models and committed training checkpoints to and from the Hugging Face Hub.

Everything goes through ``huggingface_hub`` (one ``upload_folder`` commit per push, ``hf_hub_download`` for the index
and the shards), with one exception: :func:`resumable_download`, which issues ranged ``GET``s itself because
``huggingface_hub`` 2.x deletes partial downloads when a process dies, so a multi-GB file would restart from zero.

Downloads are index first: the ``model.safetensors.index.json`` names the shards, so only the shards holding the
tensors asked for are fetched, and each is checked against the sha256 that :func:`push_sharded` recorded in the index
metadata (``metadata["hf_resumable_shards"]``).

Example:

```python
>>> from hf_resumable.hub import push_sharded, download_shards
>>> push_sharded(model, "me/tiny-gpt2", max_shard_size="50MB")
>>> folder = download_shards("me/tiny-gpt2", prefixes=["transformer.h.0."])
```
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
from huggingface_hub import CommitInfo, HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from .constants import CHECKPOINT_DIR_RE, FORMAT_VERSION, MANIFEST_FILE, MAX_JSON_SIZE, MODEL_FILE_PATTERN, MODEL_INDEX_FILE
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubError,
    IncompleteCheckpointError,
    UnsafeIndexError,
)
from .sharding import ShardIndex, check_relative_name, parse_index, plan_shards
from .checkpoint.manifest import read_manifest
from .progress import progress_bar
from .checkpoint.verify import verify_checkpoint

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "SINGLE_MODEL_FILE",
    "SHARD_RECORDS_KEY",
    "HfUrl",
    "HubSnapshot",
    "read_index_file",
    "shard_record",
    "write_sharded_model",
    "PushedCheckpoint",
    "CheckpointUploader",
    "parse_hf_url",
    "push_sharded",
    "download_shards",
    "resumable_download",
    "pull_checkpoint",
    "push_checkpoint",
    "find_latest_hub_checkpoint",
]

# Un-sharded weights file (transformers and huggingface_hub write it when everything fits in one shard).
SINGLE_MODEL_FILE = "model.safetensors"
# Index metadata key: {shard file: {"size": int, "sha256": str}} (transformers ignores unknown keys).
SHARD_RECORDS_KEY = "hf_resumable_shards"
# Index metadata key: format version of what push_sharded wrote.
INDEX_VERSION_KEY = "hf_resumable_format_version"
# Suffixes of the partial file and its sidecar used by resumable_download.
PART_SUFFIX = ".part"
SIDECAR_SUFFIX = ".part.json"
# Remote files push_sharded replaces on every push (stale shards of an earlier layout are deleted).
WEIGHT_PATTERNS = ["model*.safetensors", MODEL_INDEX_FILE]
_DOWNLOAD_CHUNK = 1024 * 1024
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


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

        Example:

        ```python
        >>> snapshot = HubSnapshot.resolve("me/tiny-gpt2", revision="main")
        >>> len(snapshot.commit)
        40
        ```
        """
        info = HfApi(token=token).repo_info(repo_id, revision=revision, repo_type=repo_type)
        if not info.sha:
            raise HubError(f"{repo_id}@{revision or 'main'}: the Hub returned no commit sha; retry, or pass a commit.")
        return cls(repo_id, info.sha, token, Path(local_dir) if local_dir is not None else None, repo_type)

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}"

    def fetch(self, filename: str, *, expected: Mapping[str, Any] | None = None) -> Path:
        """Download ``filename`` (cached) and return its local path, verified against ``expected`` size/sha256.

        Raises:
            EntryNotFoundError: if the commit has no such file.
            CorruptCheckpointError: if the bytes do not match ``expected``; the bad file is removed first.
        """
        path = Path(hf_hub_download(self.repo_id, filename, revision=self.commit, token=self.token,
                                    local_dir=self.local_dir, repo_type=self.repo_type))
        if expected is not None:
            _verify_file(path, expected, source=f"{self.label}/{filename}")
        return path

    def fetch_index(self) -> tuple[ShardIndex | None, Path]:
        """The parsed index (``None`` for a single ``model.safetensors``) and the local folder holding it.

        Raises:
            CheckpointNotFoundError: if the commit has neither an index nor ``model.safetensors``.
            UnsafeIndexError: if the index is malformed or names files outside the repo.
        """
        try:
            path = self.fetch(MODEL_INDEX_FILE)
        except EntryNotFoundError:
            path = None
        if path is not None:
            return read_index_file(path, source=f"{self.label}/{MODEL_INDEX_FILE}"), path.parent
        try:
            return None, self.fetch(SINGLE_MODEL_FILE).parent
        except EntryNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.label}: no {MODEL_INDEX_FILE} and no {SINGLE_MODEL_FILE}; this repo holds no safetensors "
                "model. Push one with hf_resumable.hub.push_sharded(model, repo_id), or check repo_id/revision."
            ) from None

    def fetch_shard(self, index: ShardIndex, filename: str) -> Path:
        """Download one shard named by ``index``, verified against its recorded hash when there is one.

        Raises:
            IncompleteCheckpointError: if the index names a shard the commit does not have.
            CorruptCheckpointError: if the shard's bytes do not match the index's record.
        """
        expected = shard_record(index, filename)
        try:
            return self.fetch(filename, expected=expected)
        except EntryNotFoundError:
            raise IncompleteCheckpointError(
                f"{index.source} names shard {filename!r}, but {self.label} has no such file: the push was partial or"
                " the index is stale. Re-push the model with push_sharded(...)."
            ) from None


def shard_record(index: ShardIndex, filename: str) -> dict[str, Any] | None:
    """The ``{"size", "sha256"}`` that :func:`push_sharded` recorded for ``filename``, if any.

    Example:

    ```python
    >>> shard_record(index, "model-00001-of-00002.safetensors")
    {'size': 20480, 'sha256': '9f86d0...'}
    ```
    """
    records = index.metadata.get(SHARD_RECORDS_KEY)
    record = records.get(filename) if isinstance(records, dict) else None
    return record if isinstance(record, dict) else None


def read_index_file(path: Path, *, source: str) -> ShardIndex:
    """Parse and validate a local ``*.safetensors.index.json`` (size-capped, traversal-checked).

    Raises:
        UnsafeIndexError: if the file is oversized, malformed, or names files outside its directory.
        CorruptCheckpointError: if it is not JSON.

    Example:

    ```python
    >>> read_index_file(Path("out/model.safetensors.index.json"), source="out").filenames
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    ```
    """
    if path.stat().st_size > MAX_JSON_SIZE:
        raise UnsafeIndexError(f"{source}: index is larger than {MAX_JSON_SIZE} bytes; refusing to parse it.")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{source}: index is not valid JSON ({err}); re-push the model.") from None
    return parse_index(document, source=source)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_DOWNLOAD_CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_download(path: Path) -> None:
    """Remove a downloaded file and, for a Hub-cache symlink, the blob it points to."""
    blob = Path(os.path.realpath(path))
    for target in {path, blob}:
        try:
            target.unlink()
        except FileNotFoundError:
            pass


def _verify_file(path: Path, expected: Mapping[str, Any], *, source: str) -> None:
    size, sha256 = expected.get("size"), expected.get("sha256")
    actual_size = path.stat().st_size
    problem = None
    if size is not None and actual_size != int(size):
        problem = f"size is {actual_size} bytes, expected {size}"
    elif sha256 is not None and (actual := _sha256_of(path)) != sha256:
        problem = f"sha256 is {actual}, expected {sha256}"
    if problem is not None:
        _remove_download(path)
        raise CorruptCheckpointError(
            f"{source}: downloaded {problem}. The bad copy at {path} was removed; retry the download, and if it "
            "persists the remote file or its index is corrupt: re-push it."
        )


# --------------------------------------------------------------------------------------------------- push a model
def write_sharded_model(state_dict: Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                        max_shard_size: int | str) -> dict:
    """Write ``state_dict`` as ``model-0000k-of-0000N.safetensors`` plus the index into ``directory``.

    Shared tensors are stored once (first name in ``state_dict`` order) and recorded in the index metadata as
    ``{dropped_name: kept_name}``, like ``huggingface_hub.save_torch_state_dict``. The metadata also records each
    shard's size and sha256 under ``"hf_resumable_shards"``.

    Returns:
        `dict`: the index document that was written.

    Example:

    ```python
    >>> index = write_sharded_model(model.state_dict(), "out", max_shard_size="100MB")
    >>> sorted(index["metadata"]["hf_resumable_shards"])
    ['model-00001-of-00001.safetensors']
    ```
    """
    from .checkpoint._model import dedupe_tied  # same aliasing rule as training checkpoints
    from .constants import SAFETENSORS_METADATA
    from .safetensors_io import write_safetensors
    from .sharding import build_index

    directory = Path(directory)
    tensors, aliases = dedupe_tied(state_dict)
    plan = plan_shards({n: t.numel() * t.element_size() for n, t in tensors.items()},
                       max_shard_size=max_shard_size, filename_pattern=MODEL_FILE_PATTERN)
    records = {}
    for filename, names in plan.filename_to_names.items():
        record = write_safetensors(directory / filename, [(n, tensors[n]) for n in names],
                                   metadata=SAFETENSORS_METADATA, fsync=False)
        records[filename] = {"size": record.size, "sha256": record.sha256}
    index = build_index(plan, metadata={**aliases, INDEX_VERSION_KEY: FORMAT_VERSION, SHARD_RECORDS_KEY: records})
    (directory / MODEL_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return index


def _stage_model(model_or_state_dict: Any, directory: Path, *, max_shard_size: int | str,
                 processing_class: Any | None) -> None:
    """Save weights (+ config, generation config, processing class when available) into ``directory``."""
    state_dict = model_or_state_dict
    if hasattr(model_or_state_dict, "state_dict"):
        model = model_or_state_dict
        state_dict = model.state_dict()
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and hasattr(generation_config, "save_pretrained"):
            generation_config.save_pretrained(directory)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"push_sharded needs a torch.nn.Module, a state dict or a directory, got {type(state_dict)}.")
    write_sharded_model(state_dict, directory, max_shard_size=max_shard_size)
    if processing_class is not None:
        processing_class.save_pretrained(directory)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _check_model_dir(directory: Path) -> None:
    if not (directory / MODEL_INDEX_FILE).is_file() and not (directory / SINGLE_MODEL_FILE).is_file():
        raise CheckpointNotFoundError(
            f"{directory}: no {MODEL_INDEX_FILE} or {SINGLE_MODEL_FILE}; save the model there first "
            "(model.save_pretrained(dir)) or pass the model itself to push_sharded."
        )


def push_sharded(
    model_or_state_dict_or_dir: Any,
    repo_id: str,
    *,
    max_shard_size: int | str = "2GB",
    revision: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    create_pr: bool = False,
    processing_class: Any | None = None,
    card: str | None = None,
) -> CommitInfo:
    """Save a model as sharded safetensors locally, then push it to the Hub in one commit.

    Tied or shared tensors are stored once (first name in ``state_dict()`` order wins) and the dropped names are
    recorded in the index metadata, so ``transformers`` re-ties them on load. Stale shards of an earlier push are
    deleted in the same commit. Re-pushing unchanged weights uploads no LFS bytes.

    Args:
        model_or_state_dict_or_dir (`torch.nn.Module`, `Mapping[str, torch.Tensor]` or path):
            a model (its ``config`` and ``generation_config`` are saved too), a state dict, or a directory that
            already holds ``model.safetensors[.index.json]`` (uploaded as is).
        repo_id (`str`): target repo, created if missing.
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard size limit (decimal units).
        revision (`str`, *optional*): target branch (created from ``main`` if missing).
        commit_message (`str`, *optional*): defaults to ``"Upload model with hf_resumable"``.
        private (`bool`, *optional*): visibility of a newly created repo.
        token (`str`, *optional*): Hub token.
        create_pr (`bool`, *optional*, defaults to `False`): open a pull request instead of committing.
        processing_class (*optional*): tokenizer or processor; saved with ``save_pretrained`` next to the weights.
        card (`str`, *optional*): model card text, written as ``README.md``.

    Returns:
        `huggingface_hub.CommitInfo`: ``.oid`` is the commit sha.

    Raises:
        CheckpointNotFoundError: if a directory holds no safetensors weights.
        CheckpointMismatchError: if a tensor is on the meta device.

    Example:

    ```python
    >>> info = push_sharded(model, "me/tiny-gpt2", max_shard_size="10MB")
    >>> AutoModelForCausalLM.from_pretrained("me/tiny-gpt2", revision=info.oid)
    ```
    """
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_resumable-push-") as tmp:
        # 1. Stage the files locally (or use the given directory as is).
        folder = Path(tmp)
        if isinstance(model_or_state_dict_or_dir, (str, os.PathLike)):
            _check_model_dir(Path(model_or_state_dict_or_dir))
            if card is None:
                folder = Path(model_or_state_dict_or_dir)
            else:  # never write into the caller's directory: link its files into the staging dir
                shutil.copytree(model_or_state_dict_or_dir, folder, dirs_exist_ok=True, copy_function=_link_or_copy)
        else:
            _stage_model(model_or_state_dict_or_dir, folder, max_shard_size=max_shard_size,
                         processing_class=processing_class)
        if card is not None:
            (folder / "README.md").unlink(missing_ok=True)
            (folder / "README.md").write_text(card, encoding="utf-8")
        # 2. Make sure the repo and branch exist, then 3. push everything in one commit.
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, create_pr=create_pr,
                                 commit_message=commit_message or "Upload model with hf_resumable",
                                 delete_patterns=WEIGHT_PATTERNS)
    logger.info("pushed %s to %s (commit %s)", type(model_or_state_dict_or_dir).__name__, repo_id, info.oid)
    return info


# --------------------------------------------------------------------------------------------------- download shards
def _select_names(index: ShardIndex, tensors: Iterable[str] | None, prefixes: Iterable[str] | None) -> list[str] | None:
    if tensors is None and prefixes is None:
        return None
    names = list(tensors or [])
    unknown = [n for n in names if n not in index.weight_map]
    if unknown:
        raise CheckpointMismatchError(
            f"{index.source}: no tensors named {unknown[:10]} (of {len(unknown)} unknown); list the available names"
            " with LazyStateDict.from_pretrained(repo_id).keys()."
        )
    prefixes = tuple(prefixes or ())
    names += [n for n in index.weight_map if prefixes and n.startswith(prefixes) and n not in names]
    return names


def download_shards(
    repo_id: str,
    *,
    tensors: Iterable[str] | None = None,
    prefixes: Iterable[str] | None = None,
    revision: str | None = None,
    token: str | None = None,
    local_dir: str | os.PathLike | None = None,
) -> Path:
    """Download the index, then only the shards that hold the requested tensors (default: all of them).

    Each shard is verified against the size and sha256 recorded by :func:`push_sharded` when the index has them.

    Args:
        repo_id (`str`): the model repo.
        tensors (`Iterable[str]`, *optional*): exact tensor names.
        prefixes (`Iterable[str]`, *optional*): name prefixes, e.g. ``["model.layers.3."]``.
        revision (`str`, *optional*): branch, tag or commit (resolved to a commit once).
        token (`str`, *optional*): Hub token.
        local_dir (`str` or `os.PathLike`, *optional*): download there instead of the Hub cache.

    Returns:
        `Path`: the local folder holding the index and the downloaded shards.

    Raises:
        CheckpointNotFoundError: if the repo has neither an index nor ``model.safetensors``.
        UnsafeIndexError: if the index names a path outside the repo (``../``) or a non-safetensors file.
        IncompleteCheckpointError: if the index names a shard the repo does not have.
        CorruptCheckpointError: if a shard's hash does not match the index (the bad file is removed).
        CheckpointMismatchError: if a requested tensor name is not in the index.
        huggingface_hub.errors.RepositoryNotFoundError / RevisionNotFoundError: if the repo or revision is unknown.

    Example:

    ```python
    >>> folder = download_shards("me/tiny-llama", prefixes=["model.layers.0."])
    >>> sorted(p.name for p in folder.glob("*.safetensors"))
    ['model-00002-of-00005.safetensors']
    ```
    """
    snapshot = HubSnapshot.resolve(repo_id, revision=revision, token=token, local_dir=local_dir)
    index, folder = snapshot.fetch_index()
    if index is None:
        return folder
    for filename in index.group_by_file(_select_names(index, tensors, prefixes)):
        snapshot.fetch_shard(index, filename)
    logger.info("downloaded shards of %s into %s", snapshot.label, folder)
    return folder


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
        while chunk := f.read(_DOWNLOAD_CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


def _is_up_to_date(target: Path, remote: _RemoteFile, expected_sha256: str | None) -> bool:
    """Whether ``target`` already holds the remote file (by sha256, or the git blob id of a regular file)."""
    if not target.is_file() or (remote.size is not None and target.stat().st_size != remote.size):
        return False
    if expected_sha256 is not None or (remote.etag and _SHA256_RE.match(remote.etag)):
        return _sha256_of(target) == (expected_sha256 or remote.etag)
    return bool(remote.etag) and _git_blob_sha1(target) == remote.etag


def _finish_download(part: Path, target: Path, expected_sha256: str | None, source: str) -> None:
    if expected_sha256 is not None:
        actual = _sha256_of(part)
        if actual != expected_sha256:
            part.unlink()
            raise CorruptCheckpointError(
                f"{source}: downloaded sha256 {actual} but expected {expected_sha256}; the partial file was removed."
                " Retry; if it persists, the remote file is corrupt: re-push it."
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
    token: str | None = None,
    repo_type: str = "model",
    max_retries: int = 3,
) -> Path:
    """Download one file so that a killed process resumes where it stopped instead of restarting.

    Bytes go to ``<local_dir>/<filename>.part``, with a sidecar ``.part.json`` recording the commit, ETag and size
    they belong to. A later call (in any process) continues with ``Range: bytes=<part size>-`` when the sidecar still
    matches the remote file, checks the sha256 (``expected_sha256``, else the ETag of an LFS file, which is its
    sha256), then renames the file into place atomically.

    > [!WARNING]
    > Two processes must not download the same file into the same ``local_dir`` at the same time: they would append
    > to one ``.part`` file.

    Args:
        repo_id (`str`): the repo.
        filename (`str`): path inside the repo.
        revision (`str`, *optional*): branch, tag or commit sha; pass a commit to pin the version.
        local_dir (`str` or `os.PathLike`): destination root; the file lands at ``local_dir/filename``.
        expected_sha256 (`str`, *optional*): required content hash.
        expected_size (`int`, *optional*): required size in bytes.
        token (`str`, *optional*): Hub token.
        repo_type (`str`, *optional*, defaults to `"model"`): the repo type.
        max_retries (`int`, *optional*, defaults to `3`): in-call retries after a dropped connection.

    Returns:
        `Path`: the complete local file.

    Raises:
        UnsafeIndexError: if ``filename`` escapes ``local_dir``.
        CorruptCheckpointError: on a size or hash mismatch (the partial file is removed).
        HubError: if the connection keeps failing; the ``.part`` file is kept for the next call.
        EntryNotFoundError: if the file does not exist at ``revision``.

    Example:

    ```python
    >>> path = resumable_download("me/run", "checkpoint-120/model-00001-of-00002.safetensors",
    ...                           revision="step-120", local_dir="pulled")
    ```
    """
    check_relative_name(filename, source=f"{repo_id}", suffix=None)
    target = Path(local_dir) / filename
    source = f"{repo_id}@{revision or 'main'}/{filename}"
    remote = _remote_file(repo_id, filename, revision, token, repo_type)
    if expected_size is not None and remote.size is not None and remote.size != expected_size:
        raise CorruptCheckpointError(f"{source}: the Hub reports {remote.size} bytes, expected {expected_size}.")
    if _is_up_to_date(target, remote, expected_sha256):
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
    _finish_download(part, target, expected_sha256 or lfs_sha, source)
    sidecar.unlink(missing_ok=True)
    return target


# --------------------------------------------------------------------------------------------------- checkpoints
def _manifest_files(manifest_path: Path) -> dict[str, dict[str, Any]]:
    """``{relpath: {"size", "sha256"}}`` of a manifest, validated by the checkpoint module's parser."""
    manifest = read_manifest(manifest_path.parent)
    return {rel: {"size": record.size, "sha256": record.sha256} for rel, record in manifest.files.items()}


def _verify_against_manifest(directory: str | os.PathLike, *, check_hashes: bool = True) -> None:
    """Verify a checkpoint with :func:`hf_resumable.checkpoint.verify_checkpoint`; bad files are removed so a
    re-pull fetches them again.

    Raises:
        IncompleteCheckpointError: if the manifest or a listed file is missing.
        CorruptCheckpointError: on a size or sha256 mismatch.
    """
    directory = Path(directory)
    report = verify_checkpoint(directory, full=check_hashes)
    if not report.ok:
        for relpath, _why in report.problems:
            if relpath != MANIFEST_FILE and (directory / relpath).is_file():
                (directory / relpath).unlink()
        report.raise_if_bad()


def _default_pull_dir(url: HfUrl, commit: str) -> Path:
    return Path(constants.HF_HOME) / "hf_resumable" / "checkpoints" / url.repo_id.replace("/", "--") / commit


def pull_checkpoint(
    repo_id_or_hf_url: str,
    *,
    revision: str | None = None,
    local_dir: str | os.PathLike | None = None,
    token: str | None = None,
) -> Path:
    """Download a committed training checkpoint directory, resumably, and verify it against its manifest.

    Args:
        repo_id_or_hf_url (`str`): ``"user/repo"`` or ``"hf://user/repo@revision/sub/dir"``. A path that is
            not itself a checkpoint but holds ``checkpoint-N/`` directories resolves to the newest one
            with a manifest (so ``hf://user/run`` resumes the latest pushed checkpoint).
        revision (`str`, *optional*): overrides the URL's ``@revision``.
        local_dir (`str` or `os.PathLike`, *optional*): destination root (default: under ``HF_HOME``, keyed by
            commit); the checkpoint lands at ``local_dir/<sub/dir>``.
        token (`str`, *optional*): Hub token.

    Returns:
        `Path`: the local checkpoint directory (the one holding ``manifest.json``).

    Raises:
        IncompleteCheckpointError: if the remote directory has no ``manifest.json`` or misses a listed file.
        CorruptCheckpointError: if a file does not match the manifest (it is removed; pulling again re-fetches it).
        HubError: if the connection keeps failing (partial files are kept; pulling again resumes).
        huggingface_hub.errors.RepositoryNotFoundError / RevisionNotFoundError: if the repo or revision is unknown.

    Example:

    ```python
    >>> path = pull_checkpoint("hf://me/run@step-120/checkpoint-120")
    >>> (path / "manifest.json").exists()
    True
    ```
    """
    url = parse_hf_url(repo_id_or_hf_url)
    snapshot = HubSnapshot.resolve(url.repo_id, revision=revision or url.revision, token=token, repo_type=url.repo_type)
    root = Path(local_dir) if local_dir is not None else _default_pull_dir(url, snapshot.commit)
    prefix = f"{url.path_in_repo}/" if url.path_in_repo else ""
    remote = _list_remote_files(snapshot, url.path_in_repo)
    latest = _latest_checkpoint_under(remote, prefix) if f"{prefix}{MANIFEST_FILE}" not in remote else None
    if latest is not None:  # a run root: take its newest committed checkpoint-N
        url = HfUrl(url.repo_id, url.revision, f"{prefix}{latest}".strip("/"), url.repo_type)
        prefix = f"{url.path_in_repo}/"
        remote = {name: size for name, size in remote.items() if name.startswith(prefix)}
    if f"{prefix}{MANIFEST_FILE}" not in remote:
        raise IncompleteCheckpointError(
            f"hf://{snapshot.label}/{url.path_in_repo}: no {MANIFEST_FILE}; this is not a committed hf_resumable "
            "checkpoint. Push it with push_checkpoint(...) after the save completes."
        )
    get = functools.partial(resumable_download, url.repo_id, revision=snapshot.commit, local_dir=root, token=token,
                            repo_type=url.repo_type)
    manifest = _manifest_files(get(f"{prefix}{MANIFEST_FILE}"))
    with progress_bar(total=sum(remote.values()), desc=f"pulling {url.path_in_repo or url.repo_id}") as bar:
        for name, size in remote.items():
            record = manifest.get(name[len(prefix):], {})
            if name != f"{prefix}{MANIFEST_FILE}":
                get(name, expected_size=record.get("size", size), expected_sha256=record.get("sha256"))
            bar.update(size)
    checkpoint_dir = root / url.path_in_repo if url.path_in_repo else root
    _verify_against_manifest(checkpoint_dir)
    logger.info("pulled checkpoint %s into %s", snapshot.label, checkpoint_dir)
    return checkpoint_dir


def _latest_checkpoint_under(remote: Mapping[str, int], prefix: str) -> str | None:
    """Name of the highest ``checkpoint-N`` directly under ``prefix`` that has a manifest."""
    steps = []
    for name in remote:
        parts = name[len(prefix):].split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_FILE and CHECKPOINT_DIR_RE.match(parts[0]):
            steps.append((int(CHECKPOINT_DIR_RE.match(parts[0]).group(1)), parts[0]))
    return max(steps)[1] if steps else None


def find_latest_hub_checkpoint(repo_id_or_hf_url: str, *, revision: str | None = None,
                               token: str | None = None) -> str | None:
    """``hf://`` URL (pinned to a commit) of the newest committed ``checkpoint-N`` under a repo path, or None.

    Example:

    ```python
    >>> find_latest_hub_checkpoint("hf://me/run")  # doctest: +SKIP
    'hf://me/run@3f2a.../checkpoint-120'
    ```
    """
    url = parse_hf_url(repo_id_or_hf_url)
    snapshot = HubSnapshot.resolve(url.repo_id, revision=revision or url.revision, token=token, repo_type=url.repo_type)
    prefix = f"{url.path_in_repo}/" if url.path_in_repo else ""
    latest = _latest_checkpoint_under(_list_remote_files(snapshot, url.path_in_repo), prefix)
    if latest is None:
        return None
    kind = "" if url.repo_type == "model" else f"{url.repo_type}s/"
    return f"hf://{kind}{url.repo_id}@{snapshot.commit}/{prefix}{latest}"


def _list_remote_files(snapshot: HubSnapshot, path_in_repo: str) -> dict[str, int]:
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=snapshot.token)
    try:
        entries = api.list_repo_tree(snapshot.repo_id, path_in_repo=path_in_repo or None, recursive=True,
                                     revision=snapshot.commit, repo_type=snapshot.repo_type)
        return {e.path: e.size for e in entries if isinstance(e, RepoFile)}
    except EntryNotFoundError:
        return {}


@dataclass(frozen=True)
class PushedCheckpoint:
    """A checkpoint directory that is confirmed on the Hub.

    Args:
        local_path (`Path`): the directory that was uploaded.
        repo_id (`str`): the repo.
        revision (`str`): the branch it was committed to.
        commit (`str`): the commit sha that holds it.
        path_in_repo (`str`): where it lives in the repo.
        tag (`str`, *optional*): the tag pointing at ``commit``.
    """

    local_path: Path
    repo_id: str
    revision: str
    commit: str
    path_in_repo: str
    tag: str | None = None

    @property
    def url(self) -> str:
        """``hf://`` URL that :func:`pull_checkpoint` accepts, pinned to the commit."""
        return f"hf://{self.repo_id}@{self.commit}/{self.path_in_repo}".rstrip("/")


def push_checkpoint(
    local_checkpoint_dir: str | os.PathLike,
    repo_id: str,
    *,
    path_in_repo: str | None = None,
    branch: str | None = None,
    tag: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | None = None,
) -> PushedCheckpoint:
    """Upload one committed checkpoint directory as one Hub commit, optionally on a branch and/or tagged.

    Args:
        local_checkpoint_dir (`str` or `os.PathLike`): a directory holding ``manifest.json`` and its files.
        repo_id (`str`): target repo (created if missing).
        path_in_repo (`str`, *optional*): defaults to the directory's name, e.g. ``"checkpoint-120"``.
        branch (`str`, *optional*): commit to this branch (created from ``main`` if missing), e.g. ``"step-120"``.
        tag (`str`, *optional*): tag the new commit, e.g. ``"step-120"``.
        commit_message (`str`, *optional*): defaults to ``"Upload <dir name>"``.
        private (`bool`, *optional*): visibility of a newly created repo.
        token (`str`, *optional*): Hub token.

    Returns:
        [`PushedCheckpoint`]: the commit that holds the checkpoint.

    Raises:
        IncompleteCheckpointError: if the directory has no manifest or misses a file it lists.
        huggingface_hub.errors.HfHubHTTPError: if the Hub refuses the commit.

    Example:

    ```python
    >>> pushed = push_checkpoint("out/checkpoint-120", "me/run", branch="step-120")
    >>> pull_checkpoint(pushed.url)
    ```
    """
    directory = Path(local_checkpoint_dir)
    _verify_against_manifest(directory, check_hashes=False)
    path_in_repo = directory.name if path_in_repo is None else path_in_repo.strip("/")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if branch is not None:
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    info = api.upload_folder(folder_path=directory, repo_id=repo_id, path_in_repo=path_in_repo or None,
                             revision=branch, commit_message=commit_message or f"Upload {directory.name}")
    if tag is not None:
        api.create_tag(repo_id, tag=tag, revision=info.oid, exist_ok=True)
    logger.info("pushed checkpoint %s to %s@%s (commit %s)", directory, repo_id, branch or "main", info.oid)
    return PushedCheckpoint(directory, repo_id, branch or "main", info.oid, path_in_repo, tag)


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
